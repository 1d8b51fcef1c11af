"""The layout's top-level folders and the import names they give. `kernels/` is a source root:
the kernel package inside it imports as `kvferry_kernels`, because a top-level `kernels` would
shadow Hugging Face's package of that name, which transformers imports."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OURS = ("kvferry", "router", "prefill_worker", "decode_worker", "kvferry_kernels", "deploy")
# The folders of the design card, each at the top of the repository.
FOLDERS = ("router", "prefill_worker", "decode_worker", "kernels", "kvferry", "protos", "deploy",
           "k8s", "bench", "docs", "tests")


def test_the_design_cards_folders_exist_and_kernels_is_a_source_root() -> None:
    assert [f for f in FOLDERS if not (REPO / f).is_dir()] == []
    assert (REPO / "kernels" / "kvferry_kernels" / "__init__.py").is_file()
    # An __init__.py here (or in a tests folder named kernels) makes `kernels` ours.
    assert not (REPO / "kernels" / "__init__.py").exists()
    assert not (REPO / "tests" / "kernels" / "__init__.py").exists()


def test_no_import_name_of_ours_is_another_distributions() -> None:
    owners = importlib.metadata.packages_distributions()
    clashes = {name: sorted(set(owners[name]) - {"kvferry"}) for name in OURS
               if set(owners.get(name, [])) - {"kvferry"}}
    assert clashes == {}


def test_transformers_and_hugging_faces_kernels_import_from_the_repository_root() -> None:
    probe = ("import transformers, kernels, kvferry_kernels.dispatch\n"
             "print(getattr(kernels, '__file__', None))\n"
             "print(kvferry_kernels.dispatch.__file__)")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    theirs, ours = result.stdout.split()
    assert theirs != "None" and not Path(theirs).is_relative_to(REPO / "kernels")
    assert Path(ours) == REPO / "kernels" / "kvferry_kernels" / "dispatch.py"


@pytest.mark.slow
def test_the_wheel_holds_the_kernel_package_at_the_top(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for folder in ("kvferry", "router", "prefill_worker", "decode_worker", "deploy", "kernels"):
        shutil.copytree(REPO / folder, source / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("kvferry-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == set(OURS)
    assert "kvferry_kernels/cpu_decode_attention.c" in names
    assert "kvferry_kernels/dispatch.py" in names
