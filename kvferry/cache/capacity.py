"""`kvferry plan`: what a batch of requests costs in K/V and how many fit in a pool, and in
each tier below it (host memory, disk, a shared store).

The byte arithmetic itself is `KvShape`'s (kvferry/cache/layout.py); this only adds it up.
"""

from __future__ import annotations

from typing import NamedTuple

from kvferry.cache.budget import KvBudget
from kvferry.cache.layout import KvShape


class Plan(NamedTuple):
    bytes_per_token: int
    tokens_per_request: int
    bytes_per_request: int
    bytes_for_batch: int
    blocks_per_request: int
    pool_blocks: int
    requests_that_fit: int


def plan(shape: KvShape, prompt_tokens: int, output_tokens: int, batch: int,
         pool_bytes: int, block_size: int, budget: KvBudget | None = None) -> Plan:
    """What `batch` requests of prompt + output tokens cost, and how many fit in the pool
    (whole blocks: a request's last block is allocated in full; under K/V eviction at most
    the policy's budget, `budget`, the formula admission and the pool use). ValueError
    naming a bad argument (block_size: a power of two, as pools require)."""
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size: must be a power of two, got {block_size}")
    for name, value in (("prompt_tokens", prompt_tokens), ("output_tokens", output_tokens)):
        if value < 0:
            raise ValueError(f"{name}: must be >= 0, got {value}")
    if batch < 1:
        raise ValueError(f"batch: must be >= 1, got {batch}")
    tokens = prompt_tokens + output_tokens
    per_request = shape.bytes_per_token * tokens
    blocks = (budget or KvBudget()).blocks(prompt_tokens, output_tokens, block_size)
    pool_blocks = pool_bytes // shape.bytes_per_block(block_size)
    return Plan(shape.bytes_per_token, tokens, per_request, per_request * batch, blocks,
                pool_blocks, pool_blocks // blocks if blocks else 0)


class TierPlan(NamedTuple):
    tier: str  # "host", "disk" or "store"
    size_bytes: int
    blocks: int
    tokens: int
    requests: int  # of the plan's size, whole blocks each


# Bytes a disk file or a store value adds to each block (kvferry/cache/tiers/codec.py).
VALUE_HEADER_BYTES = 64


def tier_plans(shape: KvShape, block_size: int, blocks_per_request: int,
               sizes: dict[str, int]) -> list[TierPlan]:
    """What each tier of `sizes` (name -> bytes; host holds bare blocks, disk and store
    blocks with a header each) holds: the articles' size formula, tier by tier."""
    plans = []
    for tier, size in sizes.items():
        per_block = shape.bytes_per_block(block_size) + (VALUE_HEADER_BYTES if tier != "host"
                                                          else 0)
        blocks = size // per_block
        plans.append(TierPlan(tier, size, blocks, blocks * block_size,
                              blocks // blocks_per_request if blocks_per_request else 0))
    return plans


def format_tiers(plans: list[TierPlan]) -> str:
    return "\n".join(f"{p.tier} tier {p.size_bytes / (1 << 30):.3f} GiB: {p.blocks:,} blocks, "
                     f"{p.tokens:,} tokens -> {p.requests:,} requests" for p in plans)


def format_plan(shape: KvShape, result: Plan, batch: int, block_size: int) -> str:
    gib = 1 << 30
    return "\n".join([
        f"K/V layout: {shape.num_layers} layers x {shape.num_kv_heads} kv heads x "
        f"{shape.head_dim} head dim, {shape.dtype}",
        f"bytes per token: {result.bytes_per_token:,}",
        f"one request ({result.tokens_per_request:,} tokens): "
        f"{result.bytes_per_request:,} bytes ({result.bytes_per_request / gib:.3f} GiB)",
        f"batch of {batch}: {result.bytes_for_batch:,} bytes "
        f"({result.bytes_for_batch / gib:.3f} GiB)",
        f"block size {block_size}: {result.blocks_per_request:,} blocks per request, "
        f"pool holds {result.pool_blocks:,} blocks -> {result.requests_that_fit:,} requests fit",
    ])
