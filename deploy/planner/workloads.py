"""What `kvferry plan --sla` simulates: a trace file of requests with arrival times and
lengths, or a mix of prompt and output lengths with Poisson arrivals. Either is returned at
a rate of one request per second (the search scales the arrivals in time)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from deploy.loadgen.arrivals import arrival_offsets_s
from deploy.planner.simulator import SimRequest


def _trace(path: Path) -> tuple[list[SimRequest], float]:
    """The trace's requests at one request per second, and its own rate."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows.append((float(row["arrival_s"]), int(row["prompt_len"]),
                         int(row["output_len"])))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"workload: {path} line {number}: expected an object with "
                             f"arrival_s, prompt_len and output_len ({exc})") from None
        if rows[-1][1] < 1 or rows[-1][2] < 1 or rows[-1][0] < 0:
            raise ValueError(f"workload: {path} line {number}: lengths must be >= 1 and "
                             "arrival_s >= 0")
    if len(rows) < 2:
        raise ValueError(f"workload: {path}: needs at least 2 requests")
    rows.sort()
    start = rows[0][0]
    span = rows[-1][0] - start
    rate = (len(rows) - 1) / span if span > 0 else float(len(rows))
    return [SimRequest((t - start) * rate, n, m) for t, n, m in rows], rate


def _mix(text: str, num_requests: int, seed: int) -> list[SimRequest]:
    parts = []
    for part in text.split(","):
        fields = part.split(":")
        try:
            values = [float(f) for f in fields]
        except ValueError:
            values = []
        if len(values) not in (2, 3) or min(values[:2]) < 1 or (len(values) == 3
                                                                 and values[2] <= 0):
            raise ValueError(f"workload: expected IN:OUT[:WEIGHT] with IN, OUT >= 1 and "
                             f"WEIGHT > 0, got {part!r} (or no such file)")
        parts.append((int(values[0]), int(values[1]), values[2] if len(values) == 3 else 1.0))
    rng = np.random.default_rng(seed)
    weights = np.array([w for _, _, w in parts])
    choice = rng.choice(len(parts), size=num_requests, p=weights / weights.sum())
    offsets = arrival_offsets_s(num_requests, 1.0, 1.0, seed)
    return [SimRequest(t, parts[i][0], parts[i][1], f"{parts[i][0]}:{parts[i][1]}")
            for t, i in zip(offsets, choice)]


def load_workload(text: str, num_requests: int, seed: int = 0
                  ) -> tuple[list[SimRequest], float | None]:
    """The requests at one request per second, and a trace's own rate (None for a mix)."""
    if num_requests < 2:
        raise ValueError(f"num_requests: must be >= 2, got {num_requests}")
    path = Path(text)
    if path.is_file():
        return _trace(path)
    return _mix(text, num_requests, seed), None
