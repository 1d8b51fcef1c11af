"""The manifests agree with the code: every kvferry container's command line parses with the
real CLI parser, ports and probe service names match what the processes serve, discovery names
match headless Services, env vars are consumed, and the drain fits the grace period. The ray
overlay runs `kvferry serve --kv-transport=ray` on the RayCluster's head (router and workers
as Ray actors, deploy/ray_launcher.py), checked against the Ray worker nodes it needs."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import io
import re
import shlex
from pathlib import Path

import pytest
import yaml
from k8s_manifests import (
    K8S_DIR,
    TREES,
    VAR_REF,
    Container,
    config_maps,
    containers,
    expand,
    pod_templates,
)

from deploy.args import build_parser
from kvferry.rpc import grpc_util

REPO = K8S_DIR.parent
SOURCE_DIRS = ("kvferry", "router", "prefill_worker", "decode_worker", "kernels")
GPU_TREES = ("base", "overlays/gpu", "overlays/ray", "overlays/autoscale", "overlays/tls")
WORKER_COMMANDS = ("prefill-worker", "decode-worker", "colocated-worker")


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _service_names(command: str) -> list[str]:
    if command in ("router", "serve"):  # serve's entry point is its router
        from router.server import SERVICE_NAMES
    elif command == "prefill-worker":
        from prefill_worker.server import SERVICE_NAMES
    else:
        from decode_worker.server import SERVICE_NAMES
    return list(SERVICE_NAMES)


class Parsed:
    """One container's kvferry command line, parsed by the real CLI parser."""

    def __init__(self, container: Container, env: dict[str, str | None]) -> None:
        argv = container.argv()
        assert argv is not None
        self.argv = expand(argv, env)
        unresolved = [a for a in self.argv if VAR_REF.search(a)]
        assert unresolved == [], f"{container.name}: no literal value for {unresolved}"
        self.command = next(a for a in self.argv if not a.startswith("-")
                            and a in _subcommands())
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                self.args = build_parser().parse_args(self.argv)
        except SystemExit:
            pytest.fail(f"{container.name}: kvferry rejects {self.argv}:\n{stderr.getvalue()}")

    def value(self, flag: str) -> object:
        """A flag's parsed value (None when the subcommand has no such flag)."""
        return getattr(self.args, flag.lstrip("-").replace("-", "_"), None)


def _kvferry_containers(tree: str, resources: list[dict]) -> list[tuple[Container, Parsed]]:
    maps = config_maps(resources)
    found = []
    for container in containers(tree, resources):
        if container.argv() is not None:
            found.append((container, Parsed(container, container.env_names(maps))))
    return found


@pytest.fixture(scope="module")
def parsed(rendered: dict[str, list[dict]]) -> dict[str, list[tuple[Container, Parsed]]]:
    return {tree: _kvferry_containers(tree, rendered[tree]) for tree in TREES}


def _port(container: Container, name: str) -> int | None:
    return next((p["containerPort"] for p in container.spec.get("ports", [])
                 if p.get("name") == name), None)


def _selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


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
            if container.is_init:
                continue
            assert p.value("--host") == "0.0.0.0", container.name
            assert _port(container, "grpc") == p.value("--port"), container.name
            assert _port(container, "metrics") == int(p.value("--metrics-port")), container.name
            names = _service_names(p.command)
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
                            if _selects(service["spec"]["selector"], c.labels)]
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
            selected = [c for c in pods if _selects(service["spec"]["selector"], c.labels)]
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
        for data in config_maps(resources).values():
            unused = [k for k in data if k not in used and f'"{k}"' not in source]
            assert unused == [], f"{tree}: ConfigMap keys nobody uses: {unused}"


