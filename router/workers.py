"""The router's view of its workers: channels and their RPC clients (`router.prefill_client`,
`router.decode_client`, `router.worker_client`), layouts, load telemetry, in-flight accounting.

Telemetry (GetStats) is refreshed periodically and is always a little stale, so the router
also counts what it sent each worker since: a request's projected blocks and prompt tokens are
added when the worker is picked and dropped once a stats snapshot taken after the worker
accepted it has been read. A burst of requests routed within one refresh interval therefore
sees each other and spreads out. A prefill worker's entry goes as soon as its prefill ends
(the K/V pushed, or the prefill failed), not when the request does: a decoding request is no
pending work for it (`RouterRequest.drop_prefill_worker`).

Each worker's prefix-cache index is mirrored here for the `prefix` policy, by a
`router.cache_mirror.CacheMirror` per worker (`Worker.cache`): the keys its cache events
reported, the cursor every GetStats sends, and the keys predicted from requests sent there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from kvferry.cache.layout import KvLayout
from kvferry.cache.stats import PoolStats
from kvferry.errors import Unavailable
from kvferry.rpc import security
from router import worker_client
from router.cache_mirror import CacheMirror
from router.decode_client import DecodeClient
from router.demand import RecentDemand
from router.prefill_client import PrefillClient

log = logging.getLogger("kvferry.router")


@dataclass(slots=True)
class InFlight:
    """What the router sent a worker that its last stats may not show yet."""

    blocks: int
    prompt_tokens: int
    accepted_at: float | None = None  # monotonic time the worker accepted it


@dataclass(slots=True)
class Worker:
    address: str
    role: str  # "prefill", "decode" or "colocated" (serves both)
    channel: grpc.aio.Channel | None
    layout: KvLayout | None = None
    total_blocks: int = 0
    projected_blocks: int = 0  # from stats: what live requests may grow to
    pending_prefill_tokens: int = 0  # from stats
    num_running: int = 0  # from stats
    stats_issued_at: float = 0.0  # when the snapshot applied last was asked for
    num_stats_refreshes: int = 0  # stats snapshots applied (kvferry_router_worker_*)
    num_in_flight: int = 0  # requests this router has open there now
    in_flight: dict[str, InFlight] = field(default_factory=dict)
    is_healthy: bool = False
    refuse_reason: str = ""
    cache: CacheMirror = field(default_factory=CacheMirror)  # its prefix-cache index
    demand: RecentDemand = field(default_factory=RecentDemand)  # blocks recently sent here
    # Every worker serves Prefill (a decode worker prefills short prompts locally); decode
    # and colocated workers also serve Decode, over one shared DecodeStream.
    prefill_client: PrefillClient | None = None
    decode_client: DecodeClient | None = None

    @property
    def prefill(self) -> PrefillClient:
        if self.prefill_client is None:
            raise Unavailable(f"worker {self.address} serves no Prefill")
        return self.prefill_client

    @property
    def decode(self) -> DecodeClient:
        if self.decode_client is None:
            raise Unavailable(f"worker {self.address} serves no Decode")
        return self.decode_client

    @property
    def headroom(self) -> int:
        """Blocks left after every known and in-flight request grows to its maximum."""
        pending = sum(f.blocks for f in self.in_flight.values())
        return self.total_blocks - self.projected_blocks - pending

    @property
    def pending_tokens(self) -> int:
        return self.pending_prefill_tokens + sum(f.prompt_tokens for f in self.in_flight.values())

    def add_in_flight(self, request_id: str, blocks: int, prompt_tokens: int,
                      keys: Sequence[bytes] = ()) -> None:
        """Count a request sent here; its prompt block `keys` are predicted cached here."""
        self.in_flight[request_id] = InFlight(blocks, prompt_tokens)
        self.num_in_flight += 1
        self.cache.predict(keys)
        self.demand.add(blocks)

    def accepted(self, request_id: str) -> None:
        entry = self.in_flight.get(request_id)
        if entry is not None:
            entry.accepted_at = time.monotonic()

    def done(self, request_id: str) -> None:
        self.in_flight.pop(request_id, None)
        self.num_in_flight -= 1

    def apply_stats(self, stats: PoolStats, issued_at: float) -> None:
        """Take a stats snapshot, unless a newer one was applied already: two refreshes in
        flight (the periodic one and an admission waiter's) may answer out of order, and an
        older snapshot would drop reservations the newer one counted."""
        if issued_at < self.stats_issued_at:
            return
        self.stats_issued_at = issued_at
        self.num_stats_refreshes += 1
        self.total_blocks = stats.total_blocks
        self.projected_blocks = stats.projected_blocks
        self.pending_prefill_tokens = stats.num_pending_prefill_tokens
        self.num_running = stats.num_running
        for request_id, entry in list(self.in_flight.items()):
            if entry.accepted_at is not None and entry.accepted_at < issued_at:
                del self.in_flight[request_id]  # the snapshot counts it now
        if stats.cache_events is not None:
            self.cache.apply(stats.cache_events)

    def forget_cache(self, now: float) -> None:
        """The worker is unhealthy (unreachable, draining, refused, perhaps restarting):
        forget its index, so the next answer is a snapshot. Answers to stats asked for before
        `now` are refused from here on: they describe the worker as it was."""
        self.cache.forget()
        self.stats_issued_at = max(self.stats_issued_at, now)


@dataclass
class WorkerSet:
    """All workers, checked for compatibility with the served model before use."""

    expected_fingerprint: str
    workers: list[Worker] = field(default_factory=list)
    credentials: security.Credentials = security.PLAINTEXT  # TLS and token for worker channels
    _refreshing: asyncio.Future[None] | None = None
    _reviving: asyncio.Future[list[None]] | None = None

    @staticmethod
    def connect(prefill: list[str], decode: list[str], fingerprint: str,
                colocated: list[str] | None = None,
                credentials: security.Credentials = security.PLAINTEXT) -> WorkerSet:
        ws = WorkerSet(fingerprint, credentials=credentials)
        for role, addresses in (("prefill", prefill), ("decode", decode),
                                ("colocated", colocated or [])):
            for address in addresses:
                ws.add(address, role)
        return ws

    def add(self, address: str, role: str) -> Worker:
        chan = security.channel(address, self.credentials)
        worker = Worker(address, role, chan, prefill_client=PrefillClient(chan),
                        decode_client=DecodeClient(chan) if role != "prefill" else None)
        self.workers.append(worker)
        return worker

    async def sync_role(self, role: str, addresses: set[str]) -> None:
        """Make the workers of `role` exactly `addresses` (DNS discovery). A vanished worker
        is dropped once this router has no request open on it."""
        known = {w.address for w in self.workers if w.role == role}
        for address in sorted(addresses - known):
            log.info("discovered %s worker %s", role, address)
            await self.refresh(self.add(address, role))
        for worker in [w for w in self.workers if w.role == role and w.address not in addresses]:
            worker.is_healthy = False
            if worker.num_in_flight <= 0:
                log.info("%s worker %s left DNS; dropping it", role, worker.address)
                self.workers.remove(worker)
                if worker.decode_client is not None:
                    await worker.decode_client.close()
                if worker.channel is not None:
                    await worker.channel.close()

    async def refresh(self, worker: Worker, timeout_s: float = 2.0,
                      wait_for_ready: bool = False) -> None:
        """Health (grpc.health.v1: a draining worker says NOT_SERVING), then stats.
        `wait_for_ready`: a channel still reconnecting gets up to `timeout_s` to do so."""
        client = worker.prefill_client if worker.role == "prefill" else worker.decode_client
        if client is None or worker.channel is None:
            worker.is_healthy = False  # nothing to reach it with
            return
        issued_at = time.monotonic()
        if not worker.is_healthy:
            worker.forget_cache(issued_at)
        try:
            if not await worker_client.is_serving(worker.channel, timeout_s, wait_for_ready):
                if worker.is_healthy:
                    log.warning("%s worker %s is not serving (draining)", worker.role,
                                worker.address)
                worker.is_healthy = False
                return
            stats = await client.get_stats(timeout_s, worker.cache.event_seq)
        except grpc.aio.AioRpcError as exc:
            if worker.is_healthy:
                log.warning("%s worker %s unreachable: %s", worker.role, worker.address,
                            exc.code().name)
            worker.is_healthy = False
            return
        layout = stats.layout
        reason = self._incompatibility(layout)
        if reason:
            if worker.refuse_reason != reason:
                log.error("refusing %s worker %s: %s", worker.role, worker.address, reason)
            worker.refuse_reason = reason
            worker.is_healthy = False
            return
        worker.layout = layout
        worker.apply_stats(stats.pool, issued_at)
        worker.is_healthy = True
        worker.refuse_reason = ""

    def _incompatibility(self, layout: KvLayout) -> str:
        if layout.model_fingerprint != self.expected_fingerprint:
            return (f"model fingerprint {layout.model_fingerprint} != served "
                    f"{self.expected_fingerprint}")
        reference = next((w.layout for w in self.workers if w.layout is not None), None)
        if reference is not None:
            problem = reference.mismatch(layout)
            if problem:
                return problem
        return ""

    async def refresh_all(self) -> None:
        for worker in self.workers:
            await self.refresh(worker)

    async def refresh_shared(self) -> None:
        """Refresh every worker once; concurrent callers share the round in flight, so many
        requests waiting for headroom do not multiply the stats calls."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self.refresh_all())
        await asyncio.shield(self._refreshing)

    async def revive(self) -> None:
        """When a role has workers but none healthy (all stalled, restarting or reconnecting
        a moment ago), check them again now, waiting up to 2 s for their channels, before a
        request is failed for want of one. Concurrent callers share one round."""
        if not self._without_healthy():
            return
        if self._reviving is None or self._reviving.done():
            self._reviving = asyncio.ensure_future(asyncio.gather(
                *(self.refresh(w, timeout_s=2.0, wait_for_ready=True)
                  for w in self._without_healthy())))
        await asyncio.shield(self._reviving)

    def _without_healthy(self) -> list[Worker]:
        """The workers of every role that has some (not refused) but none healthy."""
        down = []
        for roles in (("prefill",), ("decode", "colocated")):
            known = [w for w in self.workers if w.role in roles and not w.refuse_reason]
            if known and not any(w.is_healthy for w in known):
                down += known
        return down

    def healthy(self, *roles: str) -> list[Worker]:
        return [w for w in self.workers if w.role in roles and w.is_healthy]

    def has_prefill_workers(self) -> bool:
        return any(w.role == "prefill" for w in self.workers)

    def decode_workers(self) -> list[Worker]:
        workers = self.healthy("decode", "colocated")
        if not workers:
            raise Unavailable("no healthy decode worker")
        return workers

    def layout(self) -> KvLayout | None:
        """The K/V layout the healthy workers serve (they all agree), if one reported it."""
        return next((w.layout for w in self.workers if w.is_healthy and w.layout is not None),
                    None)

    def block_size(self) -> int:
        """Tokens per K/V block, as the healthy decode workers report it (refresh refuses a
        worker whose layout differs from the others', so they all agree)."""
        sizes = [w.layout.block_size for w in self.decode_workers() if w.layout is not None]
        if not sizes:
            raise Unavailable("no decode worker has reported its K/V layout")
        return sizes[0]

    def prefill_workers(self) -> list[Worker]:
        workers = self.healthy("prefill")
        if not workers:
            raise Unavailable("no healthy prefill worker")
        return workers

    async def close(self) -> None:
        for worker in self.workers:
            if worker.decode_client is not None:
                await worker.decode_client.close()
            if worker.channel is not None:
                await worker.channel.close()
