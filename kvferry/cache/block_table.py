"""A sequence's block table beyond append: `truncate` rolls its K/V back to a position
(speculative decoding's rejected drafts), `fork` gives another sequence the same K/V (the
n samples of one prompt) with the full blocks shared and the last partial block copied.

Both keep the pool's invariants: a block's refcount is the number of tables holding it (the
prefix index's own reference aside), and a step writes only blocks no other table holds. So a
fork copies the partial block at once rather than on the first write: every sample writes it
on its first step. The caller owns its tables and calls these on the event loop, as it does
`BlockAllocator.alloc` and `free`.
"""

from __future__ import annotations

from kvferry.cache.budget import blocks_for_tokens
from kvferry.cache.pool import KvPool
from kvferry.errors import ResourceExhausted


def truncate(pool: KvPool, table: list[int], num_tokens: int) -> list[int]:
    """Keep the blocks of positions [0, `num_tokens`) and free the rest (one reference each: a
    block another table shares stays with it). `table` changes in place; returns the blocks
    dropped from its end. When `num_tokens` ends inside a block another table shares (a sample
    forked at a block boundary, rolled back into it), that block is replaced by a copy of its
    own, so the table's next write cannot reach the other table's K/V; with no block for the
    copy, ResourceExhausted and nothing changed. What the kept last block holds past
    `num_tokens` is left as it is: no attention reads past a sequence's length, and the prefix
    index takes full blocks of final K/V only."""
    allocator = pool.allocator
    keep = blocks_for_tokens(num_tokens, pool.block_size)
    if num_tokens < 0 or keep > len(table):
        raise ValueError(f"cannot keep {num_tokens} tokens of a table of {len(table)} blocks")
    freed = table[keep:]
    is_shared_tail = (bool(num_tokens % pool.block_size)
                      and allocator.refcount(table[keep - 1]) > 1)
    room = allocator.num_free + sum(allocator.refcount(b) == 1 for b in freed)
    if is_shared_tail and room < 1:
        raise ResourceExhausted("no free K/V block to copy a shared block rolled back into")
    del table[keep:]
    allocator.free(freed)
    if is_shared_tail:
        own = allocator.alloc(1)
        pool.copy_blocks([table[-1]], own)
        allocator.free([table[-1]])
        table[-1] = own[0]
    return freed


def fork(pool: KvPool, table: list[int], num_tokens: int) -> list[int]:
    """A new table holding the K/V of positions [0, `num_tokens`) of `table`: its full
    blocks shared (one more reference each), its partial last block, if any, copied into a
    block of its own (quantized pages with their scales). All or nothing: with no free
    block for the copy, ResourceExhausted and nothing changed."""
    full, partial = divmod(num_tokens, pool.block_size)
    if num_tokens < 0 or blocks_for_tokens(num_tokens, pool.block_size) > len(table):
        raise ValueError(f"cannot fork {num_tokens} tokens of a table of {len(table)} blocks")
    own = pool.allocator.alloc(1 if partial else 0)  # raises before anything is shared
    shared = table[:full]
    pool.allocator.incref(shared)
    if own:
        pool.copy_blocks([table[full]], own)
    return shared + own