def test_model_is_mounted_read_only(parsed) -> None:
    for tree, found in parsed.items():
        for container, p in found:
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
    for tree, found in parsed.items():
        for container, p in found:
            resources = container.spec.get("resources", {})
            gpus = resources.get("limits", {}).get("nvidia.com/gpu")
            assert resources.get("requests", {}).get("nvidia.com/gpu") == gpus, container.name
            is_gpu_worker = tree in GPU_TREES and p.command in WORKER_COMMANDS
            assert (gpus is not None) == (is_gpu_worker and not container.is_init), container.name
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
                    assert _selects(term["labelSelector"]["matchLabels"],
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
                assert sum(_selects(b, labels) for b in budgets) == 1, (tree, owner)


def test_images_are_pinned_outside_cpu_dev(rendered) -> None:
    for tree, resources in rendered.items():
        if tree in ("base", "overlays/cpu-dev"):
            continue
        for container in containers(tree, resources):
            image = container.spec["image"]
            assert re.search(r"/kvferry/(worker|router):[\w.-]+$", image), container.name


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
               if _selects(monitor["spec"]["selector"]["matchLabels"], c.labels)
               and not c.is_init]
    assert scraped and all(_port(c, "metrics") for c in scraped)


# The ray overlay: `kvferry serve --kv-transport=ray` on the RayCluster's head creates the
# router and every worker as Ray actors (deploy/ray_launcher.py); the worker groups are plain
# Ray nodes where the GPU worker actors land.

_QUANTITY = re.compile(r"^(\d+)(Ki|Mi|Gi|Ti)?$")


def _bytes(quantity: str) -> int:
    number, unit = _QUANTITY.match(str(quantity)).groups()
    return int(number) * 1024 ** ("", "Ki", "Mi", "Gi", "Ti").index(unit or "")


def _ray(rendered, parsed) -> tuple[dict, Container, Parsed, list[Container]]:
    """The RayCluster, its head container with serve parsed, and the worker node containers."""
    resources = rendered["overlays/ray"]
    cluster = next(r for r in resources if r["kind"] == "RayCluster")
    head = [(c, p) for c, p in parsed["overlays/ray"] if c.owner.endswith("[head]")]
    assert len(head) == 1
    workers = [c for c in containers("overlays/ray", resources)
               if c.owner.startswith("RayCluster/") and not c.owner.endswith("[head]")]
    assert workers
    return cluster, *head[0], workers


def _script(container: Container) -> str:
    assert container.spec["command"] == ["/bin/bash", "-lc", "--"], container.name
    (script,) = container.spec["args"]
    return script


def test_ray_head_starts_ray_then_execs_serve(rendered, parsed) -> None:
    cluster, head, serve, _ = _ray(rendered, parsed)
    assert serve.command == "serve"
    assert serve.value("--kv-transport") == "ray"
    assert serve.value("--ray-address") == "auto"  # the Ray head this pod just started
    assert re.search(r"/kvferry/worker:[\w.-]+$", head.spec["image"]), "serve needs Ray"
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    script = _script(head)
    before, _, rest = script.partition("exec kvferry ")
    # Ray in the background (KubeRay's line minus --block), then serve as PID 1: SIGTERM
    # reaches it and it drains the actors.
    assert "${KUBERAY_GEN_RAY_START_CMD/ --block/}" in before
    assert not re.search(r"[;&|]", rest), "exec kvferry must be the script's last command"
    env = head.env_names(config_maps(rendered["overlays/ray"]))
    assert [v for v in VAR_REF.findall(script) if env.get(v) is None] == []
    # It waits for a GPU per worker actor: serve asks Ray for GPUs only if some are there.
    raw = dict(arg.partition("=")[::2] for arg in shlex.split(rest) if arg.startswith("--"))
    assert "GPU" in before
    assert raw["--num-prefill"] in before and raw["--num-decode"] in before


