"""The paged K/V pool and its block allocator.

The pool is one preallocated tensor per worker. A request owns a list of block ids (its block
table); token position p lives in block `table[p // block_size]` at offset `p % block_size`.
The allocator owns the free list and refcounts; callers own their block tables and must give
every block back exactly once, whatever way the request ends.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvferry.errors import ResourceExhausted


class IntegrityReport(NamedTuple):
    ok: bool
    error: str


class BlockAllocator:
    """Free list + refcounts over `num_blocks` blocks. alloc and free are O(1) per block."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        # Popped from the end: low ids are handed out first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refcount: list[int] = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def alloc(self, n: int) -> list[int]:
        """Take `n` blocks, each with refcount 1. All or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise ResourceExhausted(
                f"need {n} K/V blocks, {len(self._free)} of {self.num_blocks} free"
            )
        ids = [self._free.pop() for _ in range(n)]
        for block_id in ids:
            self._refcount[block_id] = 1
        return ids

    def incref(self, ids: list[int]) -> None:
        """Share blocks (prefix reuse): each must already be in use."""
        for block_id in ids:
            if self._refcount[block_id] <= 0:
                raise ValueError(f"block {block_id} is free; cannot share it")
            self._refcount[block_id] += 1

    def free(self, ids: list[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 go back to the free list."""
        for block_id in ids:
            count = self._refcount[block_id]
            if count <= 0:
                raise ValueError(f"block {block_id} freed twice")
            self._refcount[block_id] = count - 1
            if count == 1:
                self._free.append(block_id)

    def check_integrity(self) -> IntegrityReport:
        """free + used == total, refcounts >= 0, no block both free and used or free twice."""
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            return IntegrityReport(False, "a block is on the free list twice")
        for block_id, count in enumerate(self._refcount):
            if count < 0:
                return IntegrityReport(False, f"block {block_id} has refcount {count}")
            if (count == 0) != (block_id in free_set):
                state = "free" if block_id in free_set else "not free"
                return IntegrityReport(False, f"block {block_id} is {state} with refcount {count}")
        used = sum(1 for count in self._refcount if count > 0)
        if used + len(self._free) != self.num_blocks:
            return IntegrityReport(False, f"free {len(self._free)} + used {used} != total")
        return IntegrityReport(True, "")


class KvPool:
    """Preallocated K/V storage for every layer plus its allocator."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        # [num_layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim]
        self.cache = torch.zeros(
            num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim,
            dtype=dtype, device=device,
        )
        self.allocator = BlockAllocator(num_blocks)
        self.num_internal_blocks = 0  # held by the worker itself (CUDA graphs' scratch block)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests may hold: all but the worker's own."""
        return self.num_blocks - self.num_internal_blocks

    def k_cache(self, layer: int) -> torch.Tensor:  # [num_blocks, block_size, kv_heads, D]
        return self.cache[layer, 0]

    def v_cache(self, layer: int) -> torch.Tensor:  # [num_blocks, block_size, kv_heads, D]
        return self.cache[layer, 1]

    def slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Flat slot ids of positions [start, end) for a request's block table."""
        positions = torch.arange(start, end, dtype=torch.int64)
        table = torch.tensor(block_table, dtype=torch.int64)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size
