"""Routing on the workers' prefix caches with fake workers: the cost
formula of router/policies/routing.py, and the router's mirror of each worker's cache index (events,
snapshots, out-of-order answers, predictions)."""

from __future__ import annotations

import asyncio
import math
from collections import Counter

import pytest

from deploy.args import build_parser, router_settings
from kvferry.cache.allocator import BlockAllocator
from kvferry.cache.layout import KvLayout
from kvferry.cache.prefix import (
    CacheEvent,
    EventsSince,
    Tier,
    block_keys,
    cache_seed,
    max_shared_blocks,
)
from kvferry.cache.stats import PoolStats
from kvferry.rpc import convert
from kvferry.settings import DEMAND_TAU_S, RouterSettings
from kvferry.v1 import worker_pb2
from router.downstream import Downstream
from router.policies import make_policy
from router.policies.routing import HeadroomPolicy, PrefixPolicy
from router.request import RouterRequest
from router.workers import cache_mirror
from router.workers.client import WorkerClient
from router.workers.registry import WorkerSet
from router.workers.worker import Worker

BLOCK = 16
LAYOUT = KvLayout(2, 2, 64, BLOCK, "bfloat16", "fp")
PROMPT = list(range(1000, 1000 + 8 * BLOCK + 5))  # 8 shareable blocks and a partial one
KEYS = block_keys(PROMPT, BLOCK, cache_seed("fp", "bfloat16"),
                  max_shared_blocks(len(PROMPT), BLOCK))


def _stats(total: int = 100, projected: int = 0, pending_tokens: int = 0,
           events: EventsSince | None = None) -> PoolStats:
    return PoolStats(total_blocks=total, free_blocks=total, reserved_blocks=0, num_running=0,
                     num_waiting=0, integrity_ok=True, integrity_error="",
                     projected_blocks=projected, num_pending_prefill_tokens=pending_tokens,
                     cache_events=events)


def _stored(seq: int, keys: list[bytes], snapshot: bool = False) -> EventsSince:
    return EventsSince(seq, [CacheEvent(0, list(keys), [])], snapshot)


def _worker(name: str, total: int = 100, projected: int = 0, pending_tokens: int = 0,
            cached: list[bytes] | None = None, role: str = "decode") -> Worker:
    worker = Worker(address=name, role=role, channel=None, layout=LAYOUT, is_healthy=True)
    worker.apply_stats(_stats(total, projected, pending_tokens,
                              _stored(0, cached or [], snapshot=True)), issued_at=0.0)
    return worker


def _names(workers: list[Worker]) -> list[str]:
    return [w.address for w in workers]


# ---- the cost formula -------------------------------------------------------------------

def test_cached_worker_is_chosen_when_its_headroom_allows() -> None:
    cached = _worker("a", projected=5, cached=KEYS)  # a little busier, but holds the prefix
    empty = _worker("b")
    policy = PrefixPolicy(prefix_weight=1.0)
    assert policy.decode_cost(cached, KEYS) == 0 + 5
    assert policy.decode_cost(empty, KEYS) == 8 + 0
    assert _names(policy.order_decode([empty, cached], need_blocks=10, keys=KEYS)) == ["a", "b"]
    # Headroom alone would have picked the emptier worker.
    assert _names(HeadroomPolicy().order_decode([empty, cached], 10, KEYS)) == ["b", "a"]


def test_by_default_a_turn_stays_with_its_history_against_a_request_more_of_load() -> None:
    """The default weights (a held block worth 4 blocks of load): the worker holding all 8
    blocks of history keeps the next turn although it carries 20 blocks more (one more
    request's worth); with weights 1:1 the turn would move and ship its history."""
    holder = _worker("a", total=200, projected=60, cached=KEYS)
    other = _worker("b", total=200, projected=40)
    assert PrefixPolicy().order_decode([other, holder], 10, KEYS)[0] is holder
    assert PrefixPolicy(prefix_weight=1.0).order_decode([other, holder], 10, KEYS)[0] is other


