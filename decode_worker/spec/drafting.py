"""Speculative decoding as a plug-in of the decode step (decode_worker/step_plugin.py;
docs/spec-decode-design.md, 3.3 and 3.4): before each forward, drafts for every sequence
(a proposer per sequence, or a draft model for the batch), which the step verifies as extra
rows (decode_worker/step_rows.py); after it, the counts and the proposers learn what each
kept. Around the steps it keeps each table to what its next step's drafts may write: blocks
of rejected drafts freed (`trim`), slots for the next drafts taken from unused blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from decode_worker.sequence import DecodeSeq
from decode_worker.spec.control import SpecController
from decode_worker.spec.draft_model import DraftModel
from decode_worker.spec.ngram import NgramProposer
from decode_worker.step_plugin import StepPlugin
from decode_worker.step_rows import StepRows
from kvferry.cache.block_table import truncate
from kvferry.cache.budget import blocks_for_tokens
from kvferry.cache.pool import KvPool
from kvferry.model.eviction import StreamingEviction
from kvferry.settings import SpeculativeConfig


class Proposer(Protocol):
    """Drafts for one sequence, fed every token it keeps (prompt first)."""

    def extend(self, tokens: Sequence[int]) -> None: ...

    def propose(self, k: int) -> list[int]: ...


def ngram_proposer(config: SpeculativeConfig) -> Callable[[DecodeSeq], Proposer]:
    return lambda seq: NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


@dataclass(eq=False)
class Drafting(StepPlugin):
    """The step loop's speculation: a proposer per sequence and the lookahead each may use."""

    config: SpeculativeConfig
    make_proposer: Callable[[DecodeSeq], Proposer]  # a sequence's, when it first steps
    pool: KvPool
    num_draft_tokens: int = 0  # drafts verified, over the worker's life
    num_accepted_tokens: int = 0  # of those, accepted
    draft: DraftModel | None = None  # drafts from a model for the whole batch (not proposers)
    eviction: StreamingEviction | None = None  # drafts never straddle its next eviction

    def __post_init__(self) -> None:
        self._proposers: dict[tuple[str, int], Proposer] = {}
        self.controller = SpecController(self.config.num_tokens, self.config.is_adaptive)
        self.step_rows = 0  # rows of the step just run (executor thread)
        self._step_start = 0.0

    # The step's fixed points (decode_worker/step_plugin.py).

    def before_grow(self, running: Sequence[DecodeSeq]) -> None:
        for seq in running:
            trim(self.pool, seq, self.lookahead(seq))

    def after_grow(self, running: Sequence[DecodeSeq]) -> None:
        """Slots for each sequence's next drafts, oldest first, from blocks nobody holds
        (never evicting the prefix cache: a sequence without room verifies fewer)."""
        allocator = self.pool.allocator
        for seq in sorted(running, key=lambda s: s.arrival):
            want = blocks_for_tokens(seq.cache_position + 1 + self.lookahead(seq),
                                     self.pool.block_size)
            while len(seq.block_table) < want and allocator.num_truly_free > 0:
                seq.block_table += allocator.alloc(1)

    def needs_loop(self, batch: Sequence[DecodeSeq]) -> bool:
        """A table no longer holds its next step's drafts and a block is free to give it."""
        if self.pool.allocator.num_truly_free == 0:
            return False
        size = self.pool.block_size
        return any(len(s.block_table) * size <= s.cache_position + self.lookahead(s)
                   for s in batch)

    def plan(self, rows: StepRows) -> None:
        self._step_start = time.perf_counter()
        rows.drafts = self.batch_drafts(rows.batch, rows.block_size)

    def done(self, rows: StepRows, kept: Sequence[list[int]]) -> None:
        self.timed(time.perf_counter() - self._step_start)
        if rows.is_verifying:
            self.count(rows.batch, rows.drafts, kept)
        for seq, tokens in zip(rows.batch, kept):
            self.kept(seq, tokens)

    def forget(self, seq: DecodeSeq) -> None:
        """A sequence left the step loop."""
        self._proposers.pop(seq.key, None)
        self.controller.forget(seq.key)
        if self.draft is not None:
            self.draft.forget(seq.key)

    def moved(self, seq: DecodeSeq) -> None:
        """A sequence's blocks changed under it (swapped back in): its draft K/V is gone."""
        seq.draft_kv_tokens = 0  # the draft pool's pages were not swapped
        if self.draft is not None:
            self.draft.forget(seq.key)

    # What those points use.

    def lookahead(self, seq: DecodeSeq) -> int:
        """Drafts `seq` may verify next step: k, but never more tokens than it may still
        produce (a step yields up to drafts + 1), nor past its next eviction: the drafts a
        step verifies see the keys decoding them one at a time would (eviction moves the
        window only when a token needs a block past the budget, so within it nothing moves)."""
        k = min(self.config.num_tokens, seq.tokens_left - 1)
        if self.eviction is not None and self.eviction.applies(seq):
            k = min(k, self.eviction.room(seq))
        return max(0, k)

    def num_drafts(self, seq: DecodeSeq, block_size: int, batch_rows: int = 1) -> int:
        """Drafts `seq`'s next step in a batch of `batch_rows` sequences may verify: as many
        as the controller finds worth it, within its lookahead and the slots its table
        holds (a draft model needs the prompt's tokens, which Reserve may not have sent)."""
        if self.draft is not None and len(seq.prompt_token_ids) != seq.num_prompt_tokens:
            return 0
        room = len(seq.block_table) * block_size - 1 - seq.cache_position
        k = min(self.lookahead(seq), room)
        return min(k, self.controller.k_for(seq.key, batch_rows)) if k > 0 else 0

    def drafts(self, seq: DecodeSeq, block_size: int, batch_rows: int = 1) -> list[int]:
        """A proposer's drafts for `seq`'s next step (`num_drafts` of them at most)."""
        k = self.num_drafts(seq, block_size, batch_rows)
        return self._proposer(seq).propose(k) if k > 0 else []

    def batch_drafts(self, batch: Sequence[DecodeSeq], block_size: int) -> list[list[int]]:
        """Every sequence's drafts for the next step (executor thread); notes its rows."""
        if self.draft is not None:
            ks = [self.num_drafts(seq, block_size, len(batch)) for seq in batch]
            drafts = self.draft.propose(batch, ks)
        else:
            drafts = [self.drafts(seq, block_size, len(batch)) for seq in batch]
        self.step_rows = len(batch) + sum(len(d) for d in drafts)
        return drafts

    def timed(self, seconds: float) -> None:
        """The step just run took `seconds`: the controller's cost of rows learns it."""
        if self.step_rows:
            self.controller.times.observe(self.step_rows, seconds)

    def _proposer(self, seq: DecodeSeq) -> Proposer:
        proposer = self._proposers.get(seq.key)
        if proposer is None:
            proposer = self._proposers[seq.key] = self.make_proposer(seq)
            proposer.extend([*seq.prompt_token_ids, *seq.tokens])
        return proposer

    def kept(self, seq: DecodeSeq, tokens: Sequence[int]) -> None:
        """`tokens` were appended to `seq`: its proposer learns them."""
        proposer = self._proposers.get(seq.key)
        if proposer is not None:
            proposer.extend(tokens)

    def count(self, batch: Sequence[DecodeSeq], drafts: Sequence[list[int]],
              kept: Sequence[list[int]]) -> None:
        """Count a verification's drafts and accepted drafts, per sequence and in all (a
        sequence keeps its accepted drafts and one more token, unless a stop cut it)."""
        for seq, seq_drafts, seq_kept in zip(batch, drafts, kept):
            accepted = min(len(seq_drafts), len(seq_kept) - 1)
            if seq_drafts:
                self.controller.observe(seq.key, len(seq_drafts), accepted)
            if self.draft is not None:
                self.draft.verified(seq, len(seq_drafts), accepted)
            seq.num_draft_tokens += len(seq_drafts)
            seq.num_accepted_tokens += accepted
            self.num_draft_tokens += len(seq_drafts)
            self.num_accepted_tokens += accepted


def trim(pool: KvPool, seq: DecodeSeq, lookahead: int) -> None:
    """Free the blocks of `seq`'s table past what its next step writes (positions up to
    `next_position` + `lookahead`): rejected drafts' blocks, and lookahead no longer wanted."""
    keep = seq.cache_position + 1 + lookahead
    if len(seq.block_table) > blocks_for_tokens(keep, pool.block_size):
        truncate(pool, seq.block_table, keep)
