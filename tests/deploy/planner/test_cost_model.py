"""Profiles: the file round trip, the fits, and the profiler's arithmetic on records."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from deploy.loadgen.metrics import RequestRecord
from deploy.planner.profile import (
    CostModel,
    DecodeFit,
    DecodePoint,
    PrefillPoint,
    Profile,
    attention_tokens,
)
from deploy.planner.profiler import CpuPoint, Sweep, cpu_costs, steady_gaps, transfer_points
from tests.deploy.planner.synthetic import DECODE_BASE, PREFILL, TRANSFER, make_profile


def test_a_profile_survives_its_file(tmp_path: Path) -> None:
    profile = make_profile(jitter=(0.9, 1.0, 1.3),
                           colocated_prefill=(PrefillPoint(64, 4096, 0.01),),
                           colocated_decode=(DecodePoint(2, 200, 0.004, (0.5, 1.5)),))
    path = profile.save(tmp_path / "p.json")
    assert Profile.load(path) == profile
    assert profile.key == "synthetic-float32-cpu-grpc"


def test_a_colocated_worker_is_priced_from_its_own_points_where_measured() -> None:
    """Twice the disaggregated workers' prefill and decode: the colocated cost model says
    so, the disaggregated one does not move, and a profile without them prices colocated
    workers as the others."""
    profile = make_profile()
    doubled = dict(
        colocated_prefill=tuple(replace(p, seconds=2 * p.seconds) for p in profile.prefill),
        colocated_decode=tuple(replace(p, seconds=2 * p.seconds) for p in profile.decode))
    cost = CostModel(replace(profile, **doubled))
    colocated = cost.colocated()
    assert colocated.is_colocated and not cost.is_colocated
    assert colocated.prefill_s(256, 256 ** 2) == pytest.approx(2 * cost.prefill_s(256, 256 ** 2))
    assert colocated.decode_s(4, 1000) == pytest.approx(2 * cost.decode_s(4, 1000))
    assert colocated.colocated() is colocated and "colocated prefill" in cost.describe()
    plain = CostModel(profile)
    assert plain.colocated() is plain and "colocated" not in plain.describe()


@pytest.mark.parametrize("text, says", [
    ("not json", "Expecting value"),
    (json.dumps({"version": 99}), "not a version 1 profile"),
    (json.dumps({"version": 1, "model": "m"}), "missing"),
])
def test_a_bad_profile_file_says_what_is_wrong(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=says):
        Profile.load(path)


def test_the_fits_recover_the_costs_they_were_made_from() -> None:
    cost = CostModel(make_profile())
    assert cost.prefill_coef == pytest.approx(PREFILL, rel=1e-6)
    assert cost.transfer_coef == pytest.approx(TRANSFER, rel=1e-6)
    for batch, base in DECODE_BASE.items():
        assert cost.decode_s(batch, 1000) == pytest.approx(base + 1e-7 * 1000, rel=1e-6)
    # between measured sizes the base is interpolated, past the last it goes on rising
    assert cost.decode_s(6, 0) == pytest.approx((DECODE_BASE[4] + DECODE_BASE[8]) / 2)
    assert cost.decode_s(64, 0) == pytest.approx(0.036 + (0.036 - 0.020) / 16 * 32)


def test_a_negative_coefficient_is_dropped_not_kept() -> None:
    """Noisy points whose best fit has a negative attention cost: kept at zero instead."""
    points = [(16, 0.0030), (64, 0.0066), (256, 0.0258), (512, 0.0500)]
    profile = make_profile(prefill=tuple(PrefillPoint(n, n * n, s) for n, s in points))
    cost = CostModel(profile)
    assert min(cost.prefill_coef) >= 0
    assert cost.prefill_s(512, 512 * 512) == pytest.approx(0.05, rel=0.05)


def test_compiled_batch_sizes_cost_their_bucket() -> None:
    points = [DecodePoint(b, 0, 0.001 * b) for b in (1, 2, 4, 8)]
    fit = DecodeFit(points, buckets=(1, 2, 4, 8))
    assert fit.step_s(3, 0) == pytest.approx(0.004)  # runs as 4
    assert DecodeFit(points).step_s(3, 0) == pytest.approx(0.003)  # eager: as it is


def test_attention_work_counts_cached_tokens() -> None:
    assert attention_tokens([(0, 100), (256, 64)]) == 100 * 100 + 64 * 320


def _record(start: float, ttft: float, gaps: list[float]) -> RequestRecord:
    return RequestRecord(prompt_len=64, output_len=len(gaps) + 1, start_s=start, ttft_s=ttft,
                         itls_s=tuple(gaps), latency_s=ttft + sum(gaps))


def test_steady_gaps_are_those_with_every_request_decoding() -> None:
    # request a: tokens at 1, 2, 3, 4, 5, 6; b joins later: tokens at 2.5, 3.5, 4.5, 5.5
    a = _record(0.0, 1.0, [1.0] * 5)
    b = _record(0.0, 2.5, [1.0] * 3)
    gaps, held = steady_gaps([a, b], context=64)
    # from b's second token (3.5) to the first last token (5.5): a's 4->5, b's 3.5->4.5, 4.5->5.5
    assert gaps == pytest.approx([1.0, 1.0, 1.0])
    assert held == round(2 * (64 + (4 + 2 + 3) / 3))
    assert steady_gaps([_record(0.0, 1.0, [1.0])], 64) == ([], 0)


def test_transfer_is_the_second_gap_less_a_step() -> None:
    points = transfer_points([(100, 0.010), (1000, 0.004)], lambda n: 0.005)
    assert [(p.prompt_tokens, p.seconds) for p in points] == [(100, pytest.approx(0.005)),
                                                              (1000, 0.0)]


def test_a_sweep_refuses_empty_or_zero_values() -> None:
    with pytest.raises(ValueError, match="decode_batches"):
        Sweep(decode_batches=())
    with pytest.raises(ValueError, match="repeats"):
        Sweep(repeats=0)


def test_router_and_client_costs_come_apart_from_the_sends() -> None:
    """Sends of different mixes (one at a time, batches of long answers) recover the
    router's CPU per request, per update and per token, and the client's."""
    router, client = (0.004, 0.0005, 0.0001), (0.001, 0.00005)
    points = []
    for requests, updates, tokens in ((3, 6, 6), (4, 8, 8), (8, 40, 264), (16, 60, 768),
                                      (1, 2, 2), (32, 300, 9000)):
        points.append(CpuPoint(requests, updates, tokens,
                               router[0] * requests + router[1] * updates + router[2] * tokens,
                               client[0] * requests + client[1] * tokens))
    got_router, got_client = cpu_costs(points)
    assert got_router == pytest.approx(router, rel=1e-6)
    assert got_client == pytest.approx(client, rel=1e-6)
    assert cpu_costs([]) == ((0.0, 0.0, 0.0), (0.0, 0.0))
