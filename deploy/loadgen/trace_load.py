"""Loads a folder of per-token traces (`kvferry/trace.py` documents the format) into typed
records, joined the way `attribution.py` walks a token's path: client arrivals by public id,
router relays by public id, decode steps by downstream id, and each worker's deliveries and
busy spans (gc, K/V, prefill, lag, writes) by the worker that traced them; and `cut_out`, the
interval arithmetic that shares an idle window among those spans.

Torn lines (a killed process's last line), unknown events and events missing a field are
skipped: a trace is evidence, and partial evidence still attributes what it covers."""

from __future__ import annotations

import bisect
import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

SPAN_KINDS = ("gc", "kv", "prefill", "stage", "write", "lag")  # busy spans a worker traces


class TraceError(ValueError):
    """The folder holds no trace to read (missing, not a folder, or without events)."""


class Step(NamedTuple):
    worker: str  # the tracing file's stem, "<role>-<pid>"
    s: int  # step number, unique within its worker
    t0: float
    t1: float
    ids: tuple[str, ...]  # downstream request ids in the batch
    cpu_s: float  # the step thread's CPU time in the step
    pcpu_s: float  # the process's CPU time in the step (all threads)
    p0: float | None = None  # the process's CPU clock at t0 and t1 (None: an older trace)
    p1: float | None = None


class Span(NamedTuple):
    kind: str  # one of SPAN_KINDS
    t0: float
    t1: float


class Relay(NamedTuple):
    down: str  # the decode worker's id for the request
    n: int  # tokens in the update
    t_in: float  # read from the decode stream
    t_out: float  # written to the client


class Arrivals(NamedTuple):
    id: str  # public request id
    tag: str
    phase: str
    t: tuple[float, ...]  # arrival time of every streamed update; t[0] is the first token
    n: tuple[int, ...]  # tokens per update


class SpanIndex:
    """One worker's busy spans, by kind, for overlap queries."""

    def __init__(self, spans: list[Span]) -> None:
        self._by_kind: dict[str, list[Span]] = defaultdict(list)
        for span in sorted(spans, key=lambda sp: sp.t0):
            self._by_kind[span.kind].append(span)
        self._starts = {kind: [sp.t0 for sp in v] for kind, v in self._by_kind.items()}
        self._longest = {kind: max(sp.t1 - sp.t0 for sp in v) for kind, v in self._by_kind.items()}

    def overlapping(self, kind: str, t0: float, t1: float) -> list[tuple[float, float]]:
        """(start, end) of the spans of `kind` that overlap [t0, t1]."""
        starts = self._starts.get(kind, [])
        lo = bisect.bisect_left(starts, t0 - self._longest.get(kind, 0.0))
        hi = bisect.bisect_right(starts, t1)
        return [(sp.t0, sp.t1) for sp in self._by_kind[kind][lo:hi] if sp.t1 > t0]


def cut_out(free: list[tuple[float, float]], spans: Sequence[tuple[float, float]]
            ) -> tuple[list[tuple[float, float]], float]:
    """Cuts the spans out of the free segments: (what stays free, seconds cut)."""
    cut = 0.0
    for a, b in spans:
        rest = []
        for lo, hi in free:
            c0, c1 = max(lo, a), min(hi, b)
            if c0 >= c1:
                rest.append((lo, hi))
                continue
            cut += c1 - c0
            rest += [seg for seg in ((lo, c0), (c1, hi)) if seg[0] < seg[1]]
        free = rest
    return free, cut


@dataclass(frozen=True)
class Traces:
    roles: frozenset[str]  # roles with at least one event
    steps: dict[str, list[Step]]  # downstream id -> steps containing it, by t1
    all_steps: list[Step]
    delivers: dict[tuple[str, int], float]  # (worker, step number) -> deliver time
    spans: dict[str, SpanIndex]  # worker -> its busy spans
    relays: dict[str, list[Relay]]  # public id -> relays in stream (file) order
    arrivals: list[Arrivals]
    # downstream id -> (router queued its start command, the decode engine attached it);
    # the latest of each (a migrated request starts again)
    starts: dict[str, float] = field(default_factory=dict)
    attaches: dict[str, float] = field(default_factory=dict)


def _lines(path: Path) -> list[dict[str, Any]]:
    events = []
    for line in path.read_text().splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:  # a torn last line
            continue
        if isinstance(obj, dict) and "ev" in obj:
            events.append(obj)
    return events


def _opt(obj: dict[str, Any], key: str) -> float | None:
    value = obj.get(key)
    return None if value is None else float(value)


def _has(obj: dict[str, Any], *keys: str) -> bool:
    return all(k in obj and obj[k] is not None for k in keys)


def load(folder: Path) -> Traces:
    """Every `*.jsonl` file of the folder, all roles. Raises TraceError on a folder with no
    events."""
    if not folder.is_dir():
        raise TraceError(f"{folder}: {'not a folder' if folder.exists() else 'no such folder'}")
    roles: set[str] = set()
    steps: dict[str, list[Step]] = defaultdict(list)
    all_steps: list[Step] = []
    delivers: dict[tuple[str, int], float] = {}
    spans: dict[str, list[Span]] = defaultdict(list)
    relays: dict[str, list[Relay]] = defaultdict(list)
    arrivals: list[Arrivals] = []
    starts: dict[str, float] = {}
    attaches: dict[str, float] = {}
    for path in sorted(folder.glob("*.jsonl")):
        worker, role = path.stem, path.stem.rpartition("-")[0] or path.stem
        for e in _lines(path):
            roles.add(role)
            ev = e["ev"]
            if ev == "step" and _has(e, "t0", "t1", "s", "ids"):
                step = Step(worker, int(e["s"]), float(e["t0"]), float(e["t1"]),
                            tuple(str(i) for i in e["ids"]), float(e.get("cpu") or 0.0),
                            float(e.get("pcpu") or 0.0), _opt(e, "p0"), _opt(e, "p1"))
                all_steps.append(step)
                for request_id in step.ids:
                    steps[request_id].append(step)
            elif ev == "deliver" and _has(e, "t", "s"):
                delivers[(worker, int(e["s"]))] = float(e["t"])
            elif ev == "lag" and _has(e, "t", "lag"):
                spans[worker].append(Span("lag", float(e["t"]) - float(e["lag"]), float(e["t"])))
            elif ev in SPAN_KINDS and _has(e, "t0", "t1"):
                spans[worker].append(Span(ev, float(e["t0"]), float(e["t1"])))
            elif ev == "relay" and _has(e, "id", "down", "t_in", "t_out"):
                relays[str(e["id"])].append(Relay(str(e["down"]), int(e.get("n") or 1),
                                                  float(e["t_in"]), float(e["t_out"])))
            elif ev == "start" and _has(e, "t", "down"):
                starts[str(e["down"])] = float(e["t"])
            elif ev == "attach" and _has(e, "t", "id"):
                attaches[str(e["id"])] = float(e["t"])
            elif ev == "arrivals" and _has(e, "id", "t"):
                arrivals.append(Arrivals(str(e["id"]), str(e.get("tag") or ""),
                                         str(e.get("phase") or ""),
                                         tuple(float(t) for t in e["t"]),
                                         tuple(int(n) for n in e.get("n") or ())))
    if not roles:
        raise TraceError(f"{folder}: no trace events (*.jsonl)")
    for by_id in steps.values():
        by_id.sort(key=lambda st: st.t1)
    return Traces(frozenset(roles), dict(steps), all_steps, delivers,
                  {worker: SpanIndex(v) for worker, v in spans.items()}, dict(relays), arrivals,
                  starts, attaches)
