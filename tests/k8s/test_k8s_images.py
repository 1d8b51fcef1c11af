"""The Dockerfiles (not built here: no container engine) agree with the project and the
manifests: non-root, no HEALTHCHECK, `kvferry` as entrypoint, every package copied; the CPU
image's dependency cut leaves the router and the CPU worker path importable."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from k8s_manifests import K8S_DIR

REPO = K8S_DIR.parent
IMAGES = K8S_DIR / "images"
DOCKERFILES = ("worker.Dockerfile", "router.Dockerfile")


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (IMAGES / dockerfile).read_text())
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_image_runs_kvferry_as_non_root(dockerfile: str) -> None:
    steps = instructions(dockerfile)
    keywords = [k for k, _ in steps]
    assert "HEALTHCHECK" not in keywords  # Kubernetes probes grpc.health.v1 instead
    user = [rest for k, rest in steps if k == "USER"][-1]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric non-root USER (runAsNonRoot checks it)"
    assert keywords[-2:] == ["ENTRYPOINT", "CMD"]
    assert json.loads(steps[-2][1]) == ["kvferry"]
    assert keywords.index("USER") > max(i for i, k in enumerate(keywords) if k == "RUN")


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_image_copies_every_package(dockerfile: str) -> None:
    with open(REPO / "pyproject.toml", "rb") as f:
        find = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]
    packages = {p.rstrip("*") for p in find["include"]}
    # Each package's folder, under the source root (`where`) that holds it: that is copied.
    folders = {root: {p for p in packages if (REPO / root / p / "__init__.py").exists()}
               for root in find["where"]}
    assert set().union(*folders.values()) == packages
    needed = {(Path(root) / p).parts[0] for root, found in folders.items() for p in found}
    copied = {rest.split()[0].rstrip("/") for k, rest in instructions(dockerfile) if k == "COPY"}
    assert needed <= copied


def test_manifests_run_as_the_image_user(rendered: dict[str, list[dict]]) -> None:
    uids = {int(rest.split(":")[0]) for f in DOCKERFILES
            for k, rest in instructions(f) if k == "USER"}
    for resources in rendered.values():
        for resource in resources:
            template = resource.get("spec", {}).get("template")
            if resource["kind"] == "Deployment":
                assert template["spec"]["securityContext"]["runAsUser"] in uids


def test_cpu_requirements_drop_only_gpu_ray_and_codegen() -> None:
    sys.path.insert(0, str(IMAGES))
    try:
        from cpu_requirements import EXCLUDED, cpu_requirements, requirement_name
    finally:
        sys.path.remove(str(IMAGES))
    with open(REPO / "pyproject.toml", "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    kept = cpu_requirements(str(REPO / "pyproject.toml"))
    assert {requirement_name(d) for d in dependencies} - {requirement_name(d) for d in kept} \
        == set(EXCLUDED)


# Imported by `kvferry router` and by CPU workers (`--attention-backend torch`), with NIXL
# (`--kv-transport nixl`: the overlays cpu-dev and nixl run their workers on this image).
CPU_IMAGE_PROBE = """
import importlib.abc, sys
BLOCKED = ("triton", "ray", "grpc_tools")
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not in the CPU image")
sys.meta_path.insert(0, Block())
import deploy.args, deploy.cli, deploy.processes
import kvferry.model.checkpoint, kvferry.transfer.grpc.send
import router.server, router.http.front, router.workers.discovery
import prefill_worker.server, decode_worker.server
import kvferry.transfer.nixl.send, kvferry.transfer.nixl.receive, nixl_cu12._api
from kvferry_kernels.dispatch import get_attention_backend
get_attention_backend("torch")
deploy.args.build_parser()
print("ok")
"""


def test_router_and_cpu_workers_import_without_triton_ray_or_grpc_tools() -> None:
    """nixl_cu12 is what cpu_requirements.py installs (a project dependency, kept)."""
    result = subprocess.run([sys.executable, "-c", CPU_IMAGE_PROBE], capture_output=True,
                            text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


def test_make_model_is_deterministic(tmp_path: Path) -> None:
    """cpu-dev makes the model in every pod: the checkpoints (and fingerprints) must agree."""
    from kvferry.model.checkpoint import make_model

    first, second = make_model(tmp_path / "a"), make_model(tmp_path / "b")
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
