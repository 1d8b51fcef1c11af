"""Prefix caching: the keys of full K/V blocks, and the log of what an index stores and evicts.

A full block's key is a 128-bit BLAKE2b digest of its parent block's key and its own token
ids, so a key names the whole prefix up to the end of its block, not just the block's tokens
(vLLM's block hashing; SGLang's radix tree keys the same thing by path). The first block's
parent is a seed that covers everything else that changes the block's contents: the K/V
format version, the model fingerprint, the K/V dtype and the request's `cache_salt`, so two
models, two dtypes, two tenants or two ways of computing K/V never share a page. Only full
blocks have keys: a sequence's last, partly filled block stays private, and append-only
decoding never writes a shared block.

The index itself lives in `kvferry.cache.allocator.BlockAllocator` (which blocks hold which
keys, and the least-recently-used order of the ones no request holds), and below it in the
worker's lower tiers (`kvferry.cache.tiers`: host memory, disk, a shared store). `CacheEvents`
is their change log: every store and eviction, in whichever tier, gets a sequence number, and
a router polling a worker's stats asks for the events after the last one it applied (Dynamo's
KV events, pulled instead of published), or gets a snapshot when it fell too far behind.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from enum import IntEnum
from typing import NamedTuple

import numpy as np

from kvferry.errors import InvalidArgument

KEY_BYTES = 16  # 128-bit digests: collisions are out of reach for any cache size
MAX_CACHE_SALT_BYTES = 256
DEFAULT_MAX_EVENTS = 4096
# How K/V is computed for given tokens, beyond what the shapes and dtypes say. Bump it with any
# change to the bytes a block holds for the same tokens and model: rotary handling (positions,
# scaling), the scale layout or quantization codes of quantized pages, the positions an
# eviction policy keeps, the page layout within a block. It is folded into every block key
# (`cache_seed`) and into the disk and store values' layout hash (kvferry.cache.tiers.codec),
# so a bump retires the router's prefix keys and the blocks on disk or in a store together.
# Router and workers must run the same version to share keys (an upgrade does both).
KV_FORMAT_VERSION = 1


def cache_seed(model_fingerprint: str, kv_dtype: str, cache_salt: str = "") -> bytes:
    """The parent key of a sequence's first block."""
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"kvferry-prefix1")
    for part in (f"kv-format-{KV_FORMAT_VERSION}", model_fingerprint, kv_dtype, cache_salt):
        data = part.encode()
        h.update(len(data).to_bytes(4, "little"))
        h.update(data)
    return h.digest()


def block_keys(token_ids: Sequence[int], block_size: int, seed: bytes,
               num_blocks: int | None = None) -> list[bytes]:
    """Keys of the first `num_blocks` full blocks of `token_ids` (default: all full ones)."""
    full = len(token_ids) // block_size
    count = full if num_blocks is None else min(num_blocks, full)
    if count <= 0:
        return []
    # [count, block_size] int32 little-endian: one buffer, sliced per block
    tokens = np.asarray(token_ids[: count * block_size], dtype="<i4").reshape(count, block_size)
    keys: list[bytes] = []
    parent = seed
    for row in tokens:
        h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
        h.update(row.tobytes())
        parent = h.digest()
        keys.append(parent)
    return keys


def max_shared_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Most leading prompt blocks a request may take from the cache. The block holding the
    prompt's last token is always computed (or pushed) afresh: the first token is sampled
    from that position's logits, and it keeps every push at least one block long."""
    return max(num_prompt_tokens - 1, 0) // block_size


def check_skip_blocks(skip_blocks: int, num_prompt_tokens: int, block_size: int) -> None:
    """A push may skip only blocks a reservation can have taken from its cache."""
    most = max_shared_blocks(num_prompt_tokens, block_size)
    if not 0 <= skip_blocks <= most:
        raise InvalidArgument(f"skip_blocks must be in [0, {most}] for a "
                              f"{num_prompt_tokens}-token prompt, got {skip_blocks}",
                              "skip_blocks")


def check_cache_salt(cache_salt: str) -> None:
    if len(cache_salt.encode()) > MAX_CACHE_SALT_BYTES:
        raise InvalidArgument(f"cache_salt is longer than {MAX_CACHE_SALT_BYTES} bytes",
                              "cache_salt")


class Tier(IntEnum):
    """Where a worker holds a cached block, fastest first (proto `KvTier`)."""

    DEVICE = 0  # the K/V pool itself
    HOST = 1  # host memory (--kv-host-cache-size)
    DISK = 2  # local disk (--kv-disk-cache-dir)
    STORE = 3  # a store shared by the deployment's workers (--kv-store-url)


class TierTokens(NamedTuple):
    """Prompt tokens a lookup found in each tier below the pool (promoted into it)."""

    host: int = 0
    disk: int = 0
    store: int = 0


NO_TIER_TOKENS = TierTokens()


class CacheEvent(NamedTuple):
    seq: int
    stored: list[bytes]
    removed: list[bytes]
    tier: Tier = Tier.DEVICE


class EventsSince(NamedTuple):
    """What a poller gets: the latest sequence number, and the events after its cursor (or,
    with `is_snapshot`, one event per tier storing every key it holds now)."""

    seq: int
    events: list[CacheEvent]
    is_snapshot: bool


class CacheEvents:
    """A bounded log of index changes, every tier's in one sequence; the oldest events fall
    off past `max_events`."""

    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS) -> None:
        self.seq = 0
        self._log: deque[CacheEvent] = deque(maxlen=max_events)

    def add(self, stored: list[bytes], removed: list[bytes], tier: Tier = Tier.DEVICE) -> None:
        if stored or removed:
            self.seq += 1
            self._log.append(CacheEvent(self.seq, stored, removed, tier))

    def since(self, after: int, keys_now: Mapping[Tier, Iterable[bytes]]) -> EventsSince:
        """Events after `after`; a snapshot of `keys_now` (each tier's keys) when they are not
        all kept (or the cursor is 0, or from before this worker restarted)."""
        if after == self.seq:
            return EventsSince(self.seq, [], False)
        oldest = self._log[0].seq if self._log else self.seq + 1
        if 0 < after < self.seq and oldest <= after + 1:
            return EventsSince(self.seq, [e for e in self._log if e.seq > after], False)
        return EventsSince(self.seq, [CacheEvent(self.seq, list(keys), [], tier)
                                      for tier, keys in keys_now.items()], True)