def _sent(worker: Worker, *blocks: int) -> None:
    """Requests of these sizes sent to `worker` and finished: recent demand, no load left."""
    for i, size in enumerate(blocks):
        worker.add_in_flight(f"r{i}", size, 0)
        worker.done(f"r{i}")


def test_recent_demand_adds_what_was_sent_and_decays() -> None:
    worker = _worker("a")
    _sent(worker, 30, 10)
    sent_at = worker.demand.at
    assert worker.demand.value(sent_at) == pytest.approx(40.0, rel=1e-3)
    assert worker.demand.value(sent_at + DEMAND_TAU_S) == pytest.approx(40.0 / math.e, rel=1e-3)
    assert worker.demand.value(sent_at + 20 * DEMAND_TAU_S) < 1e-6
    assert worker.headroom == 100  # demand is not load: nothing is in flight


def test_a_new_conversation_starts_where_recent_demand_is_lower() -> None:
    """Two idle workers, neither holding the prompt: headroom routing leaves it to the tie
    (the first address, which drew the last three conversations too); the prefix policy sends
    it to the worker whose cache draws less."""
    busy, quiet = _worker("a"), _worker("b")
    _sent(busy, 20, 20, 20)
    assert HeadroomPolicy().order_decode([busy, quiet], 10, KEYS)[0] is busy
    assert PrefixPolicy().order_decode([busy, quiet], 10, KEYS)[0] is quiet
    assert PrefixPolicy(demand_weight=0.0).order_decode([busy, quiet], 10, KEYS)[0] is busy


def test_a_turn_keeps_its_history_unless_the_demand_gap_outweighs_it() -> None:
    """Cost of moving: 16 per block of the 8-block history (128); of staying: 0.25 per block
    of recent demand. 400 blocks of demand (100) keep the turn; 600 (150) move it."""
    for demand, expected in ((400, "a"), (600, "b")):
        holder, other = _worker("a", cached=KEYS), _worker("b")
        _sent(holder, demand)
        assert PrefixPolicy().order_decode([other, holder], 10, KEYS)[0].address == expected


def test_cached_worker_without_room_goes_after_one_with_room() -> None:
    cached = _worker("a", projected=92, cached=KEYS)  # headroom 8, cost 0 + 92
    other = _worker("b", projected=88)  # headroom 12, cost 8 + 88
    policy = PrefixPolicy(prefix_weight=1.0)
    assert _names(policy.order_decode([cached, other], need_blocks=10, keys=KEYS)) == ["b", "a"]
    # Where both have room, the cache wins.
    assert _names(policy.order_decode([cached, other], need_blocks=8, keys=KEYS)) == ["a", "b"]


def test_when_no_worker_has_room_the_cost_still_orders_them() -> None:
    cached = _worker("a", projected=95, cached=KEYS)
    other = _worker("b", projected=96)
    policy = PrefixPolicy(prefix_weight=1.0)
    assert _names(policy.order_decode([other, cached], 10, KEYS)) == ["a", "b"]


def test_only_a_leading_run_of_keys_counts() -> None:
    gap = _worker("a", cached=KEYS[:3] + KEYS[4:])  # block 3 evicted: 3 usable, not 7
    assert gap.cache.num_cached_blocks(KEYS) == 3
    assert PrefixPolicy(prefix_weight=1.0).decode_cost(gap, KEYS) == 5


