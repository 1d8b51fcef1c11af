"""Prefill engine: prompts -> batched K/V in the local pool -> first tokens -> pages shipped.

The local blocks live only as long as the request: they are freed when the push is accepted,
fails, or the caller goes away, and never while a forward pass may still write into them.

A deferred prefill (no decode reservation yet) parks its K/V here after its first token until
the router ships it. Parked K/V must never starve a prefill whose decode reservation is
waiting: that reservation holds the decode memory the parked requests wait for, so neither
would move. Deferred prefills therefore get blocks only while no other prefill waits for
some, and a prefill that finds the pool short evicts parked K/V, newest first. The router
then prefills an evicted request again once it has a reservation (Ship answers NOT_FOUND).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvferry.cache.allocator import IntegrityReport
from kvferry.cache.block_queue import BlockQueue
from kvferry.cache.budget import blocks_for_tokens
from kvferry.cache.layout import KvLayout
from kvferry.cache.pool import KvPool
from kvferry.cache.prefix import (
    TierTokens,
    block_keys,
    cache_seed,
    check_skip_blocks,
    max_shared_blocks,
)
from kvferry.cache.stats import PoolStats
from kvferry.cache.tiers.tiered import TieredCache, TierHit
from kvferry.errors import Aborted, InvalidArgument, NotFound, Unavailable
from kvferry.model.eviction import make_eviction
from kvferry.model.grammar import Guide, guide_for
from kvferry.model.logprobs import TokenLogprob
from kvferry.model.prefill_batch import PrefillBatcher, PrefillJob
from kvferry.model.sampling import SamplingParams, validate_prompt
from kvferry.model.transformer import Transformer
from kvferry.settings import (
    DEFAULT_MAX_WAITING,
    DEFAULT_PREFILL_CHUNK_SIZE,
    DEFAULT_PREFILL_TOKEN_BUDGET,
    KvEvictionConfig,
)
from kvferry.transfer.sender import DraftPush, KvSender, PushResult
from prefill_worker.draft_kv import DraftPrefill

log = logging.getLogger("kvferry.prefill")


class FirstTokenEvent(NamedTuple):
    token_id: int
    prefill_s: float
    num_cached_tokens: int = 0  # leading prompt tokens the prefix cache held
    cached_by_tier: TierTokens = TierTokens()  # of those, promoted from each lower tier
    sample_token_ids: tuple[int, ...] = ()  # parallel sampling: samples 1..n-1
    logprobs: tuple[TokenLogprob, ...] = ()  # SamplingParams.logprobs: the first tokens'
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # and prompt_logprobs: prompt[1:]'s


class PushedEvent(NamedTuple):
    kv_transfer_s: float
    kv_bytes: int


@dataclass(slots=True)
class Parked:
    """A deferred prefill's K/V, complete, waiting for Ship to name its decode worker."""

    job: PrefillJob
    ship: asyncio.Future[tuple[str, int]]  # decode address, blocks it holds already
    is_evicted: bool = False  # its blocks were freed to make room: the router prefills again


class _DraftRun:
    """One request's draft prefill (`DraftPrefill`, none without one): started after the
    first token on the engine's executor; the push sends its pages once it is done."""

    def __init__(self, draft: DraftPrefill | None) -> None:
        self.draft = draft
        self.done: asyncio.Future[None] | None = (
            None if draft is None else asyncio.get_running_loop().create_future())
        self._task: asyncio.Future[None] | None = None

    def push(self, first_block: int) -> DraftPush | None:
        """What a push carries of the draft: nothing where the decode worker's prefix cache
        holds the first blocks (its draft model recomputes them)."""
        if self.draft is None or first_block:
            return None
        return DraftPush(self.draft.layout, self.draft.pool, self._ready)

    async def _ready(self) -> None:
        assert self.done is not None  # noqa: S101 - push() hands this out only with a draft
        await asyncio.shield(self.done)

    def start(self, executor: ThreadPoolExecutor, prompt: list[int], blocks: list[int]
              ) -> None:
        if self.draft is None or self.done is None:
            return
        self._task = asyncio.get_running_loop().run_in_executor(executor, self.draft.run,
                                                                prompt, blocks)
        self._task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Future[None]) -> None:
        if self.done is None or self.done.done():
            return
        if task.cancelled():
            self.done.cancel()
        elif (exc := task.exception()) is not None:
            self.done.set_exception(exc)
        else:
            self.done.set_result(None)

    async def end(self) -> None:
        """The request ended: wait for a draft forward still writing into its blocks."""
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        if self.done is not None and not self.done.done():
            self.done.cancel()
        elif self.done is not None and not self.done.cancelled():
            self.done.exception()  # retrieved: the push that needed it has ended


