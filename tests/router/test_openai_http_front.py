"""The HTTP front in-process, on a real uvicorn server in the test's event loop, over a fake
router engine: a client that goes away closes the engine's generator (streaming or not), the
open-request cap answers 429, a failure mid-stream arrives as an error event, and TLS (and
mutual TLS) applies to the port."""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from kvferry.errors import Unavailable
from kvferry.model.sampling import FinishReason
from kvferry.settings import SecuritySettings
from kvferry.settings.limits import PublicLimits
from kvferry.settings.sampling import KVFERRY_DEFAULTS
from router.events import ChunkEvent, DoneEvent, Timing
from router.http.front import HttpFront
from router.identity import ANONYMOUS, Caller
from router.request import GenerateInput, OpenRequests
from tests.waiting import within

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


class FakeRouter:
    """Streams `num_tokens` tokens, one every 10 ms, then fails or finishes; records how each
    generator began and ended. With `hold`, the last token waits for the test to open
    `release`."""

    def __init__(self, num_tokens: int = 10_000, fail: bool = False, max_streams: int = 8,
                 texts: list[str] | None = None, hold: bool = False):
        self.config = SimpleNamespace(max_position_embeddings=4096,
                                      sampling_defaults=KVFERRY_DEFAULTS)
        self.limits = PublicLimits(max_streams=max_streams)
        self.num_tokens, self.fail = num_tokens, fail
        self.texts = texts  # token i's text, "" where it is held back; else "t{i} "
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        if not hold:
            self.release.set()
        self.closed = asyncio.Event()
        self.inputs: list[GenerateInput] = []
        self.callers: list[Caller] = []
        self.open = OpenRequests(max_streams)  # the real cap
        self.admission = self  # admits every input as it is: the record is the input

    def max_model_len(self) -> int:
        return self.config.max_position_embeddings

    async def admit(self, inp: GenerateInput, timeout_s: float | None,
                    caller: Caller = ANONYMOUS) -> GenerateInput:
        self.inputs.append(inp)
        self.callers.append(caller)
        return inp

    async def relay(self, inp: GenerateInput, caller: Caller = ANONYMOUS
                    ) -> AsyncIterator[object]:
        self.started.set()
        try:
            yield inp.request_id
            for i in range(self.num_tokens):
                if i == self.num_tokens - 1:
                    await self.release.wait()
                yield ChunkEvent([i], f"t{i} " if self.texts is None else self.texts[i])
                await asyncio.sleep(0.01)  # paces: a token every 10 ms
            if self.fail:
                raise Unavailable("decode failed 3 times")
            yield DoneEvent(FinishReason.LENGTH, 3, self.num_tokens, Timing(0, 0, 0, 0, 0),
                            cached_prompt_tokens=2, details=True)
        finally:
            self.closed.set()


def _serve(router: FakeRouter, test: Callable[[HttpFront], Awaitable[None]],
           security: SecuritySettings | None = None, client_auth: bool = False) -> None:
    async def main() -> None:
        front = HttpFront(router, "/models/tiny", "127.0.0.1", 0,  # type: ignore[arg-type]
                          security or SecuritySettings(), client_auth, None, 1.0)
        await front.start()
        try:
            await test(front)
        finally:
            await front.stop()

    asyncio.run(main())


def test_a_client_leaving_mid_stream_closes_the_request() -> None:
    router = FakeRouter()

    async def test(front: HttpFront) -> None:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{front.port}") as client:
            body = {**CHAT, "stream": True}
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                lines = response.aiter_lines()
                assert json.loads((await anext(lines))[6:])["choices"][0]["delta"]["role"] == \
                    "assistant"
        await within(router.closed.wait(), "the engine's generator closed")
        assert front.router.open.num_streams == 0

    _serve(router, test)


def test_a_client_leaving_before_a_whole_answer_closes_the_request() -> None:
    router = FakeRouter()

    async def test(front: HttpFront) -> None:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{front.port}") as client:
            asking = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "a"}))
            await within(router.started.wait(), "the request reached the engine")
            asking.cancel()  # the client goes away, its connection with it
            with pytest.raises(asyncio.CancelledError):
                await asking
        await within(router.closed.wait(), "the engine's generator closed")
        assert front.router.open.num_streams == 0

    _serve(router, test)


