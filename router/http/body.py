"""Request bodies of the HTTP front, read and parsed as JSON without holding the event loop.

Parsing is what a body costs the router before any limit can look at it: json plus pydantic take
about 1.3 s for a 4 MiB body of 262,000 one-key chat messages, all of it holding the GIL (C and
Rust code never yield it to the event loop's thread, so a thread pool would not help). So a body
larger than `INLINE_BYTES` is parsed in a worker process (spawned: the router's gRPC threads
must never be forked), which also refuses, before anything comes back, a conversation of more
messages than the router takes and a body of more JSON values than any request it serves needs;
what comes back is bounded, so unpickling it and validating it with pydantic on the event loop
take a few milliseconds at most. A small body is parsed inline (well under a millisecond).

Parse workers run at the lowest CPU priority, so that hostile bodies get only the CPU serving
leaves (on a 2-core machine two busy parsers otherwise quadrupled a streaming client's p99 ITL),
and a body with more `"role"` keys than the router takes messages is refused as soon as they
have arrived, before it is parsed or even read whole (`count_roles`). Large bodies are read and
parsed a few at a time (`num_slots`); while one waits for a slot uvicorn stops reading its
socket past 64 KiB, so waiting bodies hold little memory, and past `max_waiting` waiting ones a
body is refused at once (429) instead of piling up.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from typing import NamedTuple

from starlette.requests import Request

log = logging.getLogger("kvferry.router")

INLINE_BYTES = 64 << 10  # bodies up to this are parsed on the event loop
NUM_SLOTS = 2  # large bodies read and parsed at once
MAX_WAITING = 32  # large bodies waiting for a slot; more are refused (429)


class BodyRefusal(NamedTuple):
    """A body refused before it became a request: its HTTP status, the parameter it concerns
    (None: the body as a whole) and why."""

    status: int
    param: str | None
    message: str


def _too_many_values(data: object, max_values: int) -> str | None:
    """The top-level key holding the most values when `data` holds more than `max_values`
    JSON values in all ("" when it is not an object), else None; stops as soon as it knows."""
    if not isinstance(data, dict):
        roots: list[tuple[str, object]] = [("", data)]
    else:
        roots = list(data.items())
    total = 0
    counts: dict[str, int] = {}
    for key, root in roots:
        stack = [root]
        count = 0
        while stack:
            value = stack.pop()
            count += 1
            if isinstance(value, dict):
                stack.extend(value.values())
            elif isinstance(value, list):
                stack.extend(value)
            if total + count > max_values:
                counts[key] = count
                return max(counts, key=counts.__getitem__)
        counts[key] = count
        total += count
    return None


def parse_json(raw: bytes, max_messages: int, max_values: int) -> object:
    """The body's JSON, or a BodyRefusal: not JSON, nested too deeply, more chat `messages`
    than `max_messages`, or more than `max_values` JSON values. Runs in a worker process for
    large bodies, so it imports nothing heavy."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        return BodyRefusal(400, None, f"the body is not valid JSON: {exc.msg}")
    except UnicodeDecodeError as exc:
        return BodyRefusal(400, None, f"the body is not valid JSON: {exc.reason}")
    except RecursionError:
        return BodyRefusal(400, None, "the body is not valid JSON: nested too deeply")
    messages = data.get("messages") if isinstance(data, dict) else None
    if isinstance(messages, list) and len(messages) > max_messages:
        return BodyRefusal(400, "messages", f"messages: {len(messages)} messages, more than "
                           f"the router's limit of {max_messages} (--max-chat-messages)")
    key = _too_many_values(data, max_values)
    if key is not None:
        where = f"{key}: " if key else ""
        return BodyRefusal(400, key or None, f"{where}the body holds more than {max_values} "
                           "JSON values, more than any request kvferry serves")
    return data


def count_roles(raw: bytes) -> int:
    """How many `"role"` keys a raw body holds: a message has one, and text inside a JSON
    string cannot spell it (its quotes are escaped), so past `max_messages` of them the body
    is refused before any parsing. A millisecond for 4 MiB."""
    return raw.count(b'"role"')


def _ready() -> bool:
    return True


def _lower_priority() -> None:
    """Parse workers run at the lowest CPU priority: a flood of large bodies then takes only
    CPU that serving (decode steps, the router's loop) leaves unused."""
    os.nice(19)


class BodyParser:
    """Reads and parses the JSON bodies of one HTTP front (see the module's docstring)."""

    def __init__(self, max_messages: int, max_values: int, num_slots: int = NUM_SLOTS,
                 max_waiting: int = MAX_WAITING, inline_bytes: int = INLINE_BYTES) -> None:
        self.max_messages = max_messages
        self.max_values = max_values
        self.inline_bytes = inline_bytes
        self.max_waiting = max_waiting
        self.num_waiting = 0
        self._slots = asyncio.Semaphore(num_slots)
        self._pool = ProcessPoolExecutor(max_workers=num_slots,
                                         mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_lower_priority)

    def start(self) -> None:
        """Starts the worker processes now rather than on the first large body."""
        for _ in range(self._pool._max_workers):  # type: ignore[attr-defined]
            self._pool.submit(_ready)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _receive(self, request: Request) -> bytes | BodyRefusal:
        """The whole body; or, as soon as more `"role"` keys have arrived than the router
        takes messages, a refusal: the rest of the body is never read by the front (the
        server discards it as it comes, the connection stays open for the answer)."""
        chunks: list[bytes] = []
        roles, tail = 0, b""
        async for chunk in request.stream():
            roles += count_roles(tail + chunk)  # a key split across chunks counted once
            if roles > self.max_messages:
                return BodyRefusal(400, "messages", f"messages: more than {self.max_messages} "
                                   "messages (\"role\" keys) in the body, the router's limit "
                                   "(--max-chat-messages)")
            tail = (tail + chunk)[-5:]
            chunks.append(chunk)
        return b"".join(chunks)

    async def read(self, request: Request) -> object:
        """The request's body as JSON (dicts, lists, ...), or a BodyRefusal."""
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) <= self.inline_bytes:
            return parse_json(await request.body(), self.max_messages, self.max_values)
        if self.num_waiting >= self.max_waiting:
            return BodyRefusal(429, None, f"the router is reading {self.max_waiting} large "
                               "request bodies already; retry later")
        self.num_waiting += 1
        is_waiting = True
        try:
            async with self._slots:
                self.num_waiting -= 1
                is_waiting = False
                raw = await self._receive(request)
                if isinstance(raw, BodyRefusal):
                    return raw
                if len(raw) <= self.inline_bytes:
                    return parse_json(raw, self.max_messages, self.max_values)
                return await asyncio.get_running_loop().run_in_executor(
                    self._pool, parse_json, raw, self.max_messages, self.max_values)
        finally:
            if is_waiting:  # cancelled (the client went away) while waiting for a slot
                self.num_waiting -= 1
