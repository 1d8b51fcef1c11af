"""All of the router's workers (`WorkerSet`): connected, checked for compatibility with the
served model (layout, fingerprint), refreshed (health, then stats) and revived; the
healthy ones of each role, for the policies (`router.policies.routing`). One worker's view is
`router.workers.worker.Worker`."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from kvferry.cache.layout import KvLayout
from kvferry.errors import KvferryError, Unavailable
from kvferry.rpc import security
from router.workers import client as worker_client
from router.workers.cache_mirror import StoreMirror
from router.workers.decode_client import DecodeClient
from router.workers.prefill_client import PrefillClient
from router.workers.worker import Worker

log = logging.getLogger("kvferry.router")


@dataclass
class WorkerSet:
    """All workers, checked for compatibility with the served model before use."""

    expected_fingerprint: str
    workers: list[Worker] = field(default_factory=list)
    credentials: security.Credentials = security.PLAINTEXT  # TLS and token for worker channels
    # The deployment's shared K/V store as all workers reported it (`Worker.leading_tiers`).
    store: StoreMirror = field(default_factory=StoreMirror)
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
                        decode_client=DecodeClient(chan) if role != "prefill" else None,
                        shared_store=self.store)
        self.workers.append(worker)
        return worker

    async def sync_role(self, role: str, addresses: set[str]) -> None:
        """Make the workers of `role` exactly `addresses` (DNS discovery, or a Ray scaler).
        A worker no longer named has left: it is never chosen again, and is dropped once this
        router has no request open on it; one named again comes back."""
        known = {w.address: w for w in self.workers if w.role == role}
        for address in sorted(addresses - known.keys()):
            log.info("discovered %s worker %s", role, address)
            await self.refresh(self.add(address, role))
        for address in sorted(addresses & known.keys()):
            if known[address].has_left:
                log.info("%s worker %s is back", role, address)
                known[address].has_left = False
                await self.refresh(known[address])
        for worker in [w for w in self.workers if w.role == role and w.address not in addresses]:
            worker.is_healthy = False
            if not worker.has_left:
                log.info("%s worker %s has left; no new requests go there", role,
                         worker.address)
                worker.has_left = True
            if worker.num_in_flight <= 0:
                log.info("dropping %s worker %s (nothing open there)", role, worker.address)
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
        if client is None or worker.channel is None or worker.has_left:
            worker.is_healthy = False  # nothing to reach it with, or no longer ours to use
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
        except KvferryError as exc:
            if worker.is_healthy:
                log.warning("%s worker %s unreachable: %s", worker.role, worker.address,
                            type(exc).__name__)
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
