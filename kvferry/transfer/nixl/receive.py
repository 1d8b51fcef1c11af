"""The decode worker's end of the NIXL K/V transport (`send.NixlKvSender`): the
`KvTransferService.PullKv` control stream and the `NixlPuller` that reads into the `KvSink`.

A PullKv stream announces a prefill worker's registered pool, then layer groups as they
become final, and each group's CRC-32C, which the sender computes while the group is read.
For each group the puller READs the pages straight into the reservation's blocks on its NIXL
thread, then checks them where they landed (finite values, CRC-32C) on its check thread,
while the next group is read: the event loop and the step loop do no per-byte work for
incoming K/V. Only then are the pages marked received.
A new push for a reservation waits until no READ of the one it supersedes can still write.

Fences: a block a READ writes into holds one extra reference from before the READ starts
until the thread knows it finished or was cancelled (`release_xfer_handle` succeeded). An
abort, an expired lease, a drain or a cancelled stream may free the reservation meanwhile;
its blocks go back to the pool only when the fence drops, so no late write can land in a
block given to another request. A READ NIXL cannot cancel keeps its fence for good: the
blocks leak (logged), which is the safe failure. A group that failed its checks, or whose
read failed, is zeroed before its fence drops: the pool never keeps non-finite pages.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import grpc
import numpy as np

from kvferry import logs
from kvferry.cache.budget import blocks_for_tokens
from kvferry.cache.layout import KvLayout
from kvferry.errors import DataLoss, InvalidArgument, KvferryError, Unavailable
from kvferry.faults import Faults
from kvferry.rpc import convert, grpc_util
from kvferry.transfer import wire
from kvferry.transfer.nixl import agent as nixl_agent
from kvferry.transfer.nixl import pages as nixl_pages
from kvferry.transfer.nixl import staging
from kvferry.transfer.sink import KvSink
from kvferry.v1 import worker_pb2

log = logging.getLogger("kvferry.transport")

READ_TIMEOUT_S = 60.0
MAX_PEERS = 64  # prefill agents kept loaded; each restart of a prefill worker is a new one


class PullOffer(NamedTuple):
    """A PullKv stream's `begin`: where the request's pages lie in the sender's pool."""

    request_id: str
    layout: KvLayout
    num_tokens: int
    agent_name: str
    agent_metadata: bytes
    remote: nixl_pages.PoolMemory
    block_table: list[int]


class Pull(NamedTuple):
    """One PullKv stream's push, once begun."""

    request_id: str
    epoch: int
    num_tokens: int
    peer: str  # the prefill worker's agent name
    remote: nixl_pages.PoolMemory
    remote_table: list[int]
    claimed: np.ndarray  # [layers, prompt blocks]: pages a group of this pull is reading


