"""The live planner's decisions in a closed loop with the simulator: a workload that shifts
from short prompts with long answers to long prompts with short answers moves the split
the right way, within bounds, a step at a time, without going back and forth."""

from __future__ import annotations

from dataclasses import replace

import pytest

from deploy.planner.live import Bounds, Observation, Planner, workload
from deploy.planner.profile import CostModel
from deploy.planner.search import Sla
from deploy.planner.simulator import Layout, simulate
from tests.deploy.planner.synthetic import (
    SHIFT_LENGTHS,
    SHIFT_RATES,
    SHIFT_SLA,
    make_cost,
    shifting_profile,
    turns,
)

SLA = Sla.parse("ttft-p90=500,itl-p90=15")
DECODE_HEAVY = Observation(10.0, 40, ((32, 300),))  # 4 requests/s
PREFILL_HEAVY = Observation(10.0, 30, ((2000, 4),))  # 3 requests/s


def _run(planner: Planner, observations: list[Observation], start: Layout) -> list[Layout]:
    layouts, current = [start], start
    for obs in observations:
        decision = planner.decide(obs, current)
        assert decision.reason
        current = decision.layout
        layouts.append(current)
    return layouts


def test_a_shifting_workload_moves_the_split_and_settles() -> None:
    bounds = Bounds(max_prefill=3, max_decode=3, max_workers=4)
    planner = Planner(make_cost(), SLA, bounds, patience=2)
    layouts = _run(planner, [DECODE_HEAVY] * 6 + [PREFILL_HEAVY] * 7, Layout(1, 1))
    decode_phase, prefill_phase = layouts[6], layouts[-1]
    assert decode_phase.num_decode > decode_phase.num_prefill
    assert prefill_phase.num_prefill > prefill_phase.num_decode
    assert layouts[-1] == layouts[-2] == layouts[-3]  # settled
    for a, b in zip(layouts, layouts[1:]):  # one worker per role per interval, in bounds
        assert abs(a.num_prefill - b.num_prefill) <= 1 and abs(a.num_decode - b.num_decode) <= 1
        assert b.num_workers <= bounds.max_workers and b.num_prefill >= 1
    assert turns([x.num_prefill for x in layouts]) == 0  # prefill only ever grew
    assert turns([x.num_decode for x in layouts]) <= 1  # up in the first phase, then down
    # nothing moved before a target had held for two intervals
    assert layouts[1] == Layout(1, 1)


def test_a_one_interval_blip_moves_nothing() -> None:
    planner = Planner(make_cost(), SLA, Bounds(max_prefill=3, max_decode=3, max_workers=4))
    steady = Observation(10.0, 10, ((64, 64),))
    layouts = _run(planner, [steady, PREFILL_HEAVY, steady, steady], Layout(1, 1))
    assert set(layouts) == {Layout(1, 1)}


def test_scaling_down_needs_headroom() -> None:
    """Just under what one fewer worker can take: with headroom the planner stays, without
    it it gives the worker back."""
    cost = make_cost()
    light = Observation(10.0, 10, ((32, 300),))
    eager = Planner(cost, SLA, Bounds(max_workers=4), patience=1, headroom=1.0)
    careful = Planner(cost, SLA, Bounds(max_workers=4), patience=1, headroom=100.0)
    assert eager.decide(light, Layout(1, 2)).layout == Layout(1, 1)
    assert careful.decide(light, Layout(1, 2)).layout == Layout(1, 2)


def test_out_of_reach_goes_to_the_largest_layout_that_comes_closest() -> None:
    """No layout meets the SLA: of the largest, the split whose simulated requests meet it
    most often, wherever the deployment stands."""
    bounds = Bounds(max_prefill=2, max_decode=2, max_workers=3)
    for start in (Layout(1, 1), Layout(1, 2), Layout(2, 1)):
        planner = Planner(make_cost(), Sla.parse("ttft-p90=1"), bounds, patience=1)
        decision = planner.decide(DECODE_HEAVY, start)
        assert decision.target.num_workers == 3 and "no layout" in decision.reason
        # TTFT out of reach, prefill-heavy: more prefill workers get more requests under it
        prefill_bound = Planner(make_cost(), Sla.parse("ttft-p90=300"), bounds, patience=1)
        assert prefill_bound.target(PREFILL_HEAVY, start)[0] == Layout(2, 1)
        # so far out of reach that no request meets it: the smaller TTFT p90 still decides
        hopeless = Planner(make_cost(), Sla.parse("ttft-p90=10"), bounds, patience=1)
        layout, reason = hopeless.target(PREFILL_HEAVY, start)
        assert layout == Layout(2, 1) and "(0% of requests within it)" in reason, reason


def test_bounds_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="min_prefill"):
        Bounds(min_prefill=0)
    with pytest.raises(ValueError, match="max_workers"):
        Bounds(max_workers=1)


def test_the_shifting_profile_wants_opposite_splits() -> None:
    """What tests/e2e/test_ray_planner.py counts on: each phase of its workload has one
    4-worker layout that meets the SLA, from wherever the deployment stands, and the two
    phases want opposite splits."""
    cost = CostModel(shifting_profile())
    wanted = (Layout(1, 3), Layout(3, 1))
    for lengths, rate, layout in zip(SHIFT_LENGTHS, SHIFT_RATES, wanted):
        for observed in (rate - 0.4, rate, rate + 0.4):
            for start in (Layout(2, 2), *wanted):
                planner = Planner(cost, Sla.parse(SHIFT_SLA), Bounds(max_prefill=3,
                                                                      max_decode=3,
                                                                      max_workers=4))
                obs = Observation(10.0, round(observed * 10), (lengths,))
                assert planner.target(obs, start)[0] == layout, (lengths, observed, start)


def test_measured_latencies_correct_the_profile() -> None:
    """A router measuring 3x the ITL the profile predicts for the layout that runs: the
    planner asks for more decode workers than the profile alone would, says so, and a
    correction of 0 weight changes nothing."""
    light = Observation(10.0, 15, ((32, 300),))
    bounds = Bounds(max_prefill=3, max_decode=3, max_workers=4)
    trusting = Planner(make_cost(), SLA, bounds, patience=1, correction_weight=0.0)
    on_paper = trusting.target(light, Layout(1, 1))[0]
    assert on_paper.num_decode < 3
    predicted = dict((t.name, ms) for t, ms in SLA.values(
        simulate(make_cost(), Layout(1, 1), workload(light))))
    slow = replace(light, latencies_ms=(("itl", 3 * predicted["itl"]),
                                        ("ttft", predicted["ttft"])))
    corrected = Planner(make_cost(), SLA, bounds, patience=1, correction_weight=1.0)
    layout, reason = corrected.target(slow, Layout(1, 1))
    assert layout.num_decode > on_paper.num_decode and "x3.00 itl" in reason, reason
    assert corrected.correction["ttft"] == pytest.approx(1.0)
    assert trusting.target(slow, Layout(1, 1))[0] == on_paper
