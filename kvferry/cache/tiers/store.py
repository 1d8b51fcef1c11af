"""The shared store tier: cached blocks in a Redis-protocol server (Valkey, Redis) every worker
of a deployment points at with `--kv-store-url`, so a prefix one worker computed is a hit on
another.

A block is one value, `kvferry:<layout hash>:<key>` -> the codec's header and the block's
bytes, written with `SET NX` (keys name contents: a key already there is already right). The
server owns capacity and eviction (`--maxmemory` with `allkeys-lru`), so what a worker knows
of the store is a hint: a lookup asks the server (pipelined `EXISTS` for the leading run),
and a value found gone or corrupt when read ends the run there, is reported removed, and is
recomputed. Calls run on the tiered cache's threads with short timeouts; a failing server
disables the tier with one warning, and a probe (`PING`, backing off from 1 to 30 s) enables
it again. `redis` is imported only when a store is configured.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import Executor

import torch

from kvferry.cache.prefix import CacheEvents, Tier
from kvferry.cache.stats import TierState
from kvferry.cache.tiers import codec
from kvferry.cache.tiers.config import redacted_url

log = logging.getLogger("kvferry.tiers")

SOCKET_TIMEOUT_S = 1.0
CONNECT_TIMEOUT_S = 0.5
PROBE_S = (1.0, 30.0)  # first and longest wait between probes of a disabled store


class StoreTier:
    """A client of the shared store, and what this worker has seen of it."""

    tier = Tier.STORE

    def __init__(self, url: str, layout: bytes, payload_nbytes: int, events: CacheEvents,
                 namespace: str = "kvferry", password: str | None = None) -> None:
        import redis

        self.url = redacted_url(url)  # for logs
        # A password given apart (the URL then has none: TierSettings checks).
        extra = {} if password is None else {"password": password}
        self.client = redis.Redis.from_url(url, socket_timeout=SOCKET_TIMEOUT_S,
                                           socket_connect_timeout=CONNECT_TIMEOUT_S, **extra)
        self.errors: tuple[type[Exception], ...] = (redis.RedisError, OSError)
        self.layout = layout
        self.payload_nbytes = payload_nbytes
        self.prefix = f"{namespace}:{layout.hex()}:".encode()
        self.events = events
        self.state = TierState.ENABLED
        self.known: dict[bytes, None] = {}  # keys this worker wrote or read there
        self.num_corrupt = self.num_dropped_writes = 0
        self.num_evictions = 0  # the server evicts by its own policy and tells no one
        self.probe_s = PROBE_S[0]

    @property
    def capacity_blocks(self) -> int:
        """Unknown to a client (the server's maxmemory): the blocks this worker has seen."""
        return len(self.known)

    def name(self, key: bytes) -> bytes:
        return self.prefix + key.hex().encode()

    # ---- a tier thread ------------------------------------------------------------------
    def leading(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, the store holds (one round trip)."""
        if not keys:
            return 0
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self.name(key))
        count = 0
        for found in pipe.execute():
            if not found:
                break
            count += 1
        return count

    def read_into(self, key: bytes, slot: torch.Tensor) -> None:
        """GET `key` and verify it into a host slot; BadValue when gone or failing a check."""
        value = self.client.get(self.name(key))
        if value is None:
            raise codec.BadValue("evicted by the store since the lookup")
        expected = codec.parse_header(value, self.layout, key, self.payload_nbytes)
        payload = memoryview(value)[codec.HEADER_BYTES:]
        if payload.nbytes != self.payload_nbytes:
            raise codec.BadValue("value shorter than its header says")
        codec.check_payload(payload, expected)
        codec.as_bytes(slot)[:] = payload

    def write(self, keys: Sequence[bytes], slots: Sequence[torch.Tensor]
              ) -> tuple[list[bytes], int]:
        """Store blocks the store lacks (`SET NX`, pipelined); returns the keys it holds now
        and how many of them this call wrote."""
        pipe = self.client.pipeline(transaction=False)
        for key, slot in zip(keys, slots):
            payload = codec.as_bytes(slot)
            pipe.set(self.name(key), codec.header(self.layout, key, payload) + payload,
                     nx=True)
        results = pipe.execute(raise_on_error=False)
        held, num_new = [], 0
        for key, result in zip(keys, results):
            if isinstance(result, Exception):  # refused (OOM under noeviction, say)
                self.num_dropped_writes += 1
            else:
                held.append(key)
                num_new += bool(result)  # None: the key was there already
        return held, num_new

    def delete(self, key: bytes) -> None:
        self.client.delete(self.name(key))

    def ping(self) -> None:
        self.client.ping()

    # ---- the event loop -----------------------------------------------------------------
    @property
    def is_enabled(self) -> bool:
        return self.state is TierState.ENABLED

    def stored(self, keys: Sequence[bytes]) -> None:
        new = [key for key in keys if key not in self.known]
        self.known.update(dict.fromkeys(new))
        self.events.add(new, [], Tier.STORE)

    def removed(self, key: bytes, error: Exception) -> None:
        """A value found gone or corrupt: credited to no worker. Reported even when this
        worker never reported the key: the router credits a store key any worker wrote to
        every worker (`router.cache_mirror.StoreMirror`)."""
        if "evicted" not in str(error):
            self.num_corrupt += 1
            log.warning("store K/V tier: block %s dropped (%s); it is recomputed",
                        key.hex(), error)
        self.known.pop(key, None)
        self.events.add([], [key], Tier.STORE)

    def failed(self, error: BaseException) -> bool:
        """A call failed. Returns whether it was the server (the tier is now disabled; the
        caller probes it) rather than one value."""
        if not isinstance(error, self.errors):
            return False
        if self.state is TierState.ENABLED:
            log.warning("store K/V tier %s unreachable (%r): disabled until it answers; "
                        "serving goes on without it", self.url, error)
            self.state = TierState.DISABLED
            self.probe_s = PROBE_S[0]
            removed = list(self.known)
            self.known.clear()
            self.events.add([], removed, Tier.STORE)
        return True

    async def probe_until_up(self, executor: Executor) -> None:
        """PING a disabled store on `executor`, backing off, until it answers; then enable
        it (one info line)."""
        while not self.is_enabled:
            await asyncio.sleep(self.probe_s)  # paces the probe of a disabled store
            self.probe_s = min(self.probe_s * 2, PROBE_S[1])
            try:
                await asyncio.wrap_future(executor.submit(self.ping))
            except self.errors:
                continue
            log.info("store K/V tier %s answers again: enabled", self.url)
            self.state = TierState.ENABLED

    def keys(self) -> list[bytes]:
        return list(self.known)
