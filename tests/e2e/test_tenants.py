"""API keys and tenants end to end (router/identity.py), on both public APIs: a call without
a valid key is refused (gRPC UNAUTHENTICATED, HTTP 401 with an OpenAI error object) while
health checks stay open; tenant B can neither abort tenant A's request nor tell whether its
id exists; B never sees cached tokens from A's prompts; and one cap counts the open requests
of both fronts."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy import client
from deploy.launcher import Deployment
from kvferry.rpc import security
from kvferry.v1 import generation_pb2
from tests.conftest import assert_alive, assert_pools_clean
from tests.deployments import routed

pytestmark = pytest.mark.slow

KEY_A = "tenant-a-0123456789abcdef"
KEY_B = "tenant-b-0123456789abcdef"
BLOCK = 16
MAX_STREAMS = 3


@pytest.fixture(scope="module")
def deployment(qwen3_deployment: Deployment, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[Deployment]:
    """The shared workers behind a router with two API keys and a cap of its own."""
    keys_file = tmp_path_factory.mktemp("tenants") / "keys"
    keys_file.write_text(f"# the second tenant\n{KEY_B}\n")
    with routed(qwen3_deployment, "router-tenants", [
            "--api-key", KEY_A, "--api-keys-file", str(keys_file),
            "--enable-prompt-tokens-details", "--max-streams", str(MAX_STREAMS)],
            is_http=True) as deployment:
        yield deployment


def _channel(address: str, key: str | None) -> grpc.aio.Channel:
    return security.channel(address, security.PLAINTEXT._replace(token=key))


def _long(prompt: list[int], request_id: str = "") -> generation_pb2.GenerateRequest:
    return client.make_request(prompt, request_id, temperature=0.0, max_tokens=3000,
                               ignore_eos=True)


def _short(prompt: list[int], request_id: str = "") -> generation_pb2.GenerateRequest:
    return client.make_request(prompt, request_id, temperature=0.0, max_tokens=4,
                               ignore_eos=True)


def _http(deployment: Deployment, key: str | None) -> httpx.AsyncClient:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.AsyncClient(base_url=f"http://{deployment.http_address}", headers=headers,
                             timeout=60)


async def _rpc_error(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        if hasattr(call, "__aiter__"):
            async for _ in call:  # type: ignore[attr-defined]
                pass
        else:
            await call  # type: ignore[misc]
    return caught.value


def test_calls_without_a_valid_key_are_refused_on_both_apis(deployment: Deployment) -> None:
    address = deployment.router_address

    async def run() -> None:
        for key in (None, "not-a-key", KEY_A + "x"):
            async with _channel(address, key) as chan:
                stub = client.public_stub(chan)
                for call in (stub.Generate(_short([5, 6, 7]), timeout=30),
                             stub.Abort(generation_pb2.AbortRequest(request_id="x"), timeout=30),
                             stub.GetModelInfo(generation_pb2.GetModelInfoRequest(),
                                               timeout=30)):
                    error = await _rpc_error(call)
                    assert error.code() == grpc.StatusCode.UNAUTHENTICATED, error.details()
                    assert "API key" in error.details()
                health = health_pb2_grpc.HealthStub(chan)  # probes need no key
                answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=30)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
            async with _http(deployment, key) as http:
                for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"),
                                     ("POST", "/v1/chat/completions")):
                    got = await http.request(method, path, json={"prompt": "hi"})
                    assert got.status_code == 401, got.text
                    assert got.headers["www-authenticate"] == "Bearer"
                    error = got.json()["error"]
                    assert error["code"] == "invalid_api_key"
                    assert error["type"] == "invalid_request_error"
                assert (await http.get("/health")).status_code == 200
        async with _channel(address, KEY_A) as chan:
            done = await client.collect(client.public_stub(chan), _short([5, 6, 7]), 60)
            assert len(done.token_ids) == 4
        async with _http(deployment, KEY_B) as http:
            got = await http.post("/v1/completions", json={"prompt": [5, 6, 7],
                                                            "max_tokens": 4, "temperature": 0})
            assert got.status_code == 200, got.text
            assert got.json()["usage"]["completion_tokens"] == 4

    asyncio.run(run())
    assert_pools_clean(deployment)


async def _first_sse_id(lines: AsyncIterator[str]) -> str:
    async for line in lines:
        if line.startswith("data: {"):
            return json.loads(line[6:])["id"]
    raise AssertionError("the stream ended before its first event")


def test_a_tenant_cannot_abort_or_detect_another_tenants_requests(
        deployment: Deployment) -> None:
    address = deployment.router_address
    prompt = list(range(30, 70))

    async def run() -> tuple[client.Completion, int]:
        async with _channel(address, KEY_A) as chan_a, _channel(address, KEY_B) as chan_b:
            stub_a, stub_b = client.public_stub(chan_a), client.public_stub(chan_b)
            completion = client.Completion()
            stream = client.stream(stub_a, _long(prompt, "shared-id"), 120)
            async for _, completion in stream:
                if len(completion.token_ids) >= 3:
                    break
            # B: A's id and an id nobody uses get the same answer, and nothing is aborted.
            errors = [await _rpc_error(stub_b.Abort(generation_pb2.AbortRequest(
                request_id=rid), timeout=30)) for rid in ("shared-id", "never-used")]
            assert [e.code() for e in errors] == [grpc.StatusCode.NOT_FOUND] * 2
            assert errors[0].details().replace("shared-id", "ID") == \
                errors[1].details().replace("never-used", "ID")
            # B may use the same id at once: its namespace is its own.
            mine = await client.collect(stub_b, _short(prompt, "shared-id"), 60)
            assert mine.finished.reason == generation_pb2.FINISH_REASON_LENGTH
            # ...while A's own duplicate is refused, so the check is there.
            duplicate = await _rpc_error(stub_a.Generate(_short(prompt, "shared-id"),
                                                         timeout=30))
            assert duplicate.code() == grpc.StatusCode.INVALID_ARGUMENT
            seen_at_b_abort = len(completion.token_ids)
            async for _, completion in stream:  # A's request went on
                if len(completion.token_ids) >= seen_at_b_abort + 5:
                    break
            await stub_a.Abort(generation_pb2.AbortRequest(request_id="shared-id"), timeout=30)
            async for _, latest in stream:
                completion = latest
            # An HTTP request of A: B's Abort of its id finds nothing, A's ends it.
            async with _http(deployment, KEY_A) as http:
                body = {"prompt": prompt, "max_tokens": 3000, "stream": True,
                        "ignore_eos": True}
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    lines = response.aiter_lines()
                    http_id = await _first_sse_id(lines)
                    error = await _rpc_error(stub_b.Abort(generation_pb2.AbortRequest(
                        request_id=http_id), timeout=30))
                    assert error.code() == grpc.StatusCode.NOT_FOUND
                    await stub_a.Abort(generation_pb2.AbortRequest(request_id=http_id),
                                       timeout=30)
                    events = [line async for line in lines if line]
            reasons = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events
                       if e.startswith("data: {")]
            assert reasons[-1] == "abort", reasons
            return completion, len(events)

    completion, num_events = asyncio.run(run())
    assert completion.finished.reason == generation_pb2.FINISH_REASON_ABORT
    assert 8 <= len(completion.token_ids) < 3000
    assert num_events < 3000
    assert_pools_clean(deployment)
    assert_alive(deployment)


def test_a_tenant_never_sees_cached_tokens_of_another_tenants_prompt(
        deployment: Deployment) -> None:
    address = deployment.router_address
    p1, p2 = list(range(100, 100 + 3 * BLOCK + 5)), list(range(300, 300 + 3 * BLOCK + 5))

    async def grpc_cached(key: str, prompt: list[int]) -> tuple[int, int]:
        async with _channel(address, key) as chan:
            done = await client.collect(client.public_stub(chan), _short(prompt), 60)
        usage = done.finished.usage
        return usage.cached_prompt_tokens, usage.kv_bytes_not_shipped

    async def http_cached(key: str, prompt: list[int]) -> int:
        async with _http(deployment, key) as http:
            got = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4,
                                                            "temperature": 0})
        assert got.status_code == 200, got.text
        return got.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    async def run() -> None:
        for prompt in (p1, p2):  # A's prompts, twice: A's own namespace holds them
            await grpc_cached(KEY_A, prompt)
            cached, not_shipped = await grpc_cached(KEY_A, prompt)
            assert cached == 3 * BLOCK and not_shipped > 0
        assert await http_cached(KEY_B, p1) == 0  # B: nothing of A's, over HTTP
        assert await grpc_cached(KEY_B, p2) == (0, 0)  # ...nor over gRPC
        assert await http_cached(KEY_A, p2) == 3 * BLOCK  # A's namespace spans both APIs

    asyncio.run(run())
    assert_pools_clean(deployment)


def test_one_cap_counts_the_requests_of_both_fronts(deployment: Deployment) -> None:
    address = deployment.router_address

    async def run() -> None:
        async with _channel(address, KEY_A) as chan, _http(deployment, KEY_B) as http:
            stub = client.public_stub(chan)
            streams = [client.stream(stub, _long([7, 8, 9]), 120) for _ in range(2)]
            for stream in streams:
                await anext(stream)
            body = {"prompt": [7, 8, 9], "max_tokens": 3000, "stream": True,
                    "ignore_eos": True}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                lines = response.aiter_lines()  # kept: a dropped iterator closes the stream
                await _first_sse_id(lines)  # three open: two gRPC, one HTTP
                refused = await http.post("/v1/completions", json={"prompt": [1, 2]})
                assert refused.status_code == 429, refused.text
                assert "--max-streams" in refused.json()["error"]["message"]
                error = await _rpc_error(stub.Generate(_short([1, 2]), timeout=30))
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                await lines.aclose()
            for stream in streams:
                await stream.aclose()
        # Room again once the router has seen the cancels (they travel as RPCs: poll).
        async with _channel(address, KEY_A) as chan:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while True:
                try:
                    done = await client.collect(client.public_stub(chan), _short([1, 2]), 60)
                    break
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or \
                            loop.time() > deadline:
                        raise
                    await asyncio.sleep(0.05)  # paces the retries
            assert len(done.token_ids) == 4

    asyncio.run(run())
    assert_pools_clean(deployment)
