"""Per-token latency attribution: for every slow inter-token gap the client saw,
where the extra time went along the token's path, and one cause for it.

An update's path: the decode step that produced its last token (counted from the tokens
streamed so far; failing that, the request's last step that ended by the router's read) ->
the step's `deliver` on the worker's event loop -> router read (t_in) -> router write (t_out)
-> client arrival. A gap between updates k-1 and k is split, stage by stage, into update k's
time in each stage minus update k-1's; the decode stage is the interval between the two
producing steps (from the router's read of the prefill token when k-1 is that token), split
into the median step duration (BASELINE, never a cause), the step's excess over it (compute,
GIL, descheduled), the earlier steps of an update carrying several tokens (COALESCED) and the
idle time, by the worker's gc, prefill, K/V, write and lag spans overlapping it. The
contributions sum to the gap. A stage without traces on either update goes to UNTRACED.

The cause is the largest positive contribution when it covers at least half of the gap's
excess over the median gap, else SPREAD. SPREAD, IDLE_OTHER and UNTRACED count as
unexplained.

    python -m deploy.loadgen.attribution DIR [--phase P] [--tag T] [--factor F]
"""

from __future__ import annotations

import argparse
import bisect
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from deploy.loadgen.causes import (
    BASELINE,
    CLIENT,
    COALESCED,
    DESCHEDULED,
    GIL,
    IDLE_CAUSES,
    IDLE_OTHER,
    LOOP_BUSY,
    RELAY,
    TRANSIT,
    UNEXPLAINED,
    UNTRACED,
    add_join,
    add_unclaimed_idle,
    compute_cause,
    format_table,
    name_cause,
)
from deploy.loadgen.trace_load import Relay, Step, Traces, cut_out, load


class GapRow(NamedTuple):
    request_id: str  # public id
    k: int  # the gap between updates k-1 and k (k >= 1)
    gap_s: float
    cause: str
    contributions: dict[str, float]  # category -> seconds; they sum to gap_s


class CauseCount(NamedTuple):
    cause: str
    num_gaps: int
    share: float  # of all slow gaps
    median_gap_s: float


@dataclass(frozen=True)
class Attribution:
    rows: tuple[GapRow, ...]  # every slow gap, in request order
    causes: tuple[CauseCount, ...]  # most gaps first
    num_gaps: int  # every gap of the selected requests
    median_itl_s: float
    factor: float  # slow: gap > factor x median_itl_s

    @property
    def num_slow(self) -> int:
        return len(self.rows)

    @property
    def num_explained(self) -> int:
        return sum(1 for row in self.rows if row.cause not in UNEXPLAINED)

    @property
    def explained_share(self) -> float:
        return self.num_explained / self.num_slow if self.rows else 0.0


class Baseline(NamedTuple):
    """Median step of the window, and medians of its parts (wall = cpu + gil + desched)."""

    wall_s: float
    cpu_s: float
    gil_s: float
    desched_s: float


def _parts(step: Step) -> tuple[float, float, float]:
    """(cpu, GIL wait, descheduled) seconds of a step; they sum to its wall time."""
    wall = step.t1 - step.t0
    cpu = min(max(step.cpu_s, 0.0), wall)
    gil = min(max(step.pcpu_s - step.cpu_s, 0.0), wall - cpu)
    return cpu, gil, wall - cpu - gil


def step_parts(step: Step) -> tuple[float, float, float]:
    """(thread CPU, GIL wait, descheduled) seconds of a step; they sum to its wall time."""
    return _parts(step)


def _baseline(traces: Traces, phase: str | None) -> Baseline:
    """Over the steps that ended within the phase's arrivals (all steps without a phase, or
    when none did)."""
    steps = traces.all_steps
    times = [t for a in traces.arrivals if a.phase == phase for t in a.t]
    if phase is not None and times:
        steps = [st for st in steps if min(times) <= st.t1 <= max(times)] or steps
    if not steps:
        return Baseline(0.0, 0.0, 0.0, 0.0)
    parts = [_parts(st) for st in steps]
    return Baseline(statistics.median(st.t1 - st.t0 for st in steps),
                    *(statistics.median(p[i] for p in parts) for i in range(3)))


