"""The NIXL K/V transport in the manifests (components/nixl and components/nixl-rdma, used by
the overlays nixl and nixl-gpu): the workers of a tree agree on one transport; NIXL workers
get the UCX settings their nodes need; the NetworkPolicies open UCX's port range on prefill
pods to decode pods only and keep every port the workers serve open; the RDMA overlay asks
for RDMA devices and IPC_LOCK and announces NIXL metadata over mutual TLS with the token."""

from __future__ import annotations

import copy
import re

import pytest
import yaml
from k8s_manifests import K8S_DIR, Container, containers

NIXL_TREES = ("overlays/nixl", "overlays/nixl-gpu")
RDMA_TREES = ("overlays/nixl-gpu",)
WORKER_COMMANDS = ("prefill-worker", "decode-worker", "colocated-worker")
# UCX transports that join processes through shared memory or CUDA IPC: never two pods.
SHARED_MEMORY_TLS = {"sm", "shm", "mm", "posix", "sysv", "xpmem", "knem", "cma", "cuda_ipc"}
RDMA_TLS = {"rc", "rc_x", "rc_v", "rc_verbs", "rc_mlx5", "dc", "dc_x", "dc_mlx5", "ib"}
COMPONENT = "app.kubernetes.io/component"
_QUANTITY = re.compile(r"^(\d+)(Ki|Mi|Gi|Ti)?$")


def _bytes(quantity: object) -> int:
    number, unit = _QUANTITY.match(str(quantity)).groups()
    return int(number) * 1024 ** ("", "Ki", "Mi", "Gi", "Ti").index(unit or "")


def _workers(parsed, tree: str) -> list:
    return [(c, p) for c, p in parsed[tree] if p.command in WORKER_COMMANDS and not c.is_init]


def _env(container: Container) -> dict[str, str]:
    return {v["name"]: v.get("value") for v in container.spec.get("env", [])}


def _ucx_range(container: Container) -> tuple[int, int]:
    first, last = _env(container)["UCX_TCP_PORT_RANGE"].split("-")
    return int(first), int(last)


def test_the_workers_of_a_tree_agree_on_one_transport(parsed) -> None:
    for tree, found in parsed.items():
        transports = {p.value("--kv-transport") for c, p in found
                      if p.command in (*WORKER_COMMANDS, "serve") and not c.is_init}
        assert len(transports) == 1, (tree, transports)
        assert (transports == {"nixl"}) is (tree in NIXL_TREES), tree


def test_nixl_workers_get_ucx_settings_and_only_they(parsed) -> None:
    for tree, found in parsed.items():
        for container, p in found:
            ucx = {k: v for k, v in _env(container).items() if k.startswith("UCX_")}
            is_nixl_worker = tree in NIXL_TREES and (container, p) in _workers(parsed, tree)
            assert bool(ucx) is is_nixl_worker, container.name
    for tree in NIXL_TREES:
        settings = {tuple(sorted(_env(c).items())) for c, _ in _workers(parsed, tree)}
        assert len(settings) == 1, f"{tree}: prefill and decode workers differ in UCX settings"
        for container, _ in _workers(parsed, tree):
            tls = set(_env(container)["UCX_TLS"].split(","))
            assert not tls & SHARED_MEMORY_TLS, (container.name, "pods share no memory")
            first, last = _ucx_range(container)
            assert 1024 <= first <= last < 32768, (container.name, "below the ephemeral range")
            if tree in RDMA_TREES:
                assert tls & RDMA_TLS and "cuda_copy" in tls, container.name
            else:
                assert tls == {"tcp"} and _env(container)["UCX_NET_DEVICES"], container.name


def test_nixl_workers_get_shared_memory_within_their_memory_limit(parsed) -> None:
    for tree in NIXL_TREES:
        for container, _ in _workers(parsed, tree):
            mount = next(m for m in container.spec["volumeMounts"] if m["mountPath"] == "/dev/shm")
            volume = next(v for v in container.pod_spec["volumes"] if v["name"] == mount["name"])
            assert volume["emptyDir"]["medium"] == "Memory", container.name
            # a memory-backed emptyDir counts against the memory limit: leave the process half
            limit = container.spec["resources"]["limits"]["memory"]
            assert _bytes(volume["emptyDir"]["sizeLimit"]) <= _bytes(limit) // 2, container.name


