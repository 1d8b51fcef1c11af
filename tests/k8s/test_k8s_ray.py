"""The ray overlay: `kvferry serve --kv-transport=ray` on a KubeRay RayCluster's head (router
and workers as Ray actors, deploy/ray_launcher.py), checked against the Ray worker nodes it
needs: GPUs for every worker actor, the model mounted everywhere, the object store, grace;
and its trust boundary: every Ray node authenticates with the token from one Secret the
operator creates, and NetworkPolicies admit Ray's ports from the RayCluster's own pods only."""

from __future__ import annotations

import copy
import inspect
import re
import shlex

from conftest import Parsed, selects
from k8s_manifests import K8S_DIR, VAR_REF, Container, config_maps, containers
from test_k8s_nixl import ELSEWHERE, admitted

_QUANTITY = re.compile(r"^(\d+)(Ki|Mi|Gi|Ti)?$")
DEPLOY_DOC = K8S_DIR.parent / "docs" / "deploy-kubernetes.md"
COMPONENT = "app.kubernetes.io/component"
# Ports Ray opens besides those a container names: KubeRay's metrics export (8080), the
# dashboard (8265, loopback here) and its agent (52365), worker processes (10002-19999 by
# default), and the random ports raylets and object managers pick.
RAY_PORTS = (8080, 8265, 10002, 19999, 52365, 40000, 60999)


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
    """Ray's dashboard runs submitted jobs: loopback only, on top of the token it asks for
    (KubeRay binds 0.0.0.0 when `dashboard-host` is absent), and no port of the pod names it."""
    cluster, head, _, workers = _ray(rendered, parsed)
    start = cluster["spec"]["headGroupSpec"]["rayStartParams"]
    assert (start.get("include-dashboard") == "false"
            or start.get("dashboard-host") in ("127.0.0.1", "localhost")), start
    for container in [head, *workers]:
        ports = container.spec.get("ports", [])
        assert not [p for p in ports if p.get("name") == "dashboard"
                    or p["containerPort"] == 8265], container.name


def _auth_env(container: Container) -> tuple[str | None, dict | None]:
    """(RAY_AUTH_MODE's literal value, RAY_AUTH_TOKEN's secretKeyRef) of a container."""
    env = {var["name"]: var for var in container.spec.get("env", [])}
    mode = env.get("RAY_AUTH_MODE", {}).get("value")
    token = env.get("RAY_AUTH_TOKEN", {})
    assert "value" not in token, f"{container.name}: a Ray token committed as a literal"
    return mode, token.get("valueFrom", {}).get("secretKeyRef")


def test_every_ray_node_authenticates_with_the_operators_secret(rendered, parsed) -> None:
    """`ray start` turns Ray's token authentication on only with RAY_AUTH_MODE=token and a
    token: the head (whose wait loop and serve inherit its env) and every worker group get
    both, from one Secret that the overlay references but never renders (the operator creates
    it with the command docs/deploy-kubernetes.md gives)."""
    resources = rendered["overlays/ray"]
    _, head, _, workers = _ray(rendered, parsed)
    refs = set()
    for container in [head, *workers]:
        mode, ref = _auth_env(container)
        assert mode == "token", f"{container.name}: RAY_AUTH_MODE={mode}"
        assert ref is not None and ref.get("optional") is not True, \
            f"{container.name}: RAY_AUTH_TOKEN from no required Secret"
        refs.add((ref["name"], ref["key"]))
    assert len(refs) == 1, f"head and workers must share one token: {refs}"
    ((secret, key),) = refs
    assert not [r for r in resources if r["kind"] == "Secret"], "never render the token"
    # The overlay's own comment and the deployment guide name the Secret and its key ...
    kustomization = (K8S_DIR / "overlays/ray/kustomization.yaml").read_text()
    assert re.search(rf"^#\s+{secret}\s+{key}\b", kustomization, re.M), kustomization
    # ... and the guide creates it with a random value, in the namespace it applies to.
    command = re.search(rf"kubectl -n (\S+) create secret generic {secret} (.*)", DEPLOY_DOC
                        .read_text())
    assert command is not None, f"docs/deploy-kubernetes.md never creates {secret}"
    assert re.search(rf"--from-(literal|file)={key}=", command.group(2)), command.group(0)
    assert command.group(1) == "kvferry"


