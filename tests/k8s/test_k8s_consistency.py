"""The manifests agree with the code: every kvferry container's command line parses with the
real CLI parser, ports and probe service names match what the processes serve, discovery names
match headless Services, env vars are consumed, and the drain fits the grace period. The ray
overlay runs `kvferry serve --kv-transport=ray` on the RayCluster's head (router and workers
as Ray actors, deploy/ray_launcher.py), checked against the Ray worker nodes it needs."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import yaml
from conftest import selects, service_names
from k8s_manifests import (
    K8S_DIR,
    VAR_REF,
    Container,
    config_maps,
    containers,
    pod_templates,
)
from test_k8s_kv_tiers import STORE_IMAGE

from kvferry.rpc import grpc_util

REPO = K8S_DIR.parent
SOURCE_DIRS = ("kvferry", "router", "prefill_worker", "decode_worker", "kernels", "deploy")
GPU_TREES = ("base", "overlays/gpu", "overlays/ray", "overlays/autoscale", "overlays/tls",
             "overlays/nixl-gpu", "overlays/kv-tiers", "overlays/planner",
             "overlays/tensor-parallel")
CPU_DEV_TREES = ("overlays/cpu-dev", "overlays/nixl")  # cpu-dev's locally built images
TLS_TREES = ("overlays/tls", "overlays/nixl-gpu")
WORKER_COMMANDS = ("prefill-worker", "decode-worker", "colocated-worker")


def _port(container: Container, name: str) -> int | None:
    return next((p["containerPort"] for p in container.spec.get("ports", [])
                 if p.get("name") == name), None)


def test_every_tree_runs_router_prefill_and_decode(parsed) -> None:
    """As separate processes, or as the actors of one `kvferry serve` (the ray overlay)."""
    for tree, found in parsed.items():
        commands = {p.command for c, p in found if not c.is_init}
        if "serve" in commands:
            assert commands == {"serve"}, tree
            for _, p in found:
                assert p.value("--num-prefill") >= 1 and p.value("--num-decode") >= 1, tree
                assert not p.value("--colocated"), tree
        else:
            assert {"router", "prefill-worker", "decode-worker"} <= commands, tree


def test_ports_and_probes_match_the_processes(parsed) -> None:
    for found in parsed.values():
        for container, p in found:
            if container.is_init or p.command == "planner":  # the planner serves no gRPC
                continue
            assert p.value("--host") == "0.0.0.0", container.name
            assert _port(container, "grpc") == p.value("--port"), container.name
            assert _port(container, "metrics") == int(p.value("--metrics-port")), container.name
            if p.command in ("router", "serve"):  # the OpenAI-compatible HTTP API
                assert _port(container, "http") == p.value("--http-port"), container.name
            names = service_names(p.command)
            # With TLS, probes use the plaintext health-only port (they cannot speak TLS).
            probe_port = p.value("--health-port") or p.value("--port")
            if p.value("--health-port") is not None:
                assert _port(container, "health") == probe_port, container.name
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                grpc_probe = container.spec[probe]["grpc"]
                assert grpc_probe["port"] == probe_port, (container.name, probe)
                service = grpc_probe.get("service", "")
                assert service in ["", *names], (container.name, probe, service)
                # readiness must name the role's own service: "" would pass on any kvferry port
                if probe != "livenessProbe":
                    assert service == names[0], (container.name, probe)


def test_health_answers_for_the_empty_service_name() -> None:
    """Liveness probes omit `service`; the processes must report status for "" too."""
    seen: dict[str, int] = {}

    class Recorder:
        async def set(self, name: str, status: int) -> None:
            seen[name] = status

    asyncio.run(grpc_util.set_serving(Recorder(), ["kvferry.v1.X"], True))
    assert set(seen) == {"", "kvferry.v1.X"}


def test_router_discovery_names_headless_services(rendered, parsed) -> None:
    for tree, found in parsed.items():
        services = {r["metadata"]["name"]: r for r in rendered[tree] if r["kind"] == "Service"}
        workers = [(c, p) for c, p in found if p.command in WORKER_COMMANDS and not c.is_init]
        routers = [p for c, p in found if p.command == "router"]
        for router in routers:
            for role in ("prefill", "decode"):
                host, _, port = router.value(f"--{role}-dns").rpartition(":")
                service = services.get(host)
                assert service is not None, f"{tree}: no Service {host}"
                assert service["spec"].get("clusterIP") == "None", f"{tree}: {host} not headless"
                selected = [(c, p) for c, p in workers
                            if selects(service["spec"]["selector"], c.labels)]
                assert selected, f"{tree}: {host} selects no worker pod"
                for c, p in selected:
                    assert p.command == f"{role}-worker", (tree, host, c.name)
                    spec_port = next(sp for sp in service["spec"]["ports"]
                                     if sp["port"] == int(port))
                    assert _port(c, spec_port["targetPort"]) == p.value("--port")


def test_service_target_ports_exist(rendered) -> None:
    for tree, resources in rendered.items():
        pods = containers(tree, resources)
        for service in (r for r in resources if r["kind"] == "Service"):
            selected = [c for c in pods if selects(service["spec"]["selector"], c.labels)]
            assert selected, (tree, service["metadata"]["name"])
            for port in service["spec"]["ports"]:
                assert any(_port(c, port["targetPort"]) for c in selected), (tree, port)


def test_drain_fits_the_grace_period_and_liveness_waits_it_out(parsed) -> None:
    for found in parsed.values():
        for container, p in found:
            if p.command not in WORKER_COMMANDS or container.is_init:
                continue
            drain_s = float(p.value("--drain-timeout-s"))
            grace_s = container.pod_spec["terminationGracePeriodSeconds"]
            assert drain_s < grace_s <= drain_s + 30, container.name
            liveness = container.spec["livenessProbe"]
            assert liveness["periodSeconds"] * liveness["failureThreshold"] > grace_s


# ConfigMaps that the cluster's monitoring reads, not kvferry (components/monitoring)
READ_OUTSIDE = {"kvferry-grafana-dashboards": "Grafana's dashboard sidecar",
                "kvferry-prometheus-rules": "Prometheus's rule_files"}


def test_env_vars_are_consumed(rendered) -> None:
    """A KVFERRY_* variable set on a container, or a key of the shared ConfigMap, is expanded
    into some container's args or read by the code: no setting is silently ignored."""
    source = "\n".join(path.read_text() for d in SOURCE_DIRS for path in (REPO / d).rglob("*.py"))
    for tree, resources in rendered.items():
        used: set[str] = set()
        for container in containers(tree, resources):
            text = " ".join(map(str, container.spec.get("command", []) +
                                container.spec.get("args", [])))
            refs = set(VAR_REF.findall(text))
            used |= refs
            for var in container.spec.get("env", []):
                name = var["name"]
                if name.startswith("KVFERRY_") and name not in refs:
                    assert f'"{name}"' in source, f"{container.name}: {name} is never read"
        mounted = {v["configMap"]["name"] for r in resources for _, t in pod_templates(r)
                   for v in t["spec"].get("volumes", []) if "configMap" in v}
        for name, data in config_maps(resources).items():
            if name in mounted or name in READ_OUTSIDE:  # files a container or a peer reads
                continue
            unused = [k for k in data if k not in used and f'"{k}"' not in source]
            assert unused == [], f"{tree}: ConfigMap keys nobody uses: {unused}"


