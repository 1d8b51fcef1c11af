"""The `priced` policy: each cached source priced in seconds from
measured figures. A device hit on a busy prefill worker against a host hit on an idle one,
and a miss beside a store hit, each on both sides of the formula's break-even; a slow tier
is never priced above a recompute; with no lower-tier hits and workers that measure alike it
orders exactly as the prefix policy; without figures it is the prefix policy."""

from __future__ import annotations

import random

import pytest

from kvferry.cache.layout import KvLayout
from kvferry.cache.prefix import (
    CacheEvent,
    EventsSince,
    Tier,
    block_keys,
    cache_seed,
    max_shared_blocks,
)
from kvferry.cache.stats import PoolStats, TierState, TierStats
from router.policies import make_policy
from router.policies.priced import PricedPolicy
from router.policies.routing import PrefixPolicy
from router.workers.cache_mirror import StoreMirror
from router.workers.worker import Worker

BLOCK = 16
LAYOUT = KvLayout(2, 2, 64, BLOCK, "bfloat16", "fp")
B = 2 * LAYOUT.bytes_per_layer_block  # bytes per block (both layers)
PROMPT = list(range(1000, 1000 + 8 * BLOCK + 5))  # 8 shareable blocks and a partial one
KEYS = block_keys(PROMPT, BLOCK, cache_seed("fp", "bfloat16"),
                  max_shared_blocks(len(PROMPT), BLOCK))
S_TOK = 1e-3  # seconds per prompt token


def _worker(name: str, role: str = "prefill", pending_tokens: int = 0, projected: int = 0,
            cached: dict[Tier, list[bytes]] | None = None, s_tok: float = S_TOK,
            read_bytes_per_s: dict[Tier, float] | None = None,
            link_bytes_per_s: float = 0.0, store: StoreMirror | None = None,
            store_state: TierState = TierState.ENABLED) -> Worker:
    """A worker whose stats say it holds `cached` keys per tier and promotions from each
    tier ran at `read_bytes_per_s` (one promotion of 100 blocks; a store tier in
    `store_state`), sharing the router's `store` mirror."""
    events = [CacheEvent(0, keys, [], tier) for tier, keys in (cached or {}).items()]
    tiers = tuple(TierStats(tier, 1000, 0, bytes_out=100 * B, num_promotions=1,
                            promotion_s=100 * B / rate,
                            state=store_state if tier is Tier.STORE else TierState.ENABLED)
                  for tier, rate in (read_bytes_per_s or {}).items())
    worker = Worker(address=name, role=role, channel=None, layout=LAYOUT, is_healthy=True,
                    shared_store=store)
    worker.apply_stats(PoolStats(
        total_blocks=100, free_blocks=100, reserved_blocks=0, num_running=0, num_waiting=0,
        integrity_ok=True, integrity_error="", projected_blocks=projected,
        num_pending_prefill_tokens=pending_tokens, tiers=tiers, prefill_s_per_token=s_tok,
        cache_events=EventsSince(1, events, True)), issued_at=0.0)
    worker.link_bytes_per_s = link_bytes_per_s
    return worker


def _names(workers: list[Worker]) -> list[str]:
    return [w.address for w in workers]


@pytest.mark.parametrize("pending_tokens, expected", [(40, "busy"), (90, "idle")])
def test_a_device_hit_on_a_busy_worker_against_a_host_hit_on_an_idle_one(
        pending_tokens: int, expected: str) -> None:
    """The idle worker reads a block from host memory in 8 ms: 64 ms for the 8 it holds
    there. The busy worker holds them on the device but has a queue at 1 ms a token: the
    break-even is 64 queued tokens, and the cases sit on either side of it."""
    policy = PricedPolicy()
    busy = _worker("busy", pending_tokens=pending_tokens, cached={Tier.DEVICE: KEYS})
    idle = _worker("idle", cached={Tier.HOST: KEYS}, read_bytes_per_s={Tier.HOST: B / 0.008})
    fetch = policy.fetch_s(idle, [Tier.HOST] * 8, S_TOK)
    assert fetch == pytest.approx(8 * 0.008)  # 64 ms: under 16 ms per block recomputed
    busy_cost = policy.priced_prefill(busy, len(PROMPT), KEYS)
    idle_cost = policy.priced_prefill(idle, len(PROMPT), KEYS)
    assert busy_cost == pytest.approx(S_TOK * pending_tokens + policy.alpha * S_TOK * 5)
    assert idle_cost == pytest.approx(fetch + policy.alpha * S_TOK * 5)
    assert _names(policy.order_prefill([busy, idle], len(PROMPT), KEYS))[0] == expected
    # The tier-agnostic prefix policy sees two equal hits and takes the emptier queue.
    assert _names(PrefixPolicy().order_prefill([busy, idle], len(PROMPT), KEYS))[0] == "idle"


