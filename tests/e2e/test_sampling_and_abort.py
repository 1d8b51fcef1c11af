"""Seeded sampling is reproducible, and the release of blocks however a
request ends: finished, aborted through the public Abort, or cancelled by the client."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from deploy import client
from deploy.launcher import Deployment
from kvferry.rpc import grpc_util
from kvferry.v1 import generation_pb2, generation_pb2_grpc, worker_pb2_grpc
from tests.conftest import assert_alive, assert_pools_clean, downstream_id, worker_stats

# In the fast tier: one shared deployment, short requests.


def test_seeded_sampling_is_reproducible(qwen3_deployment: Deployment) -> None:
    def run(seed: int) -> list[int]:
        request = client.make_request("Once upon a time", temperature=1.5, top_p=0.95,
                                      top_k=50, seed=seed, max_tokens=32, ignore_eos=True)
        return asyncio.run(client.generate(qwen3_deployment.router_address, request)).token_ids

    first, second, other = run(7), run(7), run(8)
    assert len(first) == 32
    assert first == second
    assert first != other
    assert_pools_clean(qwen3_deployment)


def test_stop_string_ends_generation(qwen3_deployment: Deployment) -> None:
    base = asyncio.run(client.generate(
        qwen3_deployment.router_address,
        client.make_request("The quick brown", temperature=0.0, max_tokens=30, ignore_eos=True)))
    stop = base.text[5:8]
    assert len(stop) == 3
    got = asyncio.run(client.generate(
        qwen3_deployment.router_address,
        client.make_request("The quick brown", temperature=0.0, max_tokens=30, ignore_eos=True,
                            stop=[stop])))
    assert got.finished.reason == generation_pb2.FINISH_REASON_STOP
    assert got.text == base.text[: base.text.index(stop)]
    assert got.token_ids == base.token_ids[: len(got.token_ids)]
    assert_pools_clean(qwen3_deployment)


async def _abort_mid_stream(address: str) -> client.Completion:
    async with grpc_util.channel(address) as chan:
        stub = generation_pb2_grpc.GenerationServiceStub(chan)
        request = client.make_request("abort me", request_id="to-abort", max_tokens=2000,
                                      ignore_eos=True, seed=3)
        completion = client.Completion()
        is_abort_sent = False
        async for _, latest in client.stream(stub, request, timeout_s=120):
            completion = latest
            if len(completion.token_ids) >= 5 and not is_abort_sent:
                await stub.Abort(generation_pb2.AbortRequest(request_id="to-abort"), timeout=10)
                is_abort_sent = True
        return completion


def test_abort_ends_stream_and_frees_blocks(qwen3_deployment: Deployment) -> None:
    got = asyncio.run(_abort_mid_stream(qwen3_deployment.router_address))
    assert got.finished is not None
    assert got.finished.reason == generation_pb2.FINISH_REASON_ABORT
    assert 5 <= len(got.token_ids) < 2000
    assert_pools_clean(qwen3_deployment)
    assert_alive(qwen3_deployment)


async def _cancel_mid_stream(address: str, after_tokens: int) -> int:
    async with grpc_util.channel(address) as chan:
        stub = generation_pb2_grpc.GenerationServiceStub(chan)
        call = stub.Generate(client.make_request("cancel me", max_tokens=3000, ignore_eos=True),
                             timeout=120)
        seen = 0
        async for msg in call:
            seen += len(msg.chunk.token_ids)
            if seen >= after_tokens:
                call.cancel()
                break
        return seen


@pytest.mark.parametrize("after_tokens", [1, 10])
def test_client_cancel_frees_blocks(after_tokens: int, qwen3_deployment: Deployment) -> None:
    seen = asyncio.run(_cancel_mid_stream(qwen3_deployment.router_address, after_tokens))
    assert seen >= after_tokens
    assert_pools_clean(qwen3_deployment)
    assert_alive(qwen3_deployment)


def test_deadline_exceeded_frees_blocks(qwen3_deployment: Deployment) -> None:
    async def run() -> grpc.aio.AioRpcError:
        async with grpc_util.channel(qwen3_deployment.router_address) as chan:
            stub = generation_pb2_grpc.GenerationServiceStub(chan)
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                async for _ in stub.Generate(
                        client.make_request("slow", max_tokens=3000, ignore_eos=True),
                        timeout=0.5):
                    pass
            return exc.value

    error = asyncio.run(run())
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_pools_clean(qwen3_deployment)
    stats = worker_stats(qwen3_deployment)
    assert all(s.integrity_ok for s in stats)


def test_get_model_info_describes_the_served_model(qwen3_deployment: Deployment) -> None:
    async def run() -> generation_pb2.ModelInfo:
        async with grpc_util.channel(qwen3_deployment.router_address) as chan:
            stub = generation_pb2_grpc.GenerationServiceStub(chan)
            return await stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)

    info = asyncio.run(run())
    stats = worker_stats(qwen3_deployment)
    assert info.architecture == "Qwen3ForCausalLM"
    assert info.vocab_size == 512 and info.max_context_tokens == 4096
    assert list(info.eos_token_ids) == [0]
    assert info.block_size == 16 and info.kv_dtype == "float32"
    assert all(s.layout.model_fingerprint == info.model_fingerprint for s in stats)


def test_abort_releases_a_running_request_within_one_step(qwen3_deployment: Deployment) -> None:
    """The decode worker drops an aborted request at the first step boundary: at most the
    step already running when the abort arrived completes with it."""
    decode_address = qwen3_deployment.addresses("decode")[0]

    async def run() -> None:
        async with grpc_util.channel(qwen3_deployment.router_address) as chan, \
                grpc_util.channel(decode_address) as decode_chan:
            stub = generation_pb2_grpc.GenerationServiceStub(chan)
            decode = worker_pb2_grpc.DecodeServiceStub(decode_chan)
            for i in range(5):
                request_id = f"step-abort-{i}"
                call = stub.Generate(client.make_request(
                    "abort within a step", request_id=request_id, max_tokens=3000,
                    ignore_eos=True), timeout=60)
                seen = 0
                async for msg in call:
                    seen += len(msg.chunk.token_ids)
                    if seen >= 3 + i:
                        await decode.Abort(generation_pb2.AbortRequest(
                            request_id=downstream_id(qwen3_deployment, request_id)), timeout=10)
                        break
                call.cancel()

    asyncio.run(run())
    assert_pools_clean(qwen3_deployment)
    decode_stats = [s for s in worker_stats(qwen3_deployment) if s.role == "decode"][0]
    assert decode_stats.num_decode_steps > 0
    assert decode_stats.max_abort_delay_steps <= 1


async def _cancel_storm(address: str, num_requests: int, within_s: float) -> None:
    """Requests cancelled by the client within `within_s` of sending: many of them while
    the router's Reserve to the decode worker is on the wire."""
    rng = random.Random(5)
    async with grpc_util.channel(address) as chan:
        stub = generation_pb2_grpc.GenerationServiceStub(chan)

        async def one(i: int) -> None:
            request = client.make_request([rng.randint(1, 500) for _ in range(20)],
                                          f"storm-{i}", max_tokens=20, ignore_eos=True)
            task = asyncio.ensure_future(client.collect(stub, request, timeout_s=60))
            await asyncio.sleep(rng.uniform(0.0, within_s))  # paces: cancels spread over time
            task.cancel()
            try:
                got = await task
            except asyncio.CancelledError:
                return  # cancelled, as asked
            # Finished before the cancel landed: then it is whole.
            assert len(got.token_ids) == 20 and got.finished is not None, got

        for start in range(0, num_requests, 8):
            await asyncio.gather(*(one(i) for i in range(start, start + 8)))


def test_cancel_storm_around_reserve_leaks_nothing(qwen3_deployment: Deployment) -> None:
    """A cancellation that lands while the Reserve is in flight must not leave the
    reservation held until its lease (30 s) runs out: pools are clean within 5 s."""
    asyncio.run(_cancel_storm(qwen3_deployment.router_address, 64, 0.01))
    assert_pools_clean(qwen3_deployment, timeout_s=5.0)
    assert_alive(qwen3_deployment)