async def _to_its_end(cleanup: Coroutine[Any, Any, None]) -> None:
    """Run `cleanup` to its end even if the caller is cancelled again meanwhile (a stream
    cancelled while it already unwinds): cut short, a request's cleanup leaks its blocks."""
    await asyncio.shield(asyncio.ensure_future(cleanup))


class PrefillEngine:
    """Validates prompts, queues them on the batcher, pushes each one's pages when done."""

    def __init__(self, model: Transformer, pool: KvPool, layout: KvLayout,
                 sender: KvSender, token_budget: int = DEFAULT_PREFILL_TOKEN_BUDGET,
                 chunk_size: int = DEFAULT_PREFILL_CHUNK_SIZE,
                 max_waiting: int = DEFAULT_MAX_WAITING, cache: TieredCache | None = None,
                 draft: DraftPrefill | None = None, eviction: KvEvictionConfig | None = None
                 ) -> None:
        self.model = model
        # --kv-eviction: a prompt past the budget evicts while prefilled; its kept pages and
        # eviction state are pushed once it is done (kvferry/model/eviction.py).
        self.eviction = make_eviction(eviction, model, pool)
        self.draft = draft  # --speculative-draft-kv ship: the draft's prompt K/V, pushed too
        self.pool = pool
        self.layout = layout
        self.sender = sender
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill")
        self._wake = asyncio.Event()
        self.batcher = PrefillBatcher(model, pool, self._executor, self._wake.set,
                                      token_budget, chunk_size, self.eviction)
        self.blocks = BlockQueue(pool.allocator, max_waiting, on_wait=self._evict_parked)
        self.cache = cache or TieredCache(pool)  # the prefix cache, over its tiers
        self.cache.on_release = self.blocks.grant
        self._active: dict[str, asyncio.Task[object]] = {}
        # Deferred prefills waiting for Ship, oldest first (dicts keep insertion order).
        self._parked: dict[str, Parked] = {}
        self.num_evictions = 0
        self._loop_task: asyncio.Task[None] | None = None
        self.is_draining = False  # SIGTERM: no new prompts; the ones here run to the end
        self.kv_bytes_sent = 0

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self.batcher.loop(self._wake))

    def drain(self) -> None:
        self.is_draining = True

    @property
    def is_idle(self) -> bool:
        return not self._active

    async def stop(self) -> None:
        for task in list(self._active.values()):
            task.cancel()
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._executor.shutdown(wait=True)
        self.cache.close()
        await self.sender.close()

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams,
                  num_samples: int, output_index: int) -> Guide | None:
        """Refuse bad input naming its field; the first token's matcher where the request
        is constrained (past the earlier legs' outputs at the prompt's tail)."""
        if self.is_draining:
            raise Unavailable("draining: this worker is shutting down")
        if not request_id:
            raise InvalidArgument("request_id must be non-empty", "request_id")
        if request_id in self._active:
            raise InvalidArgument(f"request_id {request_id!r} is already prefilling",
                                  "request_id")
        validate_prompt(prompt, self.model.config.vocab_size,
                        self.model.config.max_position_embeddings)
        params.validate(self.model.config.vocab_size)
        if num_samples < 1:
            raise InvalidArgument("num_samples must be >= 1", "num_samples")
        return guide_for(self.model.config, params.constraint,
                         prompt[len(prompt) - output_index:])

    async def prefill(
        self, request_id: str, prompt: list[int], params: SamplingParams,
        decode_address: str, timeout_s: float | None, output_index: int = 0,
        defer_push: bool = False, cache_salt: str = "", skip_blocks: int = 0,
        num_samples: int = 1,
    ) -> AsyncIterator[FirstTokenEvent | PushedEvent]:
        """Yield the first token (of each of `num_samples` samples) as soon as it exists, then
        the push's completion.

        With `defer_push` there is no decode reservation yet: the K/V stays in this pool after
        the first token until `ship` names the decode worker (the router streams the first
        token meanwhile, so its TTFT does not wait for decode memory)."""
        if defer_push and decode_address:
            raise InvalidArgument("defer_push needs an empty decode_address", "defer_push")
        guide = self._validate(request_id, prompt, params, num_samples, output_index)
        check_skip_blocks(skip_blocks, len(prompt), self.pool.block_size)
        keys = self._block_keys(prompt, cache_salt)
        # (prompt logprobs need every position's logits: no cached prefix serves them)
        hit = await self._acquire(request_id, prompt, [] if params.prompt_logprobs is not None
                                  else keys, defer_push)
        blocks, num_cached = hit.block_ids, hit.num_cached * self.pool.block_size
        job = PrefillJob(request_id, prompt, params, blocks,
                         asyncio.get_running_loop().create_future(), output_index,
                         num_computed=num_cached, num_samples=num_samples, guide=guide)
        push: asyncio.Future[PushResult] | None = None
        parked: Parked | None = None
        draft = _DraftRun(self.draft)
        evicts = self._evicts(prompt, params, skip_blocks)
        try:
            self.batcher.submit(job)
            if decode_address and not evicts:
                # Layer-pipelined: the push starts now and sends each layer group as soon
                # as the prompt's last forward has written it.
                push = self._push(decode_address, job, timeout_s, ready=job.wait_layers,
                                  first_block=skip_blocks, draft=draft.push(skip_blocks))
            token = await job.first_token
            draft.start(self._executor, prompt, blocks)
            evicted = self._prefilled(job, keys, evicts)
            if decode_address and evicts:  # the kept pages, now the prompt is done
                push = self._push(decode_address, job, timeout_s, **evicted)
            if defer_push:
                parked = Parked(job, asyncio.get_running_loop().create_future())
                self._parked[request_id] = parked
                self._evict_parked()  # a prefill with a reservation may wait for blocks
            yield FirstTokenEvent(token, time.perf_counter() - job.started_at, num_cached,
                                  hit.by_tier, tuple(job.sample_token_ids),
                                  tuple(job.first_logprobs), tuple(job.prompt_logprobs))
            if parked is not None:
                address, skip = await parked.ship
                push = self._push(address, job, timeout_s, first_block=skip,
                                  draft=draft.push(skip), **evicted)
            if push is not None:
                pushed = await push
                self.kv_bytes_sent += pushed.num_bytes
                log.info("request %s: %d prompt tokens prefilled, %d K/V bytes pushed in %.1f ms",
                         request_id, len(prompt), pushed.num_bytes, pushed.seconds * 1e3)
                yield PushedEvent(pushed.seconds, pushed.num_bytes)
        finally:
            await _to_its_end(self._end(request_id, job, push, parked, draft))

    def _push(self, address: str, job: PrefillJob, timeout_s: float | None,
              **options: object) -> asyncio.Future[PushResult]:
        """The push of `job`'s pages to `address`, started."""
        return asyncio.ensure_future(self.sender.push(
            address, job.request_id, self.layout, len(job.prompt), self.pool, job.block_table,
            timeout_s, **options))  # type: ignore[arg-type]

    def _prefilled(self, job: PrefillJob, keys: list[bytes], evicts: bool
                   ) -> dict[str, tuple[int, int]]:
        """The prompt is done: its full blocks go to the prefix cache unless it evicted any
        (its kept blocks are no longer the prompt's pages). The push's `evicted` option."""
        if job.num_evicted:
            log.info("request %s: %d prompt tokens evicted while prefilled, %d kept",
                     job.request_id, job.num_evicted, len(job.prompt) - job.num_evicted)
        else:
            self.cache.register(keys, job.block_table)  # every full prompt block is final now
        return {"evicted": (job.num_evicted, job.num_rebased)} if evicts else {}

    def _evicts(self, prompt: list[int], params: SamplingParams, skip_blocks: int) -> bool:
        """Whether `prompt` passes the K/V budget, so it evicts while prefilled (and its
        decode reservation, knowing the budget, shares no cached blocks), unless its request
        opted out."""
        if self.eviction is None or params.kv_eviction == "none":
            return False
        evicts = len(prompt) > self.eviction.budget_blocks * self.pool.block_size
        if evicts and skip_blocks:
            raise InvalidArgument("skip_blocks: a prompt past the K/V budget evicts while "
                                  "prefilled; its decode reservation shares no blocks",
                                  "skip_blocks")
        return evicts

    async def _acquire(self, request_id: str, prompt: list[int], keys: list[bytes],
                       defer_push: bool) -> TierHit:
        """The request's blocks, its cached prefix shared (`TieredCache.acquire`), once the
        pool has them; the request is abortable (`abort`) from now on."""
        task = asyncio.current_task()
        if task is not None:
            self._active[request_id] = task
        block_size = self.pool.block_size
        try:
            return await self.cache.acquire(
                keys[:max_shared_blocks(len(prompt), block_size)], len(prompt), self.blocks,
                blocks_for_tokens(len(prompt), block_size), deferrable=defer_push)
        except BaseException:
            self._active.pop(request_id, None)
            raise

    async def _end(self, request_id: str, job: PrefillJob,
                   push: asyncio.Future[PushResult] | None, parked: Parked | None,
                   draft: _DraftRun) -> None:
        """However a prefill ended: stop its push (which reads the blocks), forget it, and
        free its blocks once no forward writes into them (evicted parked ones were freed
        already)."""
        if push is not None and not push.done():
            push.cancel()
            await asyncio.gather(push, return_exceptions=True)  # it reads our blocks
        elif push is not None and not push.cancelled():
            push.exception()  # retrieved: a failure was already raised or is moot
        await draft.end()  # the draft's forward writes into them
        self._active.pop(request_id, None)
        if parked is not None:
            if self._parked.get(request_id) is parked:
                del self._parked[request_id]
            if parked.ship.done() and not parked.ship.cancelled():
                parked.ship.exception()  # an eviction nobody awaited (a cancelled call)
        await self.batcher.release(job)
        if self.eviction is not None:
            self.eviction.forget(job.key)
        if parked is None or not parked.is_evicted:
            self.pool.allocator.free(job.block_table)
            self.blocks.grant()

    def _evict_parked(self) -> None:
        """Free parked K/V, newest first, until every prefill waiting for blocks fits (the
        deferred ones aside). What it frees goes to those waiters at once, in order."""
        while self._parked and self.pool.allocator.num_free < self.blocks.blocks_awaited:
            request_id, parked = self._parked.popitem()
            parked.is_evicted = True
            self.num_evictions += 1
            log.info("request %s: parked K/V evicted (%d blocks) for a prefill with a decode "
                     "reservation; it is prefilled again once shipped", request_id,
                     len(parked.job.block_table), extra={"request_id": request_id})
            self.pool.allocator.free(parked.job.block_table)
            parked.ship.set_exception(
                Aborted(f"parked K/V of {request_id!r} evicted to make room", "request_id"))
        self.blocks.grant()

    def _block_keys(self, prompt: list[int], cache_salt: str) -> list[bytes]:
        """Keys of the prompt's full blocks ([] with prefix caching off)."""
        if not self.pool.allocator.prefix_caching:
            return []
        seed = cache_seed(self.layout.model_fingerprint, self.layout.dtype, cache_salt)
        return block_keys(prompt, self.pool.block_size, seed)

    def ship(self, request_id: str, decode_address: str, skip_blocks: int = 0) -> None:
        """Name the decode worker a deferred prefill pushes its K/V to, and the leading
        blocks its reservation holds already (not pushed)."""
        if not decode_address:
            raise InvalidArgument("decode_address must be non-empty", "decode_address")
        parked = self._parked.get(request_id)
        if parked is None:  # never parked, evicted, or this worker restarted since
            raise NotFound(f"no deferred prefill {request_id!r} waits here", "request_id")
        check_skip_blocks(skip_blocks, len(parked.job.prompt), self.pool.block_size)
        del self._parked[request_id]
        parked.ship.set_result((decode_address, skip_blocks))

    def abort(self, request_id: str) -> None:
        task = self._active.get(request_id)
        if task is None:
            raise NotFound(f"request_id {request_id!r} is not prefilling here", "request_id")
        task.cancel()

    def stats(self, check_integrity: bool = False) -> PoolStats:
        report = (self.cache.check_integrity() if check_integrity
                  else IntegrityReport(False, "not checked"))
        return PoolStats(
            total_blocks=self.pool.num_blocks, free_blocks=self.pool.allocator.num_free,
            tensor_parallel_size=self.pool.tensor_parallel_size,
            reserved_blocks=0,
            num_running=len(self._active) - self.batcher.num_pending - self.blocks.num_waiting,
            num_waiting=self.batcher.num_pending + self.blocks.num_waiting,
            num_pending_prefill_tokens=self.batcher.pending_tokens,
            num_compiles=getattr(self.model.compiled, "num_compiles", 0),
            integrity_ok=report.ok, integrity_error=report.error,
            num_corrupt_pushes=self.sender.num_corrupt_pushes,
            num_parked=len(self._parked), num_evictions=self.num_evictions,
            prefix_cache_queries=self.pool.allocator.num_query_tokens,
            prefix_cache_hits=self.pool.allocator.num_hit_tokens,
            cached_blocks=self.pool.allocator.num_cached, tiers=self.cache.stats(),
            prefill_s_per_token=self.batcher.s_per_token,
        )