def test_model_is_mounted_read_only(parsed) -> None:
    for tree, found in parsed.items():
        for container, p in found:
            if p.command == "planner":  # reads no model
                continue
            model = p.value("--model") if p.command != "make-model" else p.value("--out")
            mounts = [m for m in container.spec["volumeMounts"]
                      if str(Path(model)).startswith(m["mountPath"].rstrip("/") + "/")]
            assert mounts, f"{container.name}: {model} is on no volume"
            # only cpu-dev's make-model init container writes the model
            assert mounts[0].get("readOnly", False) is (not container.is_init), container.name
            volume = next(v for v in container.pod_spec["volumes"]
                          if v["name"] == mounts[0]["name"])
            if tree in GPU_TREES:
                assert volume["persistentVolumeClaim"]["readOnly"] is True, container.name


def test_workers_get_gpus_requests_equal_limits_and_shm(parsed) -> None:
    """A GPU worker's pod holds one GPU per rank (--tensor-parallel-size: 1, or the
    tensor-parallel overlay's sizes)."""
    for tree, found in parsed.items():
        for container, p in found:
            resources = container.spec.get("resources", {})
            gpus = resources.get("limits", {}).get("nvidia.com/gpu")
            assert resources.get("requests", {}).get("nvidia.com/gpu") == gpus, container.name
            is_gpu_worker = tree in GPU_TREES and p.command in WORKER_COMMANDS
            assert (gpus is not None) == (is_gpu_worker and not container.is_init), container.name
            if gpus is not None:  # one GPU per rank of the worker's model
                assert int(gpus) == p.value("--tensor-parallel-size"), container.name
            if p.command in WORKER_COMMANDS and not container.is_init:
                shm = next(m for m in container.spec["volumeMounts"]
                           if m["mountPath"] == "/dev/shm")
                volume = next(v for v in container.pod_spec["volumes"]
                              if v["name"] == shm["name"])
                assert volume["emptyDir"]["medium"] == "Memory", container.name


