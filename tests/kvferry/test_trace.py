"""The per-token tracer: events land as JSON lines, garbage-collector passes and
event-loop lags are caught, and nothing is written unless KVFERRY_TRACE_DIR asks for it."""

from __future__ import annotations

import asyncio
import gc
import json
from pathlib import Path

import pytest

from kvferry import trace
from tests.waiting import until


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_events_and_gc_passes_are_written(tmp_path: Path) -> None:
    tracer = trace.Tracer(tmp_path / "x.jsonl")
    tracer.watch_gc()
    try:
        tracer.event("relay", id="a", n=1, t_in=1.0, t_out=2.0)
        gc.collect()
        clock = trace.StepClock.now()
        sum(range(200_000))  # some CPU on this thread
        clock.span(tracer, "step", s=1, ids=["a"])
    finally:
        tracer.close()
    events = _events(tmp_path / "x.jsonl")
    # Automatic young-generation passes may land anywhere among them: they are traced too.
    others = [e for e in events if e["ev"] != "gc"]
    assert others[0] == {"ev": "relay", "id": "a", "n": 1, "t_in": 1.0, "t_out": 2.0}
    passes = [e for e in events if e["ev"] == "gc"]
    assert all(e["t1"] >= e["t0"] for e in passes)
    assert any(e["gen"] == 2 for e in passes)  # the explicit gc.collect()
    step = others[-1]
    assert step["ev"] == "step" and step["ids"] == ["a"] and step["t1"] >= step["t0"]
    assert 0 < step["cpu"] <= step["pcpu"] + 1e-3  # the thread's CPU is part of the process's
    gc.collect()  # closed: no more events
    assert len(_events(tmp_path / "x.jsonl")) == len(events)


class _MovedClock:
    """The probe's monotonic clock, moved only by the test; its reads show where the probe is
    (it reads once before each sleep and once after, then once more to trace a lag)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.num_reads = 0

    def __call__(self) -> float:
        self.num_reads += 1
        return self.now


def _lags(path: Path) -> list[dict]:
    return [e for e in _events(path) if e["ev"] == "lag"]


def test_a_blocked_event_loop_is_traced_as_lag(tmp_path: Path) -> None:
    """A wake-up later than asked by more than LAG_MIN_S is traced with its lag; a smaller one
    is not. The clock jumps while the probe sleeps, as it does while a blocked loop cannot
    wake the probe."""
    path = tmp_path / "lag.jsonl"
    tracer = trace.Tracer(path)
    clock = _MovedClock()

    async def move_while_the_probe_sleeps(delay_s: float) -> None:
        """Move the clock while the probe sleeps; return once it woke and slept again."""
        clock.now += delay_s
        woken_at = clock.num_reads
        await until(lambda: clock.num_reads >= woken_at + 2, "the probe woke and slept again")

    async def block_the_loop() -> None:
        probe = asyncio.create_task(tracer.watch_loop_lag(clock))
        try:
            await until(lambda: clock.num_reads >= 1, "the probe took its first reading")
            await move_while_the_probe_sleeps(trace.LAG_PERIOD_S + trace.LAG_MIN_S / 2)
            assert _lags(path) == []  # late, but by less than LAG_MIN_S
            await move_while_the_probe_sleeps(0.05)
            await until(lambda: _lags(path), "the probe traced the lag")
        finally:
            probe.cancel()

    asyncio.run(block_the_loop())
    tracer.close()
    assert _lags(path) == [{"ev": "lag", "t": pytest.approx(100.056),
                            "lag": pytest.approx(0.05 - trace.LAG_PERIOD_S)}]


def test_off_unless_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(trace.TRACE_ENV, raising=False)
    monkeypatch.setattr(trace, "_tracer", None)
    assert trace.start("decode") is None and trace.get() is None
    monkeypatch.setenv(trace.TRACE_ENV, str(tmp_path))
    tracer = trace.start("decode")
    try:
        assert tracer is trace.get() and tracer.path.parent == tmp_path
        assert tracer.path.name.startswith("decode-")
        other = trace.switch("client", tmp_path / "next")
        assert other is trace.get() and other.path.parent == tmp_path / "next"
    finally:
        trace.switch("client", None)
    assert trace.get() is None