def _producers(traces: Traces, relays: list[Relay]) -> list[Step | None]:
    """The step that produced each update's last token (None: the prefill token). Decode
    steps yield one token each, after the prefill's first: update k ends with step number
    (tokens through k) - 1 of the request. When the steps do not bear that out (missing, or
    ending after the router read the update), the last step that ended by the read."""
    found: list[Step | None] = []
    num_tokens = 0
    for relay in relays:
        num_tokens += relay.n
        steps = traces.steps.get(relay.down, [])
        i = bisect.bisect_right(steps, relay.t_in, key=lambda st: st.t1)
        by_count = steps[num_tokens - 2] if 2 <= num_tokens <= len(steps) else None
        if num_tokens == 1 or (by_count is not None and by_count.t1 <= relay.t_in):
            found.append(by_count)
        else:
            found.append(steps[i - 1] if i else None)
    return found


def _add_step(parts: dict[str, float], step: Step, base: Baseline) -> None:
    """The step's wall time beyond the median, shared by the parts that grew past theirs."""
    excess = step.t1 - step.t0 - base.wall_s
    medians = (base.cpu_s, base.gil_s, base.desched_s)
    grown = [max(0.0, p - m) for p, m in zip(_parts(step), medians, strict=True)]
    names = (compute_cause(len(step.ids)), GIL, DESCHEDULED)
    if excess <= 0 or sum(grown) <= 0:
        parts[names[0]] += excess
        return
    for name, g in zip(names, grown, strict=True):
        parts[name] += excess * g / sum(grown)


def _add_decode(parts: dict[str, float], traces: Traces, step: Step, anchor: float,
                down: str, base: Baseline, prev_step: Step | None) -> None:
    """The decode interval from `anchor` to the producing step's end: the step itself, the
    earlier steps of a merged update, and the idle time between them by what overlapped it."""
    parts[BASELINE] += base.wall_s
    _add_step(parts, step, base)
    if step.t0 <= anchor:
        parts[IDLE_OTHER] += step.t0 - anchor  # the step began before the anchor: no idle
        return
    window = (anchor, step.t0)
    earlier = [(st.t0, st.t1) for st in traces.steps.get(down, [])
               if anchor <= st.t0 and st.t1 <= step.t0]
    free, parts[COALESCED] = cut_out([window], earlier)
    index = traces.spans.get(step.worker)
    for kind, cause in IDLE_CAUSES.items():
        free, cut = cut_out(free, index.overlapping(kind, *window) if index else [])
        parts[cause] += cut
    merged_end = max((t1 for _, t1 in earlier), default=anchor)  # idle among merged steps
    parts[COALESCED] += sum(max(0.0, min(hi, merged_end) - lo) for lo, hi in free)
    rest = sum(hi - max(lo, merged_end) for lo, hi in free if hi > merged_end)
    if prev_step is None:  # from the router's read of the prefill token
        add_join(parts, rest, traces, down, anchor, step.t0)
        return
    add_unclaimed_idle(parts, rest, step, None if earlier else prev_step,
                        step.t0 - anchor - rest)


def _add_loop(parts: dict[str, float], traces: Traces, step: Step, deliver: float,
              delta: float) -> None:
    """`delta`: this update's step-to-deliver wait minus the previous one's. A growth goes
    first to the gc, prefill, K/V and write spans that overlapped this update's wait."""
    index = traces.spans.get(step.worker)
    free = [(step.t1, deliver)]
    for kind in ("gc", "prefill", "kv", "write"):
        if delta <= 0 or index is None:
            break
        free, cut = cut_out(free, index.overlapping(kind, step.t1, deliver))
        parts[IDLE_CAUSES[kind]] += min(cut, delta)
        delta -= min(cut, delta)
    parts[LOOP_BUSY] += delta


