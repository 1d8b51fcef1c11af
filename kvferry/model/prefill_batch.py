"""Batched, chunked prefill shared by the prefill worker and the colocated worker.

Waiting prompts are packed into one varlen forward up to a token budget (no padding); a prompt
longer than the chunk size is prefilled a chunk per batch, attending over its own cached
chunks. A job's first token is sampled when its last chunk is done. Under K/V eviction
(colocated workers: kvferry/model/eviction.py), a prompt past the budget is prefilled as the
decode step would have read it: up to the budget, then a block at a time, the policy bounding
the job before each chunk, so every chunk attends over what a sequence decoding those tokens
one by one would have kept (docs/kv-eviction-design.md 3.2). Jobs are cancellable:
a queued job is dropped; a job inside a running batch is released once that batch finishes,
so its blocks are never freed while a forward pass still writes into them. Tests slow the
batches that hold a request with the prefill_batch_delay_s fault (kvferry/faults.py).

A forward with room left in its budget waits a few milliseconds for the rest of a wave of
arrivals (`Gathering`): a closed loop's clients arrive together, and a forward started on the
first arrival alone holds the others for its whole length (issue 62). A colocated worker with
sequences decoding never waits: it steps them meanwhile (`run_once(may_wait=False)`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvferry import trace
from kvferry.cache.pool import KvPool
from kvferry.faults import Faults
from kvferry.model.executor import run_to_completion
from kvferry.model.grammar import Guide
from kvferry.model.logprobs import TokenLogprob, logprobs_of
from kvferry.model.penalties import History
from kvferry.model.sampling import SamplingParams, sample_tokens
from kvferry.model.transformer import Transformer
from kvferry.settings import (
    CPU_PREFILL_TOKEN_BUDGET,
    DEFAULT_PREFILL_CHUNK_SIZE,
    DEFAULT_PREFILL_TOKEN_BUDGET,
)

log = logging.getLogger("kvferry.prefill")


# Batches this long measure the per-token forward time (shorter ones are all overhead); each
# moves the average by this weight.
MIN_MEASURED_TOKENS = 64
EWMA_WEIGHT = 0.2


@dataclass(frozen=True, slots=True)
class Gathering:
    """How a forward with room left in its budget waits for the rest of a wave: while
    submissions keep coming less than `gap_s` apart, at most `window_s` after the oldest
    waiting job's. A lone prompt waits `gap_s`; a wave, at most `window_s`. Zero: no wait."""

    gap_s: float
    window_s: float

    def __post_init__(self) -> None:
        if self.gap_s < 0 or self.window_s < 0:
            raise ValueError(f"prefill gathering: gap_s and window_s must be >= 0, got {self}")


# Chosen with bench/bench_prefill_wave.py, 8 prompts arriving 0-5 ms apart: a 6 ms gap already
# gathered every wave into one forward (2 and 4 ms split most), 10 ms leaves room for a busy
# event loop's late wake-ups; the window covers seven such gaps with room to spare. A lone
# prompt pays the gap: 4% of a 64-token forward of the default model on one CPU thread. On CPU
# it helps a wave's TTFT p50 a little (1.11x [0.98-1.29]) and not its mean (1.00x [0.88-1.15],
# bench/results/bench_prefill_wave_smollm2.json): a CPU forward's time grows with its tokens, so
# what the later arrivals gain the first ones lose; under a 256-token budget it costs (the
# first arrival alone, then the rest, was faster).
DEFAULT_GATHERING = Gathering(gap_s=0.010, window_s=0.050)
NO_GATHERING = Gathering(gap_s=0.0, window_s=0.0)


def token_budget_for(device: torch.device, budget: int | None = None) -> int:
    """`budget`, or where it is None the default for prefills on `device`. On CPU 512 prompt
    tokens per forward already run the GEMMs at full speed (2048 was 2-3% faster per token on
    the real model; 256, 6% slower) and hand a burst of prompts on to decode in quarters
    instead of all at the end of one long forward, so the decode worker steps them while the
    prefill worker does the next (docs/performance.md, against vLLM's CPU build)."""
    if budget is not None:
        return budget
    return CPU_PREFILL_TOKEN_BUDGET if device.type == "cpu" else DEFAULT_PREFILL_TOKEN_BUDGET


