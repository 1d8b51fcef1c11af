"""Speculative decoding in the step loop: draft, verify over flattened rows, accept, roll back
(docs/spec-decode-design.md, 3.3 and 3.4).

A sequence with k drafts d_1..d_k becomes k + 1 rows of one decode forward: its last token
and the drafts, at positions P..P+k (P = `next_position`), each row with its own copy of the
sequence's block-table row and its own length (position + 1). The model writes every row's
K/V before attending, so row j sees the drafts before it: today's one-token step contract with
more rows, which every backend, the compiled step and the CUDA graphs already run. A sequence
without drafts is one row of the same forward.

`rejection.verify` keeps the drafts that equal what the target samples at their positions and
adds the target's next token, so the tokens are those of decoding without speculation, draw
for draw. Positions past the last kept token hold rejected K/V: they are past `next_position`
(no attention reads them, no prefix-index key names them) and the next steps overwrite them;
`trim` frees the whole blocks past what the next step needs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from decode_worker.draft_model import DraftModel
from decode_worker.sequence import DecodeSeq, PagedRow, StepInputs, step_inputs
from decode_worker.spec_control import SpecController
from decode_worker.speculation import NgramProposer
from kvferry.cache.block_table import truncate
from kvferry.cache.layout import blocks_for_tokens
from kvferry.cache.pool import KvPool
from kvferry.model.rejection import verify
from kvferry.model.sampling import SamplingParams
from kvferry.settings import SpeculativeConfig


class Proposer(Protocol):
    """Drafts for one sequence, fed every token it keeps (prompt first)."""

    def extend(self, tokens: Sequence[int]) -> None: ...

    def propose(self, k: int) -> list[int]: ...


def ngram_proposer(config: SpeculativeConfig) -> Callable[[DecodeSeq], Proposer]:
    return lambda seq: NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


@dataclass
class Drafting:
    """The step loop's speculation: a proposer per sequence and the lookahead each may use."""

    config: SpeculativeConfig
    make_proposer: Callable[[DecodeSeq], Proposer]  # a sequence's, when it first steps
    num_draft_tokens: int = 0  # drafts verified, over the worker's life
    num_accepted_tokens: int = 0  # of those, accepted
    draft: DraftModel | None = None  # drafts from a model for the whole batch (not proposers)

    def __post_init__(self) -> None:
        self._proposers: dict[tuple[str, int], Proposer] = {}
        self.controller = SpecController(self.config.num_tokens, self.config.is_adaptive)
        self.step_rows = 0  # rows of the step just run (executor thread)

    def lookahead(self, seq: DecodeSeq) -> int:
        """Drafts `seq` may verify next step: k, but never more tokens than it may still
        produce (a step yields up to drafts + 1)."""
        return max(0, min(self.config.num_tokens, seq.tokens_left - 1))

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

    def forget(self, key: tuple[str, int]) -> None:
        """A sequence (`DecodeSeq.key`) left the step loop."""
        self._proposers.pop(key, None)
        self.controller.forget(key)
        if self.draft is not None:
            self.draft.forget(key)

    def moved(self, key: tuple[str, int]) -> None:
        """A sequence's blocks changed under it (swapped back in): its draft K/V is gone."""
        if self.draft is not None:
            self.draft.forget(key)


def row_inputs(batch: Sequence[DecodeSeq], drafts: Sequence[list[int]], block_size: int
               ) -> tuple[torch.Tensor, StepInputs]:
    """Token ids [T] and paging inputs of the rows [last token, drafts...] of every
    sequence, in batch order: each row a one-token step of its own (`step_inputs`)."""
    tokens: list[int] = []
    rows: list[PagedRow] = []
    for seq, seq_drafts in zip(batch, drafts):
        for j, token in enumerate([seq.tokens[-1], *seq_drafts]):
            tokens.append(token)
            rows.append(PagedRow(seq.block_table, seq.cache_position + j,
                                 seq.rope_position + j))
    return torch.tensor(tokens), step_inputs(rows, block_size)


def accept(logits: torch.Tensor, batch: Sequence[DecodeSeq], drafts: Sequence[list[int]]
           ) -> list[list[int]]:
    """Per sequence, the tokens its rows of `logits` [T, V] yield: the accepted drafts and the
    target's next token, cut after a stop token or at max_new_tokens."""
    out: list[list[int]] = []
    row = 0
    for seq, seq_drafts in zip(batch, drafts):
        rows = logits[row: row + len(seq_drafts) + 1]
        row += len(seq_drafts) + 1
        params = seq.params or SamplingParams()  # attached: never None
        tokens = verify(rows, seq_drafts, params, seq.output_offset + len(seq.tokens)).token_ids
        tokens = tokens[:max(1, seq.tokens_left)]
        for i, token in enumerate(tokens):
            if token in seq.stop_token_ids:
                tokens = tokens[:i + 1]
                break
        out.append(tokens)
    return out


def trim(pool: KvPool, seq: DecodeSeq, lookahead: int) -> None:
    """Free the blocks of `seq`'s table past what its next step writes (positions up to
    `next_position` + `lookahead`): rejected drafts' blocks, and lookahead no longer wanted."""
    keep = seq.cache_position + 1 + lookahead
    if len(seq.block_table) > blocks_for_tokens(keep, pool.block_size):
        truncate(pool, seq.block_table, keep)
