"""gRPC edge of the decode worker: DecodeService and KvTransferService."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from decode_worker.engine import DecodeEngine
from decode_worker.nixl_puller import NixlPuller, Pull, PullOffer
from decode_worker.sequence import DecodeEvent, ErrorEvent, FinishedEvent, TokensEvent
from kvferry import logs, trace
from kvferry.errors import InvalidArgument, KvferryError
from kvferry.rpc import chunk_codec, convert, grpc_util
from kvferry.rpc.worker_servicer import PrefillStreamServicer, WorkerServicer, first_token
from kvferry.transfer import wire
from kvferry.transfer.nixl_pages import PoolMemory
from kvferry.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("kvferry.decode")

def _merge(events: list[DecodeEvent]) -> list[worker_pb2.DecodeUpdate]:
    """Fold queued events into one update per request, in order of first occurrence."""
    updates: dict[str, worker_pb2.DecodeUpdate] = {}
    for event in events:
        update = updates.setdefault(event.request_id,
                                    worker_pb2.DecodeUpdate(request_id=event.request_id))
        if isinstance(event, TokensEvent):
            update.token_ids.extend(event.token_ids)
        elif isinstance(event, FinishedEvent):
            update.finished.reason = event.reason.value
            update.finished.first_decode_step_s = event.first_step_s
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
        )

    def _abort_quietly(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
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
                    if update.HasField("finished") or update.error_code:
                        started.discard(update.request_id)
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



def _announce(checksums: list[asyncio.Future[int]], message: worker_pb2.KvPullChecksum) -> None:
    """A group's checksum: for a group announced before it, once."""
    if not 0 <= message.group < len(checksums) or checksums[message.group].done():
        raise InvalidArgument(f"checksum for group {message.group}: no such group awaits one",
                              "checksum")
    checksums[message.group].set_result(message.crc32)


def _offer(begin: worker_pb2.KvPullBegin) -> PullOffer:
    return PullOffer(begin.request_id, convert.layout_from_proto(begin.layout),
                     begin.num_tokens, begin.agent_name, begin.agent_metadata,
                     PoolMemory(begin.pool_address, begin.pool_blocks, begin.memory_type,
                                begin.device_id), list(begin.block_table))


