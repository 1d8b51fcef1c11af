"""K/V capacity arithmetic: `kvferry plan` and the router's headroom use this one module.

bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from kvferry.cache.pool import blocks_for_tokens

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "int8": 1}


@dataclass(frozen=True)
class KvShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype: unknown {self.dtype!r}; one of {sorted(DTYPE_BYTES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @staticmethod
    def from_config(path: str | Path, dtype: str = "bfloat16") -> KvShape:
        """From a checkpoint directory or a config.json file (no weights needed)."""
        config_path = Path(path)
        if config_path.is_dir():
            config_path = config_path / "config.json"
        raw = json.loads(config_path.read_text())
        heads = raw["num_attention_heads"]
        return KvShape(
            num_layers=raw["num_hidden_layers"],
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            dtype=dtype,
        )


def blocks_needed(prompt_tokens: int, max_tokens: int, block_size: int) -> int:
    """Blocks a request may occupy at its longest: ceil((prompt + max_tokens) / block_size)."""
    return blocks_for_tokens(prompt_tokens + max_tokens, block_size)


class Plan(NamedTuple):
    bytes_per_token: int
    tokens_per_request: int
    bytes_per_request: int
    bytes_for_batch: int
    blocks_per_request: int
    pool_blocks: int
    requests_that_fit: int


def plan(shape: KvShape, prompt_tokens: int, output_tokens: int, batch: int,
         pool_bytes: int, block_size: int) -> Plan:
    """What `batch` requests of prompt + output tokens cost, and how many fit in the pool
    (whole blocks: a request's last block is allocated in full)."""
    tokens = prompt_tokens + output_tokens
    per_request = shape.bytes_per_token * tokens
    blocks = blocks_needed(prompt_tokens, output_tokens, block_size)
    pool_blocks = pool_bytes // (shape.bytes_per_token * block_size)
    return Plan(shape.bytes_per_token, tokens, per_request, per_request * batch, blocks,
                pool_blocks, pool_blocks // blocks if blocks else 0)


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
