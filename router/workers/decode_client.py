"""Client adapter for a worker's DecodeService: Reserve, Abort, GetStats and the DecodeStream.

One DecodeStream per decode worker is shared by every request the router sends there.
Requests start and abort through commands on the stream; the worker answers with one batch
per decode step holding every request's new tokens. `DecodeClient` demultiplexes those batches
into one queue per request. If the stream breaks, every request on it gets the error, and the
next request opens a new stream.

Protobuf and gRPC stay here: callers pass and get the records of `router.records`, and a
failed call raises the `kvferry.errors` class of its status (`grpc_util.from_rpc`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from kvferry import trace
from kvferry.errors import DeadlineExceeded, Remote, Unavailable
from kvferry.model.sampling import FinishReason
from kvferry.rpc import convert, grpc_util
from kvferry.v1 import generation_pb2, worker_pb2, worker_pb2_grpc
from router.records import DecodeFinished, DecodeStart, DecodeUpdate
from router.workers.client import WorkerClient, remaining_s


class StreamBroken(Unavailable):
    """The decode worker's stream broke: the requests on it must move elsewhere."""


# What a request's queue yields: its updates, or the exception that broke the stream.
MuxItem = DecodeUpdate | Exception


def _update_from_proto(msg: worker_pb2.DecodeUpdate) -> DecodeUpdate:
    finished = None
    if msg.HasField("finished"):
        finished = DecodeFinished(FinishReason(msg.finished.reason),
                                  msg.finished.first_decode_step_s,
                                  msg.finished.num_draft_tokens,
                                  msg.finished.num_accepted_tokens)
    return DecodeUpdate(msg.request_id, list(msg.token_ids), finished,
                        msg.error_code or None, msg.error_message, time.monotonic(),
                        msg.sample_index, convert.logprobs_from_proto(msg.logprobs))


class DecodeCall:
    """One request's decode on its worker's shared stream, as `DecodeClient.start` began
    it: its updates in order, and the commands that may follow the start on the same
    stream (so that none can overtake it)."""

    def __init__(self, client: DecodeClient, request_id: str, updates: asyncio.Queue[MuxItem],
                 deadline: float | None) -> None:
        self.client, self.request_id = client, request_id
        self._updates = updates
        self.deadline = deadline

    async def next(self) -> DecodeUpdate:
        """The next update; the stream's failure, a worker's error, or no update before the
        deadline, raise."""
        updates = self._updates
        if not updates.empty():  # the common case under load: no timer, no task
            item = updates.get_nowait()
        else:
            try:
                async with asyncio.timeout(remaining_s(self.deadline)):
                    item = await updates.get()
            except TimeoutError:
                raise DeadlineExceeded("deadline exceeded while decoding") from None
        if isinstance(item, Exception):
            raise item
        if item.error_code is not None:
            raise Remote(f"decode worker: {item.error_message}", item.error_code)
        return item

    def abort(self) -> None:
        """Stop the whole request (every sample) on the worker."""
        self.client.abort_on_stream(self.request_id)

    def abort_sample(self, sample_index: int) -> None:
        """Stop one sample on the worker; the others go on."""
        self.client.abort_sample_on_stream(self.request_id, sample_index)

    def close(self) -> None:
        """No more updates are read: the client drops the request's queue."""
        self.client.forget(self.request_id)


