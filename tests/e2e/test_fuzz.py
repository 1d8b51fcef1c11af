"""Issue 9, bad input: property-based GenerateRequests through the public API. Whatever the
request (text or token ids, in range or not, empty or huge; any sampling values, NaN and
infinities included; odd or duplicated request ids), the router answers OK, INVALID_ARGUMENT
or RESOURCE_EXHAUSTED; no process dies and no block leaks."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from deploy import client
from deploy.launcher import Deployment
from kvferry.rpc import grpc_util
from kvferry.v1 import generation_pb2, generation_pb2_grpc
from tests.conftest import assert_alive, assert_pools_clean

pytestmark = pytest.mark.slow

VOCAB = 512  # the seeded Qwen3 checkpoint
CONTEXT = 4096
INT32 = st.integers(-(2**31), 2**31 - 1)
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
           grpc.StatusCode.RESOURCE_EXHAUSTED}

token_ids = st.one_of(
    st.lists(st.integers(0, VOCAB - 1), max_size=40),
    st.lists(st.one_of(st.integers(0, VOCAB - 1), INT32), min_size=1, max_size=20),
    st.integers(CONTEXT - 8, 3 * CONTEXT).map(lambda n: [7] * n),  # fills the context
)
text = st.one_of(
    st.text(max_size=60),
    st.integers(CONTEXT, 4 * CONTEXT).map(lambda n: "kv " * n),
)
floats = st.floats(width=32)  # NaN, infinities, subnormals and signed zeros included
wild_sampling = st.builds(
    generation_pb2.SamplingParams,
    temperature=st.one_of(st.none(), floats),
    top_p=st.one_of(st.none(), floats),
    top_k=st.one_of(st.none(), INT32),
    seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    # Small, or past any context: a valid request never decodes for long.
    max_tokens=st.one_of(st.none(), st.integers(-(2**31), 8), st.integers(CONTEXT, 2**31 - 1)),
    stop=st.lists(st.text(max_size=4), max_size=3),
    stop_token_ids=st.lists(st.one_of(st.integers(0, VOCAB - 1), INT32), max_size=3),
    ignore_eos=st.booleans(),
)
# Valid, at the edges: these must run. A temperature of 1e-45 once turned the logits into
# inf / inf = NaN (INTERNAL).
edge_sampling = st.builds(
    generation_pb2.SamplingParams,
    temperature=st.one_of(st.none(), st.sampled_from([0.0, 1e-45, 1e-38, 1e-3, 0.7, 3.4e38])),
    top_p=st.one_of(st.none(), st.sampled_from([1e-45, 0.1, 0.9, 1.0])),
    top_k=st.one_of(st.none(), st.integers(0, 2**31 - 1)),
    seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    max_tokens=st.integers(1, 8),
    stop=st.lists(st.text(min_size=1, max_size=4), max_size=3),
    stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=3),
    ignore_eos=st.booleans(),
)
request_id = st.one_of(st.just(""), st.just("twin"), st.text(max_size=40))


@st.composite
def requests(draw: st.DrawFn) -> generation_pb2.GenerateRequest:
    """Half valid requests at the edges of the sampling ranges, half anything at all."""
    msg = generation_pb2.GenerateRequest(request_id=draw(request_id))
    which = draw(st.sampled_from(["edge", "text", "token_ids", "none"]))
    if which == "edge":
        msg.sampling.CopyFrom(draw(edge_sampling))
        msg.token_ids.ids.extend(draw(st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                               max_size=40)))
        return msg
    msg.sampling.CopyFrom(draw(st.one_of(edge_sampling, wild_sampling)))
    if which == "text":
        msg.text = draw(text)
    elif which == "token_ids":
        msg.token_ids.ids.extend(draw(token_ids))
    return msg


async def _outcome(stub: generation_pb2_grpc.GenerationServiceStub,
                   request: generation_pb2.GenerateRequest) -> grpc.StatusCode:
    num_tokens, finished = 0, None
    try:
        async for msg in stub.Generate(request, timeout=60):
            if msg.HasField("chunk"):
                num_tokens += len(msg.chunk.token_ids)
            else:
                finished = msg.finished
    except grpc.aio.AioRpcError as exc:
        assert exc.code() in ALLOWED, f"{exc.code()}: {exc.details()}\n{request}"
        return exc.code()
    assert finished is not None and finished.usage.completion_tokens == num_tokens
    if request.sampling.HasField("max_tokens"):
        assert num_tokens <= request.sampling.max_tokens
    return grpc.StatusCode.OK


async def _send_together(address: str, batch: list[generation_pb2.GenerateRequest]
                         ) -> list[grpc.StatusCode]:
    async with grpc_util.channel(address) as chan:
        stub = generation_pb2_grpc.GenerationServiceStub(chan)
        return list(await asyncio.gather(*(_outcome(stub, r) for r in batch)))


def test_fuzzed_generate_requests(qwen3_deployment: Deployment) -> None:
    seen: set[grpc.StatusCode] = set()

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.large_base_example])
    @given(batch=st.lists(requests(), min_size=1, max_size=3))  # sent concurrently
    @example(batch=[client.make_request(list(range(10, 50)), temperature=1e-45, max_tokens=4)])
    def check(batch: list[generation_pb2.GenerateRequest]) -> None:
        seen.update(asyncio.run(_send_together(qwen3_deployment.router_address, batch)))
        assert_alive(qwen3_deployment)

    check()
    assert {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT} <= seen
    assert_pools_clean(qwen3_deployment)