def test_weights_change_the_decision_as_the_formula_says() -> None:
    cached = _worker("a", projected=6, cached=KEYS)  # cost 1*0 + 1*6 = 6
    empty = _worker("b")  # cost 1*8 + 1*0 = 8
    assert PrefixPolicy(prefix_weight=1.0).order_decode([empty, cached], 1, KEYS)[0] is cached
    heavy_load = PrefixPolicy(prefix_weight=1.0, load_weight=2.0)  # a: 12, b: 8
    assert heavy_load.decode_cost(cached, KEYS) == 12
    assert heavy_load.order_decode([empty, cached], 1, KEYS)[0] is empty
    load_only = PrefixPolicy(prefix_weight=0.0)  # the cache does not count at all
    assert load_only.order_decode([empty, cached], 1, KEYS)[0] is empty
    cache_only = PrefixPolicy(prefix_weight=1.0, load_weight=0.0)
    cached.projected_blocks = 90  # still room for 1 block
    assert cache_only.order_decode([empty, cached], 1, KEYS)[0] is cached


def test_ties_go_to_fewest_in_flight_then_address() -> None:
    a, b, c = _worker("a"), _worker("b"), _worker("c")
    a.num_in_flight = 2
    policy = PrefixPolicy(prefix_weight=1.0)
    assert _names(policy.order_decode([a, c, b], 1, KEYS)) == ["b", "c", "a"]


def test_prefill_goes_where_the_prompt_is_cached_unless_its_queue_outweighs_it() -> None:
    cached = _worker("p1", cached=KEYS, role="prefill")
    empty = _worker("p2", role="prefill")
    policy = PrefixPolicy(prefix_weight=100.0, prefill_prefix_weight=1.0)  # decode's: unused
    n = len(PROMPT)  # 133 tokens: 8.3 blocks, 8 of them cached on p1
    assert policy.prefill_cost(cached, n, KEYS) == pytest.approx(n / BLOCK - 8)
    assert policy.order_prefill([empty, cached], n, KEYS)[0] is cached
    cached.add_in_flight("long", 0, 7 * BLOCK)  # 7 blocks queued: 7.3 < 8.3, still p1
    assert policy.order_prefill([empty, cached], n, KEYS)[0] is cached
    cached.add_in_flight("longer", 0, 2 * BLOCK)  # 9 blocks queued: 9.3 > 8.3
    assert policy.order_prefill([empty, cached], n, KEYS)[0] is empty


def test_a_burst_sharing_a_prefix_stays_together_until_load_outweighs_it() -> None:
    """No events arrive within one refresh interval: the router's own prediction (the keys
    of requests it just sent) keeps a same-prefix burst on one worker, while the load term
    grows by each request's blocks."""
    workers = [_worker("a"), _worker("b")]
    policy = PrefixPolicy(prefix_weight=1.0)
    placed: list[str] = []
    for i in range(5):
        best = policy.order_decode(workers, 2, KEYS)[0]
        best.add_in_flight(f"r{i}", 2, 0, KEYS)
        placed.append(best.address)
    # a: costs 8, then 0+2, 0+4, 0+6, 0+8 (a tie with b's 8 + 0: b has fewer in flight)
    assert placed == ["a", "a", "a", "a", "b"]
    assert Counter(placed) == Counter({"a": 4, "b": 1})


# ---- the cache mirror -------------------------------------------------------------------

def test_events_apply_in_order_and_move_the_cursor() -> None:
    worker = _worker("a")
    k = KEYS
    worker.apply_stats(_stats(events=EventsSince(3, [CacheEvent(0, k[:3], []),
                                                     CacheEvent(0, [], k[:1])], False)), 1.0)
    assert set(worker.cache.keys) == set(k[1:3]) and worker.cache.event_seq == 3
    worker.apply_stats(_stats(events=EventsSince(4, [CacheEvent(0, [], k[2:3])], False)), 2.0)
    assert set(worker.cache.keys) == {k[1]} and worker.cache.event_seq == 4
    worker.apply_stats(_stats(events=EventsSince(4, [], False)), 3.0)  # nothing new
    assert set(worker.cache.keys) == {k[1]} and worker.cache.event_seq == 4


