"""The decode engine's step loop: admit, preempt (swap out/in), grow, step, deliver.

Each step is a pipeline with fixed points: every running sequence's table bounded and grown
(event loop), then per forward the rows planned, the forward run and the tokens kept
(executor thread). Speculation, K/V eviction and fault injection are plug-ins called at those
points (decode_worker/step_plugin.py), in folders of their own.

`StepLoop` is composed by `decode_worker.engine.DecodeEngine`, which owns reservations, K/V
arrival and request lifecycles. Everything here runs on the event loop except `_run_steps`
and `_step`, which run on the single executor thread (forward passes only touch the pool
rows of the batch's own blocks).

A step that raises (NaN logits under sampling, out of memory, a bug) fails the requests of
its batch with INTERNAL, their blocks freed, and the loop goes on with everyone else. After
MAX_CONSECUTIVE_FAILURES failed iterations in a row the worker is broken, not unlucky: the
loop calls `on_fatal` (the process then reports NOT_SERVING and drains) and keeps failing
what reaches it. Fault injection for tests: decode_worker/step_faults.py.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

from decode_worker.evict.plugin import EvictionStep
from decode_worker.kv_stage import KvStage
from decode_worker.samples import fork_samples
from decode_worker.sequence import (
    DecodeEvent,
    DecodeSeq,
    ErrorEvent,
    FinishedEvent,
    Phase,
    TokensEvent,
)
from decode_worker.spec.draft_model import DraftModel
from decode_worker.spec.drafting import Drafting, ngram_proposer
from decode_worker.step_faults import InjectedFault, StepFaults
from decode_worker.step_plugin import StepPlugin
from decode_worker.step_rows import Kept, StepRows
from kvferry import trace
from kvferry.cache.block_queue import BlockQueue
from kvferry.cache.pool import KvPool
from kvferry.errors import Internal
from kvferry.faults import Faults
from kvferry.model.eviction import make_eviction
from kvferry.model.executor import run_to_completion
from kvferry.model.logprobs import TokenLogprob
from kvferry.model.prefill_batch import Gathering, PrefillBatcher
from kvferry.model.sampling import FinishReason
from kvferry.model.transformer import Transformer
from kvferry.settings import KvEvictionConfig, SpeculativeConfig

log = logging.getLogger("kvferry.decode")


Finish = Callable[[DecodeSeq, DecodeEvent], None]

MAX_CONSECUTIVE_FAILURES = 3

# A batch starting from idle waits while sequences keep becoming ready less than 10 ms apart,
# at most 30 ms: the members of one prefill forward attach a few milliseconds apart (3-9 ms,
# traced: their first tokens are relayed one by one), and one that stepped alone first would
# finish a step before the others, come back alone, and split the next wave into a lone
# prefill forward and the rest (closed loop of 8, real model: waves of 64 + 448 tokens instead
# of 512, the 448 prefilled while the lone one decodes). A lone request's second token pays
# the gap, once; a batch already running never waits (joiners take the next step).
DEFAULT_JOINING = Gathering(gap_s=0.010, window_s=0.030)


class StepLoop:
    """Owns the running and swapped sequences, the executor thread (shared with colocated
    prefill, `batcher`) and the step counters. Reads the engine's request table `seqs` to
    admit sequences whose K/V is in and whose stream is attached; releases a sequence only
    through the engine's `finish(seq, event)`, which must call `discard(seq)`."""

    def __init__(self, model: Transformer, pool: KvPool, blocks: BlockQueue,
                 seqs: Mapping[str, DecodeSeq], finish: Finish, stage_bytes: int = 0,
                 speculative: SpeculativeConfig | None = None, draft: DraftModel | None = None,
                 eviction: KvEvictionConfig | None = None, **prefill_options: int) -> None:
        self.model = model
        self.pool = pool
        self.blocks = blocks
        self._seqs = seqs
        self._finish = finish
        self.running: list[DecodeSeq] = []
        self.swapped: list[DecodeSeq] = []
        self.num_preemptions = 0
        self.num_steps = 0  # incremented by the executor thread only
        self.max_abort_delay_steps = 0
        self.consecutive_failures = 0
        self.on_fatal: Callable[[], None] = lambda: None  # set by the process: drain
        # CPU decode: mirror the batch's K/V densely (kv_stage) instead of gathering pages.
        self.stage = KvStage(pool, stage_bytes) if stage_bytes > 0 else None
        # The step's plug-ins, in the order the loop calls them: fault injection (tests),
        # speculation (decode_worker/spec/), K/V eviction (decode_worker/evict/).
        self.plugins: list[StepPlugin] = [StepFaults(Faults.from_env())]
        self.drafting: Drafting | None = None
        if speculative is not None and speculative.is_on:
            if self.stage is not None:
                raise ValueError("speculative decoding reads the pages: no dense K/V stage "
                                 "(--decode-stage-mib 0)")
            self.drafting = Drafting(speculative, ngram_proposer(speculative), pool,
                                     draft=draft)
            self.plugins.append(self.drafting)
        self.eviction = make_eviction(eviction, model, pool)  # kvferry/model/eviction.py
        if self.eviction is not None:
            if self.stage is not None and self.eviction.wants_mass:
                raise ValueError("kv_eviction: h2o reads every step's attention mass, which "
                                 "the dense K/V stage does not report")
            if self.drafting is not None:
                if self.eviction.wants_mass or draft is not None:
                    raise ValueError("kv_eviction: speculation only with streaming eviction "
                                     "and n-gram drafts")
                self.drafting.eviction = self.eviction
            self.plugins.append(EvictionStep(self.eviction))
        self.joining = DEFAULT_JOINING  # a batch starting from idle waits for its wave
        self._wake = asyncio.Event()
        # Set when the step loop must come back to the event loop (admissions, prefill work):
        # read by the executor thread, which otherwise steps a stable batch back to back.
        self._needs_loop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode-step")
        # Colocated mode: prompts prefilled here share the step loop and its executor.
        self.batcher = PrefillBatcher(model, pool, self.executor, self.poke,
                                      eviction=self.eviction, **prefill_options)

    def poke(self) -> None:
        """New work (an admission, a prefill, an abort): run the loop at the next boundary."""
        self._needs_loop.set()
        self._wake.set()

    def discard(self, seq: DecodeSeq) -> None:
        """The engine released `seq`: drop it from the running or swapped list."""
        if seq.phase is Phase.RUNNING and seq in self.running:
            self.running.remove(seq)
        if seq in self.swapped:
            self.swapped.remove(seq)
        for plugin in self.plugins:
            plugin.forget(seq)

    def _admit_and_reap(self) -> None:
        for seq in list(self.running):
            if seq.is_aborted:
                self.max_abort_delay_steps = max(self.max_abort_delay_steps,
                                                 self.num_steps - seq.abort_step)
                self._finish(seq, FinishedEvent(seq.request_id, FinishReason.ABORT,
                                                seq.first_step_s, sample_index=seq.sample_index))
        for seq in self._seqs.values():
            if (seq.phase is Phase.RESERVED and seq.receipt.is_complete and seq.events is not None
                    and not seq.is_aborted):
                seq.phase = Phase.RUNNING
                self.running += fork_samples(self.pool, seq) if seq.num_samples > 1 else [seq]

    def _swap_out(self, seq: DecodeSeq) -> None:
        # [layers, 2, blocks, block_size, kv_heads, head_dim] in host memory
        seq.swapped_kv = self.pool.read_pages(seq.block_table).to("cpu")
        self.pool.allocator.free(seq.block_table)
        seq.block_table = []
        seq.phase = Phase.SWAPPED
        self.running.remove(seq)
        self.swapped.append(seq)
        self.num_preemptions += 1
        log.info("request %s preempted (swapped out, %d preemptions so far)", seq.request_id,
                 self.num_preemptions)

    def _swap_in(self) -> None:
        """Resume swapped sequences, oldest first, while their blocks fit."""
        if not self.swapped:
            return
        self.swapped.sort(key=lambda s: s.arrival)
        while self.swapped:
            seq = self.swapped[0]
            assert seq.swapped_kv is not None  # noqa: S101 - set by _swap_out
            n = seq.swapped_kv.shape[2]
            if self.pool.allocator.num_free < n:
                return
            seq.block_table = self.pool.allocator.alloc(n)
            self.pool.write_pages(seq.block_table, seq.swapped_kv)
            seq.swapped_kv = None
            seq.phase = Phase.RUNNING
            for plugin in self.plugins:
                plugin.moved(seq)
            self.swapped.pop(0)
            self.running.append(seq)

    def _grow(self) -> None:
        """Give every running sequence the slot its next step writes; preempt the newest
        running sequence while the pool is short. Plug-ins give K/V back before (eviction,
        rejected drafts) and take unused blocks after (the next drafts' slots)."""
        block_size = self.pool.block_size
        for plugin in self.plugins:
            plugin.before_grow(self.running)
        if any(len(s.block_table) * block_size <= s.cache_position for s in self.running):
            for seq in sorted(self.running, key=lambda s: s.arrival):
                while (seq.phase is Phase.RUNNING
                       and len(seq.block_table) * block_size <= seq.cache_position):
                    if self.pool.allocator.num_free > 0:
                        seq.block_table += self.pool.allocator.alloc(1)
                    else:
                        self._swap_out(max(self.running, key=lambda s: s.arrival))
        for plugin in self.plugins:
            plugin.after_grow(self.running)

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        while True:
            await self._wait_for_work()
            self._wake.clear()
            while True:
                try:
                    if not await self._iteration():
                        break
                except Exception as exc:  # the step's requests fail; the loop goes on
                    self._fail_running(exc)
                else:
                    self.consecutive_failures = 0

    async def _wait_for_work(self) -> None:
        """Until poked; a parked stage (idle) gives its memory back once its hold runs out."""
        if self.stage is not None and (left := self.stage.idle_left_s()) is not None:
            try:
                await asyncio.wait_for(self._wake.wait(), max(left, 0.0))
                return
            except TimeoutError:
                self.stage.clear()
        await self._wake.wait()

    async def _iteration(self) -> bool:
        """One pass: prefill batch, admissions, swaps, growth, decode steps. Returns whether
        there may be more to do right away."""
        # a wave of prompts still arriving never holds decoding: the steps run meanwhile
        ran_prefill = await self.batcher.run_once(may_wait=not self.running)
        was_idle = not self.running
        self._admit_and_reap()
        if was_idle and self.running:
            await self._gather_joiners()
        self._swap_in()
        self.blocks.grant()
        self._grow()
        if self.running:
            await self._decode_step()
            return True
        if self.stage is not None:  # idle: the rows hold nobody; memory kept a while
            self.stage.park()
        return ran_prefill

    async def _gather_joiners(self) -> None:
        """The batch starts from idle: wait while more sequences keep becoming ready less
        than `joining.gap_s` apart, at most `joining.window_s` (DEFAULT_JOINING says why)."""
        start = last = time.monotonic()
        seen = len(self.running)
        while (left := min(last + self.joining.gap_s, start + self.joining.window_s)
               - time.monotonic()) > 0:
            self._wake.clear()  # the loop goes on after this: nothing poked is lost
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except TimeoutError:
                return
            self._admit_and_reap()
            if len(self.running) > seen:
                seen, last = len(self.running), time.monotonic()

    def _fail_running(self, exc: Exception) -> None:
        """A step (or the bookkeeping around it) raised: end every running sequence with
        INTERNAL (the engine frees its blocks and tells its stream); sequences swapped out or
        still reserved are untouched."""
        self.consecutive_failures += 1
        log.error("decode step failed (%d in a row); failing its %d requests: %r",
                  self.consecutive_failures, len(self.running), exc,
                  exc_info=not isinstance(exc, InjectedFault))
        if self.stage is not None:
            self.stage.clear()  # rows may be half-written: rebuild from the pages
        for seq in list(self.running):
            self._finish(seq, ErrorEvent(seq.request_id,
                                         Internal("decode step failed on the decode worker")))
        self.running.clear()
        if self.consecutive_failures == MAX_CONSECUTIVE_FAILURES:
            log.error("%d decode steps failed in a row: reporting NOT_SERVING and draining",
                      self.consecutive_failures)
            self.on_fatal()

    async def _decode_step(self) -> None:
        self._needs_loop.clear()
        await run_to_completion(self.executor, self._run_steps, list(self.running))

    def _run_steps(self, batch: list[DecodeSeq]) -> None:
        """Executor thread: step a stable batch back to back, handing each step's tokens to
        the event loop, until something needs the loop: a sequence finished, was aborted or
        needs a block, or new work arrived. The loop never sits between two steps."""
        assert self._loop is not None  # noqa: S101 - set by run()
        block_size = self.pool.block_size
        arranged = self.stage.arrange(batch) if self.stage is not None else None
        batch = arranged or batch  # the stage's row order, when it holds the batch
        tracer = trace.get()
        while True:
            start = time.perf_counter()
            clock = trace.StepClock.now() if tracer else None
            tokens, logprobs = self._step(batch, arranged is not None)
            self.num_steps += 1
            elapsed = time.perf_counter() - start
            if clock is not None:
                clock.span(tracer, "step", s=self.num_steps, ids=[q.request_id for q in batch])
            finished: list[DecodeSeq] = []
            for seq, kept in zip(batch, tokens):
                if len(seq.tokens) == 1:
                    seq.first_step_s = elapsed
                seq.tokens.extend(kept)
                if kept[-1] in seq.stop_token_ids or seq.tokens_left <= 0:
                    finished.append(seq)
            self._loop.call_soon_threadsafe(self._deliver, batch, tokens, logprobs, finished,
                                            self.num_steps)
            if (finished or self._needs_loop.is_set() or any(s.is_aborted for s in batch)
                    or any(len(s.block_table) * block_size <= s.cache_position for s in batch)
                    or any(plugin.needs_loop(batch) for plugin in self.plugins)):
                return

    def _step(self, batch: list[DecodeSeq], is_staged: bool = False) -> Kept:
        """One forward for the whole ragged batch (executor thread): the rows planned (by
        the plug-ins too), the forward run, the tokens each sequence keeps (one, or with
        speculation its accepted drafts and one more) and their log probabilities where
        asked; `is_staged`: the stage holds the batch's K/V, rows in batch order."""
        rows = StepRows(batch, self.pool.block_size, is_staged)
        for plugin in self.plugins:
            plugin.plan(rows)
        kept = rows.keep(rows.forward(self.model, self.pool, self.stage))
        for plugin in self.plugins:
            plugin.done(rows, kept.tokens)
        return kept

    def _deliver(self, batch: list[DecodeSeq], tokens: list[list[int]],
                 logprobs: list[list[TokenLogprob]], finished: list[DecodeSeq],
                 step: int = 0) -> None:
        """Event loop: stream one step's tokens (per sequence, in order); release the
        sequences it finished."""
        if tracer := trace.get():
            tracer.event("deliver", t=time.monotonic(), s=step)
        for seq, kept, kept_logprobs in zip(batch, tokens, logprobs):
            if seq.phase is not Phase.RUNNING or seq.is_aborted or seq.events is None:
                continue
            seq.events.put_nowait(TokensEvent(seq.request_id, list(kept), seq.sample_index,
                                              tuple(kept_logprobs)))
        for seq in finished:
            if seq.phase is not Phase.RUNNING or seq.is_aborted:
                continue
            reason = (FinishReason.STOP if seq.tokens[-1] in seq.stop_token_ids
                      else FinishReason.LENGTH)
            self._finish(seq, FinishedEvent(seq.request_id, reason, seq.first_step_s,
                                            seq.num_draft_tokens, seq.num_accepted_tokens,
                                            seq.sample_index))

