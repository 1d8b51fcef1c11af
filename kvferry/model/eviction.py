"""K/V eviction in the step loop of decode and colocated workers, and while colocated and
prefill workers prefill a prompt past the budget (docs/kv-eviction-design.md 3.1-3.4):
streaming (StreamingLLM: attention sinks and a sliding window, `StreamingEviction`) and heavy
hitters (H2O, `HeavyHitterEviction`).

A sequence holds at most `budget_blocks`: its first `sink_blocks` (the sinks) and the newest
blocks (the window). Before a step whose token would need one block more, the oldest window
block leaves the table and is freed (`num_evicted` grows by a block): on the event loop,
between steps, never under a forward. Every kept token stays rotated at its index in the
cache plus the tokens evicted since the last re-base (`rope_position`), so the
distances attention sees are those of positions within the cache. The window keeps the
positions it was written at; the sinks are re-rotated forward instead, each time from a copy
of their keys as first written (one rotation from the original, never a rotation of a
rotation). Before a sink block is first rewritten it is made the sequence's own (copied if
another table or the prefix cache holds it). When the next token's rotary position would pass
the model's context, every kept key is rotated back to its index in the cache (re-base), so
the rotary positions stay within the range the model was trained on. The same policy bounds a
prompt while it is prefilled (kvferry/model/prefill_batch.py, on the event loop between its
chunks; on a colocated worker a decode forward may then run, over other sequences' blocks),
and the sequence goes on from the state the prompt left (pushed with the kept pages from a
prefill worker).

H2O keeps the last `recent_blocks` and, of the older blocks, those whose tokens drew the most
attention so far: each step's attention kernels add every kept position's probability, summed
over query heads and layers (`Transformer.decode(mass=)`), and `observe` adds it up per block.
Past the budget the older block with the least mass leaves (on equal mass, the later one: a
prompt that arrived whole past the budget has drawn none yet and keeps its first blocks, the
attention sinks H2O finds as heavy hitters anyway). Whole blocks, not tokens: a block frees
memory in the unit the pool allocates with no copy, where tokens would need compaction inside
blocks (docs/kv-eviction-design.md 3.3 and the perplexity table in docs/performance.md
measure what that keeps). Kept keys stay at the positions they were written at, as H2O's
reference does (no re-rotation); past the model's context every kept key moves back by the
tokens evicted since the last re-base, which keeps every distance.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Protocol

import torch

from kvferry.cache.budget import blocks_for_tokens
from kvferry.cache.pool import KvPool
from kvferry.model.sampling import SamplingParams
from kvferry.model.transformer import Transformer
from kvferry.settings import KvEvictionConfig

log = logging.getLogger("kvferry.decode")


class EvictingSeq(Protocol):
    """A sequence as eviction sees it: a decode worker's `EvictingSeq`, or a prompt being
    prefilled (`kvferry.model.prefill_batch.PrefillJob`)."""

    request_id: str
    params: SamplingParams | None  # kv_eviction "none": the request keeps every token
    block_table: list[int]
    num_evicted: int  # tokens whose K/V left the table
    num_rebased: int  # of those, the ones its rotary positions no longer count

    @property
    def key(self) -> Hashable: ...

    @property
    def next_position(self) -> int: ...

    @property
    def cache_position(self) -> int: ...

    @property
    def rope_position(self) -> int: ...


class StreamingEviction:
    """The step loop's eviction: `bound` each running sequence before a step."""

    wants_mass = False  # whether steps must hand `observe` the attention mass

    def __init__(self, config: KvEvictionConfig, model: Transformer, pool: KvPool,
                 text_positions: bool = False) -> None:
        """`text_positions` (benchmarks only: bench/bench_kv_eviction.py): every token keeps
        the position it was written at, the sinks included (no re-rotation, no re-base): the
        alternative to positions within the cache that the design measures."""
        self.text_positions = text_positions
        block_size = pool.block_size
        self.model, self.pool = model, pool
        self.sink_blocks = config.sink_blocks(block_size)
        self.budget_blocks = config.budget_blocks(block_size)
        self.max_position = model.config.max_position_embeddings
        if self.budget_blocks * block_size > self.max_position and not text_positions:
            raise ValueError(f"kv_window_tokens: sinks and window take "
                             f"{self.budget_blocks * block_size} tokens, past the model's "
                             f"context of {self.max_position}")
        self._sinks: dict[Hashable, torch.Tensor] = {}  # key -> [L, S, bs, Hkv, D] as written
        self.num_evicted_blocks = 0  # over the worker's life

    @staticmethod
    def applies(seq: EvictingSeq) -> bool:
        """Whether the policy bounds `seq` (its request did not opt out: kv_eviction none)."""
        return seq.params is None or seq.params.kv_eviction != "none"

    def needs(self, seq: EvictingSeq) -> bool:
        """Whether `seq`'s next step must wait for `bound` (executor thread: read only)."""
        return self.applies(seq) and (self._over_budget(seq) or self._past_context(seq))

    def bound(self, seq: EvictingSeq) -> None:
        """Evict until `seq`'s next token fits the budget; re-base its rotary positions when
        that token's would pass the model's context. Nothing for a request that opted out."""
        if not self.applies(seq):
            return
        while self._over_budget(seq):
            if not self._evict_oldest(seq):
                return  # no block to copy a shared sink into: it waits a step (grows)
        if self._past_context(seq):
            self._rebase(seq)

    def room(self, seq: EvictingSeq) -> int:
        """Positions past `seq`'s next token that it may write before its next eviction or
        re-base. A step verifying drafts writes no further: decoding the same tokens one at
        a time would evict (or re-base) between them, so they would attend over other keys
        (decode_worker/spec/drafting.py)."""
        room = self.budget_blocks * self.pool.block_size - 1 - seq.cache_position
        if not self.text_positions:
            room = min(room, self.max_position - 1 - seq.rope_position)
        return max(0, room)

    def _over_budget(self, seq: EvictingSeq) -> bool:
        """Its next token would need a block past the budget."""
        return blocks_for_tokens(seq.cache_position + 1, self.pool.block_size) > self.budget_blocks

    def _past_context(self, seq: EvictingSeq) -> bool:
        """Its next token's rotary position would pass the model's context (never at text
        positions, which the benchmark lets grow)."""
        return seq.rope_position >= self.max_position and not self.text_positions

    def forget(self, key: Hashable) -> None:
        """The sequence left the step loop."""
        self._sinks.pop(key, None)

    def observe(self, batch: list[EvictingSeq], mass: torch.Tensor) -> None:
        """A step's attention mass (only where `wants_mass`)."""

    def _evict_oldest(self, seq: EvictingSeq) -> bool:
        if not self.text_positions and not self._own(seq, range(self.sink_blocks)):
            return False  # rewritten below: its own first (samples share an evicted prompt's)
        if seq.key not in self._sinks and not self.text_positions:  # its first eviction here
            ids = seq.block_table[:self.sink_blocks]
            # as first written: rotated back by what it evicted before this policy knew it
            # (a sample forked after its prompt evicted; 0, exactly the keys, otherwise)
            self._sinks[seq.key] = self.model.rotate_keys(
                self.pool.read_keys(ids), seq.num_rebased - seq.num_evicted)
        self._drop(seq, self.sink_blocks)
        self._write_sinks(seq)
        return True

    def _drop(self, seq: EvictingSeq, index: int) -> None:
        """Table entry `index` leaves and its block is freed: a block of tokens evicted."""
        self.pool.allocator.free([seq.block_table.pop(index)])
        seq.num_evicted += self.pool.block_size
        self.num_evicted_blocks += 1

    def _write_sinks(self, seq: EvictingSeq) -> None:
        """The sinks' keys rotated from their originals by the tokens evicted since the last
        re-base: right before the window, as positions within the cache put them."""
        if not self.sink_blocks or self.text_positions:
            return
        ids = seq.block_table[:self.sink_blocks]
        shift = seq.num_evicted - seq.num_rebased
        self.pool.write_keys(ids, self.model.rotate_keys(self._sinks[seq.key], shift))

    def _rebase(self, seq: EvictingSeq) -> None:
        """Every kept key rotated back to its index in the cache."""
        if not self._own(seq, range(len(seq.block_table))):  # the sinks rewritten too
            return
        shift = seq.num_evicted - seq.num_rebased
        ids = seq.block_table[self.sink_blocks:]
        self.pool.write_keys(ids, self.model.rotate_keys(self.pool.read_keys(ids), -shift))
        seq.num_rebased = seq.num_evicted
        if seq.key in self._sinks:
            self._write_sinks(seq)
        log.info("request %s: rotary positions re-based by %d at position %d", seq.request_id,
                 shift, seq.next_position, extra={"request_id": seq.request_id})

    def _own(self, seq: EvictingSeq, indices: range) -> bool:
        """Blocks `indices` of `seq`'s table made its own (copied where another table or the
        prefix cache holds them); False, nothing changed, when the pool lacks the blocks."""
        allocator = self.pool.allocator
        shared = [i for i in indices if not allocator.is_private(seq.block_table[i])]
        if allocator.num_free < len(shared):
            return False
        for i in shared:
            old = seq.block_table[i]
            seq.block_table[i] = allocator.alloc(1)[0]
            self.pool.copy_blocks([old], [seq.block_table[i]])
            allocator.free([old])
        return True


