"""The ray overlay: `kvferry serve --kv-transport=ray` on a KubeRay RayCluster's head (router
and workers as Ray actors, deploy/ray_launcher.py), checked against the Ray worker nodes it
needs: GPUs for every worker actor, the model mounted everywhere, the object store, grace."""

from __future__ import annotations

import inspect
import re
import shlex

from conftest import Parsed, selects
from k8s_manifests import VAR_REF, Container, config_maps, containers

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
    assert selects(selector, head.labels)
    assert not any(selects(selector, c.labels) for c in workers)




def test_ray_dashboard_is_not_on_the_pod_network(rendered, parsed) -> None:
    """Ray's dashboard runs submitted jobs without authentication: loopback only (KubeRay
    binds 0.0.0.0 when `dashboard-host` is absent), and no port of the pod names it."""
    cluster, head, _, workers = _ray(rendered, parsed)
    start = cluster["spec"]["headGroupSpec"]["rayStartParams"]
    assert (start.get("include-dashboard") == "false"
            or start.get("dashboard-host") in ("127.0.0.1", "localhost")), start
    for container in [head, *workers]:
        ports = container.spec.get("ports", [])
        assert not [p for p in ports if p.get("name") == "dashboard"
                    or p["containerPort"] == 8265], container.name
