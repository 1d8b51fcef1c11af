"""bench/gpu_tensor_parallel.py's dry run: on the CPU with gloo, each kind of check the GPU
run makes (the model split between sizes, on both tiny models, and a deployment of split
workers over gRPC) runs and is token-exact, and the report holds every row; one size pair,
(2, 1), to keep it short (the other pairs: tests/kvferry/model/test_tp_group.py and the
tensor-parallel e2e tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_tensor_parallel.py"

@pytest.mark.slow  # rank processes and a deployment per size pair
def test_the_dry_run_checks_every_size_pair_token_exact(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--sizes", "2-1",
                           "--out", str(out)], capture_output=True, text=True, timeout=900,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["ranks_backend"] == "gloo"
    assert [(r["arch"], r["sizes"]) for r in report["model"]] == [("qwen3", [2, 1]),
                                                                  ("llama", [2, 1])]
    assert [r["sizes"] for r in report["workers"]] == [[2, 1]]
    for row in [*report["model"], *report["workers"]]:
        assert row["tokens_match"] and row["tokens"] == row["expected"], row
        assert all(len(t) > 1 for t in row["tokens"])
    assert "3 of 3 checks token-exact" in done.stdout


def test_without_the_gpus_asked_for_it_exits_2(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--sizes", "2-2", "--out",
                           str(tmp_path / "x.json")], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 2 and "needs 2 CUDA devices" in done.stderr
