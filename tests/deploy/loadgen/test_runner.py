"""The runner's timestamps, exact under a virtual clock, and the same over real gRPC (on a
clock the server moves)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from deploy.loadgen.metrics import Slo, calculate_metrics
from deploy.loadgen.runner import SendOptions, run_conversations, run_requests
from deploy.loadgen.workload import BenchRequest, Conversation
from kvferry.rpc import grpc_util
from kvferry.v1 import generation_pb2_grpc
from tests.deploy.loadgen.conftest import (
    FAIL_TOKEN,
    KV_BYTES_PER_TOKEN,
    FakeStub,
    LockstepClock,
    VirtualClock,
    serve_scripted,
)

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


async def _over_grpc(address: str, clock: LockstepClock) -> tuple:
    async with grpc_util.channel(address) as chan:
        stub = generation_pb2_grpc.GenerationServiceStub(chan)
        return await run_requests(stub, REQUESTS, [0.0, 0.0, 0.0], max_concurrency=1,
                                  clock=clock)


def test_over_real_grpc() -> None:
    """The same records over a real gRPC server as from FakeStub, one stream at a time: the
    server moves a shared clock by each scripted gap as it sends the chunk."""
    clock = LockstepClock()
    with serve_scripted(clock) as server:
        outcome = asyncio.run(_over_grpc(server.address, clock))
    ok, refused, last = outcome.records
    assert (refused.status, refused.error) == (grpc.StatusCode.RESOURCE_EXHAUSTED.name,
                                               "scripted refusal")
    # Scripted chunks at +40, +90, +120 (2 tokens), +190 ms; the refusal takes no time.
    assert [r.start_s for r in outcome.records] == approx([0.0, 0.190, 0.190])
    for record in (ok, last):
        assert record.ttft_s == approx(0.040) and record.itls_s == approx((0.050, 0.030, 0.070))
        assert record.latency_s == approx(0.190) and record.output_len == 5
    assert (ok.prompt_len, last.prompt_len) == (3, 4)  # from the server's usage
    assert outcome.duration_s == approx(0.380)
    assert len(server.servicer.requests) == 3


def _recording(stub: FakeStub) -> list:
    seen = []
    original = stub.Generate
    stub.Generate = lambda request, timeout=None: seen.append(request) or original(request)
    return seen


def test_conversation_turns_carry_the_answers_one_after_another() -> None:
    clock = VirtualClock()
    stub = FakeStub(clock)
    seen = _recording(stub)
    chats = [Conversation(((1, 2), (3,), (4, 5)), output_len=5),
             Conversation(((6,), (7,)), output_len=5)]
    outcome = asyncio.run(run_conversations(stub, chats, [0.0, 5.0], SendOptions(seed=100),
                                            clock=clock, sleep=clock.sleep, id_prefix="mt"))
    # The scripted server answers five 7s in 190 ms; a turn is sent when the one before it
    # has finished.
    by_id = {r.request_id: r for r in seen}
    answer = (7,) * 5
    assert tuple(by_id["mt-0-1"].token_ids.ids) == (1, 2)
    assert tuple(by_id["mt-0-2"].token_ids.ids) == (1, 2, *answer, 3)
    assert tuple(by_id["mt-0-3"].token_ids.ids) == (1, 2, *answer, 3, *answer, 4, 5)
    assert tuple(by_id["mt-1-2"].token_ids.ids) == (6, *answer, 7)
    assert [by_id[f"mt-0-{k}"].sampling.seed for k in (1, 2, 3)] == [100, 101, 102]
    assert [by_id[f"mt-1-{k}"].sampling.seed for k in (1, 2)] == [103, 104]
    records = outcome.records
    assert [r.tag for r in records] == ["turn-1", "turn-2", "turn-3", "turn-1", "turn-2"]
    assert [r.prompt_len for r in records] == [2, 8, 15, 1, 7]
    assert [r.start_s for r in records] == approx([0.0, 0.19, 0.38, 5.0, 5.19])
    assert all(r.is_success and r.ttft_s == approx(0.040) for r in records)
    assert [r.cached_prompt_tokens for r in records] == [1, 4, 7, 0, 3]  # scripted: half
    assert records[2].kv_bytes_shipped == KV_BYTES_PER_TOKEN * 8
    assert records[2].kv_bytes_not_shipped == KV_BYTES_PER_TOKEN * 7
    assert outcome.duration_s == approx(5.38)


def test_think_time_comes_between_an_answer_and_the_next_turn() -> None:
    clock = VirtualClock()
    chat = Conversation(((1,), (2,), (3,)), output_len=5, think_time_s=1.0)
    outcome = asyncio.run(run_conversations(FakeStub(clock), [chat], [0.0], clock=clock,
                                            sleep=clock.sleep))
    assert [r.start_s for r in outcome.records] == approx([0.0, 1.19, 2.38])
    assert outcome.duration_s == approx(2.57)


def test_a_failed_turn_abandons_the_rest_of_its_conversation() -> None:
    clock = VirtualClock()
    stub = FakeStub(clock)
    seen = _recording(stub)
    chats = [Conversation(((FAIL_TOKEN,), (3,), (4,)), output_len=5),
             Conversation(((6,), (7,)), output_len=5)]
    done = []
    outcome = asyncio.run(run_conversations(stub, chats, [0.0, 0.0], clock=clock,
                                            sleep=clock.sleep, on_done=done.append))
    assert [r.status for r in outcome.records] == ["RESOURCE_EXHAUSTED", "ABANDONED",
                                                   "ABANDONED", "OK", "OK"]
    assert len(seen) == 3 and len(done) == 5  # abandoned turns are never sent, but counted
    m = calculate_metrics(outcome.records, outcome.duration_s)
    assert m.completed == 2 and m.failures_by_status == {"RESOURCE_EXHAUSTED": 1,
                                                         "ABANDONED": 2}


def test_conversations_need_one_offset_each() -> None:
    with pytest.raises(ValueError, match="offsets_s"):
        asyncio.run(run_conversations(FakeStub(VirtualClock()),
                                      [Conversation(((1,),), 1)], [0.0, 1.0]))


def test_a_cancelled_run_keeps_the_records_of_what_had_finished() -> None:
    """Ctrl-C cancels the run's task: what had finished is kept, flagged interrupted."""
    clock, done = VirtualClock(), []

    async def stalled(delay_s: float) -> None:  # the third request's send slot never comes
        await asyncio.Event().wait()

    async def body():  # type: ignore[no-untyped-def]
        task = asyncio.create_task(run_requests(
            FakeStub(clock), REQUESTS, [0.0, 0.0, 5.0], clock=clock, sleep=stalled,
            on_done=done.append))
        while len(done) < 2:
            await asyncio.sleep(0.01)
        task.cancel()
        return await task

    outcome = asyncio.run(body())
    assert outcome.is_interrupted and len(outcome.records) == 2
    assert {r.prompt_len for r in outcome.records} == {3, 2}
