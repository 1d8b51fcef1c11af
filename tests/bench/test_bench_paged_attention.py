"""bench/bench_paged_attention.py's sections named on demand (onelaunch, splits) run in the
dry run on CPU (interpreter, wall-clock timers, no CUDA graphs) and write their rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.triton
def test_dry_run_of_the_onelaunch_and_splits_sections(tmp_path: Path) -> None:
    out = tmp_path / "paged.json"
    done = subprocess.run(
        [sys.executable, "bench/bench_paged_attention.py", "--dry-run", "--sections",
         "onelaunch", "splits", "--repeats", "1", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["results"] == [] and report["config_sweep"] == []  # not asked for
    rows = report["one_launch"]
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 64), (1, 128), (2, 64), (2, 128)]
    for row in rows:
        assert row["num_splits"] == 2 and row["max_abs_diff"] < 1e-5
        assert row["one_launch_ms"] > 0 and row["two_launch_gbps"] > 0
        assert "one_launch_graph_ms" not in row  # CUDA graphs: GPU only
    splits = report["splits"]
    assert {(r["num_kv_heads"], r["context"], r["programs_per_sm"]) for r in splits} == {
        (h, c, p) for h in (1, 2) for c in (64, 128) for p in (1, 2, 4, 8)}
    assert all(r["num_q_heads"] == 4 * r["num_kv_heads"] and r["ms"] > 0 for r in splits)
    assert set(report["splits_best"]) == {"1", "2"}
    assert all(b["programs_per_sm"] in (1, 2, 4, 8) for b in report["splits_best"].values())
    assert "onelaunch [4, 2] b1 ctx 64 splits 2" in done.stdout
