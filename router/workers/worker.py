"""The router's view of one worker: its channel and RPC clients (`prefill_client.py`,
`decode_client.py`, `client.py` beside it), layout, load telemetry, in-flight accounting.

Telemetry (GetStats) is refreshed periodically and is always a little stale, so the router
also counts what it sent each worker since: a request's projected blocks and prompt tokens are
added when the worker is picked and dropped once a stats snapshot taken after the worker
accepted it has been read. A burst of requests routed within one refresh interval therefore
sees each other and spreads out. A prefill worker's entry goes as soon as its prefill ends
(the K/V pushed, or the prefill failed), not when the request does: a decoding request is no
pending work for it (`RouterRequest.drop_prefill_worker`).

Each worker's prefix-cache index is mirrored here for the `prefix` policy, by a
`router.workers.cache_mirror.CacheMirror` per worker (`Worker.cache`): the keys its cache events
reported, the cursor every GetStats sends, and the keys predicted from requests sent there.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvferry.cache.layout import KvLayout
from kvferry.cache.prefix import Tier
from kvferry.cache.stats import PoolStats, TierState, TierStats
from kvferry.errors import Unavailable
from kvferry.settings import DEMAND_TAU_S
from router.workers.cache_mirror import CacheMirror, StoreMirror
from router.workers.client import Channel
from router.workers.decode_client import DecodeClient
from router.workers.prefill_client import PrefillClient

log = logging.getLogger("kvferry.router")


MIN_MEASURED_PUSH_BYTES = 1 << 20
LINK_EWMA_WEIGHT = 0.2

@dataclass(slots=True)
class RecentDemand:
    """A decode worker's recent demand, for the `prefix` policy (router/policies/routing.py): the
    blocks of the requests the router sent it, each decayed by exp(-age / DEMAND_TAU_S).
    Chats come back to the worker holding their history, so this is the load a worker's
    cache draws; it decides where a new conversation starts."""

    blocks: float = 0.0  # as of monotonic time `at`
    at: float = 0.0

    def value(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        return self.blocks * math.exp(-max(0.0, now - self.at) / DEMAND_TAU_S)

    def add(self, blocks: int) -> None:
        """A request needing `blocks` was sent now."""
        now = time.monotonic()
        self.blocks, self.at = self.value(now) + blocks, now


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
    channel: Channel | None
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
    # Discovery no longer names it (scaled down, or gone from DNS): never chosen again, kept
    # only until the requests this router has open there end.
    has_left: bool = False
    refuse_reason: str = ""
    cache: CacheMirror = field(default_factory=CacheMirror)  # its prefix-cache index
    demand: RecentDemand = field(default_factory=RecentDemand)  # blocks recently sent here
    # Measured figures the `priced` policy reads (router.policies.priced); 0: none yet.
    prefill_s_per_token: float = 0.0  # from stats: forward seconds per prompt token
    tiers: tuple[TierStats, ...] = ()  # from stats: the tiers below its pool
    link_bytes_per_s: float = 0.0  # K/V pushed to it, bytes per second (an EWMA)
    # The deployment's shared store as every worker reported it (the router's one mirror of
    # it; None: this worker's store keys are its own only).
    shared_store: StoreMirror | None = None
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
        self.prefill_s_per_token = stats.prefill_s_per_token
        self.tiers = stats.tiers
        for request_id, entry in list(self.in_flight.items()):
            if entry.accepted_at is not None and entry.accepted_at < issued_at:
                del self.in_flight[request_id]  # the snapshot counts it now
        if stats.cache_events is not None:
            self.cache.apply(stats.cache_events)
            if self.shared_store is not None:
                self.shared_store.apply(stats.cache_events)

    def leading_tiers(self, keys: Sequence[bytes]) -> list[Tier]:
        """The fastest tier of each leading key it holds (`CacheMirror.leading_tiers`),
        crediting the shared store's keys while its own store tier is enabled."""
        has_store = any(t.tier is Tier.STORE and t.state is TierState.ENABLED
                        for t in self.tiers)
        return self.cache.leading_tiers(keys, self.shared_store if has_store else None)

    def note_push(self, num_bytes: int, seconds: float) -> None:
        """A K/V push to this (decode) worker took `seconds`: update the link's rate. Pushes
        under MIN_MEASURED_PUSH_BYTES are mostly round trips and are not counted."""
        if num_bytes >= MIN_MEASURED_PUSH_BYTES and seconds > 0:
            sample = num_bytes / seconds
            self.link_bytes_per_s = (sample if not self.link_bytes_per_s else
                                     (1 - LINK_EWMA_WEIGHT) * self.link_bytes_per_s
                                     + LINK_EWMA_WEIGHT * sample)

    def tier_read_bytes_per_s(self, tier: Tier) -> float:
        """What promotions from `tier` read per second there so far (0: none yet)."""
        for stats in self.tiers:
            if stats.tier is tier and stats.promotion_s > 0:
                return stats.bytes_out / stats.promotion_s
        return 0.0

    def forget_cache(self, now: float) -> None:
        """The worker is unhealthy (unreachable, draining, refused, perhaps restarting):
        forget its index, so the next answer is a snapshot. Answers to stats asked for before
        `now` are refused from here on: they describe the worker as it was."""
        self.cache.forget()
        self.stats_issued_at = max(self.stats_issued_at, now)
