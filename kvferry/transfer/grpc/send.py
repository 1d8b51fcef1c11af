"""`GrpcKvSender`: K/V pages as a client-streaming push of ~1 MiB chunks.

Chunks (kvferry.transfer.wire, serialized by kvferry.rpc.chunk_codec) go to the decode
worker's KvTransferService; decode_worker/server.py receives them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc

from kvferry.cache.layout import KvLayout
from kvferry.cache.pool import KvPool
from kvferry.errors import Remote
from kvferry.faults import Faults
from kvferry.rpc import convert, grpc_util, security
from kvferry.transfer import wire
from kvferry.transfer.grpc import chunk_codec
from kvferry.transfer.sender import DraftPush, LayersReady, PushResult
from kvferry.v1 import worker_pb2

if TYPE_CHECKING:
    from kvferry.transfer.transport import SenderOptions

log = logging.getLogger("kvferry.transport")



def _is_corruption(exc: grpc.aio.AioRpcError) -> bool:
    return exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "crc32" in (exc.details() or "")


# grpc.aio replaces the status a server ended a client-streaming call with by this one when
# a write the client had in flight then fails (grpc/grpc#36066): a push the decode worker
# refused after its first chunk (ALREADY_EXISTS, a checksum mismatch) can surface as this
# INTERNAL, about once in 300 pushes here. The real answer is lost, so the push is sent
# again: the receiver has forgotten the failed one, and answers the resend the same way.
LOST_STATUS_DETAILS = "Internal error from Core"
MAX_LOST_STATUS_RESENDS = 3


def _is_lost_status(exc: grpc.aio.AioRpcError) -> bool:
    return exc.code() == grpc.StatusCode.INTERNAL and exc.details() == LOST_STATUS_DETAILS


class Progress:
    """How far a push got: bytes sent, and when its first chunk went out (its layers ready)."""

    def __init__(self) -> None:
        self.sent = 0
        self.started: list[float] = []

    def start(self) -> None:
        if not self.started:
            self.started.append(time.perf_counter())


def _already_there(request_id: str, started: list[float]) -> PushResult:
    """The reservation holds this prompt's complete K/V already: an earlier push (from a
    prefill worker lost just after it ended, which is why this one was made) delivered it."""
    log.info("request %s: K/V already complete on the decode worker; nothing to push",
             request_id)
    return PushResult(0, time.perf_counter() - started[0] if started else 0.0)


class GrpcKvSender:
    """Client-streaming push of ~1 MiB chunks, one channel per decode address.

    A push the receiver refuses for a checksum mismatch (corrupted in flight) is sent again,
    whole, up to `max_resends` times (the receiver forgets a broken push's pages); then it
    fails with DATA_LOSS. `corrupt_pushes` is fault injection for tests: the first N pushes
    have one byte of their first chunk flipped after its checksum was taken,
    `chunk_delay_s` sleeps before every chunk but the first (a push a test can interrupt), and
    `done_delay_s` sleeps once the receiver has accepted a push, before it counts as done (a
    worker a test can kill after its K/V was delivered, before the router hears of it), and
    `break_pushes` fails a request's first N pushes with UNAVAILABLE, as a healed link's dead
    connection does (the router prefills such a request again, once). A
    request armed with faults of its own (kvferry/faults.py) gets those instead, its
    corrupt_pushes counted over its own pushes."""

    def __init__(self, chunk_bytes: int = wire.CHUNK_TARGET_BYTES, max_resends: int = 2,
                 corrupt_pushes: int = 0, chunk_delay_s: float = 0.0,
                 done_delay_s: float = 0.0,
                 credentials: security.Credentials = security.PLAINTEXT,
                 break_pushes: int = 0) -> None:
        self.chunk_bytes = chunk_bytes
        self.max_resends = max_resends
        self._corrupt_left = corrupt_pushes
        self.num_corrupt_pushes = 0  # refused by the receiver's checksum check
        self.num_lost_statuses = 0  # pushes sent again after grpc.aio lost their status
        self.faults = Faults(push_chunk_delay_s=chunk_delay_s, push_done_delay_s=done_delay_s,
                             corrupt_pushes=corrupt_pushes, break_pushes=break_pushes)
        self._broken: dict[str, int] = {}  # request id -> its pushes broken (break_pushes)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._credentials = credentials  # TLS and token of the decode workers' K/V service

    @classmethod
    def from_options(cls, options: SenderOptions) -> GrpcKvSender:
        """The sender a worker's settings and faults ask for (subclasses take the same)."""
        faults = options.faults
        return cls(max_resends=options.max_resends, corrupt_pushes=faults.corrupt_pushes,
                   chunk_delay_s=faults.push_chunk_delay_s,
                   done_delay_s=faults.push_done_delay_s, credentials=options.credentials,
                   break_pushes=faults.break_pushes)

    def _push_kv(self, address: str) -> grpc.aio.StreamUnaryMultiCallable:
        """KvTransferService.PushKv taking chunks already serialized by chunk_codec."""
        return self._channel(address).stream_unary(
            chunk_codec.PUSH_KV_METHOD, request_serializer=None,
            response_deserializer=worker_pb2.PushKvResponse.FromString)

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = security.channel(address, self._credentials)
        return self._channels[address]

    def _plan(self, layout: KvLayout, num_tokens: int, first_block: int) -> list[wire.ChunkSpan]:
        return wire.plan_chunks(layout, num_tokens, self.chunk_bytes, first_block=first_block)

    async def _ready_spans(self, spans: list[wire.ChunkSpan], ready: LayersReady | None,
                           progress: Progress, chunk_delay_s: float | None = None
                           ) -> AsyncIterator[tuple[int, wire.ChunkSpan]]:
        """Each span with its index, once its layers are final (and after the fault
        injection's delay, but for the first); the push's clock starts at the first."""
        if chunk_delay_s is None:
            chunk_delay_s = self.faults.push_chunk_delay_s
        for i, span in enumerate(spans):
            if i and chunk_delay_s:
                await asyncio.sleep(chunk_delay_s)
            if ready is not None:
                await ready(span.layer_end)
            progress.start()
            yield i, span

    async def _messages(self, request_id: str, layout: KvLayout, num_tokens: int, pool: KvPool,
                        block_table: list[int], spans: list[wire.ChunkSpan],
                        ready: LayersReady | None, corrupt: bool, progress: Progress,
                        draft: DraftPush | None = None, evicted: tuple[int, int] = (0, 0)
                        ) -> AsyncIterator[Any]:
        """The push's stream: one chunk per span, each once its layers are ready; then,
        with `draft`, the draft's pages of the whole prompt once they are."""
        layout_msg = convert.layout_to_proto(layout)
        chunk_delay_s = self.faults.for_request(request_id).push_chunk_delay_s
        async for i, span in self._ready_spans(spans, ready, progress, chunk_delay_s):
            yield self._chunk(request_id, layout_msg, num_tokens, pool, block_table, span,
                              progress, corrupt and i == 0, evicted=evicted)
        if draft is not None:
            await draft.ready()
            draft_msg = convert.layout_to_proto(draft.layout)
            for span in self._plan(draft.layout, num_tokens, 0):
                yield self._chunk(request_id, draft_msg, num_tokens, draft.pool, block_table,
                                  span, progress, False, is_draft=True)

    @staticmethod
    def _chunk(request_id: str, layout_msg: worker_pb2.KvLayout, num_tokens: int,
               pool: KvPool, block_table: list[int], span: wire.ChunkSpan, progress: Progress,
               corrupt: bool, is_draft: bool = False, evicted: tuple[int, int] = (0, 0)
               ) -> bytes:
        """One span of `pool`'s pages as a serialized KvChunk (`corrupt`: fault injection,
        a byte flipped after the checksum was taken)."""
        data = wire.pack_array(pool, block_table, span)
        crc = wire.crc32(data)
        if corrupt:
            data[0] ^= 0xFF
        progress.sent += data.nbytes
        return chunk_codec.encode(worker_pb2.KvChunk(
            request_id=request_id, layout=layout_msg, num_tokens=num_tokens,
            layer_start=span.layer_start, layer_end=span.layer_end,
            block_start=span.block_start, num_blocks=span.num_blocks, crc32=crc,
            is_draft=is_draft, num_evicted=evicted[0], num_rebased=evicted[1],
        ), data)

    async def push(
        self, address: str, request_id: str, layout: KvLayout, num_tokens: int,
        pool: KvPool, block_table: list[int], timeout_s: float | None,
        ready: LayersReady | None = None, first_block: int = 0,
        draft: DraftPush | None = None, evicted: tuple[int, int] = (0, 0),
    ) -> PushResult:
        """Stream the pages in layer order; with `ready`, each layer group goes as soon as
        the prefill forward has written it, overlapping the transfer with later layers.
        `draft`: the draft model's pages of the prompt follow (from block 0). `evicted`:
        (num_evicted, num_rebased) of a prompt that evicted while prefilled; its kept pages
        (those of `num_tokens - num_evicted` tokens) are what goes."""
        spans = self._plan(layout, num_tokens - evicted[0], first_block)
        progress = Progress()
        started = progress.started
        num_corrupt = num_lost = 0
        is_lost = False
        armed = self.faults.for_request(request_id)
        if armed.break_pushes:
            self._break(request_id, armed.break_pushes)
        own_corrupt_left = armed.corrupt_pushes  # a request armed with faults of its own
        while True:
            if not is_lost:  # a push resent after a lost status goes again as it was
                if armed is self.faults:
                    corrupt = self._corrupt_left > 0
                    self._corrupt_left -= corrupt
                else:
                    corrupt = own_corrupt_left > 0
                    own_corrupt_left -= corrupt
            is_lost = False
            try:
                progress.sent = 0
                await self._push_kv(address)(
                    self._messages(request_id, layout, num_tokens, pool, block_table, spans,
                                   ready, corrupt, progress, draft, evicted),
                    timeout=timeout_s)
                result = PushResult(progress.sent, time.perf_counter() - started[0])
                if armed.push_done_delay_s:
                    log.info("request %s: K/V push accepted; holding its done %.1f s (fault "
                             "injection)", request_id, armed.push_done_delay_s)
                    await asyncio.sleep(armed.push_done_delay_s)
                return result
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.ALREADY_EXISTS:
                    return _already_there(request_id, started)
                if _is_lost_status(exc) and num_lost < MAX_LOST_STATUS_RESENDS:
                    num_lost += 1
                    is_lost = True
                    self.num_lost_statuses += 1
                    log.info("request %s: K/V push ended with its status lost; sending again",
                             request_id)
                    continue
                if not _is_corruption(exc):
                    raise grpc_util.from_rpc(exc) from exc
                num_corrupt += 1
                self.num_corrupt_pushes += 1
                log.warning("request %s: K/V push %d corrupted in flight (%s)", request_id,
                            num_corrupt, exc.details())
                if num_corrupt > self.max_resends:
                    raise Remote(f"K/V for {request_id!r} corrupted in flight {num_corrupt} "
                                 "times", grpc.StatusCode.DATA_LOSS.value[0]) from exc

    def _break(self, request_id: str, num_pushes: int) -> None:
        """Fault injection: the request's first `num_pushes` pushes fail as they do over a
        link that was cut and has healed (the channel's old connection is dead)."""
        num_broken = self._broken.get(request_id, 0)
        if num_broken < num_pushes:
            self._broken[request_id] = num_broken + 1
            log.info("request %s: K/V push %d broken (fault injection)", request_id,
                     num_broken + 1)
            raise grpc_util.from_rpc(grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                "link broken (fault injection)"))

    async def close(self) -> None:
        for chan in self._channels.values():
            await chan.close()
        self._channels.clear()
