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
from kvferry.cache.layout import KvLayout
from kvferry.cache.pool import KvPool
from kvferry.cache.prefix import block_keys, cache_seed, check_cache_salt, max_shared_blocks
from kvferry.errors import InvalidArgument


class CacheHit(NamedTuple):
    seed: bytes  # the parent key of the prompt's first block (model, K/V dtype, salt)
    block_ids: list[int]  # leading prompt blocks shared from the cache, referenced


class DecodePrefixCache:
    """Lookups and indexing over the pool's allocator. Event loop only."""

    def __init__(self, pool: KvPool, layout: KvLayout) -> None:
        self.pool = pool
        self.layout = layout

    def lookup(self, prompt: list[int], num_prompt_tokens: int, cache_salt: str) -> CacheHit:
        """The cached leading blocks of `prompt` (none when it is empty or caching is off),
        each with a reference the caller gives back like its own blocks."""
        if prompt and len(prompt) != num_prompt_tokens:
            raise InvalidArgument(f"prompt_token_ids has {len(prompt)} tokens, "
                                  f"num_prompt_tokens says {num_prompt_tokens}",
                                  "prompt_token_ids")
        check_cache_salt(cache_salt)
        seed = cache_seed(self.layout.model_fingerprint, self.layout.dtype, cache_salt)
        allocator = self.pool.allocator
        if not prompt or not allocator.prefix_caching:
            return CacheHit(seed, [])
        block_size = self.pool.block_size
        keys = block_keys(prompt, block_size, seed,
                          max_shared_blocks(num_prompt_tokens, block_size))
        return CacheHit(seed, allocator.match(keys, num_prompt_tokens))

    def index(self, seq: DecodeSeq, num_written: int) -> None:
        """Index the full blocks of positions [0, num_written) of `seq`, whose K/V is final."""
        if not seq.prompt_token_ids or not self.pool.allocator.prefix_caching:
            return
        generated = seq.tokens[:max(num_written - seq.num_prompt_tokens, 0)]
        tokens = (seq.prompt_token_ids + generated)[:num_written]
        keys = block_keys(tokens, self.pool.block_size, seq.cache_seed)
        self.pool.allocator.register(keys, seq.block_table)