def test_the_mirror_tracks_each_tier_and_keeps_a_key_while_any_tier_holds_it() -> None:
    worker = _worker("a")
    k = KEYS
    worker.apply_stats(_stats(events=EventsSince(3, [
        CacheEvent(0, k[:3], []), CacheEvent(0, k[:2], [], Tier.HOST),
        CacheEvent(0, [], k[:2])], False)), 1.0)  # the device evicts 0, 1: the host keeps them
    assert worker.cache.leading_tiers(k) == [Tier.HOST, Tier.HOST, Tier.DEVICE]
    assert worker.cache.num_cached_blocks(k) == 3
    worker.apply_stats(_stats(events=EventsSince(4, [
        CacheEvent(0, [], k[1:2], Tier.HOST)], False)), 2.0)
    assert worker.cache.leading_tiers(k) == [Tier.HOST]  # no tier holds key 1 now
    assert set(worker.cache.keys) == {k[0], k[2]}
    worker.apply_stats(_stats(events=EventsSince(6, [
        CacheEvent(0, k[2:4], [], Tier.DISK), CacheEvent(0, k[:2], [], Tier.DEVICE)],
        True)), 3.0)  # a snapshot: one event per tier
    assert worker.cache.leading_tiers(k) == [Tier.DEVICE, Tier.DEVICE, Tier.DISK, Tier.DISK]


def test_a_snapshot_replaces_the_set() -> None:
    worker = _worker("a", cached=KEYS[:4])
    worker.apply_stats(_stats(events=_stored(9, KEYS[6:], snapshot=True)), 1.0)
    assert set(worker.cache.keys) == set(KEYS[6:]) and worker.cache.event_seq == 9


def test_an_older_answer_applies_no_events_and_keeps_the_cursor() -> None:
    worker = _worker("a")
    worker.apply_stats(_stats(events=_stored(5, KEYS[:2])), issued_at=2.0)
    worker.apply_stats(_stats(events=_stored(3, KEYS[2:4])), issued_at=1.0)  # issued before
    assert set(worker.cache.keys) == set(KEYS[:2]) and worker.cache.event_seq == 5


def test_a_later_answer_from_an_older_cursor_replays_to_the_same_state() -> None:
    """Two refreshes asked with cursor 1: the first answers with events 2..3, the second
    (issued later) with 2..4. Replaying 2..3 again ends where the log says."""
    worker = _worker("a")
    store, evict = CacheEvent(0, KEYS[:2], []), CacheEvent(0, [], KEYS[:1])
    worker.apply_stats(_stats(events=EventsSince(3, [store, evict], False)), issued_at=1.0)
    worker.apply_stats(_stats(events=EventsSince(
        4, [store, evict, CacheEvent(0, KEYS[5:6], [])], False)), issued_at=2.0)
    assert set(worker.cache.keys) == {KEYS[1], KEYS[5]} and worker.cache.event_seq == 4


def test_an_unhealthy_worker_is_forgotten_and_older_answers_refused() -> None:
    worker = _worker("a", cached=KEYS)
    worker.add_in_flight("r", 1, 0, KEYS[:2])
    worker.forget_cache(now=5.0)
    assert not worker.cache.keys and not worker.cache.predicted
    assert worker.cache.event_seq == 0  # the next GetStats asks for a snapshot
    worker.apply_stats(_stats(events=_stored(7, KEYS)), issued_at=4.0)  # asked before
    assert not worker.cache.keys
    worker.apply_stats(_stats(events=_stored(2, KEYS[:1], snapshot=True)), issued_at=5.0)
    assert set(worker.cache.keys) == {KEYS[0]} and worker.cache.event_seq == 2


def test_predicted_keys_count_until_events_retract_them_or_they_lapse(
        monkeypatch: pytest.MonkeyPatch) -> None:
    worker = _worker("a")
    worker.add_in_flight("r", 1, 0, KEYS)
    assert worker.cache.num_cached_blocks(KEYS) == 8
    worker.apply_stats(_stats(events=EventsSince(2, [CacheEvent(0, KEYS[:6], []),
                                                     CacheEvent(0, [], KEYS[3:4])], False)),
                       1.0)
    assert worker.cache.num_cached_blocks(KEYS) == 3  # evicted, and no longer predicted
    monkeypatch.setattr(cache_mirror, "PREDICTED_KEY_TTL_S", 0.0)
    lapsing = _worker("b")
    lapsing.add_in_flight("r", 1, 0, KEYS)
    assert lapsing.cache.num_cached_blocks(KEYS) == 0


