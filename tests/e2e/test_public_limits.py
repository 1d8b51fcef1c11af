"""Bounded public input (issue 16): oversized request ids, stop lists, prompt text, invalid
UTF-8 and too many open streams each get a clear status naming what is wrong, before
anything reaches a worker, while normal requests alongside complete token-exact and without
migrating."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from deploy import client
from deploy.launcher import Deployment
from kvferry.rpc import grpc_util
from kvferry.settings import PublicLimits
from kvferry.v1 import generation_pb2
from tests.conftest import assert_alive, assert_pools_clean

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


def test_streams_past_the_cap_are_resource_exhausted(qwen3_checkpoint: Path,
                                                     tmp_path: Path) -> None:
    with Deployment(model=str(qwen3_checkpoint), log_dir=tmp_path,
                    router_args=["--max-streams", "2"]) as deployment:
        address = deployment.router_address

        async def run() -> None:
            async with grpc_util.channel(address) as chan:
                stub = client.public_stub(chan)
                first_tokens = [asyncio.Event(), asyncio.Event()]

                async def long(i: int) -> client.Completion:
                    completion = client.Completion()
                    async for _, completion in client.stream(stub, _normal(400), 120):
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
