"""One decode forward's rows, built from its batch and what the step's plug-ins added, and
the tokens each sequence keeps from its logits.

Without drafts a sequence is one row: its last token, at its next position. With drafts
d_1..d_k (speculation, decode_worker/spec/) it is k + 1 rows of the same forward: its last
token and the drafts, at positions P..P+k (P = `next_position`), each row with its own copy
of the sequence's block-table row and its own length (position + 1). The model writes every
row's K/V before attending, so row j sees the drafts before it. `rejection.verify` keeps the
drafts that equal what the target samples at their positions and adds the target's next
token, so the tokens are those of decoding without speculation, draw for draw. Positions past
the last kept token hold rejected K/V: past `next_position`, no attention reads them and no
prefix-index key names them; the next steps overwrite them (docs/spec-decode-design.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from decode_worker.kv_stage import KvStage
from decode_worker.sequence import DecodeSeq, PagedRow, StepInputs, step_inputs
from kvferry.cache.pool import KvPool
from kvferry.model.logprobs import TokenLogprob, logprobs_of
from kvferry.model.rejection import verify
from kvferry.model.sampling import SamplingParams, sample_tokens
from kvferry.model.transformer import Transformer


class Kept(NamedTuple):
    """What a step's sequences keep, per sequence in batch order: its tokens, and where its
    request asked (SamplingParams.logprobs) their log probabilities ([] where it did not)."""

    tokens: list[list[int]]
    logprobs: list[list[TokenLogprob]]


@dataclass(eq=False)
class StepRows:
    """A step's batch (`is_staged`: the dense K/V stage holds it, rows in batch order), and
    what plug-ins add before its forward: each sequence's drafts, whether to measure each
    kept position's attention (`wants_mass`; then `mass` after the forward)."""

    batch: list[DecodeSeq]
    block_size: int
    is_staged: bool = False
    drafts: list[list[int]] = field(default_factory=list)  # [] or one list per sequence
    wants_mass: bool = False
    mass: torch.Tensor | None = None  # [rows, positions]

    @property
    def is_verifying(self) -> bool:
        return any(self.drafts)

    @property
    def num_rows(self) -> int:
        return len(self.batch) + sum(len(d) for d in self.drafts)

    def forward(self, model: Transformer, pool: KvPool, stage: KvStage | None) -> torch.Tensor:
        """Logits [rows, vocab] of one forward over every row."""
        if self.is_verifying:
            token_ids, inputs = row_inputs(self.batch, self.drafts, self.block_size)
        else:
            token_ids = torch.tensor([s.tokens[-1] for s in self.batch])
            inputs = step_inputs(self.batch, self.block_size)
        device = model.device
        if self.wants_mass:
            self.mass = torch.zeros(inputs.block_tables.shape[0],
                                    inputs.block_tables.shape[1] * self.block_size,
                                    device=device)
        return model.decode(token_ids.to(device), inputs.positions.to(device),
                            inputs.slots.to(device), inputs.block_tables.to(device), pool,
                            stage if self.is_staged and not self.is_verifying else None,
                            seq_lens=inputs.seq_lens.to(device), mass=self.mass)

    def keep(self, logits: torch.Tensor) -> Kept:
        """Per sequence, the tokens it keeps: one sampled, or its accepted drafts and one
        more (`accept`); with their log probabilities where asked."""
        if self.is_verifying:
            tokens = accept(logits, self.batch, self.drafts)
        else:
            params = [s.params or SamplingParams() for s in self.batch]  # attached: never None
            indices = [s.output_offset + len(s.tokens) for s in self.batch]
            histories = [s.history() if p.shapes_logits else None
                         for s, p in zip(self.batch, params)]
            tokens = [[token] for token in sample_tokens(logits, params, indices, histories)]
        return Kept(tokens, self._logprobs(logits, tokens))

    def _logprobs(self, logits: torch.Tensor, tokens: list[list[int]]
                  ) -> list[list[TokenLogprob]]:
        """Each kept token's log probability, from the row that predicted it (a sequence's
        rows are its last token's and its drafts', in order), where its request asks."""
        out: list[list[TokenLogprob]] = []
        row = 0
        for i, (seq, kept) in enumerate(zip(self.batch, tokens)):
            num_top = seq.params.logprobs if seq.params is not None else None
            out.append([] if num_top is None
                       else logprobs_of(logits[row: row + len(kept)], kept, num_top))
            row += 1 + (len(self.drafts[i]) if self.is_verifying else 0)
        return out


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
        tokens = verify(rows, seq_drafts, params, seq.output_offset + len(seq.tokens),
                        seq.history() if params.shapes_logits else None).token_ids
        tokens = tokens[:max(1, seq.tokens_left)]
        for i, token in enumerate(tokens):
            if token in seq.stop_token_ids:
                tokens = tokens[:i + 1]
                break
        out.append(tokens)
    return out
