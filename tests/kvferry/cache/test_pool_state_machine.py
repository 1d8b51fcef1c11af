"""A hypothesis state machine over two decode workers' K/V pools, their prefix indexes and every
path that moves blocks, with the pools' and indexes' invariants checked after every step.

Rules: `arrive` (a new request, or a next chat turn on an earlier context, under its salt or
the other tenant's), `share` (a second request on a live request's prompt), `pressure` (a
request that takes every free block, evicting cached ones), `advance` (push a reservation's
prompt K/V, or attach its Decode stream), `step` (a pass of each worker's step loop: admit,
swap in, grant waiters, grow with preemption, one decode step), `preempt` (swap a running
sequence out), `end` (abort, a waiting reservation given up, a failed step) and `migrate`
(the request's decode worker is lost: aborted there, its context reserved on the other).

Everything that owns blocks is the real code: `DecodeEngine` (reserve, abort, `_finish`),
its `KvReceiver` (pushes), `StepLoop` (`_admit_and_reap`, `_swap_in`, `_grow`, `_swap_out`,
`_deliver`, `_fail_running`), `BlockQueue`, `DecodePrefixCache` and `BlockAllocator`. No
forward pass runs: the test plays the model. A push carries pages the test computed, and a
step writes each running sequence's K/V at its next position, then appends a token, as
`StepLoop._run_steps` would. Each position's K/V names its whole prefix (K: token and
position; V: a digest of every token up to it, and the salt), so a block whose pages do not
hold the tokens the index says it holds is caught by content, not by bookkeeping alone.

Migration is what the router does when a decode worker is lost: the stream is aborted on one
worker (the server aborts a cancelled Decode stream) and the request's context (prompt and
every token streamed) is reserved, prefilled and pushed on the other.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import TypeVar, cast

import hypothesis
import numpy as np
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from decode_worker.engine import DecodeEngine
from decode_worker.sequence import DecodeSeq, Phase, Reservation
from decode_worker.step_faults import InjectedFault
from kvferry.cache.allocator import BlockAllocator
from kvferry.cache.budget import blocks_for_tokens
from kvferry.cache.layout import KvLayout
from kvferry.cache.pool import KvPool
from kvferry.cache.prefix import block_keys, cache_seed, max_shared_blocks
from kvferry.model.config import ModelConfig
from kvferry.model.sampling import SamplingParams
from kvferry.model.transformer import Transformer
from kvferry.transfer import wire

T = TypeVar("T")
VOCAB = 3  # a tiny vocabulary: prompts share prefixes often
SALTS = ("", "tenant-b")
NUM_WORKERS = 2
MAX_PENDING = 2  # reservations waiting for blocks, per worker
THEN = ("reserve", "push", "attach", "attach")
CONFIG = ModelConfig(
    path="", architecture="LlamaForCausalLM", vocab_size=VOCAB, hidden_size=2,
    intermediate_size=2, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2,
    rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False,
    has_qk_norm=False, attention_bias=False, mlp_bias=False, eos_token_ids=(),
    fingerprint="pool-state-machine",
)


class NoForwardModel:
    """What a DecodeEngine reads of its model when the test plays the forward pass."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.compiled = None


@functools.lru_cache(maxsize=1 << 14)
def prefix_digests(context: tuple[int, ...]) -> tuple[int, ...]:
    """For each position of `context`, a 20-bit digest of every token up to it."""
    digest = hashlib.blake2b(digest_size=8)
    out: list[int] = []
    for token in context:
        digest.update(token.to_bytes(2, "little"))
        out.append(int.from_bytes(digest.copy().digest()[:4], "little") % (1 << 20))
    return tuple(out)


def expected_pages(context: list[int], salt: str, start: int, end: int) -> np.ndarray:
    """The K/V the stand-in model computes for positions [start, end) of `context`:
    [2 (K, V), end - start, head_dim 2] float32. K = (token, position); V = (digest of
    tokens [0, position], salt), all exact in float32."""
    return _expected_pages(tuple(context[:end]), salt, start)


@functools.lru_cache(maxsize=1 << 14)
def _expected_pages(context: tuple[int, ...], salt: str, start: int) -> np.ndarray:
    end = len(context)
    out = np.empty((2, end - start, 2), np.float32)
    out[0, :, 0] = context[start:end]
    out[0, :, 1] = np.arange(start, end)
    out[1, :, 0] = prefix_digests(context)[start:end]
    out[1, :, 1] = SALTS.index(salt)
    out.flags.writeable = False  # shared by every caller
    return out


