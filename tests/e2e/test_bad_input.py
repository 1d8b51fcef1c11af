"""Bad input through the public Generate/Abort gets INVALID_ARGUMENT or
NOT_FOUND naming the field; no process crashes; no block leaks."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest

from deploy import client
from deploy.launcher import Deployment
from kvferry.rpc import grpc_util
from kvferry.v1 import generation_pb2, generation_pb2_grpc
from tests.conftest import assert_alive, assert_pools_clean

pytestmark = pytest.mark.slow

CONTEXT = 4096  # the seeded Qwen3 checkpoint's max_position_embeddings
VOCAB = 512

CASES = [
    ("empty text", client.make_request(""), "input"),
    ("no input", generation_pb2.GenerateRequest(), "input"),
    ("empty token ids", generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds()),
     "input"),
    ("context overflow", client.make_request([1] * 4000, max_tokens=200), "sampling.max_tokens"),
    ("prompt fills context", client.make_request([1] * CONTEXT), "input"),
    ("max_tokens zero", client.make_request("hi", max_tokens=0), "sampling.max_tokens"),
    ("max_tokens negative", client.make_request("hi", max_tokens=-3), "sampling.max_tokens"),
    ("temperature negative", client.make_request("hi", temperature=-1.0),
     "sampling.temperature"),
    ("temperature nan", client.make_request("hi", temperature=math.nan), "sampling.temperature"),
    ("top_p zero", client.make_request("hi", top_p=0.0), "sampling.top_p"),
    ("top_p above one", client.make_request("hi", top_p=1.01), "sampling.top_p"),
    ("top_k negative", client.make_request("hi", top_k=-1), "sampling.top_k"),
    ("top_k past the vocabulary", client.make_request("hi", top_k=VOCAB + 1), "sampling.top_k"),
    ("seed 2^63", client.make_request("hi", seed=2**63), "sampling.seed"),
    ("seed 2^64-1", client.make_request("hi", seed=2**64 - 1), "sampling.seed"),
    ("token id too large", client.make_request([1, VOCAB, 2]), "input.token_ids"),
    ("token id negative", client.make_request([1, -5]), "input.token_ids"),
    ("stop token id outside vocab", client.make_request("hi", stop_token_ids=[VOCAB + 1]),
     "sampling.stop_token_ids"),
]


async def _generate_error(address: str, request: generation_pb2.GenerateRequest
                          ) -> grpc.aio.AioRpcError:
    async with grpc_util.channel(address) as chan:
        stub = generation_pb2_grpc.GenerationServiceStub(chan)
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            async for _ in stub.Generate(request, timeout=60):
                pass
        return exc.value


@pytest.mark.parametrize("name,request_msg,field", CASES, ids=[c[0] for c in CASES])
def test_bad_generate_is_invalid_argument(name: str, request_msg: generation_pb2.GenerateRequest,
                                          field: str, qwen3_deployment: Deployment) -> None:
    error = asyncio.run(_generate_error(qwen3_deployment.router_address, request_msg))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert field in error.details()
    assert_alive(qwen3_deployment)
    assert_pools_clean(qwen3_deployment)


def test_abort_unknown_request_is_not_found(qwen3_deployment: Deployment) -> None:
    async def abort() -> grpc.aio.AioRpcError:
        async with grpc_util.channel(qwen3_deployment.router_address) as chan:
            stub = generation_pb2_grpc.GenerationServiceStub(chan)
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await stub.Abort(generation_pb2.AbortRequest(request_id="no-such-id"), timeout=10)
            return exc.value

    error = asyncio.run(abort())
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert "request_id" in error.details()
    assert_alive(qwen3_deployment)


def test_service_still_works_after_bad_input(qwen3_deployment: Deployment) -> None:
    got = asyncio.run(client.generate(qwen3_deployment.router_address,
                                      client.make_request("hello", max_tokens=5,
                                                          ignore_eos=True)))
    assert len(got.token_ids) == 5
    assert_pools_clean(qwen3_deployment)


def test_request_larger_than_the_pool_is_invalid_argument(
        qwen3_tiny_deployment: Deployment) -> None:
    """The shared deployment whose pools hold 12 blocks of 16 tokens: 192 tokens."""
    small_pool_deployment = qwen3_tiny_deployment
    # 100 + 100 tokens > the pool's 192: retrying cannot help, so not RESOURCE_EXHAUSTED.
    error = asyncio.run(_generate_error(small_pool_deployment.router_address,
                                        client.make_request([1] * 100, max_tokens=100)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert "sampling.max_tokens" in error.details() and "192 tokens" in error.details()
    got = asyncio.run(client.generate(small_pool_deployment.router_address,
                                      client.make_request([1] * 100, max_tokens=8,
                                                          ignore_eos=True)))
    assert len(got.token_ids) == 8
    assert_pools_clean(small_pool_deployment)
    assert_alive(small_pool_deployment)
