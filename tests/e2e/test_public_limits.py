"""Bounded public input: oversized request ids, stop lists, prompt text, invalid
UTF-8 and too many open streams each get a clear status naming what is wrong, before
anything reaches a worker, while normal requests alongside complete token-exact and without
migrating."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest

from deploy import client
from deploy.launcher import Deployment
from kvferry.faults import tag
from kvferry.rpc import grpc_util
from kvferry.settings.limits import PublicLimits
from kvferry.v1 import generation_pb2
from tests.conftest import assert_alive, assert_pools_clean
from tests.deployments import routed

pytestmark = pytest.mark.slow

PROMPT = list(range(40, 90))
LIMITS = PublicLimits()


def _normal(max_tokens: int = 24, request_id: str = "") -> generation_pb2.GenerateRequest:
    return client.make_request(PROMPT, request_id, temperature=0.0, max_tokens=max_tokens,
                               ignore_eos=True)


async def _status(address: str, request: generation_pb2.GenerateRequest | bytes
                  ) -> tuple[grpc.StatusCode, str]:
    """The status a request ends with (OK when its stream completes). Bytes go out as they
    are, for payloads the protobuf library would not serialize."""
    async with grpc_util.channel(address) as chan:
        serializer = (None if isinstance(request, bytes)
                      else generation_pb2.GenerateRequest.SerializeToString)
        call = chan.unary_stream("/kvferry.v1.GenerationService/Generate",
                                 request_serializer=serializer,
                                 response_deserializer=generation_pb2.GenerateResponse.FromString)
        try:
            async for _ in call(request, timeout=60):
                pass
        except grpc.aio.AioRpcError as exc:
            assert "Traceback" not in (exc.details() or "")
            return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def test_oversized_ids_are_refused_while_a_normal_request_completes(
        qwen3_deployment: Deployment) -> None:
    address = qwen3_deployment.router_address
    expected = asyncio.run(client.generate(address, _normal(), 60)).token_ids
    huge_id = "x" * (1 << 20)  # 1 MiB: copied into every decode update, it broke streams

    async def flood() -> tuple[list[tuple[grpc.StatusCode, str]], client.Completion]:
        hostile = [_status(address, _normal(request_id=f"{i}{huge_id}")) for i in range(20)]
        normal = client.generate(address, _normal(), 60)
        *statuses, completion = await asyncio.gather(*hostile, normal)
        return statuses, completion

    statuses, completion = asyncio.run(flood())
    for code, details in statuses:
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert details.startswith("request_id:") and "--max-request-id-bytes" in details
    assert completion.token_ids == expected
    assert completion.finished.timing.num_migrations == 0
    assert_pools_clean(qwen3_deployment)


@pytest.mark.parametrize("name, oversized, field", [
    ("too many stop strings",
     client.make_request(PROMPT, stop=[f"s{i}" for i in range(LIMITS.max_stop_strings + 1)]),
     "sampling.stop"),
    ("stop strings too long",
     client.make_request(PROMPT, stop=["y" * (LIMITS.max_stop_bytes + 1)]), "sampling.stop"),
    ("prompt text too long",
     client.make_request("z" * (LIMITS.max_prompt_bytes + 1)), "input.text"),
    ("chat content too long",
     client.make_request(messages=[("user", "z" * (LIMITS.max_prompt_bytes + 1))]),
     "input.messages"),
    ("more token ids than the context",
     client.make_request([1] * 5000), "input.token_ids"),  # the tiny models: 4096
])
def test_oversized_fields_are_named(name: str, oversized: generation_pb2.GenerateRequest,
                                    field: str, qwen3_deployment: Deployment) -> None:
    code, details = asyncio.run(_status(qwen3_deployment.router_address, oversized))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, name
    assert details.startswith(f"{field}:"), details


def _raw_text_request(text: bytes) -> bytes:
    """A GenerateRequest whose `text` (field 2) holds these bytes, encoded by hand."""
    assert len(text) < 128
    return bytes([0x12, len(text)]) + text


@pytest.mark.parametrize("payload, field", [
    (_raw_text_request(b"caf\xc3"), "input.text"),
    (bytes([0x22, 5, 0x32, 3]) + b"\xff\xfe!", "sampling.stop[0]"),
    (bytes([0x0a, 2]) + b"\xc0\xaf", "request_id"),
    (bytes([0x2a, 8, 0x0a, 6, 0x12, 4]) + b"hi\xed\xa0", "input.messages.messages[0].content"),
])
def test_invalid_utf8_is_invalid_argument_naming_the_field(
        payload: bytes, field: str, qwen3_deployment: Deployment) -> None:
    code, details = asyncio.run(_status(qwen3_deployment.router_address, payload))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == f"{field}: not valid UTF-8"


@pytest.fixture(scope="module")
def capped_deployment(qwen3_deployment: Deployment) -> Iterator[Deployment]:
    """Two open requests at most, no API keys, cached tokens not reported (the defaults):
    the shared workers behind a router of its own."""
    with routed(qwen3_deployment, "router-capped", ["--max-streams", "2"]) as deployment:
        yield deployment


def test_streams_past_the_cap_are_resource_exhausted(capped_deployment: Deployment) -> None:
    deployment = capped_deployment
    address = deployment.router_address

    async def run() -> None:
        async with grpc_util.channel(address) as chan:
            stub = client.public_stub(chan)
            first_tokens = [asyncio.Event(), asyncio.Event()]

            async def long(i: int) -> client.Completion:
                completion = client.Completion()
                # Paced (10 ms a step while it runs: 4 s), so that both still hold their
                # slots when the third request comes, however fast the machine.
                paced = _normal(400, f"long{i}" + tag(decode_step_delay_s=0.01))
                async for _, completion in client.stream(stub, paced, 120):
                    if completion.token_ids:
                        first_tokens[i].set()
                return completion

            streams = [asyncio.create_task(long(i)) for i in range(2)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first_tokens)), 60)
            code, details = await _status(address, _normal())
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-streams" in details
            for done in await asyncio.gather(*streams):
                assert len(done.token_ids) == 400
        code, _ = await _status(address, _normal())  # room again
        assert code == grpc.StatusCode.OK

    asyncio.run(run())
    assert_pools_clean(deployment)
    assert_alive(deployment)


def test_by_default_usage_tells_nothing_of_other_requests_and_abort_stays_on_its_connection(
        capped_deployment: Deployment) -> None:
    """Without --enable-prompt-tokens-details a repeated prompt reports no cached tokens and
    no K/V bytes; without API keys an Abort reaches only requests of its own connection."""
    address = capped_deployment.router_address
    prompt = list(range(200, 260))  # three full blocks and a part

    async def run() -> tuple[list[generation_pb2.Usage], client.Completion]:
        usages = [(await client.generate(address, _normal(4), 60)).finished.usage
                  for _ in range(2)]
        # Another client is another connection: gRPC shares one connection between the
        # channels of a process unless told otherwise.
        other_client = grpc.aio.insecure_channel(
            address, options=[("grpc.use_local_subchannel_pool", 1)])
        async with grpc_util.channel(address) as mine, other_client as other:
            stub = client.public_stub(mine)
            stream = client.stream(stub, client.make_request(
                prompt, "on-my-connection", temperature=0.0, max_tokens=3000, ignore_eos=True),
                120)
            _, completion = await anext(stream)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await client.public_stub(other).Abort(
                    generation_pb2.AbortRequest(request_id="on-my-connection"), timeout=30)
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
            await stub.Abort(generation_pb2.AbortRequest(request_id="on-my-connection"),
                             timeout=30)
            async for _, latest in stream:
                completion = latest
        return usages, completion

    usages, completion = asyncio.run(run())
    assert [(u.cached_prompt_tokens, u.kv_bytes_not_shipped, u.kv_bytes_shipped)
            for u in usages] == [(0, 0, 0)] * 2
    assert completion.finished.reason == generation_pb2.FINISH_REASON_ABORT
    assert len(completion.token_ids) < 3000
    assert_pools_clean(capped_deployment)