def _selects(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector; an empty one selects everything."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        value = labels.get(expr["key"])
        if expr["operator"] not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise ValueError(f"selector operator {expr['operator']}")
        matches = {"In": value in expr.get("values", []), "Exists": value is not None,
                   "NotIn": value not in expr.get("values", []), "DoesNotExist": value is None}
        if not matches[expr["operator"]]:
            return False
    return True


def _port_matches(rule_port: dict, number: int, name: str | None) -> bool:
    if rule_port.get("protocol", "TCP") != "TCP":
        return False
    port = rule_port.get("port")
    if port is None or (isinstance(port, str) and port == name):
        return True
    return isinstance(port, int) and port <= number <= rule_port.get("endPort", port)


def admitted(policies: list[dict], pod: dict, number: int, name: str | None,
             source: dict) -> bool:
    """Whether TCP `number` (named `name`) of a pod labelled `pod` admits a pod of this
    namespace labelled `source`. A pod no Ingress policy selects admits everything."""
    selecting = [p for p in policies if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                 and _selects(p["spec"]["podSelector"], pod)]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from")
            if peers is not None and not any(set(peer) == {"podSelector"}
                                             and _selects(peer["podSelector"], source)
                                             for peer in peers):
                continue
            if any(_port_matches(p, number, name) for p in rule.get("ports") or [{}]):
                return True
    return False


ELSEWHERE = {"app.kubernetes.io/name": "something-else"}


def policy_problems(tree: str, resources: list[dict]) -> list[str]:
    """Prefill pods: UCX's range open to decode pods and to nothing else; decode pods: no UCX
    ingress at all (pull); metrics and health open to every pod, gRPC to the router (and, on
    a decode pod, the prefill pods) only, as overlays/gpu's worker policies keep it."""
    policies = [r for r in resources if r["kind"] == "NetworkPolicy"]
    workers = [c for c in containers(tree, resources)
               if c.labels.get(COMPONENT) in ("prefill", "decode") and not c.is_init]
    decode = next(c.labels for c in workers if c.labels[COMPONENT] == "decode")
    router = next(c.labels for c in containers(tree, resources)
                  if c.labels.get(COMPONENT) == "router")
    problems = []
    for c in workers:
        if not any(_selects(p["spec"]["podSelector"], c.labels) for p in policies):
            problems.append(f"{c.name}: no NetworkPolicy fences its UCX port range")
        prefill = next(w.labels for w in workers if w.labels[COMPONENT] == "prefill")
        for port in c.spec.get("ports", []):
            name = port.get("name")
            for source, labels in (("router", router), ("prefill", prefill),
                                   ("elsewhere", ELSEWHERE)):
                wanted = name != "grpc" or source == "router" or (
                    source == "prefill" and c.labels[COMPONENT] == "decode")
                if admitted(policies, c.labels, port["containerPort"], name,
                            labels) is not wanted:
                    problems.append(f"{c.name}: port {name} from {source}: expected "
                                    f"{'open' if wanted else 'closed'}")
        first, last = _ucx_range(c)
        for number in range(first, last + 1):
            wanted = {"decode": c.labels[COMPONENT] == "prefill", "router": False,
                      "elsewhere": False}
            for source, labels in (("decode", decode), ("router", router),
                                   ("elsewhere", ELSEWHERE)):
                if admitted(policies, c.labels, number, None, labels) is not wanted[source]:
                    problems.append(f"{c.name}: UCX port {number} from {source}: expected "
                                    f"{'open' if wanted[source] else 'closed'}")
    return problems


@pytest.mark.parametrize("tree", NIXL_TREES)
def test_network_policies_fence_ucx(rendered, tree: str) -> None:
    assert policy_problems(tree, rendered[tree]) == []


def test_policy_check_catches_mistakes(rendered) -> None:
    """Negative controls: each of these mistakes is reported."""
    resources = rendered["overlays/nixl"]

    def broken(edit) -> list[str]:
        changed = copy.deepcopy(resources)
        for r in changed:
            if r["kind"] == "NetworkPolicy":
                edit(r["metadata"]["name"], r["spec"])
        return policy_problems("overlays/nixl", changed)

    def open_ucx_to_all(name: str, spec: dict) -> None:
        if name == "kvferry-prefill":
            del spec["ingress"][1]["from"]

    def drop_ucx(name: str, spec: dict) -> None:
        if name == "kvferry-prefill":
            del spec["ingress"][1]

    def open_decode_ucx(name: str, spec: dict) -> None:
        if name == "kvferry-decode":
            spec["ingress"].append({"ports": [{"port": 20000, "endPort": 20099}]})

    def drop_metrics(name: str, spec: dict) -> None:
        spec["ingress"][0]["ports"] = [p for p in spec["ingress"][0]["ports"]
                                       if p["port"] != "metrics"]

    assert any("from elsewhere" in p for p in broken(open_ucx_to_all))
    assert any("from decode: expected open" in p for p in broken(drop_ucx))
    assert any("kvferry-decode" in p and "expected closed" in p for p in broken(open_decode_ucx))
    def open_grpc_to_all(name: str, spec: dict) -> None:
        if name == "kvferry-decode":
            spec["ingress"][0]["ports"].append({"port": "grpc"})

    assert any("port metrics" in p for p in broken(drop_metrics))
    assert any("port grpc from elsewhere: expected closed" in p
               for p in broken(open_grpc_to_all))
    no_policies = [r for r in resources if r["kind"] != "NetworkPolicy"]
    assert any("no NetworkPolicy" in p for p in policy_problems("overlays/nixl", no_policies))


def test_rdma_workers_get_devices_ipc_lock_and_tls(parsed) -> None:
    for tree, found in parsed.items():
        for container, p in found:
            resources = container.spec.get("resources", {})
            rdma = {k for k in resources.get("limits", {}) if k.startswith("rdma/")}
            added = container.spec.get("securityContext", {}).get("capabilities", {}).get("add")
            is_rdma_worker = tree in RDMA_TREES and (container, p) in _workers(parsed, tree)
            assert bool(rdma) is is_rdma_worker, container.name
            # everything else stays within the restricted Pod Security Standard
            assert (added == ["IPC_LOCK"]) if is_rdma_worker else not added, container.name
            for key in rdma:  # extended resources: requests must equal limits
                assert resources["requests"][key] == resources["limits"][key], container.name
            if tree in RDMA_TREES:  # remote keys travel only over mutual TLS with the token
                assert p.value("--tls-ca") and p.value("--cluster-token-file"), container.name


def test_every_component_is_used_by_a_tested_overlay() -> None:
    used = set()
    for kustomization in (K8S_DIR / "overlays").glob("*/kustomization.yaml"):
        for ref in yaml.safe_load(kustomization.read_text()).get("components", []):
            used.add((kustomization.parent / ref).resolve().name)
    assert used == {p.name for p in (K8S_DIR / "components").iterdir() if p.is_dir()}