def ray_policy_problems(resources: list[dict]) -> list[str]:
    """Every port of the RayCluster's pods admits the cluster's own pods; from elsewhere (another
    app, or a kvferry pod that is no Ray node), only the ports the Service kvferry-router
    exposes on the head."""
    cluster = next(r for r in resources if r["kind"] == "RayCluster")
    nodes = [c for c in containers("overlays/ray", [cluster]) if not c.is_init]
    policies = [r for r in resources if r["kind"] == "NetworkPolicy"]
    service = next(r for r in resources if r["kind"] == "Service"
                   and r["metadata"]["name"] == "kvferry-router")
    public = {p["targetPort"] for p in service["spec"]["ports"]}
    members = {c.labels[COMPONENT]: c.labels for c in nodes}
    outsiders = {"elsewhere": ELSEWHERE,
                 "a kvferry client": {**ELSEWHERE, "app.kubernetes.io/name": "kvferry",
                                      COMPONENT: "client"}}
    problems = []
    for policy in policies:  # admitted() reads podSelector peers of this namespace only
        for rule in policy["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                if set(peer) != {"podSelector"}:
                    problems.append(f"{policy['metadata']['name']}: a peer beyond this "
                                    f"namespace's pods: {peer}")
    for c in nodes:
        if not any(selects(p["spec"]["podSelector"].get("matchLabels", {}), c.labels)
                   for p in policies):
            problems.append(f"{c.name}: no NetworkPolicy fences Ray's ports")
        named = [(p["containerPort"], p.get("name")) for p in c.spec.get("ports", [])]
        for number, name in [*named, *((n, None) for n in RAY_PORTS)]:
            is_public = name in public and selects(service["spec"]["selector"], c.labels)
            for member, labels in members.items():
                if not admitted(policies, c.labels, number, name, labels):
                    problems.append(f"{c.name}: port {name or number} from {member}: closed")
            for source, labels in outsiders.items():
                if admitted(policies, c.labels, number, name, labels) is not is_public:
                    problems.append(f"{c.name}: port {name or number} from {source}: "
                                    f"expected {'open' if is_public else 'closed'}")
    return problems


def test_network_policies_admit_ray_only_from_the_cluster(rendered) -> None:
    assert ray_policy_problems(rendered["overlays/ray"]) == []


def test_ray_policy_check_catches_mistakes(rendered) -> None:
    """Negative controls: each of these mistakes is reported."""
    resources = rendered["overlays/ray"]

    def broken(edit) -> list[str]:
        changed = copy.deepcopy(resources)
        for r in changed:
            if r["kind"] == "NetworkPolicy":
                edit(r["metadata"]["name"], r["spec"])
        return ray_policy_problems(changed)

    def open_workers_to_all(name: str, spec: dict) -> None:
        if name == "kvferry-ray-workers":
            del spec["ingress"][0]["from"]

    def admit_any_kvferry_pod(name: str, spec: dict) -> None:
        if name == "kvferry-ray-head":
            spec["ingress"][1]["from"] = [
                {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvferry"}}}]

    def admit_other_namespaces(name: str, spec: dict) -> None:
        spec["ingress"][-1]["from"].append({"namespaceSelector": {}})

    def drop_http(name: str, spec: dict) -> None:
        if name == "kvferry-ray-head":
            spec["ingress"][0]["ports"] = [p for p in spec["ingress"][0]["ports"]
                                           if p["port"] != "http"]

    def drop_workers_from_head(name: str, spec: dict) -> None:
        if name == "kvferry-ray-head":
            del spec["ingress"][1]["from"][1]

    assert any("from elsewhere: expected closed" in p and "[gpu]" in p
               for p in broken(open_workers_to_all))
    assert any("from a kvferry client: expected closed" in p
               for p in broken(admit_any_kvferry_pod))
    assert any("beyond this namespace" in p for p in broken(admit_other_namespaces))
    assert any("port http from elsewhere: expected open" in p for p in broken(drop_http))
    assert any("port gcs from ray-worker: closed" in p for p in broken(drop_workers_from_head))
    no_policies = [r for r in resources if r["kind"] != "NetworkPolicy"]
    assert any("no NetworkPolicy" in p for p in ray_policy_problems(no_policies))


def test_ray_auth_check_catches_a_missing_token(rendered, parsed) -> None:
    """Negative control: a worker group without the token, or with a literal one, fails."""
    for edit in ("drop", "literal"):
        changed = copy.deepcopy(rendered)
        cluster = next(r for r in changed["overlays/ray"] if r["kind"] == "RayCluster")
        env = cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["env"]
        token = next(var for var in env if var["name"] == "RAY_AUTH_TOKEN")
        if edit == "drop":
            env.remove(token)
        else:
            token["value"] = "committed"
        try:
            test_every_ray_node_authenticates_with_the_operators_secret(changed, parsed)
        except AssertionError:
            continue
        raise AssertionError(f"a worker group's token ({edit}) went unnoticed")
