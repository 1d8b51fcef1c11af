"""Open-loop arrival offsets: gamma gaps, vLLM's rescaling, reproducibility."""

from __future__ import annotations

import math

import numpy as np
import pytest

from deploy.loadgen.arrivals import arrival_offsets_s


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_offsets_s(3, math.inf) == [0.0, 0.0, 0.0]
    assert arrival_offsets_s(0, 2.0) == []


def test_offsets_end_at_count_over_rate_and_repeat_with_the_seed() -> None:
    offsets = arrival_offsets_s(50, request_rate=5.0, burstiness=1.0, seed=3)
    assert offsets == sorted(offsets) and offsets[0] > 0
    assert offsets[-1] == pytest.approx(50 / 5.0)  # rescaled like vLLM
    assert arrival_offsets_s(50, 5.0, 1.0, seed=3) == offsets
    assert arrival_offsets_s(50, 5.0, 1.0, seed=4) != offsets


def test_infinite_burstiness_is_evenly_spaced() -> None:
    assert arrival_offsets_s(4, 2.0, math.inf) == pytest.approx([0.5, 1.0, 1.5, 2.0])


def test_burstiness_shapes_the_gaps() -> None:
    """Gamma(shape k): coefficient of variation of the gaps is 1 / sqrt(k)."""
    for burstiness in (0.25, 1.0, 4.0):
        gaps = np.diff([0.0, *arrival_offsets_s(20_000, 10.0, burstiness, seed=1)])
        cv = gaps.std() / gaps.mean()
        assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)
        assert gaps.mean() == pytest.approx(0.1, rel=1e-9)


@pytest.mark.parametrize("args", [(1, 0.0, 1.0), (1, -1.0, 1.0), (1, 1.0, 0.0), (-1, 1.0, 1.0)])
def test_bad_arguments(args: tuple[int, float, float]) -> None:
    with pytest.raises(ValueError):
        arrival_offsets_s(*args)
