"""Decode engine: reservations, K/V reception, the batched step loop, preemption.

Lifecycle of a request here: Reserve (blocks for the prompt and its first decode slot; waits in
a bounded FIFO queue when the pool is full) -> K/V chunks arrive and are validated (or, in
colocated mode, the prompt is prefilled here) -> Decode attached -> joins the running batch at
the next step boundary -> one token per step, one block more whenever a block fills ->
finished, aborted or lease expired: its blocks go back to the free list exactly once.

Memory policy: blocks are allocated as sequences grow; when none is free, the newest running
sequence is swapped out to host memory. Swapped sequences resume (K/V bit for bit, oldest
first) before any new reservation is granted. Too big even alone: refused at Reserve, as
is prompt + max_tokens past `max_model_len` (--max-model-len; default: the model's context).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from typing import NamedTuple

from decode_worker.kv_receiver import DraftPages, KvReceiver
from decode_worker.leases import LeaseKeeper
from decode_worker.prefix_cache import DecodePrefixCache
from decode_worker.receipt import KvReceipt
from decode_worker.sequence import (
    DecodeEvent,
    DecodeSeq,
    ErrorEvent,
    FinishedEvent,
    Phase,
    Reservation,
    check_reservation,
    lookup,
)
from decode_worker.spec.draft_model import DraftModel
from decode_worker.steps import StepLoop
from kvferry.cache.allocator import IntegrityReport
from kvferry.cache.block_queue import BlockQueue
from kvferry.cache.budget import KvBudget, blocks_for_tokens
from kvferry.cache.layout import KvLayout
from kvferry.cache.pool import KvPool
from kvferry.cache.prefix import TierTokens
from kvferry.cache.stats import PoolStats
from kvferry.cache.tiers.tiered import TieredCache
from kvferry.errors import Aborted, InvalidArgument, NotFound, Unavailable
from kvferry.model.grammar import guide_for
from kvferry.model.logprobs import TokenLogprob
from kvferry.model.prefill_batch import PrefillJob
from kvferry.model.sampling import FinishReason, SamplingParams
from kvferry.model.transformer import Transformer
from kvferry.settings import DEFAULT_MAX_WAITING, KvEvictionConfig, SpeculativeConfig
from kvferry.transfer import wire

log = logging.getLogger("kvferry.decode")


class LocalPrefill(NamedTuple):
    """What a colocated prefill yields."""

    token_id: int  # the first token (sample 0's)
    prefill_s: float
    num_cached_tokens: int  # prompt tokens the prefix cache held
    cached_by_tier: TierTokens  # of those, the ones from each lower tier
    sample_token_ids: list[int]  # the first tokens of samples 1..n-1
    logprobs: list[TokenLogprob]  # SamplingParams.logprobs: the first tokens'
    prompt_logprobs: list[TokenLogprob]  # SamplingParams.prompt_logprobs: prompt[1:]'s


class DecodeEngine:
    """Owns the pool and the reservations (request lifecycles); composes the K/V receiver
    (`receiver`) and the step loop (`steps`). Not thread-safe: call from the event loop;
    only forward passes run on the step loop's executor thread."""

    def __init__(self, model: Transformer, pool: KvPool, layout: KvLayout,
                 max_waiting: int = DEFAULT_MAX_WAITING, stage_bytes: int = 0,
                 max_model_len: int | None = None, cache: TieredCache | None = None,
                 speculative: SpeculativeConfig | None = None, draft: DraftModel | None = None,
                 eviction: KvEvictionConfig | None = None, **prefill_options: int) -> None:
        self.model = model
        # What a request holds at most (kvferry/cache/budget.py): the router's formula too.
        self.kv_budget = KvBudget(eviction or KvEvictionConfig())
        self.max_model_len = max_model_len or model.config.max_position_embeddings
        self.pool = pool
        self.layout = layout
        self.max_waiting = max_waiting
        self._seqs: dict[str, DecodeSeq] = {}
        # Swapped-out sequences resume before any new reservation is granted.
        self.blocks = BlockQueue(pool.allocator, max_waiting, lambda: not self.steps.swapped)
        self._arrivals = itertools.count()
        self.steps = StepLoop(model, pool, self.blocks, self._seqs, self._finish, stage_bytes,
                              speculative, draft, eviction, **prefill_options)
        self.batcher = self.steps.batcher  # colocated prefill, run by the step loop
        self.receiver = KvReceiver(layout, pool, self._seqs, self._kv_complete,
                                   None if draft is None else DraftPages(
                                       KvLayout.of_pool(draft.pool, draft.model.config.fingerprint),
                                       draft.pool), evicts=self.steps.eviction is not None)
        self.cache = cache or TieredCache(pool)  # the prefix cache, over its tiers
        self.cache.on_release = self.blocks.grant
        self.prefix_cache = DecodePrefixCache(self.cache, layout)
        self.leases = LeaseKeeper(self._seqs, self._finish)
        self._prefill_jobs: dict[str, PrefillJob] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.is_draining = False  # SIGTERM: no new reservations; the ones here run to the end

    @property
    def _budget_blocks(self) -> int | None:
        """Blocks a sequence holds at most under K/V eviction (None: unbounded)."""
        return self.kv_budget.bounded_blocks(self.pool.block_size)

    @property
    def kv_bytes_received(self) -> int:
        return self.receiver.kv_bytes_received

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._tasks = [asyncio.create_task(self.steps.run()),
                       asyncio.create_task(self.leases.run())]
        for task in self._tasks:
            task.add_done_callback(self._task_ended)

    def set_on_fatal(self, on_fatal: Callable[[], None]) -> None:
        """Called when this worker can no longer serve (steps keep failing, a loop died)."""
        self.steps.on_fatal = on_fatal

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return  # stop()
        log.error("decode engine loop ended: %r", task.exception(), exc_info=task.exception())
        self.steps.on_fatal()

    def drain(self) -> None:
        self.is_draining = True

    @property
    def is_idle(self) -> bool:
        return not self._seqs and self.blocks.num_waiting == 0

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for seq in list(self._seqs.values()):
            for member in seq.members:  # sample 0 may have ended before the others
                self._finish(member, ErrorEvent(seq.request_id, Aborted("decode worker stopped")))
        self.steps.executor.shutdown(wait=True)
        self.cache.close()

    # ---- reservations ----------------------------------------------------------------------
    async def reserve(self, request_id: str, num_prompt_tokens: int, max_tokens: int,
                      lease_s: float, prompt_token_ids: list[int] | None = None,
                      cache_salt: str = "", num_samples: int = 1,
                      shares_cache: bool = True) -> Reservation:
        """Allocate the prompt's blocks (and the first decode slot), waiting in a bounded FIFO
        queue while the pool is full. Given the prompt's tokens, its leading full blocks
        found in the prefix cache are shared instead (no push carries them). With several
        samples, one spare block more for each further sample (decode_worker/samples.py).
        Not `shares_cache`: nothing is looked up (its prompt is computed whole)."""
        if self.is_draining:
            raise Unavailable("draining: this worker is shutting down")
        check_reservation(request_id, num_prompt_tokens, max_tokens, lease_s, self._seqs,
                          self.max_model_len, self.pool, num_samples, self.kv_budget)
        prompt = list(prompt_token_ids or [])
        budget = self._budget_blocks
        # A prompt past the K/V budget is evicted while prefilled (here, or by a prefill
        # worker that pushes its kept pages): its blocks are not the cached prefix's.
        evicts = budget is not None and num_prompt_tokens + 1 > budget * self.pool.block_size
        hit = await self.prefix_cache.acquire(
            [] if evicts or not shares_cache else prompt, num_prompt_tokens, cache_salt,
            self.blocks,
            blocks_for_tokens(num_prompt_tokens + 1, self.pool.block_size) + num_samples - 1)
        blocks, num_cached = hit.block_ids, hit.num_cached_blocks
        spares = blocks[len(blocks) - (num_samples - 1):] if num_samples > 1 else []
        blocks = blocks[:len(blocks) - len(spares)]
        if request_id in self._seqs:  # a twin arrived while we waited
            self.pool.allocator.free(hit.block_ids)
            self.blocks.grant()
            raise InvalidArgument(f"request_id {request_id!r} already reserved", "request_id")
        seq = DecodeSeq(
            request_id=request_id, num_prompt_tokens=num_prompt_tokens, max_tokens=max_tokens,
            block_table=blocks, lease_deadline=time.monotonic() + lease_s, lease_s=lease_s,
            receipt=KvReceipt(wire.coverage(self.layout, num_prompt_tokens)),
            arrival=next(self._arrivals), prompt_token_ids=prompt, cache_seed=hit.seed,
            num_cached_blocks=num_cached, cached_by_tier=hit.by_tier,
            num_samples=num_samples, spare_blocks=spares)
        seq.receipt.reset(num_cached)
        self._seqs[request_id] = seq
        return Reservation(len(blocks) + len(spares), num_cached)

    def _kv_complete(self, seq: DecodeSeq) -> None:
        """A reservation's prompt K/V is all in place: index its full blocks, and step."""
        self.prefix_cache.index(seq, seq.num_prompt_tokens)
        self.steps.poke()

    def renew_leases(self, request_ids: list[str], lease_s: float) -> list[str]:
        """Restart the leases of these reservations; returns the ids not held here."""
        return self.leases.renew(request_ids, lease_s)

    def _get(self, request_id: str) -> DecodeSeq:
        return lookup(self._seqs, request_id)

    def holds(self, request_id: str) -> bool:
        """Whether the request (any sample of it) is still here."""
        return request_id in self._seqs

    async def prefill_local(self, request_id: str, prompt: list[int], params: SamplingParams,
                            output_index: int = 0) -> LocalPrefill:
        """Colocated mode: prefill a reserved request's prompt into its own blocks, in the
        step loop, from the end of its cached prefix (the first token of each of its
        samples drawn from the last logits)."""
        seq = self._get(request_id)
        if seq.receipt.is_complete or request_id in self._prefill_jobs:
            raise InvalidArgument(f"K/V for {request_id!r} is already complete", "request_id")
        if len(prompt) != seq.num_prompt_tokens:
            raise InvalidArgument("prompt length differs from the reservation", "prompt_token_ids")
        if seq.num_cached_blocks and prompt != seq.prompt_token_ids:
            raise InvalidArgument("prompt differs from the one reserved (whose cached prefix "
                                  "the reservation shares)", "prompt_token_ids")
        num_cached = seq.num_cached_blocks * self.pool.block_size
        job = PrefillJob(request_id, prompt, params, seq.block_table,
                         asyncio.get_running_loop().create_future(), output_index,
                         num_computed=num_cached, num_samples=seq.num_samples,
                         guide=guide_for(self.model.config, params.constraint,
                                         prompt[len(prompt) - output_index:]))
        self._prefill_jobs[request_id] = job
        self.batcher.submit(job)
        try:
            token = await asyncio.shield(job.first_token)
        except asyncio.CancelledError:
            if job.first_token.cancelled() and seq.phase is Phase.DONE:
                raise Aborted(f"request {request_id!r} ended during prefill") from None
            raise
        finally:
            self._prefill_jobs.pop(request_id, None)
            await self.batcher.release(job)
        seq.num_evicted, seq.num_rebased = job.num_evicted, job.num_rebased  # while prefilling
        seq.receipt.complete()
        if not seq.prompt_token_ids:
            seq.prompt_token_ids = list(prompt)
        self._kv_complete(seq)
        return LocalPrefill(token, time.perf_counter() - job.started_at, num_cached,
                            seq.cached_by_tier, job.sample_token_ids, job.first_logprobs,
                            job.prompt_logprobs)

    # ---- decoding ----------------------------------------------------------------------------
    def attach(self, request_id: str, first_token_id: int, params: SamplingParams,
               max_new_tokens: int, stop_token_ids: list[int],
               events: asyncio.Queue[DecodeEvent] | None = None,
               num_generated: int = 0, sample_first_token_ids: list[int] | None = None
               ) -> asyncio.Queue[DecodeEvent]:
        """Register the Decode stream of a reserved request; tokens flow once K/V is in.
        A reservation of n samples takes the first tokens of samples 1..n-1 too.

        Events go to `events` (shared by the requests of one DecodeStream) or a new queue."""
        seq = self._get(request_id)
        if seq.events is not None:
            raise InvalidArgument(f"request_id {request_id!r} is already decoding", "request_id")
        vocab = self.model.config.vocab_size
        if not 0 <= first_token_id < vocab:
            raise InvalidArgument(f"first_token_id outside [0, {vocab})", "first_token_id")
        others = list(sample_first_token_ids or [])
        if len(others) != seq.num_samples - 1:
            raise InvalidArgument(f"sample_first_token_ids: the reservation has "
                                  f"{seq.num_samples} samples, so {seq.num_samples - 1} first "
                                  f"tokens besides first_token_id, got {len(others)}",
                                  "sample_first_token_ids")
        if any(not 0 <= t < vocab for t in others):
            raise InvalidArgument(f"sample_first_token_ids outside [0, {vocab})",
                                  "sample_first_token_ids")
        if not 1 <= max_new_tokens <= seq.max_tokens - 1:
            raise InvalidArgument(
                f"max_new_tokens must be in [1, {seq.max_tokens - 1}] for this reservation",
                "max_new_tokens",
            )
        params.validate(vocab)
        if params.shapes_logits and len(seq.prompt_token_ids) != seq.num_prompt_tokens:
            raise InvalidArgument("sampling: penalties and constraints read the prompt (and "
                                  "earlier legs' outputs), which the reservation was not "
                                  "given", "prompt_token_ids")
        earlier = seq.prompt_token_ids[seq.num_prompt_tokens - num_generated:]
        seq.guide = guide_for(self.model.config, params.constraint, [*earlier, first_token_id])
        seq.params = params
        seq.max_new_tokens = max_new_tokens
        seq.stop_token_ids = frozenset(stop_token_ids)
        seq.tokens = [first_token_id]
        seq.sample_first_tokens = others
        seq.output_offset = num_generated
        seq.events = events if events is not None else asyncio.Queue()
        self.steps.poke()
        return seq.events

    def abort(self, request_id: str, sample_index: int | None = None) -> None:
        """End the request (every sample), or only sample `sample_index` of it."""
        members = self._get(request_id).members
        if sample_index is not None:
            members = [s for s in members if s.sample_index == sample_index]
            if not members:
                raise NotFound(f"request {request_id!r} has no sample {sample_index}",
                               "sample_index")
        for seq in members:
            if seq.phase is Phase.DONE:
                continue
            if seq.phase is Phase.RUNNING:
                if not seq.is_aborted:
                    seq.abort_step = self.steps.num_steps
                seq.is_aborted = True  # released at the next step boundary
                self.steps.poke()
            else:
                self._finish(seq, FinishedEvent(seq.request_id, FinishReason.ABORT,
                                                seq.first_step_s, sample_index=seq.sample_index))

    def _finish(self, seq: DecodeSeq, event: DecodeEvent) -> None:
        """Release the sequence's blocks exactly once and tell its stream how it ended. A
        request of several samples leaves the table with its last sample; an error ends
        every sample."""
        if seq.phase is Phase.DONE:
            return
        job = self._prefill_jobs.get(seq.request_id)
        if job is not None and job.is_in_batch:
            # A local prefill still writes into these blocks: finish once it is out.
            seq.is_aborted = True
            asyncio.get_running_loop().create_task(self._finish_after(job, seq, event))
            return
        if job is not None:
            asyncio.get_running_loop().create_task(self.batcher.release(job))
        self.steps.discard(seq)
        if seq.receipt.is_complete and not isinstance(event, ErrorEvent):
            # Prompt and generated tokens' full blocks stay for the next turn to reuse.
            self.prefix_cache.index(seq, seq.next_position if seq.phase is Phase.RUNNING
                                    else seq.num_prompt_tokens)
        seq.phase = Phase.DONE
        outcome = event.reason.name.lower() if isinstance(event, FinishedEvent) else "error"
        log.info("request %s done (%s) after %d tokens, %d blocks freed", seq.request_id,
                 outcome, max(len(seq.tokens) - 1, 0), len(seq.block_table),
                 extra={"request_id": seq.request_id})
        self.pool.allocator.free(seq.block_table + seq.spare_blocks)
        seq.block_table, seq.spare_blocks = [], []
        seq.swapped_kv = None
        if all(s.phase is Phase.DONE for s in seq.members):
            self._seqs.pop(seq.request_id, None)
        if seq.events is not None:
            seq.events.put_nowait(event)
        if isinstance(event, ErrorEvent):
            for other in seq.members:
                self._finish(other, event)
        self.blocks.grant()
        if self.steps.swapped:  # may fit now; with nothing running the step loop sleeps
            self.steps.poke()

    async def _finish_after(self, job: PrefillJob, seq: DecodeSeq, event: DecodeEvent) -> None:
        await self.batcher.release(job)
        self._prefill_jobs.pop(seq.request_id, None)
        self._finish(seq, event)

    # ---- stats -------------------------------------------------------------------------------
    def stats(self, check_integrity: bool = False) -> PoolStats:
        reserved = [s for s in self._seqs.values() if s.phase is Phase.RESERVED]
        report = (self.cache.check_integrity() if check_integrity
                  else IntegrityReport(False, "not checked"))
        return PoolStats(
            total_blocks=self.pool.num_usable_blocks,
            tensor_parallel_size=self.pool.tensor_parallel_size,
            free_blocks=self.pool.allocator.num_free,
            reserved_blocks=sum(len(s.block_table) for s in reserved),
            num_running=len(self.steps.running),
            num_waiting=len(reserved) + len(self.steps.swapped) + self.blocks.num_waiting,
            num_pending_prefill_tokens=self.batcher.pending_tokens,
            integrity_ok=report.ok,
            integrity_error=report.error,
            num_preemptions=self.steps.num_preemptions,
            num_compiles=getattr(self.model.compiled, "num_compiles", 0),
            num_decode_steps=self.steps.num_steps,
            max_abort_delay_steps=self.steps.max_abort_delay_steps,
            projected_blocks=sum(self.kv_budget.blocks(s.num_prompt_tokens, s.max_tokens,
                                                       self.pool.block_size, s.num_samples)
                                 for s in self._seqs.values()),
            prefix_cache_queries=self.pool.allocator.num_query_tokens,
            prefix_cache_hits=self.pool.allocator.num_hit_tokens,
            cached_blocks=self.pool.allocator.num_cached, tiers=self.cache.stats(),
            prefill_s_per_token=self.batcher.s_per_token,
            spec_draft_tokens=getattr(self.steps.drafting, "num_draft_tokens", 0),
            spec_accepted_tokens=getattr(self.steps.drafting, "num_accepted_tokens", 0),
            kv_evicted_blocks=(self.steps.eviction.num_evicted_blocks
                               if self.steps.eviction is not None else 0),
            spec_draft_prefill_tokens=(self.steps.drafting.draft.num_prefill_tokens
                                       if self.steps.drafting is not None
                                       and self.steps.drafting.draft is not None else 0),
            spec_paused_sequences=(self.steps.drafting.controller.num_paused
                                   if self.steps.drafting is not None else 0),
        )
