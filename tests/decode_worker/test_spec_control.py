"""The draft-count controller: k from a sequence's acceptance and the step cost of rows."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from decode_worker.spec.control import (
    MAX_PAUSE_STEPS,
    MIN_ROW_COST,
    PAUSE_STEPS,
    SpecController,
    StepTimes,
    expected_tokens,
)


def test_expected_tokens_of_k_drafts() -> None:
    assert expected_tokens(0.0, 4) == 1.0  # every draft wrong: the target's token only
    assert expected_tokens(1.0, 4) == 5.0  # every draft right: all of them and one more
    # alpha = 0.5, k = 2: 1 + 0.5 + 0.25
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_step_times_fit_the_line_of_the_steps_seen() -> None:
    times = StepTimes()
    assert times.cost(1, 4) == pytest.approx(1 + 4 * MIN_ROW_COST)  # nothing seen: the floor
    for rows in (1, 2, 3, 5, 8) * 4:
        times.observe(rows, 0.010 + 0.002 * rows)  # 10 ms a step, 2 ms a row
    assert times.cost(1, 4) == pytest.approx((0.010 + 0.002 * 5) / 0.012)
    assert times.cost(8, 2) == pytest.approx((0.010 + 0.002 * 10) / 0.026)


def test_step_times_never_call_rows_free() -> None:
    times = StepTimes()
    for rows in (1, 5) * 10:
        times.observe(rows, 0.05)  # no measurable slope
    assert times.cost(2, 3) == pytest.approx(1 + 3 * MIN_ROW_COST / 2)


def _run(controller: SpecController, request_id: str, steps: int, rate: float) -> list[int]:
    """`steps` steps of a sequence whose drafts are accepted at `rate`: the k of each."""
    ks = []
    for _ in range(steps):
        k = controller.k_for(request_id, 1)
        ks.append(k)
        if k:
            controller.observe(request_id, k, round(k * rate))
    return ks


def test_accepted_drafts_keep_k_at_its_most() -> None:
    controller = SpecController(4)
    assert _run(controller, "a", 30, 1.0) == [4] * 30
    assert controller.num_paused == 0


def test_rejected_drafts_pause_then_probe_with_pauses_growing() -> None:
    controller = SpecController(4)
    ks = _run(controller, "a", 400, 0.0)
    first_pause = ks.index(0)
    assert 0 < first_pause < 15  # a few steps until the acceptance estimate falls
    assert ks[first_pause: first_pause + PAUSE_STEPS] == [0] * PAUSE_STEPS
    assert ks[first_pause + PAUSE_STEPS] == 1  # the probe
    # each failed probe doubles the pause, up to MAX_PAUSE_STEPS
    probes = [i for i in range(first_pause, len(ks)) if ks[i]]
    gaps = [b - a - 1 for a, b in zip(probes, probes[1:])]
    assert gaps[:4] == [2 * PAUSE_STEPS, 4 * PAUSE_STEPS, 8 * PAUSE_STEPS, MAX_PAUSE_STEPS]
    assert sum(ks) < 40  # against 4 x 400 without the controller


def test_a_successful_probe_resumes_drafting() -> None:
    controller = SpecController(4)
    ks = _run(controller, "a", 60, 0.0)
    assert ks[-1] == 0 or ks[-1] == 1
    ks = _run(controller, "a", 200, 1.0)
    assert ks[-10:] == [4] * 10  # acceptance recovered: back to k at its most


def test_expensive_rows_lower_k() -> None:
    """At half a step per row, k = 4 is not worth it even at a fair acceptance."""
    controller = SpecController(4)
    for rows in (1, 2, 3, 5) * 10:
        controller.times.observe(rows, 0.010 + 0.005 * rows)
    ks = _run(controller, "a", 20, 0.5)
    assert max(ks) < 4
    cheap = SpecController(4)
    assert max(_run(cheap, "a", 20, 0.5)) == 4


def test_off_means_k_every_step() -> None:
    controller = SpecController(3, is_adaptive=False)
    assert _run(controller, "a", 50, 0.0) == [3] * 50


@given(st.lists(st.tuples(st.integers(1, 4), st.integers(0, 4)), max_size=200))
def test_k_stays_within_bounds(steps: list[tuple[int, int]]) -> None:
    controller = SpecController(4)
    for rows, accepted in steps:
        k = controller.k_for("a", rows)
        assert 0 <= k <= 4
        if k:
            controller.observe("a", k, min(k, accepted))
    controller.forget("a")
    assert controller.num_paused == 0