def _contributions(traces: Traces, relays: list[Relay], producers: list[Step | None],
                   arrivals: Sequence[float], k: int, base: Baseline) -> dict[str, float]:
    """Update k's time in each stage minus update k-1's; the values sum to the gap."""
    parts: dict[str, float] = defaultdict(float)
    if len(relays) != len(arrivals):  # the k-th relay is not surely the k-th update
        parts[UNTRACED] = arrivals[k] - arrivals[k - 1]
        return parts
    cur, prev = relays[k], relays[k - 1]
    parts[CLIENT] += (arrivals[k] - cur.t_out) - (arrivals[k - 1] - prev.t_out)
    parts[RELAY] += (cur.t_out - cur.t_in) - (prev.t_out - prev.t_in)
    step, prev_step = producers[k], producers[k - 1]
    if step is None or (prev_step is None and sum(r.n for r in relays[:k]) > 1):
        parts[UNTRACED] += cur.t_in - prev.t_in
        return parts
    if step != prev_step:
        anchor = prev_step.t1 if prev_step else prev.t_in
        _add_decode(parts, traces, step, anchor, cur.down, base, prev_step)
    deliver = traces.delivers.get((step.worker, step.s))
    prev_loop = prev_transit = 0.0  # update 0 had no decode step
    if prev_step is not None:
        prev_deliver = traces.delivers.get((prev_step.worker, prev_step.s))
        if prev_deliver is None:
            deliver = None
        else:
            prev_loop, prev_transit = prev_deliver - prev_step.t1, prev.t_in - prev_deliver
    if deliver is None:
        prev_wait = prev.t_in - prev_step.t1 if prev_step else 0.0
        parts[UNTRACED] += (cur.t_in - step.t1) - prev_wait
    else:
        _add_loop(parts, traces, step, deliver, (deliver - step.t1) - prev_loop)
        parts[TRANSIT] += (cur.t_in - deliver) - prev_transit
    return parts


def attribute(folder: Path | Traces, phase: str | None = None, tag: str | None = "short",
              factor: float = 3.0) -> Attribution:
    """Every slow gap (> factor x the median gap) of the client's requests of `tag` (None:
    all) in `phase` (None: all), with its contributions and cause; `folder` may be already
    loaded (one load for several phases). Raises TraceError (a ValueError) on a folder
    without traces, ValueError on factor <= 0."""
    if factor <= 0:
        raise ValueError(f"factor: must be > 0, got {factor}")
    traces = folder if isinstance(folder, Traces) else load(folder)
    chosen = [a for a in traces.arrivals
              if (tag is None or a.tag == tag) and (phase is None or a.phase == phase)]
    gaps = [a.t[k] - a.t[k - 1] for a in chosen for k in range(1, len(a.t))]
    if not gaps:
        return Attribution((), (), 0, 0.0, factor)
    median_s = statistics.median(gaps)
    base = _baseline(traces, phase)
    rows = []
    for a in chosen:
        slow = [k for k in range(1, len(a.t)) if a.t[k] - a.t[k - 1] > factor * median_s]
        relays = [r for r in traces.relays.get(a.id, []) if r.n > 0] if slow else []
        producers = _producers(traces, relays)
        for k in slow:
            gap = a.t[k] - a.t[k - 1]
            parts = _contributions(traces, relays, producers, a.t, k, base)
            rows.append(GapRow(a.id, k, gap, name_cause(parts, gap, median_s), dict(parts)))
    counts = Counter(row.cause for row in rows)
    causes = tuple(
        CauseCount(cause, n, n / len(rows),
                   statistics.median(row.gap_s for row in rows if row.cause == cause))
        for cause, n in sorted(counts.items(), key=lambda item: (-item[1], item[0])))
    return Attribution(tuple(rows), causes, len(gaps), median_s, factor)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.loadgen.attribution",
                                     description="Attribute slow inter-token gaps to causes.")
    parser.add_argument("folder", type=Path, help="trace folder (KVFERRY_TRACE_DIR)")
    parser.add_argument("--phase", default=None, help="only this phase's requests")
    parser.add_argument("--tag", default="short", help="only this tag's requests ('' = all)")
    parser.add_argument("--factor", type=float, default=3.0, help="slow: gap > F x median")
    args = parser.parse_args(argv)
    try:
        attr = attribute(args.folder, args.phase, args.tag or None, args.factor)
    except ValueError as exc:
        print(f"attribution: {exc}", file=sys.stderr)
        return 2
    print(format_table(attr))
    return 0


if __name__ == "__main__":
    sys.exit(main())
