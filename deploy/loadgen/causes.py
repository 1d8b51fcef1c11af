"""The causes `attribution.py` names for a slow token gap, and how one is chosen from a gap's
contributions (category -> seconds, summing to the gap)."""

from __future__ import annotations

from typing import Any

from deploy.loadgen.trace_load import Step, Traces

BASELINE = "baseline (median step)"  # the expected part of a gap: never a cause
DESCHEDULED = "step: descheduled (CPU contention)"
GIL = "step: GIL held by another thread"
COALESCED = "steps: several tokens in one update"  # earlier steps of a merged update
IDLE_CAUSES = {  # idle between steps, by the worker's span kind, in order of precedence
    "gc": "gc pause", "prefill": "colocated prefill", "kv": "K/V receive on the loop",
    "stage": "K/V of joining requests staged (CPU)",
    "write": "stream writes", "lag": "event-loop lag",
}
IDLE_BUSY = "between steps: decode process busy (loop, gRPC threads)"
IDLE_DESCHED = "between steps: descheduled (CPU contention)"
IDLE_OTHER = "between steps: other"
# From the prefill token to the request's first decode step: the router's start command, the
# last K/V arriving, admission and the running batch's return to the loop.
JOIN = "first decode step: start, K/V arrival, joining the batch"
JOIN_PARTS = (  # the same, where the router's start and the engine's attach are traced
    "first decode step: router awaiting the push's end",
    "first decode step: start command in transit",
    "first decode step: admission, the batch's next turn",
)
LOOP_BUSY = "decode event loop busy"
TRANSIT = "decode->router stream"
RELAY = "router relay"
CLIENT = "router->client / client"
UNTRACED = "untraced"
SPREAD = "unexplained (spread)"
UNEXPLAINED = frozenset({SPREAD, IDLE_OTHER, UNTRACED})
COMPUTE_PREFIX = "step: compute"

# A gap no single category explains is named after the family that holds most of its excess.
FAMILIES = {
    DESCHEDULED: "CPU contention", IDLE_DESCHED: "CPU contention",
    GIL: "decode process work", LOOP_BUSY: "decode process work",
    IDLE_BUSY: "decode process work", IDLE_CAUSES["kv"]: "decode process work",
    IDLE_CAUSES["write"]: "decode process work", IDLE_CAUSES["gc"]: "decode process work",
    IDLE_CAUSES["lag"]: "decode process work",  # its loop late: busy or not running
    IDLE_CAUSES["stage"]: "requests joining the batch",
    TRANSIT: "router and client", RELAY: "router and client", CLIENT: "router and client",
    JOIN: "requests joining the batch", **dict.fromkeys(JOIN_PARTS, "requests joining the batch"),
}


def add_join(parts: dict[str, float], rest: float, traces: Traces, down: str, anchor: float,
              first_step: float) -> None:
    """The unclaimed wait for the first decode step, cut where the router queued the start
    command and where the decode engine attached it (without both: JOIN)."""
    start, attach = traces.starts.get(down), traces.attaches.get(down)
    if start is None or attach is None:
        parts[JOIN] += rest
        return
    cuts = sorted((anchor, min(max(start, anchor), first_step),
                   min(max(attach, anchor), first_step), first_step))
    lengths = [b - a for a, b in zip(cuts, cuts[1:])]
    for name, length in zip(JOIN_PARTS, lengths):
        parts[name] += rest * length / (sum(lengths) or 1.0)


def add_unclaimed_idle(parts: dict[str, float], rest: float, step: Step,
                        prev_step: Step | None, claimed: float) -> None:
    """Idle time no span claimed, split by the CPU the decode process spent between the two
    steps (their p1 and p0, less the claimed spans, counted busy): busy on its event loop or
    gRPC threads, or not running at all (descheduled: there is always loop work between two
    steps). Without those clocks, or across merged steps, it stays unexplained."""
    if prev_step is None or step.p0 is None or prev_step.p1 is None or rest <= 0:
        parts[IDLE_OTHER] += rest
        return
    busy = min(max(step.p0 - prev_step.p1 - claimed, 0.0) / rest, 1.0)
    parts[IDLE_BUSY] += rest * busy
    parts[IDLE_DESCHED] += rest * (1.0 - busy)


def compute_cause(batch_size: int) -> str:
    return f"{COMPUTE_PREFIX} (batch {batch_size})"


def _family(category: str) -> str:
    if category.startswith(COMPUTE_PREFIX):
        return "decode compute"
    return FAMILIES.get(category, category)


def family_of(cause: str) -> str:
    """The family a named cause belongs to ("mixed: F" and "several: F + G" to F)."""
    for prefix in ("mixed: ", "several: "):
        if cause.startswith(prefix):
            return cause[len(prefix):].split(" + ")[0]
    return _family(cause)


def name_cause(parts: dict[str, float], gap_s: float, median_s: float) -> str:
    """The largest positive contribution when it covers at least half of the gap's excess
    over the median gap; else "mixed: <family>" when one family of categories does (never
    the unexplained ones); else, when the unexplained categories hold less than half of the
    excess, "several: <family> + <family>", the two largest (the time is measured, only
    shared); else SPREAD."""
    excess = gap_s - median_s
    candidates = [(v, name) for name, v in parts.items() if name != BASELINE and v > 0]
    if not candidates:
        return SPREAD
    value, name = max(candidates)
    if value >= 0.5 * excess:
        return name
    families: dict[str, float] = {}
    for v, category in candidates:
        if category not in UNEXPLAINED:
            families[_family(category)] = families.get(_family(category), 0.0) + v
    if families:
        family_value, family = max((v, f) for f, v in families.items())
        if family_value >= 0.5 * excess:
            return f"mixed: {family}"
    unexplained = sum(v for v, category in candidates if category in UNEXPLAINED)
    if len(families) >= 2 and unexplained < 0.5 * excess:  # measured, but shared
        first, second = sorted(families.items(), key=lambda item: -item[1])[:2]
        return f"several: {first[0]} + {second[0]}"
    return SPREAD


def format_table(attr: Any) -> str:
    """Causes of the slow gaps of an `attribution.Attribution`, most first, and the share
    explained."""
    width = max([len("cause"), *(len(c.cause) for c in attr.causes)])
    lines = [f"{'cause':<{width}}  {'gaps':>6}  {'share':>6}  {'median gap ms':>13}"]
    lines += [f"{c.cause:<{width}}  {c.num_gaps:>6}  {c.share:>6.1%}  "
              f"{c.median_gap_s * 1e3:>13.1f}" for c in attr.causes]
    lines.append(f"slow gaps: {attr.num_slow} of {attr.num_gaps} "
                 f"(> {attr.factor:g} x median ITL {attr.median_itl_s * 1e3:.1f} ms)")
    lines.append(f"explained: {attr.num_explained} of {attr.num_slow} "
                 f"({attr.explained_share:.0%})")
    return "\n".join(lines)
