"""The decode worker's side of prefix caching (kvferry/cache/prefix.py): which of a new
reservation's prompt blocks its pool already holds, and which blocks a sequence leaves
indexed for later requests.

A reservation given the prompt's token ids shares the leading full blocks the index holds
(a previous chat turn's prompt and answer, say); a push then carries only the blocks after
them. A sequence's blocks are indexed once their K/V is final: the prompt's full blocks when
the push (or the local prefill) completes, the generated tokens' full blocks when the
request ends (every position up to its last fed token)."""

from __future__ import annotations

from typing import NamedTuple

from decode_worker.sequence import DecodeSeq
from kvferry.cache.block_queue import BlockQueue
from kvferry.cache.layout import KvLayout
from kvferry.cache.prefix import (
    TierTokens,
    block_keys,
    cache_seed,
    check_cache_salt,
    max_shared_blocks,
)
from kvferry.cache.tiers.tiered import TieredCache
from kvferry.errors import InvalidArgument


class CacheHit(NamedTuple):
    seed: bytes  # the parent key of the prompt's first block (model, K/V dtype, salt)
    block_ids: list[int]  # the reservation's blocks, referenced
    num_cached_blocks: int  # of those, leading prompt blocks whose K/V the cache supplied
    by_tier: TierTokens  # of those, tokens promoted from each tier below the pool


class DecodePrefixCache:
    """Lookups and indexing over the worker's tiered prefix cache. Event loop only."""

    def __init__(self, cache: TieredCache, layout: KvLayout) -> None:
        self.cache = cache
        self.block_size = cache.pool.block_size
        self.layout = layout

    async def acquire(self, prompt: list[int], num_prompt_tokens: int, cache_salt: str,
                      blocks: BlockQueue, num_blocks: int) -> CacheHit:
        """`num_blocks` blocks, waiting in `blocks`' queue, the leading ones shared from (or
        promoted into) the cache when `prompt` is given and cached; each referenced for the
        caller, who gives them back like its own."""
        if prompt and len(prompt) != num_prompt_tokens:
            raise InvalidArgument(f"prompt_token_ids has {len(prompt)} tokens, "
                                  f"num_prompt_tokens says {num_prompt_tokens}",
                                  "prompt_token_ids")
        check_cache_salt(cache_salt)
        seed = cache_seed(self.layout.model_fingerprint, self.layout.dtype, cache_salt)
        keys: list[bytes] = []
        if prompt and self.cache.prefix_caching:
            keys = block_keys(prompt, self.block_size, seed,
                              max_shared_blocks(num_prompt_tokens, self.block_size))
        hit = await self.cache.acquire(keys, num_prompt_tokens if prompt else 0, blocks,
                                       num_blocks)
        return CacheHit(seed, hit.block_ids, hit.num_cached, hit.by_tier)

    def index(self, seq: DecodeSeq, num_written: int) -> None:
        """Index the full blocks of positions [0, num_written) of `seq`, whose K/V is final.
        Nothing of a sequence that evicted K/V: its blocks are no longer a prefix's pages."""
        if not seq.prompt_token_ids or not self.cache.prefix_caching or seq.num_evicted:
            return
        generated = seq.tokens[:max(num_written - seq.num_prompt_tokens, 0)]
        tokens = (seq.prompt_token_ids + generated)[:num_written]
        keys = block_keys(tokens, self.block_size, seq.cache_seed)
        self.cache.register(keys, seq.block_table)
