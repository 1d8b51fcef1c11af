"""bench/front_interleave.py: requests take the fronts in turn, in one run, and each front's
metrics come from its own records only."""

from __future__ import annotations

import asyncio

from bench.front_interleave import Interleaved
from deploy.loadgen import RequestRecord, calculate_metrics
from deploy.loadgen.runner import Clock, SendOptions, run_requests
from deploy.loadgen.workload import BenchRequest


class FixedTtft:
    """A front whose every request has the same TTFT; remembers what it was sent."""

    def __init__(self, ttft_s: float) -> None:
        self.ttft_s = ttft_s
        self.sent: list[tuple[int, int]] = []  # (index, first prompt token)

    async def send(self, request: BenchRequest, request_id: str, index: int,
                   options: SendOptions, clock: Clock, origin_s: float,
                   answer: list[int] | None = None) -> RequestRecord:
        self.sent.append((index, request.prompt[0]))
        return RequestRecord(len(request.prompt), 2, clock() - origin_s, self.ttft_s,
                             (0.001,), self.ttft_s + 0.001, tag="untagged")


def test_requests_take_the_fronts_in_turn_and_records_name_their_front() -> None:
    fronts = {"grpc": FixedTtft(0.010), "http": FixedTtft(0.030), "http-ids": FixedTtft(0.020)}
    order = ("http", "grpc", "http-ids")
    requests = [BenchRequest((i, 1), 2, 2) for i in range(9)]
    outcome = asyncio.run(run_requests(Interleaved(fronts, order), requests, [0.0] * 9))
    assert [r.tag for r in outcome.records] == list(order) * 3
    assert fronts["http"].sent == [(0, 0), (3, 3), (6, 6)]
    assert fronts["grpc"].sent == [(1, 1), (4, 4), (7, 7)]
    for name, front in fronts.items():
        mine = [r for r in outcome.records if r.tag == name]
        metrics = calculate_metrics(mine, outcome.duration_s, percentiles=(50.0,))
        assert metrics.completed == 3
        assert metrics.ttft.median_ms == front.ttft_s * 1e3
