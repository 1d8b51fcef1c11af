"""Routing policies with fake workers, the burst case included."""

from __future__ import annotations

from collections import Counter

import pytest

from kvferry.rpc.convert import stats_from_proto
from kvferry.v1 import worker_pb2
from router.policies import make_policy
from router.policies.routing import HeadroomPolicy, LeastRequestsPolicy, RoundRobinPolicy
from router.workers.worker import Worker


def _worker(name: str, total: int = 100, projected: int = 0, pending_tokens: int = 0,
            role: str = "decode") -> Worker:
    worker = Worker(address=name, role=role, channel=None, is_healthy=True)
    worker.apply_stats(stats_from_proto(worker_pb2.WorkerStats(
        total_blocks=total, projected_blocks=projected,
        num_pending_prefill_tokens=pending_tokens)), issued_at=0.0)
    return worker


def _route_burst(policy, workers: list[Worker], count: int, need: int) -> Counter:
    """Route `count` requests before any telemetry update, as the router does."""
    placed: Counter = Counter()
    for i in range(count):
        best = policy.order_decode(workers, need)[0]
        best.add_in_flight(f"r{i}", need, 0)
        placed[best.address] += 1
    return placed


def test_headroom_prefers_the_emptiest_worker() -> None:
    workers = [_worker("a", projected=60), _worker("b", projected=10), _worker("c", total=50)]
    # headroom: a 40, b 90, c 50
    assert [w.address for w in HeadroomPolicy().order_decode(workers, 5)] == ["b", "c", "a"]


def test_headroom_burst_spreads_by_in_flight_accounting() -> None:
    workers = [_worker("a", projected=20), _worker("b")]  # b has 20 blocks more room
    placed = _route_burst(HeadroomPolicy(), workers, count=12, need=10)
    # b takes the first two, then they alternate: no pile-up on stale telemetry.
    assert placed == Counter({"b": 7, "a": 5})
    assert abs(workers[0].headroom - workers[1].headroom) <= 10


def test_headroom_ties_go_to_fewest_in_flight() -> None:
    a, b = _worker("a"), _worker("b")
    a.num_in_flight = 3
    assert HeadroomPolicy().order_decode([a, b], 1)[0] is b


def test_stats_snapshot_replaces_in_flight_it_already_counts() -> None:
    worker = _worker("a")
    worker.add_in_flight("old", 10, 0)
    worker.accepted("old")
    worker.add_in_flight("sending", 7, 0)  # not yet accepted by the worker
    assert worker.headroom == 83
    worker.apply_stats(stats_from_proto(worker_pb2.WorkerStats(total_blocks=100,
                                                               projected_blocks=10)),
                       issued_at=float("inf"))
    assert "old" not in worker.in_flight and "sending" in worker.in_flight
    assert worker.headroom == 83


def test_an_older_snapshot_answering_late_is_ignored() -> None:
    """Two refreshes in flight answer out of order: the stale one must not drop a
    reservation the newer one already counted (that over-admits and forces preemption)."""
    worker = _worker("a")
    worker.add_in_flight("r", 10, 0)
    worker.accepted("r")
    newer = stats_from_proto(worker_pb2.WorkerStats(total_blocks=100, projected_blocks=10))
    older = stats_from_proto(worker_pb2.WorkerStats(total_blocks=100, projected_blocks=0))
    # newer counts "r"; older is from before "r"
    worker.apply_stats(newer, issued_at=float("inf"))
    assert worker.headroom == 90
    worker.apply_stats(older, issued_at=1.0)
    assert worker.headroom == 90


def test_prefill_goes_to_fewest_pending_tokens() -> None:
    workers = [_worker("p1", pending_tokens=500, role="prefill"),
               _worker("p2", pending_tokens=100, role="prefill")]
    policy = HeadroomPolicy()
    assert policy.order_prefill(workers, 50)[0].address == "p2"
    workers[1].add_in_flight("x", 0, 800)  # a long prompt just sent there
    assert policy.order_prefill(workers, 50)[0].address == "p1"


def test_round_robin_rotates_whatever_the_load() -> None:
    workers = [_worker("a", projected=99), _worker("b"), _worker("c")]
    placed = _route_burst(RoundRobinPolicy(), workers, count=9, need=1)
    assert placed == Counter({"a": 3, "b": 3, "c": 3})


def test_least_requests_counts_open_requests() -> None:
    workers = [_worker("a", projected=99), _worker("b")]
    placed = _route_burst(LeastRequestsPolicy(), workers, count=6, need=1)
    assert placed == Counter({"a": 3, "b": 3})  # blind to memory, unlike headroom


def test_unknown_policy_is_named() -> None:
    with pytest.raises(ValueError, match="policy"):
        make_policy("random")
    assert make_policy("round_robin").name == "round_robin"
