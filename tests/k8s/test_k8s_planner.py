"""The planner overlay: the live planner (`kvferry planner`) with the RBAC to set the prefill
and decode Deployments' replicas and nothing more."""

from __future__ import annotations

from pathlib import Path

from deploy.planner.profile import CostModel, Profile
from deploy.planner.search import Sla


def test_the_planner_may_scale_exactly_the_workers_it_names(rendered, tmp_path: Path) -> None:
    """Its Role grants the verbs KubernetesScaler uses (tests/deploy/planner/
    test_planner_loop.py records them) on the two Deployments its flags name; its profile
    and SLA load; the worker Deployments leave their replicas to it."""
    resources = rendered["overlays/planner"]
    role = next(r for r in resources if r["kind"] == "Role"
                and r["metadata"]["name"] == "kvferry-planner")
    [rule] = role["rules"]
    assert rule["resources"] == ["deployments/scale"] and rule["apiGroups"] == ["apps"]
    assert set(rule["verbs"]) == {"get", "patch"}  # read_..._scale, patch_..._scale
    planner = next(r for r in resources if r["kind"] == "Deployment"
                   and r["metadata"]["name"] == "kvferry-planner")
    args = planner["spec"]["template"]["spec"]["containers"][0]["args"]
    flags = dict(a.split("=", 1) for a in args if a.startswith("--") and "=" in a)
    assert set(rule["resourceNames"]) == {flags["--prefill-deployment"],
                                          flags["--decode-deployment"]}
    binding = next(r for r in resources if r["kind"] == "RoleBinding")
    assert binding["subjects"][0]["name"] == planner["spec"]["template"]["spec"][
        "serviceAccountName"]
    for name in ("kvferry-prefill", "kvferry-decode"):  # the planner owns their replicas
        deployment = next(r for r in resources if r["kind"] == "Deployment"
                          and r["metadata"]["name"] == name)
        assert "replicas" not in deployment["spec"]
    profile = next(r for r in resources if r["kind"] == "ConfigMap"
                   and r["metadata"]["name"].startswith("kvferry-planner-profile"))
    mount = planner["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]
    assert flags["--profile"] == mount["mountPath"] + "/profile.json"
    path = tmp_path / "profile.json"
    path.write_text(profile["data"]["profile.json"])
    CostModel(Profile.load(path))
    Sla.parse(flags["--sla"])
