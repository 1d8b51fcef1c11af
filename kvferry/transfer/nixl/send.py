"""`NixlKvSender`: the prefill worker's end of the NIXL K/V transport (`--kv-transport nixl`).

Pull, as vLLM's NIXL connector does: the prefill worker registers its pool with a NIXL agent
and opens a PullKv stream to the decode worker (the authenticated gRPC control plane),
announcing its agent metadata and the request's block table, then each layer group as soon
as the forward pass has written it, and the group's CRC-32C, computed while the decode
worker reads the group. The decode worker READs every group
straight from these pages into its reserved blocks (kvferry/transfer/nixl/receive.py). The push
returns when the decode worker has checked every group; the caller keeps the pages until
then. Why pull rather than push:
- kvferry never writes into a decode pool from outside: every write into a reserved block
  is the decode worker's own READ, which holds the block (a fence) until NIXL reports it
  finished or cancelled, so an abort, an expired lease or a dead prefill worker cannot let
  a late write land in a block given to another request.
- The decode worker's metadata never leaves it and nothing connects to its UCX endpoint
  (over UCX's TCP transport, network policy is what keeps others out: docs/security.md).
- Layer pipelining stays: a group is announced as soon as its layers are final.

Resends and errors follow `GrpcKvSender` (a checksum mismatch is sent again, ALREADY_EXISTS
means an earlier push delivered the K/V). Fault injection `corrupt_pushes` announces a wrong
checksum for the first group, which the decode worker must catch after its read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from kvferry.cache.layout import KvLayout
from kvferry.cache.pool import KvPool
from kvferry.errors import InvalidArgument
from kvferry.rpc import convert, security
from kvferry.transfer import wire
from kvferry.transfer.grpc import chunk_codec
from kvferry.transfer.grpc.send import GrpcKvSender, Progress
from kvferry.transfer.nixl import agent as nixl_agent
from kvferry.transfer.nixl import pages as nixl_pages
from kvferry.transfer.nixl import staging
from kvferry.transfer.sender import DraftPush, LayersReady, PushResult
from kvferry.v1 import worker_pb2

log = logging.getLogger("kvferry.transport")

PULL_KV_METHOD = f"/{chunk_codec.KV_TRANSFER_SERVICE}/PullKv"
# A group is one READ, one check on the decode worker's check thread and one checksum message:
# a few ms of fixed cost. Groups are whole layers (at least 4 groups, for pipelining) and
# never smaller than this unless the prompt is, as for Ray: a 4 MiB push in one group ran at
# 0.44 GB/s against 0.21 in four (median of 5 each, bench_kv_transfer.py --transports nixl
# --sizes-mib 4 16; 16 MiB unchanged at 0.70).
NIXL_MIN_GROUP_BYTES = 4 << 20


class NixlKvSender(GrpcKvSender):
    """`KvSender` whose pages the decode worker reads with NIXL; one agent per process."""

    def __init__(self, max_resends: int = 2, corrupt_pushes: int = 0,
                 chunk_delay_s: float = 0.0, done_delay_s: float = 0.0,
                 credentials: security.Credentials = security.PLAINTEXT,
                 agent: Any = None, break_pushes: int = 0) -> None:
        super().__init__(1 << 62, max_resends, corrupt_pushes, chunk_delay_s, done_delay_s,
                         credentials, break_pushes)
        self._owns_agent = agent is None  # then `close` closes it
        self.agent = agent if agent is not None else nixl_pages.make_agent("prefill")
        self._registered: dict[int, tuple[Any, nixl_pages.PoolMemory]] = {}
        self._metadata = b""
        # A tensor-parallel worker's pool is read through whole-page staging, registered in
        # its place (kvferry/transfer/nixl/staging.py): by the pool's id, and each push's
        # staging blocks by its block table's (unique among the pushes in flight).
        self._staging: dict[int, KvPool | None] = {}
        self._staged: dict[int, list[int]] = {}

    def register(self, pool: KvPool) -> nixl_pages.PoolMemory:
        """Register `pool` with the agent (once): remote agents may then read it."""
        key = pool.cache.data_ptr()
        if key not in self._registered:
            descs = nixl_agent.register(self.agent, pool.cache)
            self._registered[key] = (descs, nixl_pages.PoolMemory.of(pool))
            self._metadata = self.agent.get_agent_metadata()
            log.info("NIXL agent %s: registered a %d MiB K/V pool", self.agent.name,
                     pool.cache.numel() * pool.cache.element_size() >> 20)
        return self._registered[key][1]

    async def close(self) -> None:
        """Close the channels, then the agent if this sender made it (its pool is
        deregistered: no peer can read it any more). Idempotent."""
        await super().close()
        if self._owns_agent:
            nixl_agent.close(self.agent)

    def _staging_of(self, pool: KvPool) -> KvPool | None:
        if id(pool) not in self._staging:
            self._staging[id(pool)] = staging.staging_for(pool)
        return self._staging[id(pool)]

    async def push(self, address: str, request_id: str, layout: KvLayout, num_tokens: int,
                   pool: KvPool, block_table: list[int], *args: Any, **kwargs: Any
                   ) -> PushResult:
        """`GrpcKvSender.push`; a tensor-parallel worker's pages go through staging blocks
        held for the push (every resend included)."""
        stage = self._staging_of(pool)
        if stage is None:
            return await super().push(address, request_id, layout, num_tokens, pool,
                                      block_table, *args, **kwargs)
        self._staged[id(block_table)] = stage.allocator.alloc(len(block_table))
        try:
            return await super().push(address, request_id, layout, num_tokens, pool,
                                      block_table, *args, **kwargs)
        finally:
            stage.allocator.free(self._staged.pop(id(block_table)))

    def _push_kv(self, address: str) -> grpc.aio.StreamUnaryMultiCallable:
        return self._channel(address).stream_unary(
            PULL_KV_METHOD, request_serializer=worker_pb2.KvPullMessage.SerializeToString,
            response_deserializer=worker_pb2.PushKvResponse.FromString)

    def _plan(self, layout: KvLayout, num_tokens: int, first_block: int) -> list[wire.ChunkSpan]:
        return wire.plan_chunks(layout, num_tokens, self.chunk_bytes, NIXL_MIN_GROUP_BYTES,
                                first_block)

    async def _messages(self, request_id: str, layout: KvLayout, num_tokens: int, pool: KvPool,
                        block_table: list[int], spans: list[wire.ChunkSpan],
                        ready: LayersReady | None, corrupt: bool, progress: Progress,
                        draft: DraftPush | None = None, evicted: tuple[int, int] = (0, 0)
                        ) -> AsyncIterator[Any]:
        if evicted[0]:
            raise InvalidArgument("the nixl K/V transport carries no evicted prompt; prefill "
                                  "workers evict while prefilling over grpc only", "kv_eviction")
        if draft is not None:
            raise InvalidArgument("the nixl K/V transport carries no draft pages; use "
                                  "--speculative-draft-kv recompute", "speculative_draft_kv")
        stage = self._staging_of(pool)
        # what the decode worker reads: the pool, or this push's staging blocks
        source, table = ((pool, block_table) if stage is None
                         else (stage, self._staged[id(block_table)]))
        memory = self.register(source)
        yield worker_pb2.KvPullMessage(begin=worker_pb2.KvPullBegin(
            request_id=request_id, layout=convert.layout_to_proto(layout),
            num_tokens=num_tokens, agent_name=self.agent.name, agent_metadata=self._metadata,
            pool_address=memory.address, pool_blocks=memory.num_blocks,
            memory_type=memory.memory_type, device_id=memory.device_id,
            block_table=table))
        chunk_delay_s = self.faults.for_request(request_id).push_chunk_delay_s
        async for i, span in self._ready_spans(spans, ready, progress, chunk_delay_s):
            if stage is not None:  # the group's pages gathered from the ranks first
                await asyncio.to_thread(staging.stage, pool, nixl_pages.span_ids(
                    block_table, span), stage, nixl_pages.span_ids(table, span), span)
            progress.sent += wire.span_bytes(layout, span)
            yield worker_pb2.KvPullMessage(group=worker_pb2.KvPullGroup(
                layer_start=span.layer_start, layer_end=span.layer_end,
                block_start=span.block_start, num_blocks=span.num_blocks))
            # The decode worker READs the group meanwhile: both only read these pages.
            crc = await asyncio.to_thread(nixl_pages.crc32_pages, source, table, span)
            if corrupt and i == 0:
                crc ^= 0xFFFFFFFF  # fault injection: the pages no longer match their checksum
            yield worker_pb2.KvPullMessage(checksum=worker_pb2.KvPullChecksum(group=i,
                                                                              crc32=crc))
