"""Every kustomize tree renders and validates, offline, in strict mode against the Kubernetes
1.30 schemas shipped in `kubernetes-validate`.

kubernetes-validate has no schema for a CRD kind and only warns about it, so CRD kinds must be
on an explicit allow-list, their required fields are checked here, and the pod templates they
embed are validated as core PodTemplates.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import kubernetes_validate
import pytest
from k8s_manifests import K8S_DIR, KUBERNETES_VERSION, OVERLAYS, TREES, pod_templates

CrdCheck = Callable[[dict], list[str]]


def _string_map(value: object) -> bool:
    return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())


OVERWRITE_CMD = "ray.io/overwrite-container-cmd"
GEN_RAY_START = "$KUBERAY_GEN_RAY_START_CMD"


def _ray_start_problems(where: str, containers: list, overwrite: bool) -> list[str]:
    """KubeRay runs a Ray pod's first container. Without the overwrite annotation it puts its
    own `ray start ... --block &&` in front of any command given (which then never runs);
    with it, the container must start Ray itself from KUBERAY_GEN_RAY_START_CMD."""
    ray = containers[0]
    script = " ".join(map(str, ray.get("command", []) + ray.get("args", [])))
    if not script:
        return []  # KubeRay's own command
    if not overwrite:
        return [f"{where}: a command needs metadata.annotations {OVERWRITE_CMD}: 'true'"]
    gen = GEN_RAY_START.lstrip("$")
    if f"${gen}" not in script and f"${{{gen}" not in script:
        return [f"{where}: the command never starts Ray ({GEN_RAY_START})"]
    return []


def check_raycluster(resource: dict) -> list[str]:
    """Fields KubeRay's ray.io/v1 RayCluster needs to reconcile, and commands that start Ray."""
    problems = []
    overwrite = (resource.get("metadata", {}).get("annotations") or {}).get(OVERWRITE_CMD) \
        == "true"
    spec = resource.get("spec") or {}
    if not isinstance(spec.get("rayVersion"), str):
        problems.append("spec.rayVersion: expected a string")
    head = spec.get("headGroupSpec") or {}
    head_containers = (head.get("template") or {}).get("spec", {}).get("containers")
    if not head_containers:
        problems.append("spec.headGroupSpec.template.spec.containers: missing")
    else:
        problems += _ray_start_problems("spec.headGroupSpec", head_containers, overwrite)
    if not _string_map(head.get("rayStartParams", {})):
        problems.append("spec.headGroupSpec.rayStartParams: values must be strings")
    groups = spec.get("workerGroupSpecs")
    if not isinstance(groups, list) or not groups:
        return [*problems, "spec.workerGroupSpecs: expected a non-empty list"]
    names = [group.get("groupName") for group in groups]
    if len(set(names)) != len(names):
        problems.append(f"spec.workerGroupSpecs: duplicate groupName in {names}")
    for i, group in enumerate(groups):
        where = f"spec.workerGroupSpecs[{i}]"
        if not isinstance(group.get("groupName"), str) or not group["groupName"]:
            problems.append(f"{where}.groupName: missing")
        group_containers = (group.get("template") or {}).get("spec", {}).get("containers")
        if not group_containers:
            problems.append(f"{where}.template.spec.containers: missing")
        else:
            problems += _ray_start_problems(where, group_containers, overwrite)
        if not _string_map(group.get("rayStartParams", {})):
            problems.append(f"{where}.rayStartParams: values must be strings")
        counts = [group.get(key) for key in ("minReplicas", "replicas", "maxReplicas")]
        if not all(isinstance(c, int) for c in counts) or not counts[0] <= counts[1] <= counts[2]:
            problems.append(f"{where}: need integers minReplicas <= replicas <= maxReplicas")
    return problems


def check_podmonitor(resource: dict) -> list[str]:
    """Fields the Prometheus Operator's monitoring.coreos.com/v1 PodMonitor needs."""
    spec = resource.get("spec") or {}
    problems = []
    if not isinstance(spec.get("selector"), dict):
        problems.append("spec.selector: missing")
    endpoints = spec.get("podMetricsEndpoints")
    if not isinstance(endpoints, list) or not endpoints:
        problems.append("spec.podMetricsEndpoints: expected a non-empty list")
    for i, endpoint in enumerate(endpoints or []):
        if not isinstance(endpoint.get("port"), str):
            problems.append(f"spec.podMetricsEndpoints[{i}].port: expected a port name")
    return problems


