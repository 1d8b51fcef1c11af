"""bench/bench_compile_startup.py: its arguments, and one real run on the tiny model in which
the worker's second start loads its compiled package instead of compiling."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import bench_compile_startup as bench

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv", [["--buckets", "0"], ["--buckets", "x"], ["--repeats", "0"],
                                  ["--mode", "off"], ["--kinds", "warm"],
                                  ["--kinds", "warm,cold"], ["--kinds", "cold,cold"],
                                  ["--kinds", "cold,hot"]])
def test_bad_input_exits_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2


@pytest.mark.slow  # compiles every bucket twice: minutes on 2 cores
def test_a_warm_start_loads_every_bucket_from_the_cache(tmp_path: Path) -> None:
    out = tmp_path / "startup.json"
    done = subprocess.run(
        [sys.executable, "bench/bench_compile_startup.py", "--model", "tiny", "--buckets", "1",
         "--repeats", "1", "--kinds", "cold,warm", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cold: " in done.stdout and "(0 of 1 from the cache)" in done.stdout
    assert "(1 of 1 from the cache)" in done.stdout  # the warm start compiled nothing
    result = json.loads(out.read_text())
    assert result["failures"] == [] and result["is_met"] is True
    # Only the starts asked for (an eager start is the report's baseline, not the cache's
    # test: one deployment fewer here).
    assert {kind: len(s) for kind, s in result["seconds"].items()} == {"cold": 1, "warm": 1}
