"""The HTTP front's connections, bounded: uvicorn's httptools protocol with a cap on the bytes
of a request head, a deadline for receiving it, an idle bound on a body being received, and a
cap on open connections.

httptools has no header-size limit of its own (it accumulates an unterminated header in
memory), so the head is fed to the parser no further than the cap: past it the connection
gets 431 and is closed, having cost the router at most the cap. A connection must complete
each request head within the timeout of its first byte (of the connection, for its first
request), and a body must keep arriving (no gap as long as the timeout); otherwise it is
closed. One timer per connection, armed only while a request is being received: a streaming
response pays nothing per chunk. Past the connection cap a new connection is closed at once,
before it is read (uvicorn's `limit_concurrency` would still accept it and answer 503).
Idle keep-alive connections are closed by uvicorn after `timeout_keep_alive`.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from asyncio import TimerHandle
from dataclasses import dataclass
from enum import Enum

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("kvferry.router")

FD_RESERVE = 256  # file descriptors kept for everything but HTTP connections (gRPC, logs)
_HEAD_TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; "
                   b"charset=utf-8\r\ncontent-length: 32\r\nconnection: close\r\n\r\n"
                   b"the request head is too large.\r\n")


@dataclass(frozen=True)
class ConnectionLimits:
    """What one HTTP connection, and all of them together, may hold (PublicLimits' http_*)."""

    max_head_bytes: int  # request line + headers, as received
    head_timeout_s: float  # to receive a request head; also the longest gap inside a body
    max_connections: int  # open at once; more are closed as soon as they are accepted

    def __post_init__(self) -> None:
        if self.max_head_bytes < 1 or self.max_connections < 1 or not self.head_timeout_s > 0:
            raise ValueError(f"ConnectionLimits: every limit must be positive, got {self}")


def fd_bounded_connections(requested: int) -> int:
    """`requested`, or fewer where the process's file-descriptor limit could not hold them."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return requested
    room = max(1, soft - FD_RESERVE)
    if requested > room:
        log.warning("HTTP connections capped at %d, not %d: the file-descriptor limit is %d",
                    room, requested, soft)
    return min(requested, room)


class _Phase(Enum):
    HEAD = 1  # waiting for (or receiving) a request head: bytes counted, deadline armed
    BODY = 2  # receiving a body: idle bound armed
    IDLE = 3  # a request is being answered, or the connection waits between requests


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, holding every connection to the class's `limits`
    (`bounded_protocol` makes one class per front)."""

    limits: ConnectionLimits

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._phase = _Phase.HEAD
        self._head_bytes = 0
        self._timer: TimerHandle | None = None
        self._last_data_s = 0.0
        if len(self.connections) >= self.limits.max_connections:
            self.transport = transport  # connection_lost closes it
            transport.abort()
            return
        super().connection_made(transport)
        self._arm(self.limits.head_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._phase is _Phase.BODY:
            self._last_data_s = self.loop.time()
        if self._phase is not _Phase.HEAD:
            super().data_received(data)
            return
        room = self.limits.max_head_bytes - self._head_bytes
        if len(data) <= room:
            self._head_bytes += len(data)
            super().data_received(data)
            return
        # Feed no more than the cap; what follows a completed head goes on normally.
        self._head_bytes += room
        super().data_received(data[:room])
        if self.transport.is_closing():
            return
        if self._phase is _Phase.HEAD:
            self._refuse_head()
            return
        self.data_received(data[room:])

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._timer is None:  # a later request on a kept-alive connection
            self._arm(self.limits.head_timeout_s)

    def on_headers_complete(self) -> None:
        self._phase = _Phase.BODY
        self._last_data_s = self.loop.time()
        self._disarm()
        self._arm(self.limits.head_timeout_s)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()
        self._phase = _Phase.HEAD  # the next bytes are the next request's head
        self._head_bytes = 0

    def _arm(self, delay_s: float) -> None:
        self._timer = self.loop.call_later(delay_s, self._on_timer)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if self._phase is _Phase.BODY:
            idle_s = self.loop.time() - self._last_data_s
            if self.flow.read_paused or idle_s < self.limits.head_timeout_s:
                # The app has not taken what came (paused), or bytes still arrive.
                self._arm(max(self.limits.head_timeout_s - idle_s, 0.05))
                return
        self.transport.close()

    def _refuse_head(self) -> None:
        is_answering = self.cycle is not None and not self.cycle.response_complete
        if not is_answering:  # between responses: say why before closing
            self.transport.write(_HEAD_TOO_LARGE)
        self.transport.close()


def bounded_protocol(limits: ConnectionLimits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol class, holding every connection to `limits`."""
    return type("BoundedHttpToolsProtocol", (BoundedHttpToolsProtocol,), {"limits": limits})