@pytest.mark.parametrize("queue, expected", [(400, "store"), (500, "miss")])
def test_a_miss_beside_a_store_hit(queue: int, expected: str) -> None:
    """The store worker reads its 8 blocks at 4 ms each (32 ms) and has `queue` tokens
    queued (1 ms each); the idle worker misses and computes 128 more tokens, weighed
    alpha = 4 (512 ms). The break-even is a queue of 480 tokens."""
    policy = PricedPolicy()
    rate = B / 0.004
    store = _worker("store", pending_tokens=queue, cached={Tier.STORE: KEYS},
                    read_bytes_per_s={Tier.STORE: rate})
    miss = _worker("miss")
    store_cost = S_TOK * queue + 8 * 0.004 + policy.alpha * S_TOK * 5
    miss_cost = policy.alpha * S_TOK * len(PROMPT)
    assert policy.priced_prefill(store, len(PROMPT), KEYS) == pytest.approx(store_cost)
    assert policy.priced_prefill(miss, len(PROMPT), KEYS) == pytest.approx(miss_cost)
    assert (store_cost < miss_cost) == (expected == "store")
    assert _names(policy.order_prefill([miss, store], len(PROMPT), KEYS))[0] == expected


def _events(worker: Worker, seq: int, events: list[CacheEvent], is_snapshot: bool = False
            ) -> None:
    worker.apply_stats(PoolStats(
        total_blocks=100, free_blocks=100, reserved_blocks=0, num_running=0, num_waiting=0,
        integrity_ok=True, integrity_error="", tiers=worker.tiers,
        prefill_s_per_token=worker.prefill_s_per_token,
        cache_events=EventsSince(seq, events, is_snapshot)), issued_at=float(seq))


def test_a_store_block_one_worker_wrote_is_a_store_hit_on_every_worker_sharing_the_store(
        ) -> None:
    """The writer reported its 8 blocks in the store. A worker whose store tier is enabled
    but never saw them is credited 8 store hits, and the policy takes it over a plain miss;
    a worker with no store tier, or with it disabled, is credited none. A removal reported
    by any worker (a read found the value evicted) ends the credit there for all; a writer's
    snapshot after a restart (it no longer knows those keys) does not."""
    policy = PricedPolicy()
    shared = StoreMirror()
    rate = {Tier.STORE: B / 0.004}
    writer = _worker("writer", pending_tokens=2000, cached={Tier.STORE: KEYS},
                     read_bytes_per_s=rate, store=shared)
    reader = _worker("reader", read_bytes_per_s=rate, store=shared)
    plain = _worker("plain", store=shared)
    down = _worker("down", read_bytes_per_s=rate, store=shared, store_state=TierState.DISABLED)
    assert reader.leading_tiers(KEYS) == [Tier.STORE] * 8
    assert plain.leading_tiers(KEYS) == down.leading_tiers(KEYS) == []
    assert reader.cache.keys == {}  # credited from the shared mirror, not its own events
    assert policy.priced_prefill(reader, len(PROMPT), KEYS) == pytest.approx(
        8 * 0.004 + policy.alpha * S_TOK * 5)
    order = policy.order_prefill([plain, down, writer, reader], len(PROMPT), KEYS)
    assert _names(order)[0] == "reader"
    _events(plain, 2, [CacheEvent(1, [], [KEYS[3]], Tier.STORE)])  # evicted: a plain's read
    assert reader.leading_tiers(KEYS) == [Tier.STORE] * 3
    assert writer.leading_tiers(KEYS) == [Tier.STORE] * 3  # its own report is stale now
    _events(writer, 3, [CacheEvent(2, [], [], Tier.STORE)], is_snapshot=True)
    assert writer.leading_tiers(KEYS) == [Tier.STORE] * 3  # from the shared mirror now
    assert writer.cache.keys == {}