@dataclass(slots=True)
class PrefillJob:
    """A prompt being prefilled into `block_table` (the reservation's list, shared)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    block_table: list[int]
    first_token: asyncio.Future[int]
    output_index: int = 0  # output number of the token this prefill samples (seeded sampling)
    num_samples: int = 1  # parallel sampling: first tokens drawn from the last logits
    sample_token_ids: list[int] = field(default_factory=list)  # samples 1.. (set with 0's)
    num_computed: int = 0
    is_in_batch: bool = False
    started_at: float = 0.0  # perf_counter when its first chunk entered a batch
    batch_done: asyncio.Event = field(default_factory=asyncio.Event)
    layers_ready: int = 0  # layers whose K/V is final for the whole prompt
    layer_progress: asyncio.Event = field(default_factory=asyncio.Event)
    # K/V eviction while prefilling (as decode_worker.sequence.DecodeSeq's): tokens whose K/V
    # left the table, and of those the ones its rotary positions no longer count.
    num_evicted: int = 0
    num_rebased: int = 0
    submitted_at: float = 0.0  # perf_counter when queued (PrefillBatcher.submit)
    # SamplingParams.logprobs: the first tokens' (one per sample, set with them);
    # prompt_logprobs: those of prompt[1:] (each chunk's as its forward ends).
    first_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    guide: Guide | None = None  # the first token's matcher, where params has a constraint

    def history(self) -> History:
        """What its first token's penalties and constraint read: the request's prompt, and
        (after a migration) the outputs at the prompt's tail."""
        start = len(self.prompt) - self.output_index
        return History(self.prompt[:start], self.prompt[start:], self.guide)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    @property
    def key(self) -> Hashable:
        """The eviction policy's key for it: the sequence it becomes (sample 0)."""
        return self.request_id, 0

    @property
    def next_position(self) -> int:
        """Position in the text of the next token to prefill."""
        return self.num_computed

    @property
    def cache_position(self) -> int:
        return self.num_computed - self.num_evicted

    @property
    def rope_position(self) -> int:
        return self.num_computed - self.num_rebased

    def mark_layer(self, layer: int) -> None:
        """Event loop: the final chunk's forward finished `layer`."""
        self.layers_ready = max(self.layers_ready, layer + 1)
        self.layer_progress.set()

    async def wait_layers(self, count: int) -> None:
        """Until the first `count` layers' K/V are final (what a pipelined push waits on)."""
        while self.layers_ready < count:
            self.layer_progress.clear()
            await self.layer_progress.wait()


class Bound(Protocol):
    """K/V eviction as the batcher uses it (kvferry/model/eviction.py): `bound` evicts until
    the job's next token fits `budget_blocks` (and re-bases its rotary positions)."""

    budget_blocks: int
    wants_mass: bool  # observe() takes each forward's attention mass (H2O)

    def bound(self, seq: PrefillJob) -> None: ...

    def applies(self, seq: PrefillJob) -> bool: ...

    def observe(self, batch: list[PrefillJob], mass: torch.Tensor) -> None: ...


class BatchItem:
    """Tokens [start, end) of a job's prompt, written from cache index `start - evicted`,
    rotated `evicted - rebased` further (what the job had evicted when planned)."""

    __slots__ = ("job", "start", "end", "evicted", "rebased")

    def __init__(self, job: PrefillJob, start: int, end: int) -> None:
        self.job, self.start, self.end = job, start, end
        self.evicted, self.rebased = job.num_evicted, job.num_rebased


