"""Memory pressure waits instead of failing. A bounded queue gives
RESOURCE_EXHAUSTED past its bound; preemption under a deliberately tiny pool still
completes every request with the right tokens."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest

from deploy import client
from deploy.launcher import Deployment
from kvferry.rpc import grpc_util
from kvferry.v1 import generation_pb2, worker_pb2, worker_pb2_grpc
from tests.conftest import QWEN3_BLOCK_BYTES, assert_alive, assert_pools_clean, worker_stats
from tests.deployments import reconfigured, routed

pytestmark = pytest.mark.slow

BLOCK_BYTES = QWEN3_BLOCK_BYTES


@pytest.fixture(scope="module", params=["round_robin", "headroom"])
def tiny_deployment(request: pytest.FixtureRequest, qwen3_tiny_deployment: Deployment
                    ) -> Iterator[Deployment]:
    # round_robin sends requests whatever the worker's headroom, so the decode worker must
    # preempt; headroom holds them at the router until they fit at their longest. The shared
    # 12-block workers behind a router of each policy.
    with routed(qwen3_tiny_deployment, f"router-{request.param}",
                ["--policy", request.param]) as deployment:
        deployment.policy = request.param  # type: ignore[attr-defined]
        yield deployment


@pytest.fixture
def short_queue_deployment(qwen3_tiny_deployment: Deployment) -> Iterator[Deployment]:
    """The shared tiny deployment, its decode worker restarted with a 4-block pool and room
    for one waiter, then restarted as it was."""
    with reconfigured(qwen3_tiny_deployment, ["decode-0"],
                      ["--kv-pool-size", f"{4 * BLOCK_BYTES}B", "--max-waiting", "1"]):
        yield qwen3_tiny_deployment


def _decode_stats(deployment: Deployment) -> worker_pb2.WorkerStats:
    return next(s for s in worker_stats(deployment) if s.role == "decode")


def _requests() -> list[generation_pb2.GenerateRequest]:
    return [client.make_request(list(range(10 + i, 30 + i)), temperature=0.0,
                                max_tokens=40 + 5 * i, ignore_eos=True) for i in range(8)]


def test_preemption_under_a_tiny_pool_keeps_tokens_exact(
        tiny_deployment: Deployment, qwen3_deployment: Deployment) -> None:
    requests = _requests()
    preemptions = _decode_stats(tiny_deployment).num_preemptions
    squeezed = asyncio.run(client.generate_many(tiny_deployment.router_address, requests, 300))
    roomy = asyncio.run(client.generate_many(qwen3_deployment.router_address, requests, 300))
    for i, (a, b) in enumerate(zip(squeezed, roomy)):
        assert len(a.token_ids) == 40 + 5 * i
        assert a.token_ids == b.token_ids, f"request {i}"
    decode = _decode_stats(tiny_deployment)
    assert decode.total_blocks == 12
    if tiny_deployment.policy == "round_robin":  # type: ignore[attr-defined]
        assert decode.num_preemptions > preemptions
    else:
        assert decode.num_preemptions == preemptions
    assert_pools_clean(tiny_deployment)
    assert_alive(tiny_deployment)


def test_queue_bound_gives_resource_exhausted(short_queue_deployment: Deployment) -> None:
    address = short_queue_deployment.addresses("decode")[0]

    def reserve(request_id: str) -> worker_pb2.ReserveRequest:
        # 40 prompt tokens + the first slot: 3 of the pool's 4 blocks.
        return worker_pb2.ReserveRequest(request_id=request_id, num_prompt_tokens=40,
                                         max_tokens=8, lease_s=30)

    async def scenario() -> tuple[grpc.StatusCode, int]:
        async with grpc_util.channel(address) as chan:
            stub = worker_pb2_grpc.DecodeServiceStub(chan)
            await stub.Reserve(reserve("holder"), timeout=10)
            waiting = asyncio.ensure_future(stub.Reserve(reserve("waiter"), timeout=30))
            # The pool is full: the waiter is queued (the worker says so), it does not fail.
            deadline = asyncio.get_running_loop().time() + 60
            while not (await stub.GetStats(worker_pb2.GetStatsRequest(), timeout=10)
                       ).num_waiting:
                assert asyncio.get_running_loop().time() < deadline and not waiting.done()
                await asyncio.sleep(0.02)  # paces the polling
            assert not waiting.done()
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await stub.Reserve(reserve("third"), timeout=10)
            await stub.Abort(generation_pb2.AbortRequest(request_id="holder"), timeout=10)
            granted = await waiting
            await stub.Abort(generation_pb2.AbortRequest(request_id="waiter"), timeout=10)
            return exc.value.code(), granted.num_blocks

    code, granted_blocks = asyncio.run(scenario())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert granted_blocks == 3
    assert_pools_clean(short_queue_deployment)
