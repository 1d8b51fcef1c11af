"""Drafts from a smaller model (`--speculative-method draft --speculative-model DIR`), its
prompt K/V recomputed on the decode worker or shipped by the prefill worker
(docs/spec-decode-design.md 3.6).

The draft model has a K/V pool of its own with as many blocks of the same size as the
target's, addressed by the same block tables: a sequence's position p has its target K/V and
its draft K/V in the same block and slot, so every block operation (growth, rollback, fork,
free) covers both, and nothing but a count per sequence says how much of its draft K/V is
valid. A step with k drafts for a sequence whose next position is P:

1. catch-up: one packed prefill of the draft over positions [valid, P] (the prompt the first
   time, the tokens accepted since otherwise), whose last logits give draft 1;
2. k - 1 one-row decode steps, each feeding the draft before (positions P+1 .. P+k-1).

The drafts are the draft model's argmax (deterministic drafts: `rejection.verify` keeps
exactly what the target samples, whatever they are). Once the target kept m of them, positions
P .. P + min(m, k - 1) hold draft K/V of kept tokens: valid = P + min(m + 1, k). Rejected
positions past it are overwritten when reached again.

Where the prefill worker shipped the draft's prompt pages with the model's
(`--speculative-draft-kv ship`, `DecodeSeq.draft_kv_tokens`), the first catch-up starts after
the prompt instead. A sequence whose blocks changed under it (swapped out and back) starts
from valid = 0; a forked sample from its prompt's full blocks where they came shipped (shared,
so their draft pages are sample 0's), else from 0. Blocks shared through the prefix cache get
their draft pages recomputed by each sequence that reads them: the same tokens at the same
positions, so the values written are those already there, up to the float rounding of a
different batch (which can change a draft, never an output).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from decode_worker.sequence import DecodeSeq, PagedRow, step_inputs
from kvferry.cache.pool import KvPool
from kvferry.model.transformer import Transformer


def check_draft(target: Transformer, draft: Transformer) -> None:
    """A draft model must share the target's vocabulary (ValueError naming the flag)."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"speculative_model: its vocabulary of {draft.config.vocab_size} "
                         f"tokens differs from the model's {target.config.vocab_size}; a draft "
                         "model must share the model's tokenizer")


def draft_pool(draft: Transformer, target_pool: KvPool) -> KvPool:
    """The draft's K/V pool: the target pool's blocks, in the draft's geometry."""
    config = draft.config
    return KvPool(config.num_layers, config.num_kv_heads, config.head_dim,
                  target_pool.block_size, target_pool.num_blocks, draft.dtype, draft.device,
                  prefix_caching=False)


class DraftModel:
    """Proposes drafts for a batch (executor thread) and tracks each sequence's valid draft
    K/V (`DecodeSeq.key` -> positions)."""

    def __init__(self, model: Transformer, pool: KvPool) -> None:
        self.model, self.pool = model, pool
        self._valid: dict[Hashable, int] = {}
        self.num_prefill_tokens = 0  # positions catch-ups prefilled, over the worker's life

    def propose(self, batch: Sequence[DecodeSeq], ks: Sequence[int]) -> list[list[int]]:
        """Up to `ks[i]` drafts for each sequence (none where it is 0)."""
        rows = [i for i, k in enumerate(ks) if k > 0]
        drafts: list[list[int]] = [[] for _ in batch]
        if not rows:
            return drafts
        logits = self._catch_up([batch[i] for i in rows])
        last = logits.argmax(dim=-1).tolist()
        for i, token in zip(rows, last):
            drafts[i].append(token)
        for step in range(1, max(ks)):
            live = [i for i in rows if ks[i] > step]
            if not live:
                break
            last = self._step([batch[i] for i in live], [drafts[i][-1] for i in live], step)
            for i, token in zip(live, last):
                drafts[i].append(token)
        return drafts

    def _catch_up(self, seqs: list[DecodeSeq]) -> torch.Tensor:
        """Draft K/V of positions [valid, P] of each sequence; the logits at P."""
        ids: list[int] = []
        lens, starts, slots = [], [], []
        for seq in seqs:
            start = min(self._valid.get(seq.key, seq.draft_kv_tokens), seq.next_position)
            seq.draft_kv_tokens = 0  # from now on `_valid` tracks it
            context = [*seq.prompt_token_ids, *seq.tokens]
            ids += context[start: seq.next_position + 1]
            lens.append(seq.next_position + 1 - start)
            self.num_prefill_tokens += lens[-1]
            starts.append(start)
            slots.append(self.pool.slots(seq.block_table, start, seq.next_position + 1))
        device = self.model.device
        return self.model.prefill(torch.tensor(ids, device=device), lens,
                                  torch.cat(slots).to(device), self.pool, context_lens=starts,
                                  block_tables=[seq.block_table for seq in seqs])

    def _step(self, seqs: list[DecodeSeq], tokens: list[int], offset: int) -> list[int]:
        """Feed each sequence's latest draft at its next position + `offset`: the next."""
        rows = step_inputs([PagedRow(s.block_table, s.cache_position + offset,
                                     s.rope_position + offset) for s in seqs],
                           self.pool.block_size)
        device = self.model.device
        logits = self.model.decode(torch.tensor(tokens, device=device),
                                   rows.positions.to(device), rows.slots.to(device),
                                   rows.block_tables.to(device), self.pool,
                                   seq_lens=rows.seq_lens.to(device))
        return logits.argmax(dim=-1).tolist()

    def verified(self, seq: DecodeSeq, num_drafts: int, num_accepted: int) -> None:
        """The target kept `num_accepted` of the `num_drafts` drafts proposed for `seq` (its
        tokens not yet extended): the draft K/V of the kept tokens stays valid."""
        if num_drafts:
            self._valid[seq.key] = seq.next_position + min(num_accepted + 1, num_drafts)

    def forget(self, key: Hashable) -> None:
        """The sequence left, or its blocks changed under it: no draft K/V of it is valid."""
        self._valid.pop(key, None)
