"""bench/gpu_roofline.py's dry run: every section runs on CPU (the Triton interpreter, a
scaled-down 8B shape, no graph capture) and writes every row the GPU run would, with a
roofline worked out from rates measured in the same run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.triton
def test_the_dry_run_writes_every_section(tmp_path: Path) -> None:
    out = tmp_path / "roofline.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_roofline.py"), "--dry-run",
                           "--models", "llama-3.1-8b", "--repeats", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["copy_bandwidth_gbps"] > 0 and report["gemm_tflops"] > 0
    model = report["models"]["llama-3.1-8b"]
    assert model["kv_bytes_per_token"] == 2 * 2 * 2 * 32 * 4  # K+V, layers, heads, D, fp32
    decode = report["decode"]
    assert {(r["batch"], r["context"]) for r in decode} == {(1, 32), (1, 64), (3, 32), (3, 64)}
    for row in decode:
        assert "skipped" not in row, row
        assert len(row["step_ms"]["rounds"]) == 2
        kv = row["batch"] * row["context"] * model["kv_bytes_per_token"]
        assert row["bytes_read"] > kv  # weights and K/V both counted
        assert row["of_roofline"] == pytest.approx(row["roofline_ms"] / row["step_ms"]["median"])
    assert [r["prompt_tokens"] for r in report["prefill"]] == [16, 48]
    assert all(r["achieved_tflops"] > 0 for r in report["prefill"])
    kinds = [(r["batch"], r["kv_cache_dtype"]) for r in report["kv_dtype"]]
    assert kinds == [(3, "auto"), (3, "int8"), (3, "fp8_e4m3"),
                     (1, "auto"), (1, "int8"), (1, "fp8_e4m3")]
    assert all("step_vs_auto" in r for r in report["kv_dtype"] if r["kv_cache_dtype"] != "auto")


def test_without_a_gpu_and_without_dry_run_it_exits_2(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_roofline.py"), "--out",
                           str(tmp_path / "x.json")], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 2 and "no CUDA device" in done.stderr