class DecodeClient(WorkerClient):
    def __init__(self, channel: grpc.aio.Channel) -> None:
        super().__init__(worker_pb2_grpc.DecodeServiceStub(channel))
        self._stub: worker_pb2_grpc.DecodeServiceStub
        self._queues: dict[str, asyncio.Queue[MuxItem]] = {}
        self._commands: asyncio.Queue[worker_pb2.DecodeCommand | None] | None = None
        self._reader: asyncio.Task[None] | None = None

    # ---- unary calls ---------------------------------------------------------------------
    async def reserve(self, request_id: str, prompt_token_ids: list[int], max_tokens: int,
                      lease_s: float, timeout_s: float | None, cache_salt: str = "",
                      num_samples: int = 1, shares_cache: bool = True) -> int:
        """Reserve blocks for the prompt (and its samples); returns how many leading prompt
        blocks the worker's prefix cache shared into the reservation (none unless
        `shares_cache`)."""
        request = worker_pb2.ReserveRequest(
            request_id=request_id, num_prompt_tokens=len(prompt_token_ids),
            max_tokens=max_tokens, lease_s=lease_s, prompt_token_ids=prompt_token_ids,
            cache_salt=cache_salt, num_samples=num_samples,
            computes_whole_prompt=not shares_cache)
        with grpc_util.translated():
            response = await self._stub.Reserve(request, timeout=timeout_s)
        return response.num_cached_blocks

    async def renew_leases(self, request_ids: list[str], lease_s: float,
                           timeout_s: float) -> list[str]:
        """Restart these reservations' leases; returns the ids the worker no longer holds."""
        with grpc_util.translated():
            response = await self._stub.RenewLeases(worker_pb2.RenewLeasesRequest(
                request_ids=request_ids, lease_s=lease_s), timeout=timeout_s)
        return list(response.unknown_ids)

    # ---- the shared DecodeStream ---------------------------------------------------------
    def _ensure_stream(self) -> asyncio.Queue[worker_pb2.DecodeCommand | None]:
        if self._commands is None or self._reader is None or self._reader.done():
            self._commands = asyncio.Queue()
            call = self._stub.DecodeStream(_iterate(self._commands))
            self._reader = asyncio.create_task(self._read(call, self._commands))
        return self._commands

    async def _read(self, call: grpc.aio.StreamStreamCall,
                    commands: asyncio.Queue[worker_pb2.DecodeCommand | None]) -> None:
        error: Exception = StreamBroken("decode stream closed by the worker")
        try:
            await self._relay(call)
        except grpc.aio.AioRpcError as exc:
            error = StreamBroken(f"decode stream broke: {exc.code().name}: {exc.details()}")
        finally:
            # The commands' iterator ends with the stream: gRPC does not cancel the task
            # reading it once the worker ended the call, and that task, left waiting, was
            # destroyed pending (asyncio's "Task was destroyed" in the router's log).
            commands.put_nowait(None)
        for queue in self._queues.values():
            queue.put_nowait(error)

    async def _relay(self, call: grpc.aio.StreamStreamCall) -> None:
        """Each update the stream brings to its request's queue (none: forgotten)."""
        async for batch in call:
            for msg in batch.updates:
                queue = self._queues.get(msg.request_id)
                if queue is None:
                    continue
                try:
                    queue.put_nowait(_update_from_proto(msg))
                except ValueError as exc:  # an unknown finish reason fails its request only
                    queue.put_nowait(exc)

    def start(self, start: DecodeStart, deadline: float | None) -> DecodeCall:
        """Begin decoding a reserved request; its updates arrive through the returned call,
        until the monotonic `deadline` (None: no limit)."""
        commands = self._ensure_stream()
        queue: asyncio.Queue[MuxItem] = asyncio.Queue()
        self._queues[start.request_id] = queue
        commands.put_nowait(worker_pb2.DecodeCommand(start=worker_pb2.DecodeRequest(
            request_id=start.request_id, first_token_id=start.first_token_id,
            sampling=convert.sampling_to_proto(start.sampling),
            max_new_tokens=start.max_new_tokens, stop_token_ids=start.stop_token_ids,
            num_generated=start.num_generated,
            sample_first_token_ids=start.sample_first_token_ids,
        )))
        if tracer := trace.get():
            tracer.event("start", t=time.monotonic(), down=start.request_id)
        return DecodeCall(self, start.request_id, queue, deadline)

    def abort_on_stream(self, request_id: str) -> None:
        """Abort on the DecodeStream: it cannot overtake the start sent before it."""
        if self._commands is not None:
            self._commands.put_nowait(worker_pb2.DecodeCommand(
                abort=generation_pb2.AbortRequest(request_id=request_id)))

    def abort_sample_on_stream(self, request_id: str, sample_index: int) -> None:
        """Abort one sample on the DecodeStream (after the start it answers)."""
        if self._commands is not None:
            self._commands.put_nowait(worker_pb2.DecodeCommand(
                abort_sample=worker_pb2.AbortSample(request_id=request_id,
                                                    sample_index=sample_index)))

    def forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)


async def _iterate(commands: asyncio.Queue[worker_pb2.DecodeCommand | None]
                   ) -> AsyncIterator[worker_pb2.DecodeCommand]:
    """The stream's commands, until None (the stream ended)."""
    while (command := await commands.get()) is not None:
        yield command