def test_whole_answer_usage_and_the_open_request_cap() -> None:
    router = FakeRouter(num_tokens=3, max_streams=1, hold=True)

    async def test(front: HttpFront) -> None:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{front.port}") as client:
            first = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "a"}))
            await within(router.started.wait(), "the first request reached the engine")
            refused = await client.post("/v1/completions", json={"prompt": "b"})  # over the cap
            router.release.set()  # the first may finish now
            done = (await within(first, "the first request's answer")).json()
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "resource_exhausted"
        assert done["choices"][0] == {"index": 0, "text": "t0 t1 t2 ", "logprobs": None,
                                      "finish_reason": "length"}
        assert done["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                                 "prompt_tokens_details": {"cached_tokens": 2}}
        assert done["model"] == "tiny" and done["id"].startswith("cmpl-")

    _serve(router, test)


def test_a_failure_mid_stream_is_an_error_event() -> None:
    router = FakeRouter(num_tokens=2, fail=True)

    async def test(front: HttpFront) -> None:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{front.port}") as client:
            response = await client.post("/v1/completions", json={"prompt": "a", "stream": True})
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert response.status_code == 200 and events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "unavailable" and error["type"] == "service_unavailable_error"

    _serve(router, test)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_token_whose_text_is_held_back_is_still_a_chunk(path: str) -> None:
    """Every token step reaches the client when it is sampled, held-back text or not: the
    first chunk comes with the first token although its text is empty."""
    texts = ["", "\u00e9", "", "", "\u4e2d", "!"]  # bytes of a character split over tokens
    router = FakeRouter(num_tokens=len(texts), texts=texts)

    async def test(front: HttpFront) -> None:
        body = {"prompt": "a"} if path == "/v1/completions" else dict(CHAT)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{front.port}") as client:
            response = await client.post(path, json={**body, "stream": True})
        events = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: {")]
        choices = [e["choices"][0] for e in events]
        if path == "/v1/chat/completions":
            assert choices.pop(0)["delta"] == {"role": "assistant", "content": ""}
            contents = [c["delta"].get("content") for c in choices]
        else:
            contents = [c["text"] for c in choices]
        *steps, last = zip(contents, (c["finish_reason"] for c in choices), strict=True)
        assert steps == [(text, None) for text in texts]
        assert last == ("", "length") or last == (None, "length")

    _serve(router, test)


def _tls_context(certs, with_client_cert: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs.ca_cert))
    if with_client_cert:
        context.load_cert_chain(str(certs.cert), str(certs.key))
    return context


@pytest.mark.parametrize("client_auth", [False, True])
def test_tls_applies_to_the_http_port(tmp_path: Path, client_auth: bool) -> None:
    pytest.importorskip("cryptography")
    from deploy.certs import make_certs

    certs = make_certs(tmp_path)
    security = SecuritySettings(tls_cert=str(certs.cert), tls_key=str(certs.key),
                                tls_ca=str(certs.ca_cert))

    async def test(front: HttpFront) -> None:
        assert front.scheme == "https"
        url = f"https://127.0.0.1:{front.port}/health"
        async with httpx.AsyncClient(verify=_tls_context(certs, True)) as client:
            assert (await client.get(url)).status_code == 200
        async with httpx.AsyncClient(verify=_tls_context(certs, False)) as client:
            if client_auth:
                with pytest.raises(httpx.HTTPError):  # the handshake or first read fails
                    await client.get(url)
            else:
                assert (await client.get(url)).status_code == 200
        async with httpx.AsyncClient() as client:  # plaintext to a TLS port
            with pytest.raises(httpx.HTTPError):
                await client.get(url.replace("https", "http"))

    _serve(FakeRouter(), test, security, client_auth)


def test_usage_leaves_cached_tokens_out_when_unreported() -> None:
    """A router that does not report cache details (no --enable-prompt-tokens-details)
    leaves `prompt_tokens_details` out, as vLLM does, rather than reading 0."""
    from router.http.reply import usage

    done = DoneEvent(FinishReason.LENGTH, 3, 2, Timing(0, 0, 0, 0, 0))
    assert usage([done]) == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    reported = done._replace(cached_prompt_tokens=2, details=True)
    assert usage([reported])["prompt_tokens_details"] == {"cached_tokens": 2}


def test_a_wrong_method_is_a_client_error_naming_the_method_to_use() -> None:
    """GET on a POST endpoint: 405, typed as the client's error (not server_error), saying
    which method the path takes."""
    async def test(front: HttpFront) -> None:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{front.port}") as client:
            response = await client.get("/v1/chat/completions")
        assert response.status_code == 405
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["code"] == "method_not_allowed" and "takes POST" in error["message"]

    _serve(FakeRouter(), test)