class HeavyHitterEviction(StreamingEviction):
    """H2O over whole blocks: the newest `recent_blocks` and the heaviest older blocks."""

    wants_mass = True

    def __init__(self, config: KvEvictionConfig, model: Transformer, pool: KvPool) -> None:
        super().__init__(config, model, pool)
        self.recent_blocks = config.recent_blocks(pool.block_size)
        self._mass: dict[Hashable, list[float]] = {}  # key -> mass per table entry

    def forget(self, key: Hashable) -> None:
        self._mass.pop(key, None)

    def observe(self, batch: list[EvictingSeq], mass: torch.Tensor) -> None:
        """Add one step's mass [B, >= tokens of the widest table] (rows in `batch` order) to
        each sequence's blocks (executor thread, between `bound`s)."""
        block_size = self.pool.block_size
        width = max(len(s.block_table) for s in batch)
        per_block = mass[:, :width * block_size].reshape(len(batch), width, block_size)
        per_block = per_block.sum(dim=2).tolist()
        for seq, row in zip(batch, per_block):
            kept = self._masses(seq)
            for i in range(len(seq.block_table)):
                kept[i] += row[i]

    def _masses(self, seq: EvictingSeq) -> list[float]:
        """`seq`'s mass per table entry, one for each (0.0 for blocks it has not seen)."""
        kept = self._mass.setdefault(seq.key, [])
        kept += [0.0] * (len(seq.block_table) - len(kept))
        return kept

    def _evict_oldest(self, seq: EvictingSeq) -> bool:
        """The lightest block older than the recent window leaves."""
        kept = self._masses(seq)
        # Written blocks before the recent window (the next token's block is its newest; a
        # prompt's table may hold blocks reserved past it, not written yet).
        older = seq.cache_position // self.pool.block_size - (self.recent_blocks - 1)
        if older <= 0:
            return False
        victim = min(range(older), key=lambda i: (kept[i], -i))
        kept.pop(victim)
        self._drop(seq, victim)
        return True


def make_eviction(config: KvEvictionConfig | None, model: Transformer, pool: KvPool
                  ) -> StreamingEviction | None:
    """The step loop's eviction under `config` (None: every token kept)."""
    if config is None or not config.is_on:
        return None
    if config.policy == "h2o":
        return HeavyHitterEviction(config, model, pool)
    return StreamingEviction(config, model, pool)
