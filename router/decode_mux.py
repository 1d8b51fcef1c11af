"""One DecodeStream per decode worker, shared by every request the router sends there.

Requests start and abort through commands on the stream; the worker answers with one batch
per decode step holding every request's new tokens. This demultiplexes those batches into one
queue per request. If the stream breaks, every request on it gets the error, and the next
request opens a new stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from kvferry.errors import Unavailable
from kvferry.v1 import generation_pb2, worker_pb2, worker_pb2_grpc


class StreamBroken(Unavailable):
    """The decode worker's stream broke: the requests on it must move elsewhere."""


# What a request's queue yields: its updates, or the exception that broke the stream.
MuxItem = worker_pb2.DecodeUpdate | Exception


class DecodeMux:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = worker_pb2_grpc.DecodeServiceStub(channel)
        self._queues: dict[str, asyncio.Queue[MuxItem]] = {}
        self._commands: asyncio.Queue[worker_pb2.DecodeCommand] | None = None
        self._reader: asyncio.Task[None] | None = None

    def _ensure_stream(self) -> asyncio.Queue[worker_pb2.DecodeCommand]:
        if self._commands is None or self._reader is None or self._reader.done():
            self._commands = asyncio.Queue()
            call = self._stub.DecodeStream(_iterate(self._commands))
            self._reader = asyncio.create_task(self._read(call))
        return self._commands

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        error: Exception = StreamBroken("decode stream closed by the worker")
        try:
            async for batch in call:
                for update in batch.updates:
                    queue = self._queues.get(update.request_id)
                    if queue is not None:
                        queue.put_nowait(update)
        except grpc.aio.AioRpcError as exc:
            error = StreamBroken(f"decode stream broke: {exc.code().name}: {exc.details()}")
        for queue in self._queues.values():
            queue.put_nowait(error)

    def start(self, request: worker_pb2.DecodeRequest) -> asyncio.Queue[MuxItem]:
        """Begin decoding `request`; its updates arrive on the returned queue."""
        commands = self._ensure_stream()
        queue: asyncio.Queue[MuxItem] = asyncio.Queue()
        self._queues[request.request_id] = queue
        commands.put_nowait(worker_pb2.DecodeCommand(start=request))
        return queue

    def abort(self, request_id: str) -> None:
        if self._commands is not None:
            self._commands.put_nowait(worker_pb2.DecodeCommand(
                abort=generation_pb2.AbortRequest(request_id=request_id)))

    def forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)


async def _iterate(commands: asyncio.Queue[worker_pb2.DecodeCommand]
                   ) -> AsyncIterator[worker_pb2.DecodeCommand]:
    while True:
        yield await commands.get()
