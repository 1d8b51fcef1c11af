"""The Ray K/V transport: pages travel through Ray's object store, never through the router.

The prefill worker (a Ray actor) packs each layer group of a request's pages into one array,
`ray.put`s it, and hands the object ref to the decode actor's `push_chunk`, which Ray resolves
(zero-copy from shared memory on the same node, through Ray's object manager across nodes)
before the decode worker validates it and copies it into its blocks: the same checks and the
same single copy as a gRPC chunk. Layer groups go as soon as the prefill forward has written
them, so the transfer overlaps the later layers' compute. Each push first opens an epoch on
the decode actor (`begin_push`) that its chunks, finish and fail carry, as a gRPC PushKv
stream does: a newer push for the same request fences off a superseded one's late chunks.
The receiving side is kvferry.transfer.ray.receive.

Decode actors are found by the gRPC address the router gives the prefill worker: every
kvferry actor answers `address()`, and the sender keeps the mapping.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import NamedTuple

import grpc
import ray

from kvferry.cache.layout import KvLayout
from kvferry.cache.pool import KvPool
from kvferry.errors import InvalidArgument, Remote
from kvferry.faults import Faults
from kvferry.transfer import wire
from kvferry.transfer.sender import DraftPush, LayersReady, PushResult

log = logging.getLogger("kvferry.transport")

NAMESPACE = "kvferry"


class ChunkAck(NamedTuple):
    """The decode actor's answer to one chunk: bytes written, or why it refused them."""

    num_bytes: int
    error_code: int = 0  # a grpc.StatusCode number; 0: accepted
    error_message: str = ""
    error_field: str = ""


class PushBegun(NamedTuple):
    """The decode actor's answer to opening a push: the epoch its chunks, finish and fail
    carry (a newer push for the same request supersedes it), or why it refused."""

    epoch: int | None  # None: refused, see `refusal`
    refusal: ChunkAck = ChunkAck(0)


# Bigger chunks than gRPC's 1 MiB: each chunk is one `ray.put` and one actor call, ~3 ms of
# fixed cost on the 2-core machine. plan_chunks still cuts a push of 16 MiB or more into at
# least 4 layer groups, so that sending overlaps the later layers' compute; a smaller push
# goes in groups of at least 4 MiB (a 4 MiB push: one chunk, 17 ms end to end, against
# 27-30 ms in four), since its prefill is too short for the overlap to matter.
RAY_CHUNK_TARGET_BYTES = 16 << 20
RAY_MIN_GROUP_BYTES = 4 << 20