ALLOWED_CRDS: dict[tuple[str, str], CrdCheck] = {
    ("ray.io/v1", "RayCluster"): check_raycluster,
    ("monitoring.coreos.com/v1", "PodMonitor"): check_podmonitor,
}
# Which overlay may use which CRD: the base and the gpu/cpu-dev overlays are plain Kubernetes.
EXPECTED_CRD_KINDS = {"base": set(), "overlays/gpu": set(), "overlays/cpu-dev": set(),
                      "overlays/ray": {"RayCluster"}, "overlays/autoscale": {"PodMonitor"},
                      "overlays/tls": set(), "overlays/nixl": set(), "overlays/nixl-gpu": set(),
                      "overlays/kv-tiers": set(), "overlays/planner": set(),
                      "overlays/tensor-parallel": set()}


def validate(resource: dict) -> None:
    kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)


def as_pod_template(owner: str, template: dict) -> dict:
    return {"apiVersion": "v1", "kind": "PodTemplate",
            "metadata": {"name": owner.lower().replace("/", "-").strip("]").replace("[", "-")},
            "template": template}


def crd_problems(resource: dict) -> list[str]:
    """Allow-list check, required fields, and strict validation of embedded pod templates."""
    key = (resource.get("apiVersion"), resource.get("kind"))
    if key not in ALLOWED_CRDS:
        return [f"{key}: no Kubernetes {KUBERNETES_VERSION} schema and not an allowed CRD"]
    problems = ALLOWED_CRDS[key](resource)
    if not resource.get("metadata", {}).get("name"):
        problems.append("metadata.name: missing")
    for owner, template in pod_templates(resource) if not problems else ():
        try:
            validate(as_pod_template(owner, template))
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{owner} pod template: {exc.message} at {list(exc.path)}")
    return problems


@pytest.mark.parametrize("tree", TREES)
def test_tree_renders_and_validates_strictly(tree: str, rendered: dict[str, list[dict]]) -> None:
    resources = rendered[tree]
    assert resources, f"k8s/{tree} rendered nothing"
    problems, crd_kinds = [], set()
    for resource in resources:
        name = f"{resource.get('kind')}/{resource.get('metadata', {}).get('name')}"
        try:
            validate(resource)
        except kubernetes_validate.SchemaNotFoundError:
            crd_kinds.add(resource["kind"])
            problems += [f"{name}: {p}" for p in crd_problems(resource)]
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{name}: {exc.message} at {list(exc.path)}")
    assert problems == []
    assert crd_kinds == EXPECTED_CRD_KINDS[tree]


def test_every_overlay_is_tested() -> None:
    on_disk = {p.name for p in (K8S_DIR / "overlays").iterdir() if p.is_dir()}
    assert on_disk == set(OVERLAYS)


def test_rendered_names_are_unique(rendered: dict[str, list[dict]]) -> None:
    for tree, resources in rendered.items():
        keys = [(r["kind"], r["metadata"]["name"]) for r in resources]
        assert len(keys) == len(set(keys)), tree


def _router_deployment(rendered: dict[str, list[dict]]) -> dict:
    return next(r for r in rendered["base"]
                if r["kind"] == "Deployment" and r["metadata"]["name"] == "kvferry-router")


# Negative controls: the checks above would catch these mistakes.

def test_strict_mode_rejects_a_misspelt_field(rendered: dict[str, list[dict]]) -> None:
    broken = copy.deepcopy(_router_deployment(rendered))
    container = broken["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=False)  # lax mode: passes
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(broken)


def test_grpc_probe_port_must_be_a_number(rendered: dict[str, list[dict]]) -> None:
    broken = copy.deepcopy(_router_deployment(rendered))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(broken)


def test_crd_checks_catch_missing_fields(rendered: dict[str, list[dict]]) -> None:
    ray = next(r for r in rendered["overlays/ray"] if r["kind"] == "RayCluster")
    assert crd_problems(ray) == []
    broken = copy.deepcopy(ray)
    del broken["spec"]["workerGroupSpecs"][0]["groupName"]
    assert any("groupName" in p for p in crd_problems(broken))
    broken = copy.deepcopy(ray)
    container = broken["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    container["imagePullPolicy"] = 1
    assert any("pod template" in p for p in crd_problems(broken))
    # without the annotation KubeRay would run `ray start --block && <our script>`
    broken = copy.deepcopy(ray)
    del broken["metadata"]["annotations"]["ray.io/overwrite-container-cmd"]
    assert any("overwrite-container-cmd" in p for p in crd_problems(broken))
    # with it, a script that never runs KubeRay's ray start line leaves no Ray node
    broken = copy.deepcopy(ray)
    head = broken["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    head["args"] = [head["args"][0].replace("KUBERAY_GEN_RAY_START_CMD", "TYPO")]
    assert any("never starts Ray" in p for p in crd_problems(broken))
    unknown = {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": "x"}}
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        validate(unknown)
    assert crd_problems(unknown) != []
