"""Prefix caching in the allocator: block keys, the index, LRU eviction, the event log.

The state machine drives random alloc / free / register / match sequences and checks after
every step that the integrity check holds, that no block a request holds is ever handed out
again, and that a key always leads to the block it was registered with."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvferry.cache import prefix
from kvferry.cache.allocator import BlockAllocator
from kvferry.cache.pool import KvPool
from kvferry.cache.prefix import (
    KEY_BYTES,
    CacheEvents,
    Tier,
    block_keys,
    cache_seed,
    check_cache_salt,
    check_skip_blocks,
    max_shared_blocks,
)
from kvferry.cache.tiers import codec
from kvferry.errors import InvalidArgument, ResourceExhausted

SEED = cache_seed("fingerprint", "float32")


def test_keys_chain_the_whole_prefix() -> None:
    tokens = list(range(40))
    keys = block_keys(tokens, 16, SEED)
    assert len(keys) == 2 and all(len(k) == KEY_BYTES for k in keys)  # the last 8: no key
    assert block_keys(tokens, 16, SEED) == keys  # deterministic
    changed = block_keys([99] + tokens[1:], 16, SEED)
    assert changed[0] != keys[0] and changed[1] != keys[1]  # block 1 names its parent too
    later = block_keys(tokens[:16] + [99] + tokens[17:], 16, SEED)
    assert later[0] == keys[0] and later[1] != keys[1]
    assert block_keys(tokens, 16, SEED, num_blocks=1) == keys[:1]


@pytest.mark.parametrize("seed", [cache_seed("other", "float32"),
                                  cache_seed("fingerprint", "bfloat16"),
                                  cache_seed("fingerprint", "float32", "tenant-a")])
def test_model_dtype_and_salt_each_change_every_key(seed: bytes) -> None:
    tokens = list(range(32))
    assert set(block_keys(tokens, 16, seed)).isdisjoint(block_keys(tokens, 16, SEED))


def test_a_kv_format_bump_retires_every_key_and_every_stored_block(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """KV_FORMAT_VERSION is in the seed of every block key (router and workers both derive
    theirs with cache_seed) and in the layout hash of disk and store values: a bump changes
    both, a value written before it is refused, and an equal version reads it as before."""
    tokens = list(range(32))
    pool = KvPool(2, 2, 8, 16, 4, torch.float32, prefix_caching=True)
    keys = block_keys(tokens, 16, cache_seed("fingerprint", "float32"))
    layout = codec.layout_hash(pool)
    payload = memoryview(bytes(64))
    head = codec.header(layout, keys[0], payload)
    monkeypatch.setattr(prefix, "KV_FORMAT_VERSION", prefix.KV_FORMAT_VERSION + 1)
    assert set(block_keys(tokens, 16, cache_seed("fingerprint", "float32"))).isdisjoint(keys)
    assert codec.layout_hash(pool) != layout
    with pytest.raises(codec.BadValue, match="another K/V layout"):
        codec.parse_header(head, codec.layout_hash(pool), keys[0], payload.nbytes)
    monkeypatch.undo()
    assert block_keys(tokens, 16, cache_seed("fingerprint", "float32")) == keys
    assert codec.parse_header(head, codec.layout_hash(pool), keys[0], payload.nbytes)


@pytest.mark.parametrize(("num_tokens", "most"), [(1, 0), (16, 0), (17, 1), (32, 1), (33, 2)])
def test_the_block_of_the_last_prompt_token_is_never_shared(num_tokens: int, most: int) -> None:
    assert max_shared_blocks(num_tokens, 16) == most


def test_bad_skip_blocks_and_salt_name_their_field() -> None:
    with pytest.raises(InvalidArgument) as exc:
        check_skip_blocks(2, 32, 16)
    assert exc.value.field == "skip_blocks"
    with pytest.raises(InvalidArgument) as exc:
        check_cache_salt("x" * 257)
    assert exc.value.field == "cache_salt"


def _cached(alloc: BlockAllocator, keys: list[bytes]) -> list[int]:
    """Allocate, index and release blocks for `keys`: what a finished request leaves."""
    ids = alloc.alloc(len(keys))
    alloc.register(keys, ids)
    alloc.free(ids)
    return ids


def test_released_blocks_stay_cached_and_count_as_free() -> None:
    alloc = BlockAllocator(8, block_size=16, prefix_caching=True)
    keys = block_keys(list(range(48)), 16, SEED)
    ids = _cached(alloc, keys)
    assert alloc.num_free == 8 and alloc.num_cached == 3 and alloc.check_integrity().ok
    hits = alloc.match(keys[:2] + [b"\0" * KEY_BYTES], num_query_tokens=48)
    assert hits == ids[:2] and alloc.num_cached == 1 and alloc.num_free == 6
    assert (alloc.num_query_tokens, alloc.num_hit_tokens) == (48, 32)
    assert alloc.match(keys, 48) == ids  # shared again: refcount 2 on the first two
    alloc.free(hits)
    alloc.free(ids)
    assert alloc.num_cached == 3 and alloc.check_integrity().ok


def test_eviction_waits_for_the_free_list_and_takes_the_least_recent_leaf_first() -> None:
    alloc = BlockAllocator(6, block_size=4, prefix_caching=True)
    old = _cached(alloc, block_keys(list(range(8)), 4, SEED))  # 2 blocks, released first
    new = _cached(alloc, block_keys(list(range(100, 108)), 4, SEED))
    taken = alloc.alloc(2)  # the 2 truly free blocks: nothing evicted
    assert not set(taken) & set(old + new) and alloc.num_cached == 4
    assert alloc.alloc(1) == [old[1]]  # the older sequence's last block goes first
    assert alloc.match(block_keys(list(range(8)), 4, SEED), 8) == [old[0]]
    assert alloc.check_integrity().ok


def test_a_block_in_use_is_never_evicted() -> None:
    alloc = BlockAllocator(3, block_size=4, prefix_caching=True)
    keys = block_keys(list(range(12)), 4, SEED)
    ids = alloc.alloc(3)
    alloc.register(keys, ids)
    with pytest.raises(ResourceExhausted):
        alloc.alloc(1)  # every block indexed, but all held
    alloc.free(ids[2:])
    assert alloc.alloc(1) == [ids[2]]
    assert alloc.match(keys, 12) == ids[:2]  # the held ones are still indexed


def test_prefix_caching_off_indexes_nothing() -> None:
    alloc = BlockAllocator(4, block_size=4)
    keys = block_keys(list(range(8)), 4, SEED)
    _cached(alloc, keys)
    assert alloc.num_cached == 0 and alloc.match(keys, 8) == []


def test_events_are_incremental_until_the_log_forgets() -> None:
    alloc = BlockAllocator(4, block_size=4, prefix_caching=True)
    alloc.events._log = alloc.events._log.__class__(maxlen=2)
    a = block_keys(list(range(8)), 4, SEED)
    _cached(alloc, a)
    first = alloc.events_since(0)
    assert first.is_snapshot and set(first.events[0].stored) == set(a)
    assert alloc.events_since(first.seq) == (first.seq, [], False)
    b = block_keys(list(range(50, 58)), 4, SEED)
    _cached(alloc, b)
    alloc.alloc(4)  # evicts all four
    since = alloc.events_since(first.seq)
    assert not since.is_snapshot
    assert [(e.stored, sorted(e.removed)) for e in since.events] == [(b, []),
                                                                    ([], sorted(a + b))]
    alloc.register(block_keys(list(range(90, 94)), 4, SEED), [0])
    assert alloc.events_since(first.seq).is_snapshot  # the log kept only the last 2
    assert alloc.events_since(alloc.events.seq + 5).is_snapshot  # a cursor from before a restart


def test_every_tier_logs_in_one_sequence_and_snapshots_one_event_per_tier() -> None:
    events = CacheEvents()
    a, b = block_keys(list(range(8)), 4, SEED)
    events.add([a, b], [])
    events.add([a], [], Tier.HOST)
    events.add([], [a])
    since = events.since(1, {})
    assert [(e.seq, e.stored, e.removed, e.tier) for e in since.events] == [
        (2, [a], [], Tier.HOST), (3, [], [a], Tier.DEVICE)]
    snapshot = events.since(0, {Tier.DEVICE: [b], Tier.HOST: [a]})
    assert snapshot.is_snapshot and snapshot.seq == 3
    assert [(e.stored, e.tier) for e in snapshot.events] == [([b], Tier.DEVICE),
                                                             ([a], Tier.HOST)]


class AllocatorMachine(RuleBasedStateMachine):
    """Requests take blocks (matched from the cache or fresh), index some, release them."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = BlockAllocator(12, block_size=2, prefix_caching=True)
        self.held: list[list[int]] = []  # each request's blocks
        self.registered: dict[bytes, int] = {}  # what the index should hold, while it does
        self.next_token = 0

    def _prefix_keys(self, prefix: int, length: int) -> list[bytes]:
        return block_keys([prefix] * 2 * length, 2, SEED)  # a few prefixes, shared often

    @rule(prefix=st.integers(0, 3), length=st.integers(1, 5), extra=st.integers(0, 3))
    def request(self, prefix: int, length: int, extra: int) -> None:
        keys = self._prefix_keys(prefix, length)
        busy = {b for ids in self.held for b in ids}
        hits = self.alloc.match(keys, 2 * length)
        for key, block_id in zip(keys, hits):
            assert self.registered[key] == block_id  # a key leads to its own block
        try:
            fresh = self.alloc.alloc(len(keys) - len(hits) + extra)
        except ResourceExhausted:
            self.alloc.free(hits)
            return
        assert not set(fresh) & busy, "a block in use was handed out again"
        self._forget_evicted()
        ids = hits + fresh
        self.alloc.register(keys, ids)
        for key, block_id in zip(keys, ids):
            self.registered.setdefault(key, block_id)
        self.held.append(ids)

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 100))
    def release(self, index: int) -> None:
        self.alloc.free(self.held.pop(index % len(self.held)))

    def _forget_evicted(self) -> None:
        indexed = set(self.alloc.cached_keys())
        self.registered = {k: b for k, b in self.registered.items() if k in indexed}

    @invariant()
    def consistent(self) -> None:
        report = self.alloc.check_integrity()
        assert report.ok, report.error
        self._forget_evicted()
        assert self.alloc.num_used == len({b for ids in self.held for b in ids})


AllocatorMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                              deadline=None)
test_allocator_with_a_prefix_cache = AllocatorMachine.TestCase