def test_get_stats_sends_the_cursor() -> None:
    class Stub:
        asked: list[int] = []

        async def GetStats(self, request: worker_pb2.GetStatsRequest,  # noqa: N802
                           timeout: float | None = None) -> worker_pb2.WorkerStats:
            self.asked.append(request.cache_events_after)
            return worker_pb2.WorkerStats(cache_event_seq=12, cache_snapshot=True,
                                          cache_events=[worker_pb2.CacheEvent(stored=KEYS)])

        async def Abort(self, request: object, timeout: float | None = None) -> object:
            raise NotImplementedError

    stub = Stub()
    reply = asyncio.run(WorkerClient(stub).get_stats(1.0, cache_events_after=11))
    assert stub.asked == [11]
    assert reply.pool.cache_events == EventsSince(12, [CacheEvent(0, KEYS, [])], True)


def test_a_workers_allocator_reaches_the_router_through_the_proto() -> None:
    """A decode worker's allocator indexes a prompt as the worker does; its events, polled
    from cursor to cursor through WorkerStats, leave the router's mirror equal to the index,
    and the router's own keys for the prompt find it all."""
    allocator = BlockAllocator(64, BLOCK, prefix_caching=True)
    worker = _worker("a")
    downstream = _downstream(PrefixPolicy(prefix_weight=1.0), worker)
    seed = cache_seed(LAYOUT.model_fingerprint, LAYOUT.dtype, "t")

    def poll(issued_at: float) -> None:
        msg = worker_pb2.WorkerStats(total_blocks=64)
        convert.add_cache_events(msg, allocator.events_since(worker.cache.event_seq))
        worker.apply_stats(convert.stats_from_proto(msg), issued_at)

    blocks = allocator.alloc(9)
    allocator.register(block_keys(PROMPT, BLOCK, seed), blocks)
    allocator.free(blocks)
    poll(1.0)  # cursor 0: a snapshot
    assert set(worker.cache.keys) == set(allocator.cached_keys()) and worker.cache.event_seq > 0
    state = RouterRequest("r", cache_salt="t")
    downstream.key_prompt(state, PROMPT)
    assert worker.cache.num_cached_blocks(state.block_keys) == 8
    allocator.alloc(64 - 8 + 2)  # evicts the two least recently released blocks
    poll(2.0)  # events after the cursor
    assert set(worker.cache.keys) == set(allocator.cached_keys())
    assert worker.cache.num_cached_blocks(state.block_keys) == 6


def test_a_tier_survives_the_proto() -> None:
    since = EventsSince(4, [CacheEvent(0, KEYS[:2], [], Tier.HOST),
                            CacheEvent(0, [], KEYS[:1], Tier.STORE)], False)
    msg = worker_pb2.WorkerStats(total_blocks=1)
    convert.add_cache_events(msg, since)
    assert [e.tier for e in msg.cache_events] == [worker_pb2.KV_TIER_HOST,
                                                  worker_pb2.KV_TIER_STORE]
    assert convert.stats_from_proto(msg).cache_events == since


# ---- plumbing: keys, admission, settings --------------------------------------------------

def _downstream(policy: object, *workers: Worker) -> Downstream:
    return Downstream(WorkerSet("fp", workers=list(workers)), policy, lease_s=30.0,
                      admission_timeout_s=0.5)


