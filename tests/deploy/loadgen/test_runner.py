"""The runner's timestamps, exact under a virtual clock, and the same over real gRPC."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from deploy.loadgen.metrics import Slo, calculate_metrics
from deploy.loadgen.runner import SendOptions, run_requests
from deploy.loadgen.workload import BenchRequest
from kvferry.rpc import grpc_util
from kvferry.v1 import generation_pb2_grpc
from tests.deploy.loadgen.conftest import FAIL_TOKEN, FakeServer, FakeStub, VirtualClock

approx = pytest.approx
REQUESTS = [BenchRequest((1, 2, 3), 5, 3, tag="a"), BenchRequest((FAIL_TOKEN, 2), 5, 2),
            BenchRequest((4, 5, 6, 7), 5, 4)]


def test_virtual_clock_gives_exact_records_and_metrics() -> None:
    clock = VirtualClock()
    outcome = asyncio.run(run_requests(FakeStub(clock), REQUESTS, [0.5, 1.0, 2.0],
                                       clock=clock, sleep=clock.sleep))
    ok, refused, last = outcome.records
    # Sent exactly on schedule; scripted chunks at +40, +90, +120 (2 tokens), +190 ms.
    assert [r.start_s for r in outcome.records] == approx([0.5, 1.0, 2.0])
    assert ok.ttft_s == approx(0.040) and ok.latency_s == approx(0.190)
    assert ok.itls_s == approx((0.050, 0.030, 0.070))
    assert (ok.output_len, ok.prompt_len, ok.status, ok.tag) == (5, 3, "OK", "a")
    assert ok.tpot_s == approx((0.190 - 0.040) / 4)
    assert (refused.status, refused.error, refused.prompt_len) == ("RESOURCE_EXHAUSTED",
                                                                   "refused", 2)
    assert last.prompt_len == 4  # from the server's usage
    assert outcome.duration_s == approx(2.190)

    m = calculate_metrics(outcome.records, outcome.duration_s, Slo(ttft_ms=40.001, tpot_ms=37.501))
    assert (m.completed, m.failed, m.failures_by_status) == (2, 1, {"RESOURCE_EXHAUSTED": 1})
    assert m.ttft.mean_ms == approx(40) and m.tpot.mean_ms == approx(37.5)
    assert m.itl.percentile_ms(99) == approx(70)  # pooled [30, 30, 50, 50, 70, 70]
    assert m.itl.median_ms == approx(50) and m.e2el.mean_ms == approx(190)
    assert m.request_goodput == approx(2 / 2.190)
    assert m.output_throughput == approx(10 / 2.190)


def test_max_concurrency_holds_requests_back() -> None:
    clock = VirtualClock()
    requests = [BenchRequest((1,), 5, 1)] * 3
    outcome = asyncio.run(run_requests(FakeStub(clock), requests, [0.0] * 3,
                                       max_concurrency=1, clock=clock, sleep=clock.sleep))
    # One at a time: each starts when the one before it has finished (190 ms each).
    assert [r.start_s for r in outcome.records] == approx([0.0, 0.190, 0.380])
    assert calculate_metrics(outcome.records, outcome.duration_s).max_concurrent_requests == 1


def test_request_protos_carry_length_and_ignore_eos() -> None:
    clock = VirtualClock()
    stub = FakeStub(clock)
    seen = []
    original = stub.Generate
    stub.Generate = lambda request, timeout=None: seen.append(request) or original(request)
    asyncio.run(run_requests(stub, [BenchRequest("text prompt", 9)], [0.0],
                             SendOptions(temperature=0.0, seed=11), clock=clock,
                             sleep=clock.sleep))
    (request,) = seen
    assert request.text == "text prompt" and request.request_id == "bench-0"
    assert request.sampling.max_tokens == 9 and request.sampling.ignore_eos
    assert request.sampling.temperature == 0.0 and request.sampling.seed == 11


async def _over_grpc(address: str) -> tuple:
    async with grpc_util.channel(address) as chan:
        stub = generation_pb2_grpc.GenerationServiceStub(chan)
        return await run_requests(stub, REQUESTS, [0.0, 0.0, 0.0], clock=time.perf_counter)


def test_over_real_grpc(fake_server: FakeServer) -> None:
    outcome = asyncio.run(_over_grpc(fake_server.address))
    ok, refused, _ = outcome.records
    assert refused.status == grpc.StatusCode.RESOURCE_EXHAUSTED.name
    assert refused.error == "scripted refusal"
    # Real time: never earlier than scripted (1 ms timer slack), at most 60 ms late.
    assert 0.039 <= ok.ttft_s <= 0.100
    for gap, scripted in zip(ok.itls_s, (0.050, 0.030, 0.070)):
        assert scripted - 0.001 <= gap <= scripted + 0.060
    assert 0.189 <= ok.latency_s <= 0.300
    assert ok.output_len == 5 and ok.prompt_len == 3
    assert len(fake_server.servicer.requests) == 3
