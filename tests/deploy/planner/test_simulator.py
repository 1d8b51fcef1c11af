"""The deployment simulator on a profile whose costs are known exactly: a request alone,
queueing against the textbook formula, batching, colocated interleaving, a full pool."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import pytest

from deploy.loadgen.metrics import calculate_metrics
from deploy.planner.profile import CostModel
from deploy.planner.simulator import Layout, SimRequest, Simulation, simulate
from kvferry.cache.budget import KvBudget
from kvferry.settings import KvEvictionConfig
from tests.deploy.planner.synthetic import make_cost, make_profile


def test_a_request_alone_costs_prefill_then_transfer_then_a_step_per_token() -> None:
    cost = make_cost()
    [record] = simulate(cost, Layout(1, 1), [SimRequest(1.0, 100, 4)])
    assert record.ttft_s == pytest.approx(cost.prefill_s(100, 100 * 100))
    assert record.itls_s == pytest.approx((
        cost.transfer_s(100) + cost.decode_s(1, 100),
        cost.decode_s(1, 101),
        cost.decode_s(1, 102)))
    assert record.output_len == 4 and record.start_s == 1.0


def test_a_colocated_layout_runs_on_the_colocated_points_without_the_router_beside_it(
        ) -> None:
    """Its own points hold the router's and the client's turns on its cores: the simulator
    charges them as measured, and no longer slows the worker for them a second time."""
    profile = make_profile(num_cores=2, relay_s_per_token=0.001, client_s_per_token=0.001)
    slower = dict(
        colocated_prefill=tuple(replace(p, seconds=1.5 * p.seconds) for p in profile.prefill),
        colocated_decode=tuple(replace(p, seconds=1.5 * p.seconds) for p in profile.decode))
    cost = CostModel(replace(profile, **slower))
    layout = Layout(0, 1, is_colocated=True)
    assert Simulation(cost, layout).cores.shared_with == []
    assert Simulation(CostModel(profile), layout).cores.shared_with != []  # unmeasured
    assert Simulation(cost, Layout(1, 1)).cost is cost  # disaggregated: as before
    [record] = simulate(cost, layout, [SimRequest(0.0, 100, 3)])
    colocated = cost.colocated()
    assert record.itls_s == pytest.approx((colocated.decode_s(1, 100),
                                           colocated.decode_s(1, 101)))
    assert record.ttft_s == pytest.approx(colocated.prefill_s(100, 100 * 100))


def test_colocated_needs_no_transfer() -> None:
    cost = make_cost()
    [record] = simulate(cost, Layout(0, 1, is_colocated=True), [SimRequest(0.0, 100, 3)])
    assert record.itls_s == pytest.approx((cost.decode_s(1, 100), cost.decode_s(1, 101)))


def test_prefill_queue_matches_the_md1_waiting_time() -> None:
    """One-token requests of one length: the prefill worker is an M/D/1 queue, whose mean
    wait is rho * S / (2 (1 - rho)) (Pollaczek-Khinchine)."""
    cost = make_cost()
    service = cost.prefill_s(64, 64 * 64)
    rate = 0.6 / service
    rng = random.Random(1)
    arrivals = list(itertools.accumulate(rng.expovariate(rate) for _ in range(20_000)))
    requests = [SimRequest(t, 64, 1) for t in arrivals]
    # a budget of one prompt per forward: no batching, a plain single server
    cost = make_cost(prefill_token_budget=64)
    records = simulate(cost, Layout(1, 1), requests)
    mean_wait = sum(r.ttft_s - service for r in records) / len(records)
    expected = 0.6 * service / (2 * (1 - 0.6))
    assert mean_wait == pytest.approx(expected, rel=0.08)


def test_waiting_prompts_share_one_forward_up_to_the_budget() -> None:
    """As kvferry/model/prefill_batch.py plans: 7 prompts of 100 under a budget of 512 give
    5 whole prompts and a 12-token chunk of the last one (nobody behind it to leave room
    for), then the sixth and the rest of the seventh."""
    cost = make_cost()
    records = simulate(cost, Layout(1, 1), [SimRequest(0.0, 100, 1) for _ in range(7)])
    first = cost.prefill_s(512, 5 * 100 * 100 + 12 * 12)
    second = first + cost.prefill_s(188, 100 * 100 + 88 * 100)
    assert [r.ttft_s for r in records] == pytest.approx([first] * 5 + [second] * 2)


def test_a_long_prompt_is_prefilled_a_chunk_per_forward() -> None:
    cost = make_cost(prefill_chunk_size=256, prefill_token_budget=512)
    [record] = simulate(cost, Layout(1, 1), [SimRequest(0.0, 600, 1)])
    chunks = [(0, 256), (256, 256), (512, 88)]
    assert record.ttft_s == pytest.approx(sum(cost.prefill_s(n, n * (c + n))
                                              for c, n in chunks))


def test_sequences_decode_together_in_one_batch() -> None:
    cost = make_cost()
    records = simulate(cost, Layout(0, 1, is_colocated=True),
                       [SimRequest(0.0, 64, 10) for _ in range(4)])
    # all four prefilled in one forward, then every step holds all four
    assert all(r.ttft_s == pytest.approx(records[0].ttft_s) for r in records)
    for k, gap in enumerate(records[0].itls_s):
        assert gap == pytest.approx(cost.decode_s(4, 4 * (64 + k)))


def test_a_colocated_prefill_stalls_the_running_batch() -> None:
    cost = make_cost()
    alone = simulate(cost, Layout(0, 1, is_colocated=True), [SimRequest(0.0, 64, 40)])[0]
    late = SimRequest(alone.ttft_s + 10 * cost.decode_s(1, 70), 400, 2)
    mixed = simulate(cost, Layout(0, 1, is_colocated=True), [SimRequest(0.0, 64, 40), late])
    # one of the first request's gaps holds the other's prefill forward
    assert max(mixed[0].itls_s) >= cost.prefill_s(400, 400 * 400)
    assert max(alone.itls_s) < cost.prefill_s(400, 400 * 400)
    # disaggregated, the decode worker never waits for it
    split = simulate(cost, Layout(1, 1), [SimRequest(0.0, 64, 40), late])
    assert max(split[0].itls_s[1:]) < cost.prefill_s(400, 400 * 400)


def test_a_full_pool_holds_pushes_and_swaps_then_frees_every_block() -> None:
    num_blocks = 40
    cost = make_cost(num_blocks=num_blocks)
    requests = [SimRequest(i * 0.001, 100, 150) for i in range(12)]  # 16 blocks each at the end
    sim = Simulation(cost, Layout(1, 1))
    records = sim.run(requests)
    assert all(r.is_success and r.output_len == 150 for r in records)
    assert sim.decode[0].free_blocks == num_blocks
    assert not sim.decode[0].running and not sim.decode[0].swapped and not sim.waiting
    # a request that fits alone waits for room instead of failing; with a pool ten times
    # bigger nobody waits, so the small pool's latencies are longer
    roomy = simulate(make_cost(num_blocks=10 * num_blocks), Layout(1, 1), requests)
    assert max(r.latency_s for r in records) > max(r.latency_s for r in roomy)


def test_a_request_bigger_than_the_pool_is_refused() -> None:
    cost = make_cost(num_blocks=4)
    [big, small] = simulate(cost, Layout(1, 1), [SimRequest(0.0, 100, 10),
                                                 SimRequest(0.0, 10, 5)])
    assert big.status == "RESOURCE_EXHAUSTED" and small.is_success


def test_under_eviction_a_generation_longer_than_the_pool_is_served_in_the_budget() -> None:
    """The deployment's K/V budget (kvferry/cache/budget.py) is the simulator's: under
    streaming eviction (32 + 32 tokens kept, 4 blocks of 16) a request of 40 prompt tokens
    and 400 generated, 28 blocks at its longest, runs in a pool of 10 blocks where it is
    refused without a policy; its steps attend over the kept tokens only."""
    request = [SimRequest(0.0, 40, 400)]
    [refused] = simulate(make_cost(num_blocks=10), Layout(1, 1), request)
    assert refused.status == "RESOURCE_EXHAUSTED"
    budget = KvBudget(KvEvictionConfig("streaming", sink_tokens=32, window_tokens=32))
    profile = make_profile(num_blocks=10)
    cost = CostModel(profile, kv_budget=budget)
    sim = Simulation(cost, Layout(1, 1))
    [record] = sim.run(request)
    assert record.is_success and record.output_len == 400
    assert [w.free_blocks for w in sim.decode] == [10]  # every block back at the end
    last = cost.decode_s(1, 4 * profile.block_size)  # the budget's 4 blocks
    assert record.itls_s[-1] == pytest.approx(last)
    unbounded = simulate(make_cost(num_blocks=100), Layout(1, 1), request)[0]
    assert unbounded.itls_s[-1] > last  # 438 tokens read at its last step


def test_the_decode_spread_widens_itl_but_keeps_its_median() -> None:
    ratios = tuple(0.8 + 0.4 * (i + 0.5) / 20 for i in range(19)) + (3.0,)
    steady = make_cost()
    jittery = make_cost(jitter=ratios)
    requests = [SimRequest(0.0, 64, 400)]
    plain = calculate_metrics(simulate(steady, Layout(1, 1), requests), 10.0, percentiles=(99,))
    spread = calculate_metrics(simulate(jittery, Layout(1, 1), requests), 10.0,
                               percentiles=(99,))
    assert spread.itl.median_ms == pytest.approx(plain.itl.median_ms, rel=0.05)
    assert spread.itl.percentile_ms(99) > 2 * plain.itl.percentile_ms(99)
    again = simulate(jittery, Layout(1, 1), requests)  # seeded: the same run twice
    assert again == simulate(jittery, Layout(1, 1), requests)


@pytest.mark.parametrize("layout", [Layout(2, 3), Layout(0, 3, is_colocated=True),
                                    Layout(1, 2, local_prefill_threshold=80)])
def test_every_request_completes_with_its_tokens(layout: Layout) -> None:
    rng = random.Random(7)
    t, requests = 0.0, []
    for _ in range(300):
        t += rng.expovariate(40.0)
        requests.append(SimRequest(t, rng.choice((16, 64, 300, 900)), rng.randint(1, 80)))
    records = simulate(make_cost(num_blocks=300), layout, requests)
    assert [r.output_len for r in records] == [r.output_len for r in requests]
    assert all(r.ttft_s > 0 and len(r.itls_s) == r.output_len - 1 for r in records)
    assert all(math.isclose(r.latency_s, r.ttft_s + sum(r.itls_s), abs_tol=1e-9)
               for r in records)


def test_a_joining_prompts_kv_slows_the_running_steps_a_share_at_a_time() -> None:
    """The decode worker takes a pushed prompt's K/V in beside its steps: each step is
    longer by at most RECEIVE_SHARE of itself until the receive time is spent."""
    from deploy.planner.profile import TransferPoint
    from deploy.planner.simulator import RECEIVE_SHARE

    receive = 0.005  # shorter than a prefill here, as measured; a step is 5 to 6 ms
    cost = make_cost(receive=(TransferPoint(100, receive), TransferPoint(1000, receive)))
    steady = simulate(cost, Layout(1, 1), [SimRequest(0.0, 64, 60)])[0]
    # alone, the decode worker takes it in during the prefill: the gap is transfer + a step
    assert steady.itls_s[0] == pytest.approx(cost.transfer_s(64) + cost.decode_s(1, 64))
    joined = simulate(cost, Layout(1, 1), [SimRequest(0.0, 64, 60),
                                           SimRequest(steady.ttft_s + 0.05, 100, 2)])[0]
    extra = [a - b for a, b in zip(joined.itls_s, steady.itls_s)]
    assert sum(extra) >= receive  # all of it was paid, by the running sequence too
    assert max(extra) <= cost.decode_s(2, 300) * (1 + RECEIVE_SHARE)  # a share at a time