def _call(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    """`fn(*args)` on the loop, from any thread; nothing once the loop is gone (the worker
    is stopping, and its pool with it)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


class NixlPuller:
    """Reads pushed groups into `sink`'s reservations. Owns a NIXL agent (the sink's pool
    registered with it), one thread for everything NIXL and one for the checks."""

    def __init__(self, sink: KvSink, agent: Any = None,
                 read_timeout_s: float = READ_TIMEOUT_S, read_delay_s: float = 0.0) -> None:
        self.sink = sink
        self.pool = pool = sink.pool
        before = nixl_pages.thread_ids()
        self._owns_agent = agent is None  # then `close` closes it
        self.agent = agent if agent is not None else nixl_pages.make_agent("decode")
        # READs land in the pool itself, or for a tensor-parallel worker's in whole-page
        # staging, written into the ranks once checked (kvferry/transfer/nixl/staging.py)
        self.staging = staging.staging_for(pool)
        self.landing = landing = self.staging or pool
        self._reg = nixl_agent.register(self.agent, landing.cache)
        nixl_pages.name_transfer_threads(nixl_pages.thread_ids() - before)
        self.local = nixl_pages.PoolMemory.of(landing)
        self._page = nixl_pages.page_bytes(landing)
        self._peers: OrderedDict[str, None] = OrderedDict()  # loaded agents, LRU first
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kvferry-nixl-read",
                                          initializer=nixl_pages.name_this_thread)
        self._checker = ThreadPoolExecutor(1, thread_name_prefix="kvferry-nixl-check",
                                           initializer=nixl_pages.name_this_thread)
        for started in (self._reader.submit(int), self._checker.submit(int)):
            started.result()  # both threads exist (and are named) from the start
        self._in_flight: dict[str, set[asyncio.Future[None]]] = {}  # fences not yet dropped
        self.read_timeout_s = read_timeout_s
        # Fault injection (kvferry/faults.py): each READ takes this long, or a request's own.
        self.faults = Faults(nixl_read_delay_s=read_delay_s)
        self.num_fenced_blocks = 0  # block references held by READs in flight
        self.num_leaked_blocks = 0  # fenced for good: READs NIXL could not cancel

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.wrap_future(self._reader.submit(fn, *args))

    async def begin(self, msg: PullOffer) -> Pull:
        problem = self.sink.layout.mismatch(msg.layout)
        if problem:
            raise InvalidArgument(problem, "layout")
        reserved = self.sink.target(msg.request_id).num_prompt_tokens
        if msg.num_tokens != reserved:
            raise InvalidArgument(f"num_tokens {msg.num_tokens} != reserved prompt length "
                                  f"{reserved}", "num_tokens")
        remote = msg.remote
        if remote.memory_type not in ("DRAM", "VRAM"):
            raise InvalidArgument(f"memory_type {remote.memory_type!r}: expected DRAM or VRAM",
                                  "memory_type")
        table = list(msg.block_table)
        if len(table) != blocks_for_tokens(msg.num_tokens, self.pool.block_size):
            raise InvalidArgument(f"block_table has {len(table)} blocks for "
                                  f"{msg.num_tokens} tokens", "block_table")
        if remote.num_blocks < 1 or any(not 0 <= b < remote.num_blocks for b in table):
            raise InvalidArgument("block_table names blocks outside the sender's pool",
                                  "block_table")
        if not msg.agent_name or not msg.agent_metadata:
            raise InvalidArgument("agent_name and agent_metadata are required", "agent_name")
        if msg.agent_name not in self._peers:
            try:
                name = await self._run(self._load_peer, msg.agent_metadata)
            except Exception as exc:  # nixlBind errors: not metadata NIXL can load
                raise InvalidArgument(f"agent_metadata: {exc}", "agent_metadata") from exc
            self._peers[name] = None  # loaded: never add it twice
            while len(self._peers) > MAX_PEERS:  # restarted prefill workers' old agents
                old, _ = self._peers.popitem(last=False)
                await self._run(self.agent.remove_remote_agent, old)
            if name != msg.agent_name:
                raise InvalidArgument(f"agent_metadata is for {name!r}, not "
                                      f"{msg.agent_name!r}", "agent_metadata")
        self._peers.move_to_end(msg.agent_name)
        await self.settled(msg.request_id)
        epoch = self.sink.begin_push(msg.request_id)
        return Pull(msg.request_id, epoch, msg.num_tokens, msg.agent_name, remote, table,
                    wire.coverage(self.sink.layout, msg.num_tokens))

    async def group(self, pull: Pull, span: wire.ChunkSpan, crc: Awaitable[int]) -> int:
        """Read one group into the reservation and check it against `crc` (the sender's
        checksum, which may arrive while the READ runs). Returns its bytes. Several groups of
        one pull may be under way at once: one READs while the one before it is checked."""
        target = self.sink.writable(pull.request_id, pull.epoch)
        layout = self.sink.layout
        nbytes = wire.span_bytes(layout, span)
        wire.check_span(layout, pull.num_tokens, span, nbytes)
        rows = slice(span.layer_start, span.layer_end)
        cols = slice(span.block_start, span.block_start + span.num_blocks)
        if target.received[rows, cols].any() or pull.claimed[rows, cols].any():
            raise InvalidArgument("group overlaps pages already received", "block_start")
        pull.claimed[rows, cols] = True
        dest = nixl_pages.span_ids(target.block_table, span)
        self.pool.allocator.incref(dest)  # the fence: see the module docstring
        self.num_fenced_blocks += len(dest)
        # where the READ lands: the fenced blocks, or as many staging blocks (never short:
        # no more are in flight than the pool has)
        landed = dest if self.staging is None else self.staging.allocator.alloc(len(dest))
        loop = asyncio.get_running_loop()
        over: asyncio.Future[None] = loop.create_future()  # the fence has dropped
        self._in_flight.setdefault(pull.request_id, set()).add(over)
        reading = self._reader.submit(self._read_group, pull, span, landed, dest)
        reading.add_done_callback(lambda done: self._after_read(
            loop, done, dest, pull.request_id, over, landed))
        try:
            checking = await asyncio.wrap_future(reading)
            landed = await asyncio.wrap_future(checking)
        except nixl_pages.ReadNotReleased as exc:
            raise Unavailable(f"NIXL read could not be cancelled: {exc}", "data") from exc
        if isinstance(landed, KvferryError):
            raise landed
        if landed != await crc:  # finite pages: a resend overwrites them, no need to zero
            raise InvalidArgument("group checksum mismatch: corrupted in flight", "crc32")
        self.sink.mark_received(pull.request_id, pull.epoch, span, nbytes)  # if still ours
        return nbytes

    async def settled(self, request_id: str) -> None:
        """Until no READ of an earlier pull for `request_id` can still write: a new push
        for a reservation waits for the one it supersedes."""
        pending = self._in_flight.get(request_id)
        if pending:
            await asyncio.wait(set(pending))

    def _after_read(self, loop: asyncio.AbstractEventLoop, done: Future[Any],
                    dest: list[int], request_id: str, over: asyncio.Future[None],
                    landed: list[int]) -> None:
        """Runs on a puller thread when a READ ends: drop the fence once its check ends
        too (the check zeroes a bad group's pages), on the loop."""
        if not done.cancelled() and isinstance(done.exception(), nixl_pages.ReadNotReleased):
            log.error("a NIXL read could not be cancelled: %d blocks stay fenced", len(dest))
            _call(loop, self._count_leak, len(dest))
            return
        if done.cancelled() or done.exception() is not None:
            _call(loop, self._release, dest, request_id, over, landed)
            return
        done.result().add_done_callback(
            lambda _: _call(loop, self._release, dest, request_id, over, landed))

    def _release(self, dest: list[int], request_id: str, over: asyncio.Future[None],
                 landed: list[int]) -> None:
        self.num_fenced_blocks -= len(dest)
        self.pool.allocator.free(dest)
        if self.staging is not None:
            self.staging.allocator.free(landed)
        over.set_result(None)
        pending = self._in_flight[request_id]
        pending.discard(over)
        if not pending:
            del self._in_flight[request_id]

    def _count_leak(self, n: int) -> None:
        self.num_fenced_blocks -= n
        self.num_leaked_blocks += n

    # ---- on the puller's threads ------------------------------------------------------------
    def _load_peer(self, metadata: bytes) -> str:
        """add_peer; UCX may start threads for the new peer: they move bytes too."""
        before = nixl_pages.thread_ids()
        try:
            return nixl_pages.add_peer(self.agent, metadata)
        finally:
            nixl_pages.name_transfer_threads(nixl_pages.thread_ids() - before)

    def _read_group(self, pull: Pull, span: wire.ChunkSpan, landed: list[int],
                    dest: list[int]) -> Future[int | KvferryError]:
        """On the NIXL thread: READ the span's pages into blocks `landed` (the pool's
        `dest`, or staging blocks), then queue their check on the check thread. Returns the
        check's future (done at once, with the error, when the READ failed: its pages are
        zeroed)."""
        local, remote = nixl_pages.descriptors(
            self.local, landed, pull.remote, nixl_pages.span_ids(pull.remote_table, span),
            span, self._page)
        try:
            self._read(pull, local, remote)
        except KvferryError as exc:
            staging.zero(self.landing, landed, span)
            failed: Future[int | KvferryError] = Future()
            failed.set_result(exc)
            return failed
        return self._checker.submit(self._check, span, landed, dest)

    def _check(self, span: wire.ChunkSpan, landed: list[int], dest: list[int]
               ) -> int | KvferryError:
        """On the check thread: the CRC-32C of the pages where they landed, or the error
        when they are not all finite (then they are zeroed). Staged pages that pass are
        written into the pool's `dest` blocks, on every rank."""
        if not nixl_pages.blocks_finite(self.landing, landed, span):
            staging.zero(self.landing, landed, span)
            return DataLoss("group holds non-finite K/V (inf or NaN, or a scale that "
                            "dequantizes to inf); zeroed", "data")
        crc = nixl_pages.crc32_blocks(self.landing, landed, span)
        if self.staging is not None:
            staging.unstage(self.staging, landed, self.pool, dest, span)
        return crc

    def _read(self, pull: Pull, local: Any, remote: Any) -> None:
        delay_s = self.faults.for_request(pull.request_id).nixl_read_delay_s
        if delay_s:
            time.sleep(delay_s)
        agent = self.agent
        state = nixl_pages.read(agent, agent.get_xfer_descs(local, self.local.memory_type),
                                agent.get_xfer_descs(remote, pull.remote.memory_type),
                                pull.peer, self.read_timeout_s)
        if state != "DONE":
            raise Unavailable(f"NIXL read from {pull.peer} ended {state}", "data")

    def close(self) -> None:
        """Stop the threads (a READ in flight ends first), then close the agent if this
        puller made it. Idempotent."""
        self._reader.shutdown(wait=True)
        self._checker.shutdown(wait=True)
        if self._owns_agent:
            nixl_agent.close(self.agent)


# ---- the PullKv control stream -----------------------------------------------------------
def _announce(checksums: list[asyncio.Future[int]], message: worker_pb2.KvPullChecksum) -> None:
    """A group's checksum: for a group announced before it, once."""
    if not 0 <= message.group < len(checksums) or checksums[message.group].done():
        raise InvalidArgument(f"checksum for group {message.group}: no such group awaits one",
                              "checksum")
    checksums[message.group].set_result(message.crc32)


def _offer(begin: worker_pb2.KvPullBegin) -> PullOffer:
    return PullOffer(begin.request_id, convert.layout_from_proto(begin.layout),
                     begin.num_tokens, begin.agent_name, begin.agent_metadata,
                     nixl_pages.PoolMemory(begin.pool_address, begin.pool_blocks,
                                           begin.memory_type, begin.device_id),
                     list(begin.block_table))


class PullKvReceiver:
    def __init__(self, puller: NixlPuller) -> None:
        self.puller = puller

    async def PullKv(self, request_iterator: AsyncIterator[worker_pb2.KvPullMessage],  # noqa: N802
                     context: grpc.aio.ServicerContext) -> worker_pb2.PushKvResponse:
        """A NIXL push: `begin`, then groups to read, each read as soon as it is announced
        (the next READ overlaps the last one's check)."""
        pull: Pull | None = None
        groups: list[asyncio.Task[int]] = []
        checksums: list[asyncio.Future[int]] = []  # each group's, once its message came
        written = 0
        sink = self.puller.sink
        try:
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
            sink.finish_push(pull.request_id, pull.epoch)
        except asyncio.CancelledError:
            if pull is not None:
                sink.fail_push(pull.request_id, pull.epoch)
            raise
        except Exception as exc:
            if pull is not None:
                sink.fail_push(pull.request_id, pull.epoch)
            await grpc_util.abort_with(context, exc, pull.request_id if pull else "")
        finally:
            for task in groups:  # their READs keep their fences until they end
                task.cancel()
        return worker_pb2.PushKvResponse(bytes_written=written)


def handler(puller: NixlPuller) -> grpc.RpcMethodHandler:
    """`PullKv` reading into `puller`'s sink."""
    return grpc.stream_unary_rpc_method_handler(
        PullKvReceiver(puller).PullKv, request_deserializer=worker_pb2.KvPullMessage.FromString,
        response_serializer=worker_pb2.PushKvResponse.SerializeToString)