def test_the_store_mirror_keeps_the_most_recently_reported_keys() -> None:
    shared = StoreMirror(max_keys=4)
    shared.apply(EventsSince(1, [CacheEvent(1, KEYS[:6], [], Tier.STORE),
                                 CacheEvent(2, KEYS[6:], [], Tier.HOST)], False))
    assert list(shared.keys) == KEYS[2:6]  # the host tier's keys are not the store's
    shared.apply(EventsSince(2, [CacheEvent(3, [KEYS[2]], [], Tier.STORE)], False))
    assert list(shared.keys) == [*KEYS[3:6], KEYS[2]]


def test_a_slow_tier_costs_no_more_than_recomputing() -> None:
    policy = PricedPolicy()
    slow = _worker("slow", cached={Tier.DISK: KEYS}, read_bytes_per_s={Tier.DISK: B / 10.0})
    assert policy.fetch_s(slow, [Tier.DISK] * 8, S_TOK) == pytest.approx(8 * BLOCK * S_TOK)


def test_decode_prices_the_blocks_a_worker_lacks_over_its_link() -> None:
    policy = PricedPolicy()
    link = B / 0.01  # 10 ms per block pushed
    holder = _worker("holder", "decode", projected=30, cached={Tier.HOST: KEYS},
                     read_bytes_per_s={Tier.HOST: B / 0.001}, link_bytes_per_s=link)
    empty = _worker("empty", "decode", link_bytes_per_s=link)
    holder_cost = 8 * 0.001 + 0.01 / policy.prefix_weight * 30
    empty_cost = 8 * 0.01
    assert policy.priced_decode(holder, KEYS, S_TOK) == pytest.approx(holder_cost)
    assert policy.priced_decode(empty, KEYS, S_TOK) == pytest.approx(empty_cost)
    assert _names(policy.order_decode([empty, holder], 10, KEYS)) == ["holder", "empty"]


def test_without_lower_tiers_it_orders_as_the_prefix_policy() -> None:
    rng = random.Random(3)
    priced, prefix = PricedPolicy(), PrefixPolicy()
    for _ in range(200):
        workers = [_worker(f"w{i}", "decode", pending_tokens=rng.randrange(0, 500),
                           projected=rng.randrange(0, 60),
                           cached={Tier.DEVICE: KEYS[:rng.randrange(0, 9)]},
                           link_bytes_per_s=B / 0.01) for i in range(4)]
        for worker in workers:
            worker.add_in_flight(f"r{worker.address}", rng.randrange(0, 5), 0)
        assert (_names(priced.order_prefill(workers, len(PROMPT), KEYS))
                == _names(prefix.order_prefill(workers, len(PROMPT), KEYS)))
        assert (_names(priced.order_decode(workers, 10, KEYS))
                == _names(prefix.order_decode(workers, 10, KEYS)))


def test_without_figures_it_is_the_prefix_policy() -> None:
    unmeasured = [_worker("a", s_tok=0.0, cached={Tier.HOST: KEYS}),
                  _worker("b", s_tok=0.0, pending_tokens=50)]
    assert (_names(PricedPolicy().order_prefill(unmeasured, len(PROMPT), KEYS))
            == _names(PrefixPolicy().order_prefill(unmeasured, len(PROMPT), KEYS)))
    assert make_policy("priced", prefix_weight=8.0).prefix_weight == 8.0


def test_the_router_measures_each_link_and_reads_each_tiers_rate() -> None:
    worker = _worker("d", "decode", read_bytes_per_s={Tier.HOST: 5e9})
    worker.note_push(512 << 10, 0.1)  # under 1 MiB: mostly a round trip, not counted
    assert worker.link_bytes_per_s == 0.0
    worker.note_push(2 << 20, 1.0)
    worker.note_push(4 << 20, 1.0)
    assert worker.link_bytes_per_s == pytest.approx(0.8 * (2 << 20) + 0.2 * (4 << 20))
    assert worker.tier_read_bytes_per_s(Tier.HOST) == pytest.approx(5e9)
    assert worker.tier_read_bytes_per_s(Tier.DISK) == 0.0
