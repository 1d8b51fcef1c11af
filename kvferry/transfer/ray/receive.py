"""The decode worker's end of a Ray K/V push (kvferry.transfer.ray.send).

Same checks and the same push epochs as a gRPC PushKv stream: `begin` opens a push and
supersedes an unfinished one for the same reservation, whose later chunks are refused. Errors
come back as acks (a gRPC status code number and message, as `grpc_util.describe` maps them)
instead of exceptions, so the sender handles them as it handles a gRPC status.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from kvferry.cache.layout import KvLayout
from kvferry.errors import InvalidArgument, KvferryError
from kvferry.rpc import grpc_util
from kvferry.transfer.ray.send import ChunkAck, PushBegun
from kvferry.transfer.sink import KvSink
from kvferry.transfer.wire import ChunkSpan

T = TypeVar("T")


def _refusal(exc: KvferryError) -> ChunkAck:
    code, message = grpc_util.describe(exc)
    return ChunkAck(0, code.value[0], message, exc.field or "")


class RayKvReceiver:
    """Wraps a decode engine's K/V sink; `receiver` None: this actor does not decode and
    refuses every push."""

    def __init__(self, receiver: KvSink | None) -> None:
        self._receiver = receiver

    def _call(self, action: Callable[[KvSink], T]) -> T:
        if self._receiver is None:
            raise InvalidArgument("this actor does not decode", "request_id")
        return action(self._receiver)

    def begin(self, request_id: str) -> PushBegun:
        try:
            return PushBegun(self._call(lambda r: r.begin_push(request_id)))
        except KvferryError as exc:
            return PushBegun(None, _refusal(exc))

    def push_chunk(self, request_id: str, layout: KvLayout, num_tokens: int, span: ChunkSpan,
                   data: bytes, crc32: int, epoch: int) -> ChunkAck:
        """Validate one chunk of push `epoch` against the reservation and write it."""
        try:
            return ChunkAck(self._call(lambda r: r.receive_chunk(
                request_id, layout, num_tokens, span, data, crc32, epoch)))
        except KvferryError as exc:
            return _refusal(exc)

    def finish(self, request_id: str, epoch: int) -> ChunkAck:
        try:
            self._call(lambda r: r.finish_push(request_id, epoch))
        except KvferryError as exc:
            return _refusal(exc)
        return ChunkAck(0)

    def fail(self, request_id: str, epoch: int) -> None:
        """Push `epoch` broke off: forget its pages, unless a newer push took over."""
        if self._receiver is not None:
            self._receiver.fail_push(request_id, epoch)
