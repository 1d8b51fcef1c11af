"""A scripted OpenAI-compatible server: the same stream as conftest's gRPC script (chunks at
+40, +90, +120 (2 tokens), +190 ms; usage: 5 completion tokens, half the prompt cached), as
server-sent events. Served for real (Starlette under uvicorn, on a free port; on real time or
on a LockstepClock) or as a `Post` through httpx.MockTransport on a virtual clock.

The first prompt token id (completions) or word (chat) picks a failure mode (MODES)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from deploy.loadgen.openai_client import Post
from deploy.loadgen.openai_stream import Answer, ConnectionLost
from tests.deploy.loadgen.conftest import FAIL_TOKEN, SCRIPT, LockstepClock, VirtualClock
from tests.waiting import until_sync

MODEL = "fake-model"
TEXTS = (" w1", "", " w2 w3", " w4")  # one per scripted chunk; "" is a token with no text yet
# First token id (completions) or word (chat) -> what the server does.
MODES = {FAIL_TOKEN: "400", 999_998: "503", 999_997: "drop", 999_996: "no-done",
         999_995: "stream-error", 999_994: "no-usage"}


def mode_of(body: dict[str, Any]) -> str:
    if "messages" in body:
        words = str(body["messages"][-1]["content"]).split()
        first = words[0] if words else ""
        return next((m for m in MODES.values() if first == m), "ok")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        return MODES.get(int(prompt[0]), "ok")
    return "ok"


CHAT_TEMPLATE_TOKENS = 4  # what a chat template adds around a message, as a server counts


def _prompt_tokens(body: dict[str, Any]) -> int:
    if "messages" in body:
        return len(str(body["messages"][-1]["content"]).split()) + CHAT_TEMPLATE_TOKENS
    prompt = body["prompt"]
    return len(prompt) if isinstance(prompt, list) else len(prompt.split())


def _chunk(body: dict[str, Any], text: str | None, finish: str | None = None,
           role: bool = False) -> dict[str, Any]:
    if "messages" in body:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [choice]}
    choice = {"index": 0, "text": text or "", "finish_reason": finish}
    return {"id": "cmpl-1", "object": "text_completion", "choices": [choice]}


def events(body: dict[str, Any]) -> Iterator[tuple[float, bytes | None]]:
    """(delay before, SSE bytes) of the scripted stream; None: drop the connection."""
    mode = mode_of(body)
    is_chat = "messages" in body
    if is_chat:  # the role announcement comes at once: it is not a token
        yield 0.0, _sse(_chunk(body, None, role=True))
    for i, (step, text) in enumerate(zip(SCRIPT, TEXTS)):
        if mode == "drop" and i == 2:
            yield 0.0, None
            return
        if mode == "stream-error" and i == 2:
            yield 0.0, _sse({"error": {"message": "scripted stream error", "code": 500}})
            return
        yield step.delay_s, _sse(_chunk(body, text))
    yield 0.0, _sse(_chunk(body, None if is_chat else "", finish="length"))
    if mode != "no-usage":
        prompt = _prompt_tokens(body)
        usage = {"prompt_tokens": prompt, "completion_tokens": sum(s.num_tokens for s in SCRIPT),
                 "total_tokens": prompt + 5,
                 "prompt_tokens_details": {"cached_tokens": prompt // 2}}
        yield 0.0, _sse({"id": "x", "choices": [], "usage": usage})
    if mode != "no-done":
        yield 0.0, b"data: [DONE]\n\n"


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def refusal(body: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
    """The scripted HTTP error, if this request's mode is one."""
    mode = mode_of(body)
    if mode == "400":
        return 400, {"error": {"message": "scripted refusal: max_tokens is too large",
                               "type": "invalid_request_error", "param": "max_tokens"}}
    if mode == "503":
        return 503, {"error": {"message": "overloaded", "type": "server_error"}}
    return None


MODELS = {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "test"}]}


@dataclass
class FakeOpenAI:
    """What the server was sent, and where it listens."""

    base_url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)


def make_app(record: FakeOpenAI, clock: LockstepClock | None = None) -> Starlette:
    async def generate(request: Request) -> Response:
        body = await request.json()
        record.bodies.append(body)
        record.headers.append(dict(request.headers))
        refused = refusal(body)
        if refused is not None:
            return JSONResponse(refused[1], status_code=refused[0])

        async def stream() -> AsyncIterator[bytes]:
            for delay_s, data in events(body):
                if clock is None:
                    await asyncio.sleep(delay_s)  # paces: the scripted gaps, on real time
                elif delay_s:  # a scripted chunk (nothing else waits)
                    await asyncio.to_thread(clock.advance, delay_s)
                if data is None:
                    raise ConnectionAbortedError("scripted drop")
                yield data

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def models(request: Request) -> Response:
        return JSONResponse(MODELS)

    return Starlette(routes=[Route("/v1/chat/completions", generate, methods=["POST"]),
                             Route("/v1/completions", generate, methods=["POST"]),
                             Route("/v1/models", models)])


@dataclass
class ServedFake:
    record: FakeOpenAI
    server: uvicorn.Server
    thread: threading.Thread


def serve(clock: LockstepClock | None = None) -> ServedFake:
    """Start the fake under uvicorn on a free port (stop with stop())."""
    record = FakeOpenAI()
    config = uvicorn.Config(make_app(record, clock), host="127.0.0.1", port=0,
                            log_level="critical", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    until_sync(lambda: server.started or not thread.is_alive(), "the fake OpenAI server started")
    if not server.started:
        raise RuntimeError("the fake OpenAI server stopped while starting")
    port = server.servers[0].sockets[0].getsockname()[1]
    record.base_url = f"http://127.0.0.1:{port}/v1"
    return ServedFake(record, server, thread)


def stop(served: ServedFake) -> None:
    served.server.should_exit = True
    served.thread.join(10)


def virtual_post(clock: VirtualClock, record: FakeOpenAI) -> Post:
    """The same server without sockets, as a `Post`: each scripted delay advances the virtual
    clock; httpx's MockTransport plays the HTTP exchange."""

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        record.bodies.append(body)
        refused = refusal(body)
        if refused is not None:
            return httpx.Response(refused[0], json=refused[1])

        async def stream() -> AsyncIterator[bytes]:
            for delay_s, data in events(body):
                clock.now += delay_s
                if data is None:
                    raise httpx.RemoteProtocolError("scripted drop")
                yield data

        return httpx.Response(200, content=stream(),
                              headers={"content-type": "text/event-stream"})

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))

    async def lines(response: httpx.Response) -> AsyncIterator[str]:
        try:
            async for line in response.aiter_lines():
                yield line
        except httpx.TransportError as exc:
            raise ConnectionLost(str(exc)) from exc

    @asynccontextmanager
    async def post(url: str, body: dict[str, Any], headers: dict[str, str]
                   ) -> AsyncIterator[Answer]:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            yield Answer(response.status_code, lines(response), response.aread)

    return post
