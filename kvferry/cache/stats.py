"""What a worker reports about its K/V pool and queues (the router's load telemetry)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from kvferry.cache.prefix import EventsSince, Tier


class TierState(IntEnum):
    """What a tier below the pool does now (proto TierStats.state)."""

    ENABLED = 0
    READ_ONLY = 1  # full: serves what it holds, takes nothing new
    DISABLED = 2  # failing: neither serves nor takes


@dataclass(frozen=True)
class TierStats:
    """One tier below a worker's pool (mirrors proto TierStats); counters since start."""

    tier: Tier
    capacity_blocks: int
    used_blocks: int  # blocks it holds (visible)
    hit_tokens: int = 0  # prompt tokens served from it (promoted into the pool)
    bytes_in: int = 0  # written into it
    bytes_out: int = 0  # read out of it into the pool
    evictions: int = 0  # blocks it dropped to make room
    dropped_writes: int = 0  # blocks it did not take (full of pinned slots, queue full)
    corrupt_blocks: int = 0  # blocks that failed their check and were dropped
    num_promotions: int = 0  # lookups that promoted blocks from it
    promotion_s: float = 0.0  # their time, summed
    state: TierState = TierState.ENABLED


@dataclass(frozen=True)
class PoolStats:
    """A worker's pool and queue state (mirrors proto WorkerStats)."""

    total_blocks: int
    free_blocks: int
    reserved_blocks: int
    num_running: int
    num_waiting: int
    integrity_ok: bool
    integrity_error: str
    num_preemptions: int = 0
    num_pending_prefill_tokens: int = 0
    num_decode_steps: int = 0
    max_abort_delay_steps: int = 0
    projected_blocks: int = 0
    num_corrupt_pushes: int = 0
    num_parked: int = 0
    num_evictions: int = 0
    num_compiles: int = 0  # compiled packages in use (--compile), built or loaded
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, found
    cached_blocks: int = 0  # held by the prefix cache alone (reclaimable; counted free)
    tiers: tuple[TierStats, ...] = ()  # the tiers below the pool, fastest first
    prefill_s_per_token: float = 0.0  # measured forward time per prompt token (0: none yet)
    tensor_parallel_size: int = 1  # ranks the model is split over (blocks count per rank)
    spec_draft_tokens: int = 0  # speculative decoding: drafts verified
    spec_accepted_tokens: int = 0  # of those, accepted
    # draft model: prompt and accepted positions its catch-ups prefilled on this worker
    # (shipped prompts: only the tokens since)
    spec_draft_prefill_tokens: int = 0
    spec_paused_sequences: int = 0  # drafting paused: recent drafts were not worth their cost
    kv_evicted_blocks: int = 0  # K/V eviction: blocks sequences gave up (not at their end)
    # Prefix-cache index changes since the caller's cursor (GetStats answers only).
    cache_events: EventsSince | None = None