def test_the_router_keys_prompts_as_the_workers_do() -> None:
    state = RouterRequest("r", cache_salt="tenant")
    _downstream(PrefixPolicy(prefix_weight=1.0), _worker("a")).key_prompt(state, PROMPT)
    seed = cache_seed(LAYOUT.model_fingerprint, LAYOUT.dtype, "tenant")
    assert state.block_keys == block_keys(PROMPT, BLOCK, seed)[:8]
    assert state.block_keys != KEYS  # the salt changes every key
    _downstream(HeadroomPolicy(), _worker("a")).key_prompt(state, PROMPT)
    assert state.block_keys == []  # a policy that does not read them: not computed


def test_admission_orders_decode_workers_on_the_request_keys() -> None:
    cached, empty = _worker("a", projected=3, cached=KEYS), _worker("b")
    downstream = _downstream(PrefixPolicy(prefix_weight=1.0), empty, cached)
    state = RouterRequest("r")
    downstream.key_prompt(state, PROMPT)
    candidates, _ = asyncio.run(downstream._admit(state, need=10, deadline=None))
    assert candidates == [cached, empty]


def test_weights_are_settings_checked_and_reach_the_policy() -> None:
    with pytest.raises(ValueError, match="prefix_weight"):
        RouterSettings(model="m", colocated=("h:1",), prefix_weight=-1.0)
    with pytest.raises(ValueError, match="load_weight"):
        RouterSettings(model="m", colocated=("h:1",), load_weight=float("nan"))
    with pytest.raises(ValueError, match="prefill_prefix_weight"):
        RouterSettings(model="m", colocated=("h:1",), prefill_prefix_weight=-0.5)
    with pytest.raises(ValueError, match="demand_weight"):
        RouterSettings(model="m", colocated=("h:1",), demand_weight=-1.0)
    args = build_parser().parse_args(["router", "--model", "m", "--colocated", "h:1",
                                      "--prefix-weight", "2", "--load-weight", "0.5",
                                      "--prefill-prefix-weight", "3", "--demand-weight", "0.5"])
    settings = router_settings(args)
    assert settings.policy == "prefix"  # the default
    policy = make_policy(settings.policy, settings.prefix_weight, settings.load_weight,
                         settings.prefill_prefix_weight, settings.demand_weight)
    assert isinstance(policy, PrefixPolicy) and isinstance(policy, HeadroomPolicy)
    assert (policy.prefix_weight, policy.load_weight, policy.prefill_prefix_weight,
            policy.demand_weight) == (2.0, 0.5, 3.0, 0.5)
    defaults = router_settings(build_parser().parse_args(["router", "--model", "m",
                                                          "--colocated", "h:1"]))
    assert (defaults.prefix_weight, defaults.prefill_prefix_weight, defaults.demand_weight) == (
        16.0, 4.0, 0.25)


def test_decode_and_prefill_weigh_the_cache_each_with_their_own_weight() -> None:
    """The same worker state priced twice: the decode weight counts the blocks a push would
    carry, the prefill weight the blocks a prefill would compute."""
    policy = PrefixPolicy(prefix_weight=16.0, load_weight=1.0, prefill_prefix_weight=4.0)
    holder = _worker("a", projected=60, cached=KEYS)  # 60 blocks of load, the 8 blocks cached
    other = _worker("b")
    assert policy.decode_cost(other, KEYS) == 16 * 8 and policy.decode_cost(holder, KEYS) == 60
    assert policy.order_decode([other, holder], 1, KEYS)[0] is holder  # 60 < 128: stays
    at_four = PrefixPolicy(prefix_weight=4.0)
    assert at_four.order_decode([other, holder], 1, KEYS)[0] is other  # 60 > 32: moves
    p_holder = _worker("p1", cached=KEYS, role="prefill")
    p_other = _worker("p2", role="prefill")
    p_holder.add_in_flight("queued", 0, 40 * BLOCK)  # 40 blocks of prompt queued there
    n = len(PROMPT)
    assert policy.prefill_cost(p_holder, n, KEYS) == pytest.approx(4 * (n / BLOCK - 8) + 40)
    assert policy.order_prefill([p_holder, p_other], n, KEYS)[0] is p_other  # 41.2 > 33.25