class KvTransferServicer(worker_pb2_grpc.KvTransferServiceServicer):
    def __init__(self, engine: DecodeEngine, puller: NixlPuller | None = None) -> None:
        self.engine = engine
        self.puller = puller  # --kv-transport nixl

    async def PullKv(self, request_iterator: AsyncIterator[worker_pb2.KvPullMessage],
                     context: grpc.aio.ServicerContext) -> worker_pb2.PushKvResponse:
        """A NIXL push (decode_worker/nixl_puller.py): `begin`, then groups to read, each
        read as soon as it is announced (the next READ overlaps the last one's check)."""
        pull: Pull | None = None
        groups: list[asyncio.Task[int]] = []
        checksums: list[asyncio.Future[int]] = []  # each group's, once its message came
        written = 0
        try:
            if self.puller is None:
                raise InvalidArgument("this worker does not run --kv-transport nixl",
                                      "kv_transport")
            async for message in request_iterator:
                if message.HasField("begin"):
                    if pull is not None:
                        raise InvalidArgument("one push has one begin", "begin")
                    logs.request_id.set(message.begin.request_id)
                    pull = await self.puller.begin(_offer(message.begin))
                elif pull is None:
                    raise InvalidArgument("a push starts with begin", "begin")
                elif message.HasField("checksum"):
                    _announce(checksums, message.checksum)
                else:
                    group = message.group
                    checksums.append(asyncio.get_running_loop().create_future())
                    groups.append(asyncio.ensure_future(self.puller.group(pull, wire.ChunkSpan(
                        group.layer_start, group.layer_end, group.block_start,
                        group.num_blocks), checksums[-1])))
                    for task in groups:  # a failed group ends the push at once
                        if task.done() and task.exception() is not None:
                            raise task.exception()  # type: ignore[misc]
            if pull is None:
                raise InvalidArgument("empty push", "request_id")
            if not all(crc.done() for crc in checksums):
                raise InvalidArgument("a group's checksum never came", "checksum")
            written = sum(await asyncio.gather(*groups))
            self.engine.receiver.finish_push(pull.request_id, pull.epoch)
        except asyncio.CancelledError:
            if pull is not None:
                self.engine.receiver.fail_push(pull.request_id, pull.epoch)
            raise
        except Exception as exc:
            if pull is not None:
                self.engine.receiver.fail_push(pull.request_id, pull.epoch)
            await grpc_util.abort_with(context, exc, pull.request_id if pull else "")
        finally:
            for task in groups:  # their READs keep their fences until they end
                task.cancel()
        return worker_pb2.PushKvResponse(bytes_written=written)

    async def PushKv(
        self, request_iterator: AsyncIterator[chunk_codec.ReceivedChunk | worker_pb2.KvChunk],
        context: grpc.aio.ServicerContext,
    ) -> worker_pb2.PushKvResponse:
        """Chunks come parsed by chunk_codec.decode (payload a view into the received bytes,
        see add_to_server), written into the reservation's blocks with one copy."""
        request_id = ""
        written = 0
        epoch: int | None = None  # this stream's push, once begun
        try:
            async for chunk in request_iterator:
                if request_id and chunk.request_id != request_id:
                    raise InvalidArgument("one push carries one request_id", "request_id")
                if not request_id:
                    logs.request_id.set(chunk.request_id)
                    request_id = chunk.request_id
                    epoch = self.engine.receiver.begin_push(request_id)
                span = wire.ChunkSpan(chunk.layer_start, chunk.layer_end, chunk.block_start,
                                      chunk.num_blocks)
                received_from = time.monotonic()
                written += self.engine.receiver.receive_chunk(
                    request_id, convert.layout_from_proto(chunk.layout), chunk.num_tokens,
                    span, chunk.data, chunk.crc32, epoch,
                )
                if tracer := trace.get():
                    tracer.event("kv", t0=received_from, t1=time.monotonic(), id=request_id,
                                 bytes=len(chunk.data))
            if not request_id:
                raise InvalidArgument("empty push", "request_id")
            self.engine.receiver.finish_push(request_id, epoch)
        except asyncio.CancelledError:
            if epoch is not None:
                self.engine.receiver.fail_push(request_id, epoch)
            raise
        except Exception as exc:
            if epoch is not None:
                self.engine.receiver.fail_push(request_id, epoch)
            await grpc_util.abort_with(context, exc, request_id)
        return worker_pb2.PushKvResponse(bytes_written=written)


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
        token, prefill_s, num_cached, by_tier = await self.engine.prefill_local(
            request.request_id, list(request.prompt_token_ids),
            convert.sampling_from_proto(request.sampling), request.num_generated)
        yield first_token(token, prefill_s, num_cached, by_tier)
        yield worker_pb2.PrefillResponse(done=worker_pb2.PrefillDone())  # nothing shipped



SERVICE_NAMES = ["kvferry.v1.DecodeService", "kvferry.v1.KvTransferService",
                 "kvferry.v1.PrefillService"]


def add_to_server(server: grpc.aio.Server, engine: DecodeEngine, role: str = "decode",
                  puller: NixlPuller | None = None) -> None:
    worker_pb2_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(engine, role), server)
    transfer = KvTransferServicer(engine, puller)
    push_kv = grpc.stream_unary_rpc_method_handler(
        transfer.PushKv, request_deserializer=chunk_codec.decode,
        response_serializer=worker_pb2.PushKvResponse.SerializeToString)
    pull_kv = grpc.stream_unary_rpc_method_handler(
        transfer.PullKv, request_deserializer=worker_pb2.KvPullMessage.FromString,
        response_serializer=worker_pb2.PushKvResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        chunk_codec.KV_TRANSFER_SERVICE, {"PushKv": push_kv, "PullKv": pull_kv}),))
    worker_pb2_grpc.add_PrefillServiceServicer_to_server(LocalPrefillServicer(engine, role),
                                                         server)
