"""The greedy run the model tests compare: prompts prefilled, then batched decode steps, on
any model with `prefill` and `decode` (a Transformer, a shard of one, or a tensor-parallel
group's rank 0)."""

from __future__ import annotations

import torch

from kvferry.cache.budget import blocks_for_tokens
from kvferry.cache.pool import KvPool
from kvferry.model.tp_group import TensorParallelModel
from kvferry.model.transformer import Transformer

PROMPTS = [[5, 9, 200, 31, 7], list(range(40, 77))]
STEPS = 6


def greedy(model: Transformer | TensorParallelModel, pool: KvPool
           ) -> tuple[list[list[int]], torch.Tensor]:
    """Both prompts prefilled in one forward, then STEPS batched decode steps: the tokens,
    and the prefill's logits."""
    tables, tokens, first = prefill_part(model, pool)
    return decode_part(model, pool, tables, tokens), first


def prefill_part(model: Transformer | TensorParallelModel, pool: KvPool
                 ) -> tuple[list[list[int]], list[list[int]], torch.Tensor]:
    """The prompts prefilled in one forward: their block tables, first tokens and logits."""
    tables = [pool.allocator.alloc(blocks_for_tokens(len(p) + STEPS, 16)) for p in PROMPTS]
    slots = torch.cat([pool.slots(t, 0, len(p)) for t, p in zip(tables, PROMPTS)])
    logits = model.prefill(torch.tensor(PROMPTS[0] + PROMPTS[1]),
                           [len(p) for p in PROMPTS], slots, pool)
    return tables, [[int(row.argmax())] for row in logits], logits.clone()


def decode_part(model: Transformer | TensorParallelModel, pool: KvPool,
                tables: list[list[int]], tokens: list[list[int]],
                prompts: list[list[int]] = PROMPTS, steps: int = STEPS) -> list[list[int]]:
    """`steps` - 1 batched decode steps after the prompts' first tokens (`tokens`, extended
    in place), on the blocks `tables` name."""
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    for _ in range(steps - 1):
        positions = [len(p) + len(t) - 1 for p, t in zip(prompts, tokens)]
        slots = torch.cat([pool.slots(t, pos, pos + 1) for t, pos in zip(tables, positions)])
        logits = model.decode(torch.tensor([t[-1] for t in tokens]), torch.tensor(positions),
                              slots, block_tables, pool)
        for row, t in zip(logits, tokens):
            t.append(int(row.argmax()))
    return tokens


def pool_of(model: Transformer) -> KvPool:
    cfg = model.config
    return KvPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, 64, torch.float32)