class PrefillBatcher:
    """FIFO queue of prefill jobs; `run_once` runs one budgeted batch on the executor."""

    def __init__(self, model: Transformer, pool: KvPool, executor: Executor,
                 on_submit: Callable[[], None], token_budget: int = DEFAULT_PREFILL_TOKEN_BUDGET,
                 chunk_size: int = DEFAULT_PREFILL_CHUNK_SIZE, eviction: Bound | None = None,
                 gathering: Gathering = DEFAULT_GATHERING) -> None:
        """`on_submit` wakes whoever calls `run_once` (a submission, or a deferred wave's
        window closing)."""
        if token_budget < 1 or chunk_size < 1:
            raise ValueError("prefill token_budget and chunk_size must be >= 1")
        self.model = model
        self.pool = pool
        self.executor = executor
        self.on_submit = on_submit
        self.token_budget = token_budget
        self.chunk_size = chunk_size
        self.eviction = eviction
        self.gathering = gathering
        self._queue: list[PrefillJob] = []
        self._last_submit_at = 0.0  # perf_counter of the newest submission
        self._submitted = asyncio.Event()  # cuts a gathering wait short to look again
        self._deferred: asyncio.TimerHandle | None = None  # wakes a deferred wave's caller
        self._loop: asyncio.AbstractEventLoop | None = None
        # Forward seconds per prompt token, an EWMA over batches of at least
        # MIN_MEASURED_TOKENS (0: none yet): what routers price a recompute with.
        self.s_per_token = 0.0
        self._faults = Faults.from_env()  # for tests: kvferry/faults.py

    @property
    def num_pending(self) -> int:
        return len(self._queue)

    @property
    def pending_tokens(self) -> int:
        return sum(len(j.prompt) - j.num_computed for j in self._queue)

    def submit(self, job: PrefillJob) -> None:
        job.submitted_at = self._last_submit_at = time.perf_counter()
        self._queue.append(job)
        self._submitted.set()
        self.on_submit()

    async def release(self, job: PrefillJob) -> None:
        """Forget a job however it ended; returns once no forward pass touches its blocks."""
        if job in self._queue:
            self._queue.remove(job)
        while job.is_in_batch:
            job.batch_done.clear()
            await job.batch_done.wait()
        if not job.first_token.done():
            job.first_token.cancel()

    def _plan(self) -> list[BatchItem]:
        """Jobs in arrival order under the token budget. A chunk that leaves its prompt
        unfinished leaves room for the jobs behind it (what they want, up to half the budget):
        a long prompt's chunks would otherwise fill every forward and hold the first tokens
        of the short prompts behind it until it is done (measured with 512 tokens per
        forward, the CPU default: short requests' TTFT p99 among 3000-token prompts,
        docs/performance.md)."""
        items: list[BatchItem] = []
        budget = self.token_budget
        remaining = [len(job.prompt) - job.num_computed for job in self._queue]
        wants = [min(r, self.chunk_size) for r in remaining]
        behind = sum(wants)
        for job, left, want in zip(self._queue, remaining, wants):
            behind -= want
            n = min(want, budget, self._room(job))
            if n < left:  # a chunk: the prompt goes on after it
                n = min(n, budget - min(behind, self.token_budget // 2))  # first job: >= 1
            if n <= 0:  # no budget left, or too little for a chunk of this one: a later
                continue  # prompt may still fit whole
            items.append(BatchItem(job, job.num_computed, job.num_computed + n))
            budget -= n
        return items

    def _room(self, job: PrefillJob) -> int:
        """Tokens the job may prefill next: under eviction, bounded first (event loop,
        between forwards), up to where its table reaches the budget."""
        if self.eviction is None or not self.eviction.applies(job):
            return len(job.prompt)
        self.eviction.bound(job)  # a shared sink with no block to copy it into: room 0
        return self.eviction.budget_blocks * self.pool.block_size - job.cache_position

    def _forward(self, items: list[BatchItem]) -> list[list[int] | None]:
        """Executor thread: one packed forward; the first tokens (one per sample) of the jobs
        that completed."""
        ids = torch.tensor([t for it in items for t in it.job.prompt[it.start:it.end]])
        slots = torch.cat([self.pool.slots(it.job.block_table, it.start - it.evicted,
                                           it.end - it.evicted)
                           for it in items]).to(self.model.device)
        finishing = [it.job for it in items if it.end == len(it.job.prompt)]
        loop = self._loop
        assert loop is not None  # noqa: S101 - set by run_once on the event loop

        def layer_done(layer: int) -> None:
            for job in finishing:
                loop.call_soon_threadsafe(job.mark_layer, layer)

        mass = None  # H2O: what each chunk's tokens attended to
        if self.eviction is not None and self.eviction.wants_mass:
            mass = [torch.zeros(len(it.job.block_table) * self.pool.block_size,
                                device=self.model.device) for it in items]
        rows, firsts = logit_rows(items)
        logits = self.model.prefill(
            ids.to(self.model.device), [it.end - it.start for it in items], slots, self.pool,
            context_lens=[it.start - it.evicted for it in items],
            block_tables=[it.job.block_table for it in items],
            on_layer_done=layer_done if finishing else None,
            rope_offsets=[it.evicted - it.rebased for it in items],
            mass=mass,  # type: ignore[arg-type]
            logit_rows=rows,
        )
        if mass is not None and self.eviction is not None:
            for it, chunk_mass in zip(items, mass):
                self.eviction.observe([it.job], chunk_mass[None])
        for it, first in zip(items, firsts):
            if it.job.wants_prompt_logprobs:
                add_prompt_logprobs(it, logits[first:])
        last = [first + (it.end - it.start - 1 if it.job.wants_prompt_logprobs else 0)
                for it, first in zip(items, firsts)]
        return self._first_tokens(items, logits[last])

    @staticmethod
    def _first_tokens(items: list[BatchItem], logits: torch.Tensor) -> list[list[int] | None]:
        """The first tokens (one per sample) of the jobs whose prompt `items` completed, from
        each chunk's last logits (and with SamplingParams.logprobs, theirs)."""
        done = [i for i, it in enumerate(items) if it.end == len(it.job.prompt)]
        # one row per sample of each finished prompt: sample s draws with its own seed
        rows = [(i, s) for i in done for s in range(items[i].job.num_samples)]
        tokens = sample_tokens(logits[[i for i, _ in rows]],
                               [items[i].job.params.for_sample(s) for i, s in rows],
                               [items[i].job.output_index for i, _ in rows],
                               [items[i].job.history() if items[i].job.params.shapes_logits
                                else None for i, _ in rows])
        result: list[list[int] | None] = [None] * len(items)
        for (i, _), token in zip(rows, tokens):
            result[i] = [*(result[i] or []), token]
        for i in done:
            job = items[i].job
            if job.params.logprobs is not None:
                first = result[i] or []
                job.first_logprobs = logprobs_of(logits[[i] * len(first)], first,
                                                 job.params.logprobs)
        return result

    def gather_left_s(self, now: float) -> float:
        """Seconds the next forward should still wait for more of a wave (0: start now):
        while its budget has room, the newest submission is under `gap_s` old and the oldest
        waiting job under `window_s`."""
        if not self._queue or not self.gathering.gap_s or not self.gathering.window_s:
            return 0.0
        wanted = sum(min(len(j.prompt) - j.num_computed, self.chunk_size) for j in self._queue)
        if wanted >= self.token_budget:  # full: waiting adds nobody to this forward
            return 0.0
        until = min(self._last_submit_at + self.gathering.gap_s,
                    self._queue[0].submitted_at + self.gathering.window_s)
        return max(until - now, 0.0)

    async def _gather(self) -> None:
        """Wait while `gather_left_s` says so, looking again at every submission (a
        cancelled job leaves the queue meanwhile as it would have anyway)."""
        tracer, traced_from = trace.get(), time.monotonic()
        while (left := self.gather_left_s(time.perf_counter())) > 0:
            self._submitted.clear()
            waiter = asyncio.ensure_future(self._submitted.wait())
            await asyncio.wait({waiter}, timeout=left)
            waiter.cancel()
        if tracer:
            tracer.event("prefill_gather", t0=traced_from, t1=time.monotonic(),
                         ids=[j.request_id for j in self._queue])

    def _defer(self, left_s: float) -> None:
        """A caller that may not wait (decode steps to run): wake it when the window
        closes, unless a submission does first."""
        if self._deferred is not None:
            self._deferred.cancel()
        assert self._loop is not None  # noqa: S101 - set by run_once
        self._deferred = self._loop.call_later(left_s, self.on_submit)

    async def run_once(self, may_wait: bool = True) -> bool:
        """Run one batch if any job waits. Returns whether a batch ran. A wave still
        arriving is waited for (`Gathering`), or with `may_wait` False left for a later call:
        `on_submit` is called when its window closes."""
        self._loop = asyncio.get_running_loop()
        if (left_s := self.gather_left_s(time.perf_counter())) > 0:
            if not may_wait:
                self._defer(left_s)
                return False
            await self._gather()
        items = self._plan()
        if not items:
            return False
        now = time.perf_counter()
        for it in items:
            it.job.is_in_batch = True
            if not it.job.started_at:  # its first chunk (after any cached prefix)
                it.job.started_at = now
        tracer, traced_from = trace.get(), time.monotonic()
        try:
            delay_s = max(self._faults.for_request(it.job.request_id).prefill_batch_delay_s
                          for it in items)
            if delay_s:
                await asyncio.sleep(delay_s)  # an injected fault: the jobs stay pending
            tokens = await run_to_completion(self.executor, self._forward, items)
            self._measure(sum(it.end - it.start for it in items),
                          time.perf_counter() - now - delay_s)
            if tracer:
                tracer.event("prefill", t0=traced_from, t1=time.monotonic(),
                             ids=[it.job.request_id for it in items],
                             tokens=sum(it.end - it.start for it in items))
        except Exception as exc:  # a failed forward fails its jobs, not the loop
            log.exception("prefill batch of %d failed", len(items))
            for it in items:
                self._fail(it.job, exc)
            return True
        finally:
            for it in items:
                it.job.is_in_batch = False
                it.job.batch_done.set()
        for it, token in zip(items, tokens):
            it.job.num_computed = it.end
            if token is not None:
                if it.job in self._queue:
                    self._queue.remove(it.job)
                if not it.job.first_token.done():
                    it.job.sample_token_ids = token[1:]
                    it.job.first_token.set_result(token[0])
        return True

    def _measure(self, num_tokens: int, seconds: float) -> None:
        if num_tokens >= MIN_MEASURED_TOKENS:
            sample = seconds / num_tokens
            self.s_per_token = (sample if not self.s_per_token
                                else (1 - EWMA_WEIGHT) * self.s_per_token + EWMA_WEIGHT * sample)

    def _fail(self, job: PrefillJob, exc: Exception) -> None:
        if job in self._queue:
            self._queue.remove(job)
        if not job.first_token.done():
            job.first_token.set_exception(exc)

    async def loop(self, wake: asyncio.Event) -> None:
        """Serve the queue forever (the prefill worker's own loop)."""
        while True:
            await wake.wait()
            wake.clear()
            while await self.run_once():
                await asyncio.sleep(0)  # let pushes and new arrivals run between batches


def logit_rows(items: list[BatchItem]) -> tuple[list[int], list[int]]:
    """The packed rows of a forward over `items` whose logits it returns: each chunk's last,
    or every row of a chunk whose prompt asks for prompt logprobs; with the index among them
    of each chunk's first."""
    rows: list[int] = []
    firsts: list[int] = []
    start = 0
    for it in items:
        n = it.end - it.start
        firsts.append(len(rows))
        rows.extend(range(start, start + n) if it.job.wants_prompt_logprobs
                    else [start + n - 1])
        start += n
    return rows, firsts


def add_prompt_logprobs(item: BatchItem, logits: torch.Tensor) -> None:
    """The chunk's rows of logits (from its first on) predict the prompt's tokens after
    each of its positions: theirs, to the job's prompt logprobs (the prompt's last position
    predicts the first generated token instead)."""
    job = item.job
    num = min(item.end, len(job.prompt) - 1) - item.start
    if num > 0 and job.params.prompt_logprobs is not None:
        job.prompt_logprobs += logprobs_of(
            logits[:num], job.prompt[item.start + 1: item.start + 1 + num],
            job.params.prompt_logprobs)
