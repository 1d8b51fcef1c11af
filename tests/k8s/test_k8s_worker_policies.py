"""Workers' ingress in the gpu overlay, every tree built on it, and the NIXL trees
(overlays/gpu/networkpolicy.yaml): a prefill pod's gRPC port admits the router only, a decode
pod's the router and prefill pods (K/V pushes); metrics and health stay open; every other
port, a tensor-parallel worker's would-be rendezvous or gloo ports among them, is closed to
every pod (docs/security.md, "Ports")."""

from __future__ import annotations

import copy

import pytest
from conftest import selects
from k8s_manifests import containers
from test_k8s_nixl import ELSEWHERE, admitted

# Trees with the gpu overlay's workers, and the NIXL trees (components/nixl admits gRPC the
# same way; its UCX port range is test_k8s_nixl's).
POLICY_TREES = ("overlays/gpu", "overlays/tensor-parallel", "overlays/tls",
                "overlays/autoscale", "overlays/planner", "overlays/kv-tiers", "overlays/nixl",
                "overlays/nixl-gpu")
COMPONENT = "app.kubernetes.io/component"
OPEN_TO_ALL = ("metrics", "health")
# Ports nothing may reach on a worker pod: torch's default rendezvous port, a gloo-like
# ephemeral one, UCX's range (closed without NIXL).
OTHER_PORTS = (29500, 41073, 20000)


def worker_policy_problems(tree: str, resources: list[dict]) -> list[str]:
    # UCX's range is open to decode pods on a NIXL tree's prefill pods (test_k8s_nixl).
    other_ports = OTHER_PORTS if "nixl" not in tree else OTHER_PORTS[:2]
    policies = [r for r in resources if r["kind"] == "NetworkPolicy"]
    found = [c for c in containers(tree, resources) if not c.is_init]
    peers = {c.labels[COMPONENT]: c.labels for c in found
             if c.labels.get(COMPONENT) in ("router", "prefill", "decode")}
    sources = {**peers, "elsewhere": ELSEWHERE,
               "a kvferry client": {**ELSEWHERE, "app.kubernetes.io/name": "kvferry",
                                    COMPONENT: "client"}}
    problems = []
    for c in found:
        role = c.labels.get(COMPONENT)
        if role not in ("prefill", "decode"):
            continue
        if not any(selects(p["spec"]["podSelector"].get("matchLabels", {}), c.labels)
                   for p in policies):
            problems.append(f"{c.name}: no NetworkPolicy selects it")
        dialers = {"router"} | ({"prefill"} if role == "decode" else set())
        ports = [(p["containerPort"], p.get("name")) for p in c.spec.get("ports", [])]
        for number, name in [*ports, *((n, None) for n in other_ports)]:
            for source, labels in sources.items():
                wanted = (name in OPEN_TO_ALL or (name == "grpc" and source in dialers))
                if admitted(policies, c.labels, number, name, labels) is not wanted:
                    problems.append(f"{c.name}: port {name or number} from {source}: "
                                    f"expected {'open' if wanted else 'closed'}")
    return problems


@pytest.mark.parametrize("tree", POLICY_TREES)
def test_workers_admit_only_the_router_and_their_peers(rendered, tree: str) -> None:
    resources = rendered[tree]
    names = {r["metadata"]["name"] for r in resources if r["kind"] == "NetworkPolicy"}
    assert {"kvferry-prefill-ingress", "kvferry-decode-ingress"} <= names or (
        "nixl" in tree and {"kvferry-prefill", "kvferry-decode"} <= names)
    assert worker_policy_problems(tree, resources) == []


def test_worker_policy_check_catches_mistakes(rendered) -> None:
    """Negative controls: no policies, gRPC open to every pod, and a decode pod closed to
    the prefill pods that push to it are each reported."""
    tree = "overlays/tensor-parallel"
    resources = rendered[tree]

    def broken(edit) -> list[str]:
        changed = copy.deepcopy(resources)
        for r in changed:
            if r["kind"] == "NetworkPolicy":
                edit(r["metadata"]["name"], r["spec"])
        return worker_policy_problems(tree, changed)

    def open_grpc(name: str, spec: dict) -> None:
        if name == "kvferry-prefill-ingress":
            del spec["ingress"][1]["from"]

    def drop_prefill_peer(name: str, spec: dict) -> None:
        if name == "kvferry-decode-ingress":
            spec["ingress"][1]["from"] = spec["ingress"][1]["from"][:1]

    def open_everything(name: str, spec: dict) -> None:
        spec["ingress"].append({})

    assert any("grpc from elsewhere: expected closed" in p for p in broken(open_grpc))
    assert any("grpc from prefill: expected open" in p for p in broken(drop_prefill_peer))
    assert any("port 29500 from elsewhere: expected closed" in p
               for p in broken(open_everything))
    without = [r for r in resources if r["kind"] != "NetworkPolicy"]
    assert any("no NetworkPolicy selects it" in p for p in worker_policy_problems(tree, without))
