"""gRPC edge of the decode worker: DecodeService, and PrefillService for prompts prefilled
here. The K/V transports' receiving ends live with their senders in `kvferry/transfer/`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from decode_worker.engine import DecodeEngine
from decode_worker.sequence import DecodeEvent, ErrorEvent, FinishedEvent, TokensEvent
from kvferry import logs, trace
from kvferry.errors import InvalidArgument, KvferryError
from kvferry.rpc import convert, grpc_util
from kvferry.rpc.worker_servicer import PrefillStreamServicer, WorkerServicer, first_token
from kvferry.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("kvferry.decode")

def _merge(events: list[DecodeEvent]) -> list[worker_pb2.DecodeUpdate]:
    """Fold queued events into one update per request and sample, in order of first
    occurrence (an error is the request's, sample 0's update)."""
    updates: dict[tuple[str, int], worker_pb2.DecodeUpdate] = {}
    for event in events:
        index = getattr(event, "sample_index", 0)
        update = updates.setdefault((event.request_id, index), worker_pb2.DecodeUpdate(
            request_id=event.request_id, sample_index=index))
        if isinstance(event, TokensEvent):
            update.token_ids.extend(event.token_ids)
            update.logprobs.extend(convert.logprobs_to_proto(event.logprobs))
        elif isinstance(event, FinishedEvent):
            update.finished.reason = event.reason.value
            update.finished.first_decode_step_s = event.first_step_s
            update.finished.num_draft_tokens = event.num_draft_tokens
            update.finished.num_accepted_tokens = event.num_accepted_tokens
        else:
            error = event.error
            if isinstance(error, KvferryError):
                code, message = grpc_util.describe(error)
            else:  # exception text describes internals: it stays in this worker's log
                log.error("request %s: %r", event.request_id, error)
                code, message = grpc.StatusCode.INTERNAL, "internal error on the decode worker"
            update.error_code = code.value[0]
            update.error_message = message
    return list(updates.values())


def _drain(first: DecodeEvent, events: asyncio.Queue[DecodeEvent]) -> list[DecodeEvent]:
    """The event just taken plus all that queued up behind it."""
    batch = [first]
    while not events.empty():
        batch.append(events.get_nowait())
    return batch


class DecodeServicer(WorkerServicer[DecodeEngine], worker_pb2_grpc.DecodeServiceServicer):
    def __init__(self, engine: DecodeEngine, role: str = "decode") -> None:
        super().__init__(engine, role, engine.layout)

    async def Reserve(self, request: worker_pb2.ReserveRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.ReserveResponse:
        logs.request_id.set(request.request_id)
        try:
            granted = await self.engine.reserve(
                request.request_id, request.num_prompt_tokens, request.max_tokens,
                request.lease_s, list(request.prompt_token_ids), request.cache_salt,
                max(request.num_samples, 1), not request.computes_whole_prompt,
            )
        except Exception as exc:
            await grpc_util.abort_with(context, exc, request.request_id)
        return worker_pb2.ReserveResponse(num_blocks=granted.num_blocks,
                                          num_cached_blocks=granted.num_cached_blocks)

    async def RenewLeases(self, request: worker_pb2.RenewLeasesRequest,
                          context: grpc.aio.ServicerContext) -> worker_pb2.RenewLeasesResponse:
        try:
            unknown = self.engine.renew_leases(list(request.request_ids), request.lease_s)
        except Exception as exc:
            await grpc_util.abort_with(context, exc, "")
        return worker_pb2.RenewLeasesResponse(unknown_ids=unknown)

    def _attach(self, request: worker_pb2.DecodeRequest,
                events: asyncio.Queue[DecodeEvent] | None = None) -> asyncio.Queue[DecodeEvent]:
        return self.engine.attach(
            request.request_id, request.first_token_id,
            convert.sampling_from_proto(request.sampling), request.max_new_tokens,
            list(request.stop_token_ids), events, request.num_generated,
            list(request.sample_first_token_ids),
        )

    def _abort_quietly(self, request_id: str, sample_index: int | None = None) -> None:
        try:
            self.engine.abort(request_id, sample_index)
        except KvferryError:
            pass  # finished in the meantime: its blocks are already back

    async def DecodeStream(self, request_iterator: AsyncIterator[worker_pb2.DecodeCommand],
                           context: grpc.aio.ServicerContext
                           ) -> AsyncIterator[worker_pb2.DecodeBatch]:
        events: asyncio.Queue[DecodeEvent] = asyncio.Queue()
        started: set[str] = set()

        async def read_commands() -> None:
            async for command in request_iterator:
                if command.HasField("start"):
                    request_id = command.start.request_id
                    try:
                        self._attach(command.start, events)
                        started.add(request_id)
                        if tracer := trace.get():
                            tracer.event("attach", t=time.monotonic(), id=request_id)
                    except Exception as exc:  # reported on the stream, per request
                        events.put_nowait(ErrorEvent(request_id, exc))
                elif command.HasField("abort_sample"):
                    self._abort_quietly(command.abort_sample.request_id,
                                        command.abort_sample.sample_index)
                else:
                    self._abort_quietly(command.abort.request_id)

        reader = asyncio.create_task(read_commands())
        try:
            while True:
                getter = asyncio.ensure_future(events.get())
                done, _ = await asyncio.wait({getter, reader},
                                             return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:  # the router closed its side
                    getter.cancel()
                    reader.result()  # surface a broken command stream
                    return
                updates = _merge(_drain(getter.result(), events))
                for update in updates:
                    if update.error_code or not self.engine.holds(update.request_id):
                        started.discard(update.request_id)  # every sample of it ended
                written_from = time.monotonic()
                yield worker_pb2.DecodeBatch(updates=updates)
                if tracer := trace.get():
                    tracer.event("write", t0=written_from, t1=time.monotonic(),
                                 ids=[u.request_id for u in updates],
                                 n=[len(u.token_ids) for u in updates])
        finally:
            reader.cancel()
            for request_id in started:
                self._abort_quietly(request_id)



class LocalPrefillServicer(PrefillStreamServicer[DecodeEngine],
                           worker_pb2_grpc.PrefillServiceServicer):
    """PrefillService of a decode (or colocated) worker: prompts are prefilled into this
    worker's own reservations, interleaved with decode steps in one loop; nothing is shipped.
    Colocated workers get every prompt this way; decode workers get the short ones
    (conditional disaggregation)."""

    def __init__(self, engine: DecodeEngine, role: str) -> None:
        super().__init__(engine, role, engine.layout)

    async def _responses(self, request: worker_pb2.PrefillRequest,
                         context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[worker_pb2.PrefillResponse]:
        if not request.is_local_decode:
            raise InvalidArgument("a decode worker prefills only its own reservations",
                                  "is_local_decode")
        done = await self.engine.prefill_local(
            request.request_id, list(request.prompt_token_ids),
            convert.sampling_from_proto(request.sampling), request.num_generated)
        yield first_token(*done)
        yield worker_pb2.PrefillResponse(done=worker_pb2.PrefillDone())  # nothing shipped



SERVICE_NAMES = ["kvferry.v1.DecodeService", "kvferry.v1.KvTransferService",
                 "kvferry.v1.PrefillService"]


def add_to_server(server: grpc.aio.Server, engine: DecodeEngine, role: str = "decode") -> None:
    """DecodeService and PrefillService; the K/V transports' ends (KvTransferService) are
    added by `kvferry.transfer.transport.add_receivers`."""
    worker_pb2_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(engine, role), server)
    worker_pb2_grpc.add_PrefillServiceServicer_to_server(LocalPrefillServicer(engine, role),
                                                         server)
