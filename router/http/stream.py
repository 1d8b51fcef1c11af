"""How one request's engine events become an HTTP answer: a whole JSON body (`collect`) or
server-sent events (`sse`, sent by `EventStream`, which closes the request however the
response ends), and the wait for the first event that a client leaving cuts short
(`until_disconnect`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvferry.errors import Internal
from router.events import ChunkEvent, DoneEvent
from router.http.errors import failure
from router.http.reply import SSE_DONE, ChoiceSoFar, Reply
from router.http.schema import OpenAIRequest
from router.stream_clock import StreamClock

log = logging.getLogger("kvferry.router")
T = TypeVar("T")
Event = ChunkEvent | DoneEvent


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; cancelled (raising ClientGone) when the client disconnects first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait((task,))
    if task.cancelled():
        raise ClientGone
    return task.result()


class EventStream(StreamingResponse):
    """Server-sent events; `on_close` runs however the response ends (finished, client gone,
    or never started), so the request's generator is always closed."""

    def __init__(self, events: AsyncIterator[str],
                 on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


async def first_event(events: AsyncIterator[str | Event]) -> Event:
    """Past the request id, the first event."""
    await anext(events)
    return await anext(events)  # type: ignore[return-value]  # ids come first only


async def collect(events: AsyncIterator[str | Event], reply: Reply, clock: StreamClock,
                  num_samples: int = 1) -> str:
    """A whole answer (every sample's choice) as one JSON body."""
    await anext(events)
    choices = [ChoiceSoFar() for _ in range(num_samples)]
    dones: list[DoneEvent] = []
    async for event in events:
        if isinstance(event, ChunkEvent):
            clock.chunk(len(event.token_ids))
            choices[event.sample_index].add(event)
        elif isinstance(event, DoneEvent):
            clock.done(event)
            _log_done(reply.request_id, event)
            dones.append(event)
            if len(dones) == num_samples:
                return reply.body(choices, dones)
    raise Internal("the request ended without finishing")


async def sse(events: AsyncIterator[str | Event], first: Event, reply: Reply,
              clock: StreamClock, body: OpenAIRequest, num_choices: int) -> AsyncIterator[str]:
    """A whole answer as server-sent events, from its first event on: each choice's role
    (chat), then the choices' chunks as they come, each choice closing with its
    finish_reason, the usage once at the end."""
    if reply.is_chat:
        for index in range(num_choices):
            yield reply.role_event(index)
    event, dones = first, []
    held = [ChoiceSoFar() for _ in range(num_choices)]  # with tools: read at the end
    try:
        while True:
            if isinstance(event, ChunkEvent):
                clock.chunk(len(event.token_ids))
                if reply.tools is not None:
                    held[event.sample_index].add(event)
                elif event.text or event.token_ids:  # a step whose text is held back: ""
                    yield reply.chunk_event(event)
            else:  # one DoneEvent per sample (Router.generate)
                clock.done(event)
                _log_done(reply.request_id, event)
                yield (reply.chunk_event(None, event.reason, event.sample_index)
                       if reply.tools is None else
                       reply.tool_event(held[event.sample_index], event.reason,
                                        event.sample_index))
                dones.append(event)
                if len(dones) == num_choices:
                    break
            event = await anext(events)
    except Exception as exc:
        answer = failure(exc, reply.request_id, body)
        clock.failed(answer.code_name)
        yield f"data: {answer.body}\n\n{SSE_DONE}"
        return
    if reply.include_usage:
        yield reply.usage_event(dones)
    yield SSE_DONE


def _log_done(request_id: str, event: DoneEvent) -> None:
    log.info("request %s done (%s, http): %d prompt + %d generated tokens, TTFT %.1f ms, %d "
             "migrations", request_id, event.reason.name.lower(), event.prompt_tokens,
             event.completion_tokens, event.timing.time_to_first_token_s * 1e3,
             event.timing.num_migrations)