def slot_ids(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    return [block_table[p // block_size] * block_size + p % block_size
            for p in range(start, end)]


def flat_pages(pool: KvPool) -> np.ndarray:
    """The pool's K/V as [2 (K, V), slots, head_dim] (one layer, one K/V head): a view."""
    # [1 layer, 2, blocks, block_size, 1 kv head, 2] -> [2, slots, head_dim]
    return pool.cache.view(2, pool.num_blocks * pool.block_size, 2).numpy()


def write_pages(pool: KvPool, block_table: list[int], pages: np.ndarray, start: int) -> None:
    slots = slot_ids(block_table, pool.block_size, start, start + pages.shape[1])
    flat_pages(pool)[:, slots] = pages


def pick(items: list[T], index: int) -> T | None:
    return items[index % len(items)] if items else None


@dataclass
class Leg:
    """One request on one decode worker, as the test knows it."""

    request_id: str
    worker: int
    salt: str
    prompt: list[int]  # the context this reservation was made for
    max_tokens: int
    num_expected_cached: int  # prompt blocks the index held at Reserve
    num_generated: int = 0  # outputs before this leg (a migrated request)
    is_pushed: bool = False
    tokens: list[int] = field(default_factory=list)  # first token + generated (attached)
    may_end: bool = False  # aborted, failed or at its length: the engine may release it

    def context(self, num_written: int) -> list[int]:
        return (self.prompt + self.tokens)[:num_written]


@dataclass
class PendingReserve:
    """A reservation waiting in the BlockQueue; its lookup's blocks are held meanwhile."""

    leg: Leg
    task: asyncio.Task[Reservation]
    cached_ids: list[int]


def num_written(seq: DecodeSeq, block_size: int) -> int:
    """Positions whose K/V the sequence's pages (or swapped copy) hold."""
    if seq.phase in (Phase.RUNNING, Phase.SWAPPED):
        return seq.next_position
    if seq.receipt.is_complete:
        return seq.num_prompt_tokens
    return seq.num_cached_blocks * block_size


class PoolMachine(RuleBasedStateMachine):
    """Two decode workers with small pools; requests arrive, share prefixes, grow, get
    preempted, migrate and end. The model: which request holds which blocks (each engine's
    tables, plus reservations still waiting), what tokens each indexed key stands for, and the
    index as a router sees it through the event log."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.engines: list[DecodeEngine] = []
        self.legs: dict[str, Leg] = {}  # live: reserved and not yet released
        self.pending: dict[str, PendingReserve] = {}
        self.meaning: dict[bytes, tuple[str, tuple[int, ...]]] = {}  # key -> salt, tokens
        # Contexts whose K/V was indexed (pushed prompts, released requests): stems to share.
        self.history: list[tuple[int, str, list[int]]] = []  # worker, salt, context
        self.mirrors: list[tuple[int, set[bytes]]] = []  # per worker: event cursor, keys
        self.next_id = 0
        self.is_consistent = True  # the last step's checks passed (teardown's final check)

    # ---- set-up and helpers ------------------------------------------------------------------
    @initialize(num_blocks=st.integers(8, 24), block_size=st.sampled_from([2, 4]))
    def build(self, num_blocks: int, block_size: int) -> None:
        model = cast(Transformer, NoForwardModel(CONFIG))
        for _ in range(NUM_WORKERS):
            pool = KvPool(CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim, block_size,
                          num_blocks, torch.float32, prefix_caching=True)
            self.engines.append(DecodeEngine(model, pool,
                                             KvLayout.of_pool(pool, CONFIG.fingerprint)))
            self.mirrors.append((0, set()))

    @property
    def block_size(self) -> int:
        return self.engines[0].pool.block_size

    @property
    def num_blocks(self) -> int:
        return self.engines[0].pool.num_blocks

    def _allocator(self, worker: int) -> BlockAllocator:
        return self.engines[worker].pool.allocator

    def _seed(self, salt: str) -> bytes:
        layout = self.engines[0].layout
        return cache_seed(layout.model_fingerprint, layout.dtype, salt)

    def _remember(self, salt: str, tokens: list[int]) -> None:
        """Record what each full block's key of `tokens` stands for."""
        size = self.block_size
        for i, key in enumerate(block_keys(tokens, size, self._seed(salt))):
            meaning = (salt, tuple(tokens[:(i + 1) * size]))
            assert self.meaning.setdefault(key, meaning) == meaning

    def _begin(self) -> None:
        self.is_consistent = False

    def _settle(self) -> None:
        """Let woken reservations run, then take in the ones that completed."""
        for _ in range(4):
            self.loop.run_until_complete(asyncio.sleep(0))  # paces: one loop turn
        for request_id, pending in list(self.pending.items()):
            if not pending.task.done():
                continue
            del self.pending[request_id]
            granted = pending.task.result()  # a reservation never fails once it waited
            self._admitted(pending.leg, granted)
            event("a waiting reservation was granted")

    def _admitted(self, leg: Leg, granted: Reservation) -> None:
        assert granted.num_cached_blocks == leg.num_expected_cached, (
            "the lookup did not return the longest indexed prefix")
        assert granted.num_blocks == blocks_for_tokens(len(leg.prompt) + 1, self.block_size)
        self.legs[leg.request_id] = leg

    def _reserve(self, worker: int, salt: str, prompt: list[int], max_tokens: int,
                 request_id: str, num_generated: int = 0) -> Leg | None:
        """Reserve through the engine: admitted at once (the leg is returned) or waiting
        (pending). Every request here fits the pool alone."""
        engine = self.engines[worker]
        size = self.block_size
        self._remember(salt, prompt)
        keys = block_keys(prompt, size, self._seed(salt), max_shared_blocks(len(prompt), size))
        indexed = set(engine.pool.allocator.cached_keys())
        num_hits = next((i for i, key in enumerate(keys) if key not in indexed), len(keys))
        leg = Leg(request_id, worker, salt, list(prompt), max_tokens, num_hits,
                  num_generated=num_generated)
        task = self.loop.create_task(engine.reserve(request_id, len(prompt), max_tokens, 60.0,
                                                    prompt, salt))
        for _ in range(2):
            self.loop.run_until_complete(asyncio.sleep(0))  # paces: one loop turn
        if num_hits:
            event("a reservation shared cached blocks")
        if task.done():
            self._admitted(leg, task.result())
            return leg
        block_of = engine.pool.allocator._block_of
        self.pending[request_id] = PendingReserve(leg, task,
                                                  [block_of[k] for k in keys[:num_hits]])
        event("a reservation waits for blocks")
        return None

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _seqs(self, worker: int) -> dict[str, DecodeSeq]:
        return self.engines[worker]._seqs

    def _legs_where(self, *, pushed: bool | None = None, attached: bool | None = None
                    ) -> list[Leg]:
        legs = [leg for leg in self.legs.values()
                if (pushed is None or leg.is_pushed == pushed)
                and (attached is None or bool(leg.tokens) == attached)]
        return sorted(legs, key=lambda leg: leg.request_id)

    def _check_indexed(self, leg: Leg, written: int) -> None:
        """A request that ended with its K/V complete and its blocks in the pool (not by an
        error) left every full block of that K/V in the index. Callers skip it when a waiter
        was granted blocks by the release (it may have evicted some)."""
        engine = self.engines[leg.worker]
        context = leg.context(written)
        keys = block_keys(context, self.block_size, self._seed(leg.salt))
        missing = set(keys) - set(engine.pool.allocator.cached_keys())
        assert not missing, f"{len(missing)} of {len(keys)} full blocks not indexed at release"

    # ---- rules -------------------------------------------------------------------------------
    # Rules that find nothing to act on do nothing (preconditions that are mostly false make
    # hypothesis give up on drawing a rule).
    @precondition(lambda self: self.engines)
    @rule(worker=st.integers(0, NUM_WORKERS - 1), salt=st.sampled_from(SALTS),
          stem=st.none() | st.tuples(st.integers(0, 1 << 16), st.integers(0, 24)),
          tail=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
          max_tokens=st.sampled_from(range(2, 17)), then=st.sampled_from(THEN))
    def arrive(self, worker: int, salt: str, stem: tuple[int, int] | None, tail: list[int],
               max_tokens: int, then: str) -> None:
        """A new request; it shares whatever prefix the index holds. With `stem` (which
        earlier context, how many of its tokens) its prompt starts with an earlier request's
        context (a next chat turn), and it goes where that context was (prefix-aware
        routing), under its salt, or under the other one when `salt` is not "" (the other
        tenant must never share it). `then`: how far it goes at once when its blocks are
        granted (push its K/V, attach its Decode stream)."""
        self._begin()
        prompt = list(tail)
        if stem is not None and self.history:
            worker, stem_salt, context = self.history[stem[0] % len(self.history)]
            salt = stem_salt if salt == SALTS[0] else SALTS[1 - SALTS.index(stem_salt)]
            prompt = context[:stem[1]] + tail
        self._start(worker, salt, prompt, max_tokens, then)

    @rule(index=st.integers(0, 1 << 16), tail=st.lists(st.integers(0, VOCAB - 1), max_size=3),
          max_tokens=st.sampled_from(range(2, 17)), then=st.sampled_from(THEN))
    def share(self, index: int, tail: list[int], max_tokens: int, then: str) -> None:
        """A second request on a live request's prompt (parallel samples, a retry, a system
        prompt), on the same worker and salt: its reservation shares the prompt's blocks while
        the first one still holds them."""
        self._begin()
        leg = pick(self._legs_where(pushed=True), index)
        if leg is not None:
            self._start(leg.worker, leg.salt, leg.prompt + tail, max_tokens, then)

    @precondition(lambda self: self.engines)
    @rule(worker=st.integers(0, NUM_WORKERS - 1), num_evicted=st.integers(0, 8),
          seed=st.integers(0, 1 << 16), then=st.sampled_from(THEN))
    def pressure(self, worker: int, num_evicted: int, seed: int, then: str) -> None:
        """A request that needs every truly free block and `num_evicted` cached ones: the
        allocation evicts the least recently released cached blocks, and running sequences
        that grow next find the pool short."""
        self._begin()
        allocator = self._allocator(worker)
        truly_free = allocator.num_free - allocator.num_cached
        need = min(truly_free + num_evicted, allocator.num_free, self.num_blocks - 1)
        # `need` blocks with the first decode slot
        if need < 1:
            return
        prompt = random.Random(seed).choices(range(VOCAB), k=need * self.block_size - 1)
        if sum(p.leg.worker == worker for p in self.pending.values()) >= MAX_PENDING:
            return
        # The longest output that still fits the pool with this prompt.
        max_tokens = self.block_size + 1
        self._go(self._reserve(worker, SALTS[0], prompt, max_tokens, self._new_id()), then)

    def _start(self, worker: int, salt: str, prompt: list[int], max_tokens: int,
               then: str) -> None:
        if sum(p.leg.worker == worker for p in self.pending.values()) >= MAX_PENDING:
            return
        # At most half the pool (prompt and output), so that a few requests share it.
        half = self.num_blocks // 2 * self.block_size
        max_tokens = min(max_tokens, half - 1)
        prompt = prompt[:half - max_tokens]
        self._go(self._reserve(worker, salt, prompt, max_tokens, self._new_id()), then)

    def _go(self, leg: Leg | None, then: str) -> None:
        if leg is not None and then != "reserve":
            self._push(leg)
            if then == "attach":
                self._attach(leg, leg.prompt[-1])

    @rule(index=st.integers(0, 1 << 16), attach_first=st.booleans(),
          first=st.integers(0, VOCAB - 1))
    def advance(self, index: int, attach_first: bool, first: int) -> None:
        """A reserved request moves on: its prompt's K/V is pushed (from the block after the
        cached prefix on), or its Decode stream attaches with the prefill's first token
        (either may come first)."""
        self._begin()
        leg = pick([leg for leg in self._legs_where() if not (leg.is_pushed and leg.tokens)],
                   index)
        if leg is None:
            return
        if leg.is_pushed or (attach_first and not leg.tokens):
            self._attach(leg, first)
        else:
            self._push(leg)

    def _push(self, leg: Leg) -> None:
        engine = self.engines[leg.worker]
        size = self.block_size
        num_prompt = len(leg.prompt)
        num_blocks = blocks_for_tokens(num_prompt, size)
        sender = KvPool(CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim, size,
                        num_blocks, torch.float32, prefix_caching=False)
        write_pages(sender, list(range(num_blocks)),
                    expected_pages(leg.prompt, leg.salt, 0, num_prompt), 0)
        seq = self._seqs(leg.worker)[leg.request_id]
        epoch = engine.receiver.begin_push(leg.request_id)
        for span in wire.plan_chunks(engine.layout, num_prompt,
                                     first_block=seq.num_cached_blocks):
            data = wire.pack_array(sender, list(range(num_blocks)), span).tobytes()
            engine.receiver.receive_chunk(leg.request_id, engine.layout, num_prompt, span, data,
                                          wire.crc32(data), epoch)
        engine.receiver.finish_push(leg.request_id, epoch)
        leg.is_pushed = True
        self.history.append((leg.worker, leg.salt, list(leg.prompt)))

    def _attach(self, leg: Leg, first: int) -> None:
        self.engines[leg.worker].attach(leg.request_id, first, SamplingParams(),
                                        leg.max_tokens - 1, [], num_generated=leg.num_generated)
        leg.tokens = [first]

    @precondition(lambda self: self.engines)
    @rule(num_passes=st.integers(1, 2), seed=st.integers(0, 1 << 16))
    def step(self, num_passes: int, seed: int) -> None:
        """Passes of each worker's step loop: reap and admit, swap in, grant waiters, grow
        (which preempts the newest sequence while the pool is short), one decode step whose
        tokens `seed` picks."""
        self._begin()
        sampler = random.Random(seed)
        for _ in range(num_passes):
            for worker in range(NUM_WORKERS):
                self._step_once(worker, sampler)

    def _step_once(self, worker: int, sampler: random.Random) -> None:
        engine = self.engines[worker]
        steps = engine.steps
        steps._admit_and_reap()
        steps._swap_in()
        engine.blocks.grant()
        swapped = list(steps.swapped)
        steps._grow()
        for seq in steps.swapped:
            if seq not in swapped:
                event("growth preempted a sequence" + (" (holding shared blocks)"
                                                       if seq.num_cached_blocks else ""))
        batch = list(steps.running)
        tokens: list[int] = []
        finished: list[DecodeSeq] = []
        allocator = engine.pool.allocator
        for seq in batch:
            leg = self.legs[seq.request_id]
            position = seq.next_position
            block_id = seq.block_table[position // self.block_size]
            # Append-only decoding never writes a block another request or the index holds.
            assert allocator._refcount[block_id] == 1, "a step writes a shared block"
            assert block_id not in allocator._key_of, "a step writes an indexed block"
            context = leg.context(position + 1)
            write_pages(engine.pool, seq.block_table,
                        expected_pages(context, leg.salt, position, position + 1), position)
            token = sampler.randrange(VOCAB)
            tokens.append(token)
            seq.tokens.append(token)
            leg.tokens.append(token)
            self._remember(leg.salt, leg.context(position + 1))
            if len(seq.tokens) - 1 >= seq.max_new_tokens:
                finished.append(seq)
                leg.may_end = True
        had_waiters = engine.blocks.num_waiting > 0
        steps._deliver(batch, [[t] for t in tokens], [[] for _ in tokens], finished,
                       steps.num_steps)
        for seq in finished:
            if not had_waiters:
                self._check_indexed(self.legs[seq.request_id], seq.next_position)
        self._settle()

    @rule(index=st.integers(0, 1 << 16))
    def preempt(self, index: int) -> None:
        """Swap a running sequence out to host memory (the step loop's preemption)."""
        self._begin()
        # Sequences on shared prefix blocks first: their release is the one easy to get wrong.
        running = sorted((s for e in self.engines for s in e.steps.running if not s.is_aborted),
                         key=lambda s: (-s.num_cached_blocks, s.request_id))
        seq = pick(running, index)
        if seq is None:
            return
        event("a sequence was preempted" + (" (holding shared blocks)"
                                             if seq.num_cached_blocks else ""))
        self.engines[self.legs[seq.request_id].worker].steps._swap_out(seq)
        assert seq.block_table == [] and seq.phase is Phase.SWAPPED

    @rule(index=st.integers(0, 1 << 16),
          how=st.sampled_from(("abort", "abort", "cancel_waiting", "fail_step")))
    def end(self, index: int, how: str) -> None:
        """Work goes away: a client aborts (released now, or at the next step boundary when
        running), a waiting reservation's caller gives up, or a decode step fails (its batch
        ends with INTERNAL and nothing of it is indexed)."""
        self._begin()
        if how == "abort":
            leg = pick(self._legs_where(), index)
            if leg is not None:
                self._abort(leg)
        elif how == "cancel_waiting":
            self._cancel_waiting(pick(sorted(self.pending), index))
        else:
            self._fail_step(index % NUM_WORKERS)
        self._settle()

    def _abort(self, leg: Leg) -> None:
        engine = self.engines[leg.worker]
        seq = self._seqs(leg.worker)[leg.request_id]
        leg.may_end = True
        phase = seq.phase
        written = num_written(seq, self.block_size)
        is_checked = seq.receipt.is_complete and not engine.blocks.num_waiting
        engine.abort(leg.request_id)
        if phase is Phase.RUNNING:
            assert seq.is_aborted and leg.request_id in self._seqs(leg.worker)
            return
        assert leg.request_id not in self._seqs(leg.worker) and seq.block_table == []
        if is_checked and phase is Phase.RESERVED:  # a swapped one had no blocks to index
            self._check_indexed(leg, written)

    def _cancel_waiting(self, request_id: str | None) -> None:
        if request_id is None:
            return
        pending = self.pending.pop(request_id)
        pending.task.cancel()
        for _ in range(2):
            self.loop.run_until_complete(asyncio.sleep(0))  # paces: one loop turn
        assert pending.task.cancelled()
        assert request_id not in self._seqs(pending.leg.worker)

    def _fail_step(self, worker: int) -> None:
        steps = self.engines[worker].steps
        for seq in steps.running:
            self.legs[seq.request_id].may_end = True
        log = logging.getLogger("kvferry.decode")
        level = log.level
        log.setLevel(logging.CRITICAL)  # the failure's error log is expected here
        try:
            steps._fail_running(InjectedFault("a step failed (test)"))
        finally:
            log.setLevel(level)
        steps.consecutive_failures = 0

    @rule(index=st.integers(0, 1 << 16))
    def migrate(self, index: int) -> None:
        """The router loses the request's decode worker: the stream is aborted there, and the
        context (prompt + every token streamed) is reserved on the other worker."""
        self._begin()
        leg = pick([leg for leg in self._legs_where(pushed=True, attached=True)
                    if not leg.may_end], index)
        if leg is None:
            return
        context = leg.prompt + leg.tokens
        remaining = leg.max_tokens - len(leg.tokens)
        self._abort(leg)
        self._settle()
        if remaining > 1:
            self._reserve(1 - leg.worker, leg.salt, context, remaining,
                          f"{leg.request_id}.m", leg.num_generated + len(leg.tokens))
            event("a request migrated")

    # ---- invariants --------------------------------------------------------------------------
    @invariant()
    def pools_agree_with_the_model(self) -> None:
        if not self.engines:
            return
        self._forget_released()
        for worker in range(NUM_WORKERS):
            self._check_blocks(worker)
            self._check_contents(worker)
            self._check_index(worker)
            self._check_events(worker)
        self.is_consistent = True

    def _forget_released(self) -> None:
        for request_id, leg in list(self.legs.items()):
            if request_id not in self._seqs(leg.worker):
                assert leg.may_end, f"{request_id} was released without a reason"
                self.history.append((leg.worker, leg.salt, leg.prompt + leg.tokens))
                del self.legs[request_id]
        for worker in range(NUM_WORKERS):
            live = {r for r, leg in self.legs.items() if leg.worker == worker}
            assert set(self._seqs(worker)) == live

    def _check_blocks(self, worker: int) -> None:
        """Each block's refcount is the number of requests (and waiting reservations) holding
        it, the index holding no reference of its own; a held block is never free and a free
        one is held by nobody; the pool's own integrity check passes; free + used == total."""
        engine = self.engines[worker]
        allocator = engine.pool.allocator
        holders: Counter[int] = Counter()
        for seq in self._seqs(worker).values():
            assert len(set(seq.block_table)) == len(seq.block_table), "a block twice in a table"
            holders.update(seq.block_table)
            if seq.phase is Phase.SWAPPED:
                assert seq.block_table == [] and seq.swapped_kv is not None
            else:
                assert seq.swapped_kv is None
        for pending in self.pending.values():
            if pending.leg.worker == worker:
                holders.update(pending.cached_ids)
        free = set(allocator._free) | set(allocator._evictable)
        for block_id in range(self.num_blocks):
            assert allocator._refcount[block_id] == holders[block_id], (
                f"block {block_id}: refcount {allocator._refcount[block_id]}, "
                f"held {holders[block_id]} times")
            assert (block_id in free) == (holders[block_id] == 0), (
                f"block {block_id}: free {block_id in free}, held {holders[block_id]} times")
        stats = engine.stats(check_integrity=True)  # what GetStats(check_integrity) answers
        assert stats.integrity_ok, stats.integrity_error
        assert stats.free_blocks + len(holders) == stats.total_blocks == self.num_blocks
        assert allocator.num_used == len(holders)

    def _check_contents(self, worker: int) -> None:
        """Every request's pages (or its swapped copy) hold the K/V of its own tokens, shared
        prefix blocks included."""
        flat = flat_pages(self.engines[worker].pool)
        size = self.block_size
        for seq in self._seqs(worker).values():
            leg = self.legs[seq.request_id]
            assert seq.tokens == leg.tokens
            written = num_written(seq, size)
            expected = expected_pages(leg.context(written), leg.salt, 0, written)
            if seq.phase is Phase.SWAPPED:
                assert seq.swapped_kv is not None
                # [layers, 2, blocks, block_size, kv_heads, head_dim] -> [2, positions, D]
                got = seq.swapped_kv.reshape(2, -1, 2)[:, :written].numpy()
            else:
                assert len(seq.block_table) >= blocks_for_tokens(written, size)
                got = flat[:, slot_ids(seq.block_table, size, 0, written)]
            assert np.array_equal(got, expected), f"{seq.request_id}: pages hold other tokens"

    def _check_index(self, worker: int) -> None:
        """Every indexed key stands for tokens a request fed, under its own salt, and its block
        holds exactly their K/V: a lookup can only return a block with the right contents."""
        pool = self.engines[worker].pool
        allocator = pool.allocator
        flat = flat_pages(pool)
        size = self.block_size
        for key in allocator.cached_keys():
            assert key in self.meaning, "the index holds a key no request produced"
            salt, tokens = self.meaning[key]
            block_id = allocator._block_of[key]
            assert allocator._key_of[block_id] == key
            start = len(tokens) - size
            got = flat[:, block_id * size:(block_id + 1) * size]
            assert np.array_equal(got, expected_pages(list(tokens), salt, start, len(tokens))), (
                f"indexed block {block_id} holds other tokens than its key")

    def _check_events(self, worker: int) -> None:
        """A router replaying the event log sees exactly the keys the index holds."""
        allocator = self._allocator(worker)
        cursor, keys = self.mirrors[worker]
        since = allocator.events_since(cursor)
        if since.is_snapshot:
            keys = set(since.events[0].stored)
        for change in [] if since.is_snapshot else since.events:
            keys |= set(change.stored)
            keys -= set(change.removed)
            if change.removed:
                event("the index evicted blocks")
        assert keys == set(allocator.cached_keys())
        self.mirrors[worker] = (since.seq, keys)

    # ---- the end -----------------------------------------------------------------------------
    def teardown(self) -> None:
        """Release everything: every pool is then all free, its index still true. Checked
        when the run so far passed (a failure is reported as itself), with the invariant's own
        checks, so that a bug found here and during a run is one failure, not two."""
        try:
            if self.engines and self.is_consistent:
                self._release_everything()
                self.pools_agree_with_the_model()
                assert not self.legs and not self.pending
                for engine in self.engines:
                    assert engine.pool.allocator.num_free == self.num_blocks
                    assert not engine.steps.running and not engine.steps.swapped
                    assert engine.blocks.num_waiting == 0
        finally:
            for pending in self.pending.values():
                pending.task.cancel()
            self.loop.run_until_complete(asyncio.sleep(0))  # paces: one loop turn
            self.loop.close()
            for engine in self.engines:
                engine.steps.executor.shutdown(wait=False)

    def _release_everything(self) -> None:
        for request_id in sorted(self.pending):
            self.pending.pop(request_id).task.cancel()
        for _ in range(2):
            self.loop.run_until_complete(asyncio.sleep(0))  # paces: one loop turn
        for leg in sorted(self.legs.values(), key=lambda leg: leg.request_id):
            if leg.request_id in self._seqs(leg.worker):
                self._abort(leg)
        for engine in self.engines:
            engine.steps._admit_and_reap()  # the step loop's next pass reaps aborted ones
        self._settle()
        self._forget_released()


# No explain phase: on a failure it reruns every example under a tracer, for minutes.
PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None,
                                         phases=[p for p in hypothesis.Phase
                                                 if p is not hypothesis.Phase.explain])
test_pools_through_allocate_share_preempt_migrate_and_evict = PoolMachine.TestCase
