"""Per-token attribution traces: what every process did around each token, as
JSON lines, for `deploy/loadgen/attribution.py` to join.

Off unless KVFERRY_TRACE_DIR names a folder; then each process appends to
`<dir>/<role>-<pid>.jsonl`, one event per line. Every time is `time.monotonic()` in seconds,
CLOCK_MONOTONIC on Linux, which all processes of one machine share. Events:

decode worker (role "decode"; "colocated" for a worker serving both roles):
  step     t0, t1: one decode step on the executor thread; s: its number; ids: the batch's
           request ids (downstream ids); cpu: the step thread's CPU seconds in it; pcpu: the
           process's CPU seconds in it (all threads); p0, p1: the process's CPU clock
           (time.process_time) at its start and end, so the CPU the process spent between
           two steps is the next step's p0 minus this one's p1. wall - cpu is time the
           thread waited: for the GIL when pcpu - cpu is large, else descheduled by the OS.
  deliver  t: the event loop handed step `s`'s tokens to the streams.
  write    t0, t1: one DecodeStream update written towards the router; ids: its requests.
  kv       t0, t1: one K/V chunk (or NIXL group) handled on the event loop; id; bytes.
  attach   t: the router's start command for request `id` reached the engine.
  stage    t0, t1: the CPU dense stage copied joining requests' K/V in (`tokens` of them),
           on the step thread before a run of steps.
  prefill  t0, t1: a colocated prefill batch on the executor thread; ids; tokens.
  gc       t0, t1: a garbage-collector pass in this process; gen: its generation.
  lag      t: the event loop woke `lag` seconds later than asked (only lags over LAG_MIN_S).
router (role "router"):
  relay    id: public request id; down: the decode worker's id for it; n: tokens in the
           update; t_in: the update read from the decode stream; t_out: written to the client.
  start    t: the start command for `down` was queued on the decode stream.
client (role "client", `kvferry bench --trace DIR`):
  arrivals id: public request id; tag; phase; t: arrival time of every streamed update; n: the
           tokens each carried.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

TRACE_ENV = "KVFERRY_TRACE_DIR"
LAG_PERIOD_S = 0.005  # the loop-lag probe's sleep
LAG_MIN_S = 0.002  # lags below this are not written


class Tracer:
    """Appends events to one file; safe from any thread. Lines are flushed as written, so a
    killed process loses nothing it traced."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", buffering=1)  # line-buffered
        self._lock = threading.Lock()
        self._gc_start = 0.0

    def event(self, ev: str, **fields: Any) -> None:
        line = json.dumps({"ev": ev, **fields}, separators=(",", ":"))
        with self._lock:
            self._file.write(line + "\n")

    def watch_gc(self) -> None:
        """Trace every garbage-collector pass of this process."""
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        now = time.monotonic()
        if phase == "start":
            self._gc_start = now
        else:
            self.event("gc", t0=self._gc_start, t1=now, gen=info.get("generation", -1))

    async def watch_loop_lag(self, clock: Callable[[], float] = time.monotonic) -> None:
        """Run forever on an event loop: trace each wake-up later than LAG_MIN_S (by `clock`,
        which tests replace)."""
        while True:
            asked = clock()
            await asyncio.sleep(LAG_PERIOD_S)
            lag = clock() - asked - LAG_PERIOD_S
            if lag > LAG_MIN_S:
                self.event("lag", t=clock(), lag=lag)

    def close(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._on_gc)
        with self._lock:
            self._file.close()


_tracer: Tracer | None = None


def start(role: str) -> Tracer | None:
    """This process's tracer, made on first call when KVFERRY_TRACE_DIR is set (else None)."""
    global _tracer
    folder = os.environ.get(TRACE_ENV)
    if _tracer is None and folder:
        _tracer = Tracer(Path(folder) / f"{role}-{os.getpid()}.jsonl")
        _tracer.watch_gc()
    return _tracer


def switch(role: str, folder: Path | None) -> Tracer | None:
    """Close this process's tracer and trace into `folder` from now on (None: stop). For a
    benchmark client that runs several deployments, each traced into a folder of its own."""
    global _tracer
    if _tracer is not None:
        _tracer.close()
        _tracer = None
    if folder is not None:
        _tracer = Tracer(folder / f"{role}-{os.getpid()}.jsonl")
        _tracer.watch_gc()
    return _tracer


def get() -> Tracer | None:
    """The tracer `start` made, if any: call sites test it once per event."""
    return _tracer


class StepClock(NamedTuple):
    """Wall, thread-CPU and process-CPU clocks read at a step's start."""

    wall: float
    cpu: float
    pcpu: float

    @classmethod
    def now(cls) -> StepClock:
        return cls(time.monotonic(), time.thread_time(), time.process_time())

    def span(self, tracer: Tracer, ev: str, **fields: Any) -> None:
        """Trace `ev` from this start to now, with the CPU seconds both clocks spent."""
        pcpu = time.process_time()
        tracer.event(ev, t0=self.wall, t1=time.monotonic(), cpu=time.thread_time() - self.cpu,
                     pcpu=pcpu - self.pcpu, p0=self.pcpu, p1=pcpu, **fields)