def test_pods_run_as_non_root_and_workers_spread(rendered) -> None:
    for tree, resources in rendered.items():
        for resource in resources:
            for owner, template in pod_templates(resource):
                spec = template["spec"]
                assert spec["securityContext"]["runAsNonRoot"] is True, (tree, owner)
                role = template["metadata"]["labels"]["app.kubernetes.io/component"]
                if role in ("prefill", "decode"):
                    term = spec["affinity"]["podAntiAffinity"][
                        "preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
                    assert term["topologyKey"] == "kubernetes.io/hostname"
                    assert selects(term["labelSelector"]["matchLabels"],
                                    template["metadata"]["labels"])


def test_disruption_budgets_cover_every_role(rendered) -> None:
    for tree, resources in rendered.items():
        budgets = [r["spec"]["selector"]["matchLabels"] for r in resources
                   if r["kind"] == "PodDisruptionBudget"]
        for resource in resources:
            for owner, template in pod_templates(resource):
                if owner.endswith("[head]"):
                    continue
                labels = template["metadata"]["labels"]
                assert sum(selects(b, labels) for b in budgets) == 1, (tree, owner)


def test_images_are_pinned_outside_cpu_dev(rendered) -> None:
    for tree, resources in rendered.items():
        if tree == "base" or tree in CPU_DEV_TREES:
            continue
        for container in containers(tree, resources):
            image = container.spec["image"]
            # ours at a release tag; the K/V store's Valkey at its release (test_k8s_kv_tiers)
            assert (re.search(r"/kvferry/(worker|router):[\w.-]+$", image)
                    or STORE_IMAGE.match(image)), container.name


def test_autoscale_metric_matches_the_adapter_rules(rendered) -> None:
    resources = rendered["overlays/autoscale"]
    values = yaml.safe_load((K8S_DIR / "overlays/autoscale/prometheus-adapter-values.yaml")
                            .read_text())
    served = {rule["name"]["as"] for rule in values["rules"]["custom"]}
    deployments = {r["metadata"]["name"]: r for r in resources if r["kind"] == "Deployment"}
    hpas = [r for r in resources if r["kind"] == "HorizontalPodAutoscaler"]
    assert {h["spec"]["scaleTargetRef"]["name"] for h in hpas} == {"kvferry-prefill",
                                                                   "kvferry-decode"}
    for hpa in hpas:
        target = deployments[hpa["spec"]["scaleTargetRef"]["name"]]
        assert "replicas" not in target["spec"], "the HPA owns replicas"
        for metric in hpa["spec"]["metrics"]:
            assert metric["pods"]["metric"]["name"] in served
    monitor = next(r for r in resources if r["kind"] == "PodMonitor")
    scraped = [c for c in containers("overlays/autoscale", resources)
               if selects(monitor["spec"]["selector"]["matchLabels"], c.labels)
               and not c.is_init]
    assert scraped and all(_port(c, "metrics") for c in scraped)


# The ray overlay: `kvferry serve --kv-transport=ray` on the RayCluster's head creates the
# router and every worker as Ray actors (deploy/ray_launcher.py); the worker groups are plain
# Ray nodes where the GPU worker actors land.

TLS_FLAGS = ("--tls-cert", "--tls-key", "--tls-ca", "--cluster-token-file")


@pytest.mark.parametrize("tree", TLS_TREES)
def test_tls_overlay_wires_every_process_to_read_only_secrets(parsed, tree: str) -> None:
    """overlays/tls (and nixl-gpu, built on it): router and workers all get the cluster
    certificate, CA and token, each file on a read-only Secret volume; workers then require
    client certificates (mTLS)."""
    found = [(c, p) for c, p in parsed[tree] if not c.is_init]
    assert {p.command for _, p in found} >= {"router", "prefill-worker", "decode-worker"}
    for container, p in found:
        for flag in TLS_FLAGS:
            path = p.value(flag)
            assert path, (container.name, flag)
            mount = next((m for m in container.spec["volumeMounts"]
                          if path.startswith(m["mountPath"].rstrip("/") + "/")), None)
            assert mount is not None and mount.get("readOnly") is True, (container.name, flag)
            volume = next(v for v in container.pod_spec["volumes"]
                          if v["name"] == mount["name"])
            assert "secret" in volume, (container.name, flag)
            key = Path(path).relative_to(mount["mountPath"]).as_posix()
            items = volume["secret"].get("items")
            assert items is None or key in {i["path"] for i in items}, (container.name, flag)
        assert p.value("--tls-server-name"), container.name  # pods are dialled by IP
    for other, trees_found in parsed.items():
        if other not in TLS_TREES:
            assert all(p.value("--tls-cert") is None for _, p in trees_found), other
