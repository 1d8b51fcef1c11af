"""The shared store tier: cached blocks in a Redis-protocol server (Valkey, Redis) every worker
of a deployment points at with `--kv-store-url`, so a prefix one worker computed is a hit on
another.

A block is one value, `kvferry:<layout hash>:<key>` -> the codec's header and the block's
bytes, written with `SET NX` (keys name contents: a key already there is already right). The
server owns capacity and eviction (`--maxmemory` with `allkeys-lru`), so what a worker knows
of the store is a hint: a lookup asks the server (pipelined `EXISTS` for the leading run),
then fetches the run in one `MGET`; a value found gone or corrupt ends the run there, is
reported removed, and is recomputed.

A slow store never stalls the worker: calls run on threads of the store's own (one for
lookups, fetches and probes, one for writes), never on the threads host and disk promotions
use; a request with no key left to look up makes no call; each lookup has a deadline
(`--kv-store-deadline-ms`, tens of milliseconds; a fetch adds its bytes at a floor rate),
past which the request goes on without the store's blocks, and a call still queued when its
deadline passed is skipped. A store whose calls keep missing their deadline
(`SLOW_CALLS_TO_DISABLE` in a row) is disabled, as is one that fails a call with anything but
a refused value (an unreachable server, a timeout, a garbage reply that makes the client
raise whatever it raises): one warning, and a probe (`PING` within the deadline, backing off
from 1 to 30 s) enables it again. `known`, the keys this worker has seen there, is an LRU of
at most `MAX_KNOWN_KEYS`: a key it drops is reported removed, so the router's mirror and
GetStats snapshots stay bounded. `redis` is imported only when a store is configured.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

from kvferry.cache.prefix import CacheEvents, Tier
from kvferry.cache.stats import TierState
from kvferry.cache.tiers import codec
from kvferry.settings.tiers import DEFAULT_STORE_DEADLINE_S, redacted_url

log = logging.getLogger("kvferry.tiers")
T = TypeVar("T")

SOCKET_TIMEOUT_S = 1.0
CONNECT_TIMEOUT_S = 0.5
PROBE_S = (1.0, 30.0)  # first and longest wait between probes of a disabled store
# Calls in a row past their deadline that disable the store (then probed like a failed one).
SLOW_CALLS_TO_DISABLE = 3
# A fetch's deadline adds its bytes at this rate (a run of large blocks is not a slow store).
FETCH_FLOOR_BYTES_PER_S = 100e6
# Keys this worker remembers seeing in the store (16 bytes each, and as many in the router's
# mirror of this worker): the least recently seen are dropped, and reported removed, past it.
MAX_KNOWN_KEYS = 1 << 16
# Store writes queued on the store's write thread before new ones are dropped (and counted):
# each holds host slots pinned until the store has taken it.
MAX_QUEUED_WRITES = 8


class StoreTier:
    """A client of the shared store, its two threads, and what this worker has seen of it.
    The index (`known`, state) is the event loop's; the calls run on the store's threads."""

    tier = Tier.STORE

    def __init__(self, url: str, layout: bytes, payload_nbytes: int, events: CacheEvents,
                 namespace: str = "kvferry", password: str | None = None,
                 deadline_s: float = DEFAULT_STORE_DEADLINE_S,
                 max_known_keys: int = MAX_KNOWN_KEYS) -> None:
        import redis

        self.url = redacted_url(url)  # for logs
        # A password given apart (the URL then has none: TierSettings checks).
        extra = {} if password is None else {"password": password}
        self.client = redis.Redis.from_url(url, socket_timeout=SOCKET_TIMEOUT_S,
                                           socket_connect_timeout=CONNECT_TIMEOUT_S, **extra)
        self.layout = layout
        self.payload_nbytes = payload_nbytes
        self.prefix = f"{namespace}:{layout.hex()}:".encode()
        self.events = events
        self.deadline_s = deadline_s
        self.max_known_keys = max_known_keys
        self.state = TierState.ENABLED
        self.known: OrderedDict[bytes, None] = OrderedDict()  # seen there; LRU first
        self.num_corrupt = self.num_dropped_writes = 0
        self.num_evictions = 0  # the server evicts by its own policy and tells no one
        self.num_slow_calls = 0  # calls past their deadline, since start
        self.num_calls = 0  # calls made (lookups, fetches, probes), since start
        self.probe_s = PROBE_S[0]
        self.num_queued_writes = 0
        self._slow_in_a_row = 0
        self._probe: asyncio.Task[None] | None = None
        self._reads = ThreadPoolExecutor(1, thread_name_prefix="kvferry-store-read")
        self._writes = ThreadPoolExecutor(1, thread_name_prefix="kvferry-store-write")

    @property
    def capacity_blocks(self) -> int:
        """Unknown to a client (the server's maxmemory): the blocks this worker has seen
        there, at most `max_known_keys`."""
        return len(self.known)

    def name(self, key: bytes) -> bytes:
        return self.prefix + key.hex().encode()

    # ---- the store's read thread ----------------------------------------------------------
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

    def fetch(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The values of `keys` (None: not there), in one MGET."""
        values = self.client.mget([self.name(key) for key in keys])
        if not isinstance(values, list) or len(values) != len(keys):
            raise TypeError(f"MGET of {len(keys)} keys answered {type(values).__name__}")
        return values

    def ping(self, _keys: Sequence[bytes] = ()) -> bool:
        return bool(self.client.ping())

    # ---- a tier thread --------------------------------------------------------------------
    def verify_into(self, key: bytes, value: bytes, slot: torch.Tensor) -> None:
        """Check a fetched value and copy its block into a host slot; BadValue when it
        fails a check."""
        if not isinstance(value, bytes):
            raise codec.BadValue(f"a {type(value).__name__}, not a block value")
        expected = codec.parse_header(value, self.layout, key, self.payload_nbytes)
        payload = memoryview(value)[codec.HEADER_BYTES:]
        if payload.nbytes != self.payload_nbytes:
            raise codec.BadValue("value shorter than its header says")
        codec.check_payload(payload, expected)
        codec.as_bytes(slot)[:] = payload

    # ---- the store's write thread ---------------------------------------------------------
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

    # ---- the event loop -------------------------------------------------------------------
    @property
    def is_enabled(self) -> bool:
        return self.state is TierState.ENABLED

    async def lookup(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, the store holds; 0 without a call when there
        is no key or the store is disabled, and 0 past the deadline or on a failure."""
        if not keys or not self.is_enabled:
            return 0
        return await self._call(self.leading, keys, self.deadline_s) or 0

    async def fetch_run(self, keys: Sequence[bytes]) -> list[bytes]:
        """The values of the leading run of `keys` the store still holds (an empty list past
        the deadline or on a failure). A key gone since the lookup ends the run, reported
        removed."""
        if not keys or not self.is_enabled:
            return []
        budget = self.deadline_s + len(keys) * self.payload_nbytes / FETCH_FLOOR_BYTES_PER_S
        values = await self._call(self.fetch, keys, budget) or []
        run = 0
        while run < len(values) and values[run] is not None:
            run += 1
        if run < len(values):
            self.removed(keys[run], codec.BadValue("evicted by the store since the lookup"))
        return values[:run]  # type: ignore[return-value]

    async def _call(self, fn: Callable[..., T], keys: Sequence[bytes], budget_s: float
                    ) -> T | None:
        """`fn(keys)` on the read thread within `budget_s`; None past it (counted towards
        disabling the store) or when it failed (the store is then disabled)."""
        self.num_calls += 1
        deadline = time.monotonic() + budget_s
        job = asyncio.wrap_future(self._reads.submit(_in_time, deadline, fn, keys))
        try:
            result = await asyncio.wait_for(asyncio.shield(job), budget_s)
        except TimeoutError:
            self._slow(budget_s)
            return None
        except Exception as exc:  # noqa: BLE001 - any failure is the store's: disable it
            self.failed(exc)
            return None
        if result is None:  # skipped: its deadline passed while it was queued
            self._slow(budget_s)
            return None
        self._slow_in_a_row = 0
        return result

    def _slow(self, budget_s: float) -> None:
        self.num_slow_calls += 1
        self._slow_in_a_row += 1
        if self._slow_in_a_row >= SLOW_CALLS_TO_DISABLE:
            self.failed(TimeoutError(f"{self._slow_in_a_row} calls in a row took longer than "
                                     f"their {budget_s * 1e3:.0f} ms deadline"))

    def queue_write(self, keys: Sequence[bytes], slots: Sequence[torch.Tensor]
                    ) -> Future[tuple[list[bytes], int]] | None:
        """`write` on the store's write thread, or None (dropped and counted) when
        `MAX_QUEUED_WRITES` are queued already."""
        if self.num_queued_writes >= MAX_QUEUED_WRITES:
            self.num_dropped_writes += len(keys)
            return None
        self.num_queued_writes += 1
        return self._writes.submit(self.write, keys, slots)

    def written(self, done: Future[tuple[list[bytes], int]]) -> int:
        """A queued write ended: the keys it holds are known; returns how many it wrote."""
        self.num_queued_writes -= 1
        error = done.exception()
        if error is not None:
            self.failed(error)
            return 0
        held, num_new = done.result()
        self.stored(held)
        return num_new

    def forget(self, key: bytes) -> None:
        """Delete a value that failed its check from the store (best effort)."""
        self._writes.submit(self.delete, key)

    def stored(self, keys: Sequence[bytes]) -> None:
        """Keys seen in the store (written or read): the new ones reported stored; past
        `max_keys`, the least recently seen are dropped and reported removed."""
        new = [key for key in keys if key not in self.known]
        for key in keys:
            self.known[key] = None
            self.known.move_to_end(key)
        dropped = []
        while len(self.known) > self.max_known_keys:
            dropped.append(self.known.popitem(last=False)[0])
        self.events.add([k for k in new if k in self.known], dropped, Tier.STORE)

    def removed(self, key: bytes, error: Exception) -> None:
        """A value found gone or corrupt: credited to no worker. Reported even when this
        worker never reported the key: the router credits a store key any worker wrote to
        every worker (`router.workers.cache_mirror.StoreMirror`)."""
        if "evicted" not in str(error):
            self.num_corrupt += 1
            log.warning("store K/V tier: block %s dropped (%s); it is recomputed",
                        key.hex(), error)
        self.known.pop(key, None)
        self.events.add([], [key], Tier.STORE)

    def failed(self, error: BaseException) -> bool:
        """A call failed. Returns whether it was the server (the tier is now disabled and
        probed) rather than one value: anything but a refused value (`codec.BadValue`) is,
        garbage replies included (redis-py may raise anything on one)."""
        if isinstance(error, codec.BadValue):
            return False
        if self.state is TierState.ENABLED:
            log.warning("store K/V tier %s unreachable or slow (%r): disabled until it "
                        "answers; serving goes on without it", self.url, error)
            self.state = TierState.DISABLED
            self.probe_s = PROBE_S[0]
            removed = list(self.known)
            self.known.clear()
            self.events.add([], removed, Tier.STORE)
        self._start_probe()
        return True

    def _start_probe(self) -> None:
        if self._probe is not None and not self._probe.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a unit test's direct call): nothing to probe on
            return
        self._probe = loop.create_task(self.probe_until_up())

    async def probe_until_up(self) -> None:
        """PING a disabled store, backing off, until it answers within the deadline; then
        enable it (one info line)."""
        while not self.is_enabled:
            await asyncio.sleep(self.probe_s)  # paces the probe of a disabled store
            self.probe_s = min(self.probe_s * 2, PROBE_S[1])
            deadline = time.monotonic() + self.deadline_s
            job = asyncio.wrap_future(self._reads.submit(_in_time, deadline, self.ping, ()))
            try:
                if not await asyncio.wait_for(asyncio.shield(job), self.deadline_s):
                    continue
            except Exception:  # noqa: BLE001 - down or slow still: probe again later
                continue
            log.info("store K/V tier %s answers again: enabled", self.url)
            self._slow_in_a_row = 0
            self.state = TierState.ENABLED

    def keys(self) -> list[bytes]:
        return list(self.known)

    def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
        # Not waited for: a hung store must not hold up the worker's exit (what is queued is
        # a cache's writes, dropped as a full queue's are).
        self._reads.shutdown(wait=False, cancel_futures=True)
        self._writes.shutdown(wait=False, cancel_futures=True)
        self.client.close()


def _in_time(deadline: float, fn: Callable[..., T], keys: Sequence[bytes]) -> T | None:
    """`fn(keys)`, unless its caller stopped waiting while it was queued (then None)."""
    if time.monotonic() > deadline:
        return None
    return fn(keys)
