"""A draft model's prompt K/V built on the prefill worker (`--speculative-draft-kv ship`).

The prefill worker holds the draft model (the decode workers' `--speculative-model`) and a
pool of its pages with as many blocks as its own pool, addressed by the same block tables:
a request's position p has its model K/V and its draft K/V in the same block and slot. After
a request's first token, the draft is prefilled over the whole prompt on the engine's
executor (behind the model's forwards, in chunks), and the push sends its pages after the
model's (`kvferry.transfer.sender.DraftPush`): the decode worker then starts drafting after
the prompt instead of prefilling the draft in its step loop.

Every prompt position is computed again, even where this worker's prefix cache held the
model's K/V (the draft pool keeps no cache of its own): a block shared with a running request
is written with the values already in it, up to a different batch's float rounding, which can
change a draft, never an output. Where the decode worker's prefix cache holds the first
blocks no draft pages are pushed (its draft model recomputes them).
"""

from __future__ import annotations

import torch

from kvferry.cache.layout import KvLayout
from kvferry.cache.pool import KvPool
from kvferry.model.transformer import Transformer


class DraftPrefill:
    """The draft model and its pool on a prefill worker."""

    def __init__(self, model: Transformer, pool: KvPool, chunk_size: int) -> None:
        if chunk_size < 1:
            raise ValueError(f"prefill_chunk_size: must be >= 1, got {chunk_size}")
        self.model, self.pool, self.chunk_size = model, pool, chunk_size
        self.layout = KvLayout.of_pool(pool, model.config.fingerprint)

    def run(self, prompt: list[int], block_table: list[int]) -> None:
        """Write the draft's K/V of every prompt position into the request's blocks
        (executor thread), `chunk_size` positions per forward."""
        device = self.model.device
        for start in range(0, len(prompt), self.chunk_size):
            end = min(start + self.chunk_size, len(prompt))
            self.model.prefill(torch.tensor(prompt[start:end], device=device), [end - start],
                               self.pool.slots(block_table, start, end).to(device), self.pool,
                               context_lens=[start], block_tables=[block_table])
