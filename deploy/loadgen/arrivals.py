"""When each request is sent: open-loop arrivals, Poisson or gamma, as vLLM's `bench serve`.

Gaps between requests are drawn from a gamma distribution with shape = burstiness and
scale = 1 / (rate x burstiness), so the mean gap is 1 / rate whatever the burstiness:
burstiness 1 is a Poisson process, below 1 burstier, above 1 more even, inf exactly even.
Like vLLM, the cumulative offsets are then rescaled so the last request goes out at exactly
num_requests / rate: runs with different seeds offer the same mean load.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets_s(num_requests: int, request_rate: float, burstiness: float = 1.0,
                      seed: int = 0) -> list[float]:
    """Send time of each request in seconds after the start of the run (non-decreasing).

    An infinite rate sends everything at once (all offsets 0). Same arguments, same offsets.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (inf: all at once), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if num_requests == 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if math.isinf(burstiness):
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness),
                         size=num_requests)
    # vLLM counts the first gap before the first request, then rescales to the target total.
    offsets = np.cumsum(gaps)
    if offsets[-1] > 0:
        offsets *= (num_requests / request_rate) / offsets[-1]
    return [float(x) for x in offsets]
