"""bench/bench_cpu_attention.py: the contexts it spreads, and a run on the tiny model that
times both attention paths at every (contexts, batch), the kernel really in use."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import bench_cpu_attention, bench_step_parts
from bench.bench_cpu_attention import contexts, main


def test_spread_contexts_cover_half_to_one_and_a_half_times() -> None:
    assert contexts("spread", 5, 40) == [20, 30, 40, 50, 60]
    assert contexts("equal", 3, 40) == [40, 40, 40]
    assert contexts("spread", 1, 40) == [40]


class _Ticks:
    """The bench's perf_counter: each read 1 ms after the one before, so a span lasts as
    many ms as the clock was read inside it, whatever the machine's speed."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1e-3
        return self.now


def test_a_tiny_run_times_both_paths(tmp_path: Path, qwen3_checkpoint: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = _Ticks()  # the bench's two clocks, the step's and the attention callbacks'
    monkeypatch.setattr(bench_cpu_attention, "time", ticks)
    monkeypatch.setattr(bench_step_parts, "time", ticks)
    monkeypatch.setenv("KVFERRY_COMPILE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(bench_cpu_attention, "COMPILE_CACHE_DIR", tmp_path / "cache")
    kernels_used = []
    run = bench_cpu_attention.run

    def spying_run(model, pool, lengths, path, steps, seed):  # type: ignore[no-untyped-def]
        kernels_used.append(path)
        return run(model, pool, lengths, path, steps, seed)

    monkeypatch.setattr(bench_cpu_attention, "run", spying_run)
    out = tmp_path / "out.json"
    main(["--model", str(qwen3_checkpoint), "--compile", "off", "--batches", "1", "3",
          "--context", "20", "--steps", "2", "--rounds", "2", "--out", str(out)])
    report = json.loads(out.read_text())
    assert [(r["contexts"], r["batch"]) for r in report["runs"]] == [
        ("equal", 1), ("equal", 3), ("spread", 1), ("spread", 3)]
    for row in report["runs"]:
        for path in ("torch", "kernel"):
            assert len(row[path]) == 2
            # The attention callbacks ran, timed inside the step: the step read the clock
            # around them, so it spans more ticks than they do.
            assert all(r["step_ms"] > r["attention_ms"] > 0 for r in row[path])
    assert kernels_used.count("kernel") == kernels_used.count("torch") == 8