class RayKvSender:
    """`KvSender` over Ray object refs; same resend-on-corruption contract as gRPC's, and
    the same fault injection (`corrupt_pushes`, or a request's own: kvferry/faults.py)."""

    def __init__(self, chunk_bytes: int = RAY_CHUNK_TARGET_BYTES, max_resends: int = 2,
                 corrupt_pushes: int = 0) -> None:
        self.chunk_bytes = chunk_bytes
        self.max_resends = max_resends
        self._corrupt_left = corrupt_pushes
        self.faults = Faults(corrupt_pushes=corrupt_pushes)
        self.num_corrupt_pushes = 0  # refused by the receiver's checksum check
        self._actors: dict[str, ray.actor.ActorHandle] = {}

    async def _actor(self, address: str) -> ray.actor.ActorHandle:
        if address not in self._actors:
            for entry in ray.util.list_named_actors(all_namespaces=True):
                if entry["namespace"] != NAMESPACE:
                    continue
                try:  # an actor listed may be gone by now (a planner moved its worker)
                    handle = ray.get_actor(entry["name"], namespace=NAMESPACE)
                    self._actors[await handle.address.remote()] = handle
                except (ValueError, ray.exceptions.RayActorError):
                    continue  # gone since it was listed: not the one asked for
        if address not in self._actors:
            raise Remote(f"no kvferry Ray actor serves {address}",
                         grpc.StatusCode.UNAVAILABLE.value[0])
        return self._actors[address]

    async def push(
        self, address: str, request_id: str, layout: KvLayout, num_tokens: int,
        pool: KvPool, block_table: list[int], timeout_s: float | None,
        ready: LayersReady | None = None, first_block: int = 0,
        draft: DraftPush | None = None, evicted: tuple[int, int] = (0, 0),
    ) -> PushResult:
        if evicted[0]:
            raise InvalidArgument("the ray K/V transport carries no evicted prompt; prefill "
                                  "workers evict while prefilling over grpc only", "kv_eviction")
        if draft is not None:
            raise InvalidArgument("the ray K/V transport carries no draft pages; use "
                                  "--speculative-draft-kv recompute", "speculative_draft_kv")
        actor = await self._actor(address)
        spans = wire.plan_chunks(layout, num_tokens, self.chunk_bytes, RAY_MIN_GROUP_BYTES,
                                 first_block)
        armed = self.faults.for_request(request_id)
        for attempt in range(self.max_resends + 1):
            if armed is self.faults:
                corrupt = self._corrupt_left > 0
                self._corrupt_left -= corrupt
            else:  # a request armed with faults of its own: its own first pushes
                corrupt = attempt < armed.corrupt_pushes
            try:
                epoch, acks, started = await asyncio.wait_for(
                    self._send(actor, request_id, layout, num_tokens, pool, block_table, spans,
                               ready, corrupt), timeout_s)
            except ray.exceptions.RayActorError as exc:
                self._actors.pop(address, None)
                raise Remote(f"decode actor at {address} is gone: {exc}",
                             grpc.StatusCode.UNAVAILABLE.value[0]) from exc
            refused = next((a for a in acks if a.error_code), None)
            if refused is None:
                return PushResult(sum(a.num_bytes for a in acks), time.perf_counter() - started)
            if refused.error_code == grpc.StatusCode.ALREADY_EXISTS.value[0]:
                log.info("request %s: K/V already complete on the decode worker", request_id)
                return PushResult(0, time.perf_counter() - started)  # see grpc/send.py
            if epoch is not None:  # an unopened push has no pages to forget
                await actor.fail_push.remote(request_id, epoch)
            if refused.error_field != "crc32":
                raise Remote(refused.error_message, refused.error_code)
            self.num_corrupt_pushes += 1
            log.warning("request %s: K/V push %d corrupted in flight (%s)", request_id,
                        attempt + 1, refused.error_message)
        raise Remote(f"K/V for {request_id!r} corrupted in flight {self.max_resends + 1} "
                     "times", grpc.StatusCode.DATA_LOSS.value[0])

    async def _send(self, actor: ray.actor.ActorHandle, request_id: str, layout: KvLayout,
                    num_tokens: int, pool: KvPool, block_table: list[int],
                    spans: list[wire.ChunkSpan], ready: LayersReady | None,
                    corrupt: bool) -> tuple[int | None, list[ChunkAck], float]:
        """Open a push (its epoch fences a superseded one), every chunk in flight at once (one
        actor call each), then the closing call. Returns the epoch (None: the actor refused
        to open the push), the acks, and when the first chunk went out (its layers ready)."""
        begun: PushBegun = await actor.begin_push.remote(request_id)
        if begun.epoch is None:
            return None, [begun.refusal], time.perf_counter()
        pending = []
        started = 0.0
        for i, span in enumerate(spans):
            if ready is not None:
                await ready(span.layer_end)
            started = started or time.perf_counter()
            data = wire.pack_array(pool, block_table, span)
            crc = wire.crc32(data)
            if corrupt and i == 0:
                data[0] ^= 0xFF  # fault injection: after the checksum was taken
            pending.append(actor.push_chunk.remote(request_id, layout, num_tokens, span,
                                                   ray.put(data), crc, begun.epoch))
        acks: list[ChunkAck] = list(await asyncio.gather(*pending))
        if not any(a.error_code for a in acks):
            acks.append(await actor.finish_push.remote(request_id, begun.epoch))
        return begun.epoch, acks, started

    async def close(self) -> None:
        self._actors.clear()