def test_ray_worker_nodes_hold_every_worker_actor(rendered, parsed) -> None:
    cluster, head, serve, workers = _ray(rendered, parsed)
    needed = serve.value("--num-prefill") + serve.value("--num-decode")
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    offered = 0
    for container in workers:
        assert container.argv() is None, f"{container.name}: a plain Ray node runs no kvferry"
        assert "KUBERAY_GEN_RAY_START_CMD/" not in _script(container), "keep ray start --block"
        resources = container.spec["resources"]
        gpus = resources["limits"]["nvidia.com/gpu"]
        assert resources["requests"]["nvidia.com/gpu"] == gpus >= 1, container.name
        group = groups[container.owner.rpartition("[")[2].rstrip("]")]
        assert group["rayStartParams"].get("num-gpus", str(gpus)) == str(gpus)
        offered += gpus * group["minReplicas"]
    assert offered >= needed, f"{offered} GPUs for {needed} worker actors"


def test_ray_nodes_mount_the_model_and_fit_the_object_store(rendered, parsed) -> None:
    cluster, head, serve, workers = _ray(rendered, parsed)
    model = serve.value("--model")

    def model_volume(container: Container) -> tuple[str, dict]:
        mount = next((m for m in container.spec["volumeMounts"]
                      if model.startswith(m["mountPath"].rstrip("/") + "/")), None)
        assert mount is not None, f"{container.name}: {model} is on no volume"
        assert mount.get("readOnly") is True, container.name
        volume = next(v for v in container.pod_spec["volumes"] if v["name"] == mount["name"])
        return mount["mountPath"], volume["persistentVolumeClaim"]

    # worker actors load --model on whichever node they land: the same path everywhere
    assert {model_volume(c)[0] for c in [head, *workers]} == {model_volume(head)[0]}
    for container in [head, *workers]:
        assert model_volume(container)[1] == {"claimName": "kvferry-models", "readOnly": True}
    params = [cluster["spec"]["headGroupSpec"]["rayStartParams"],
              *(g["rayStartParams"] for g in cluster["spec"]["workerGroupSpecs"])]
    for container, start in zip([head, *workers], params, strict=True):
        shm = next(m for m in container.spec["volumeMounts"] if m["mountPath"] == "/dev/shm")
        volume = next(v for v in container.pod_spec["volumes"] if v["name"] == shm["name"])
        assert volume["emptyDir"]["medium"] == "Memory", container.name
        assert int(start["object-store-memory"]) <= _bytes(volume["emptyDir"]["sizeLimit"])


def test_ray_head_grace_covers_stopping_every_actor(rendered, parsed) -> None:
    """serve stops the actors one by one, router first, each within RayDeployment.stop's
    grace_s; the kubelet must not SIGKILL it before, nor liveness kill a draining router."""
    from deploy.ray_launcher import RayDeployment

    _, head, serve, _ = _ray(rendered, parsed)
    per_actor_s = inspect.signature(RayDeployment.stop).parameters["grace_s"].default
    actors = 1 + serve.value("--num-prefill") + serve.value("--num-decode")
    grace_s = head.pod_spec["terminationGracePeriodSeconds"]
    assert per_actor_s * actors < grace_s <= per_actor_s * actors + 30
    liveness = head.spec["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > grace_s


def test_ray_overlay_keeps_only_what_selects_the_cluster(rendered, parsed) -> None:
    resources = rendered["overlays/ray"]
    assert [r for r in resources if r["kind"] == "Deployment"] == []
    _, head, _, workers = _ray(rendered, parsed)
    services = {r["metadata"]["name"]: r for r in resources if r["kind"] == "Service"}
    assert set(services) == {"kvferry-router"}  # headless worker Services are gone
    selector = services["kvferry-router"]["spec"]["selector"]
    assert _selects(selector, head.labels)
    assert not any(_selects(selector, c.labels) for c in workers)


TLS_FLAGS = ("--tls-cert", "--tls-key", "--tls-ca", "--cluster-token-file")


def test_tls_overlay_wires_every_process_to_read_only_secrets(parsed) -> None:
    """overlays/tls: router and workers all get the cluster certificate, CA and token, each
    file on a read-only Secret volume; workers then require client certificates (mTLS)."""
    found = [(c, p) for c, p in parsed["overlays/tls"] if not c.is_init]
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
    for tree, trees_found in parsed.items():
        if tree != "overlays/tls":
            assert all(p.value("--tls-cert") is None for _, p in trees_found), tree
