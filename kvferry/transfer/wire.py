"""The K/V page wire format: how a request's paged K/V crosses a process boundary.

A push is a sequence of chunks. Each chunk holds a rectangle of the request's pages:
layers [layer_start, layer_end) x logical blocks [block_start, block_start + num_blocks),
laid out as [layers, 2 (K, V), blocks, block_size, kv_heads, head_dim] in the pool's dtype,
C order, with a CRC-32. Chunks aim at about 1 MiB: whole layers are grouped when they are
small, a layer's blocks are split when it is large. The receiver checks every header against
its own layout and the reservation before it writes a byte, and writes each chunk into its
blocks with one copy. The layout both ends compare is `kvferry.cache.layout.KvLayout`.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import crc32c
import numpy as np
import torch

from kvferry.cache.budget import blocks_for_tokens
from kvferry.cache.layout import KvLayout
from kvferry.cache.pool import KvPool, all_finite  # noqa: F401 - all_finite: wire's check
from kvferry.errors import InvalidArgument

CHUNK_TARGET_BYTES = 1 << 20


class ChunkSpan(NamedTuple):
    """Which rectangle of a request's pages one chunk carries."""

    layer_start: int
    layer_end: int
    block_start: int
    num_blocks: int


def plan_chunks(layout: KvLayout, num_tokens: int, target_bytes: int = CHUNK_TARGET_BYTES,
                min_group_bytes: int = 0, first_block: int = 0) -> list[ChunkSpan]:
    """Cover every (layer, block) of a `num_tokens` prompt from block `first_block` on (the
    receiver's prefix cache holds the ones before) exactly once, in layer order.
    `min_group_bytes`: fewer layer groups rather than smaller ones, for transports with a
    high fixed cost per chunk."""
    end_block = blocks_for_tokens(num_tokens, layout.block_size)
    if not 0 <= first_block < end_block:
        raise InvalidArgument(f"skip_blocks {first_block} outside [0, {end_block})",
                              "skip_blocks")
    num_blocks = end_block - first_block
    per_layer = layout.bytes_per_layer_block * num_blocks
    spans: list[ChunkSpan] = []
    if per_layer <= target_bytes:
        # Whole layers per chunk, but at least 4 groups, so a pipelined push can start after
        # the first quarter of the layers (fewer when groups would be under min_group_bytes).
        group_cap = max(1, -(-layout.num_layers // 4), -(-min_group_bytes // max(per_layer, 1)))
        layers_per_chunk = max(1, min(target_bytes // max(per_layer, 1), group_cap))
        for start in range(0, layout.num_layers, layers_per_chunk):
            end = min(start + layers_per_chunk, layout.num_layers)
            spans.append(ChunkSpan(start, end, first_block, num_blocks))
        return spans
    blocks_per_chunk = max(1, target_bytes // layout.bytes_per_layer_block)
    for layer in range(layout.num_layers):
        for start in range(first_block, end_block, blocks_per_chunk):
            spans.append(ChunkSpan(layer, layer + 1, start, min(blocks_per_chunk,
                                                                end_block - start)))
    return spans


def span_bytes(layout: KvLayout, span: ChunkSpan) -> int:
    """Bytes of K/V a span covers."""
    return (span.layer_end - span.layer_start) * span.num_blocks * layout.bytes_per_layer_block


def pack_array(pool: KvPool, block_table: list[int], span: ChunkSpan) -> np.ndarray:
    """Copy one span of a request's pages out of the pool: a flat uint8 array, one copy
    (two from a GPU pool: the gather, then device to host)."""
    # [layers, 2, blocks, block_size, kv_heads, head_dim]
    pages = pool.read_pages(block_table[span.block_start: span.block_start + span.num_blocks],
                            slice(span.layer_start, span.layer_end))
    return pages.cpu().reshape(-1).view(torch.uint8).numpy()


def crc32(data: bytes | np.ndarray) -> int:
    """CRC-32C (Castagnoli) of a chunk: the `crc32` field of the wire format. The `crc32c`
    library computes it with the CPU's CRC instruction (SSE4.2, ARMv8) at ~10 GB/s here,
    5x zlib's CRC-32, which capped K/V transfer throughput since both ends checksum every
    byte."""
    return crc32c.crc32c(data)


def check_span(layout: KvLayout, num_tokens: int, span: ChunkSpan, data_len: int) -> None:
    """Reject a span outside the request's prompt pages or a payload of the wrong size."""
    num_blocks = blocks_for_tokens(num_tokens, layout.block_size)
    if not 0 <= span.layer_start < span.layer_end <= layout.num_layers:
        raise InvalidArgument(
            f"chunk layers [{span.layer_start}, {span.layer_end}) outside "
            f"[0, {layout.num_layers})", "layer_start",
        )
    if span.num_blocks < 1 or not 0 <= span.block_start <= num_blocks - span.num_blocks:
        raise InvalidArgument(
            f"chunk blocks [{span.block_start}, {span.block_start + span.num_blocks}) outside "
            f"the prompt's {num_blocks} blocks", "block_start",
        )
    expected = span_bytes(layout, span)
    if data_len != expected:
        raise InvalidArgument(f"chunk data is {data_len} bytes, expected {expected}", "data")


def is_finite(data: bytes | np.ndarray, pool: KvPool) -> bool:
    """Whether a chunk of `pool`'s pages holds no inf or NaN (`KvPool.pages_finite`: the
    values when floating, and a quantized page's scales)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we only read it
        raw = torch.frombuffer(data, dtype=torch.uint8)
    if raw.numel() == 0:
        return True
    return pool.pages_finite(raw.view(pool.cache.dtype).view(-1, *pool.page_shape))


def unpack_into(pool: KvPool, block_table: list[int], span: ChunkSpan,
                data: bytes | np.ndarray) -> None:
    """Write a validated chunk into the request's blocks: one copy from the wire buffer."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we only read it
        raw = torch.frombuffer(data, dtype=torch.uint8)
    num_layers = span.layer_end - span.layer_start
    pages = raw.view(pool.cache.dtype).view(num_layers, 2, span.num_blocks, *pool.page_shape)
    pool.write_pages(block_table[span.block_start: span.block_start + span.num_blocks], pages,
                     slice(span.layer_start, span.layer_end))


def coverage(layout: KvLayout, num_tokens: int) -> np.ndarray:
    """An all-False [layers, blocks] map of which pages a push has delivered."""
    return np.zeros((layout.num_layers, blocks_for_tokens(num_tokens, layout.block_size)), bool)
