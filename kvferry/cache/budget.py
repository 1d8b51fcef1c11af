"""What one request holds at most in a K/V pool: the one formula that the router's
admission, a decode worker's reservation and `kvferry plan` share.

Whole blocks: a request's prompt and generation, ceil((prompt + max_tokens) / block_size)
blocks; several samples of one prompt share its full blocks and hold their own past them.
Under K/V eviction (`--kv-eviction streaming|h2o`, docs/kv-eviction-design.md) a sequence
holds at most the policy's budget of blocks however long it generates, or its prompt's
blocks and the first decode slot if the prompt alone is longer (a prompt pushed whole is
bounded at its first step). A request that opts out (`sampling.kv_eviction` "none") holds
what it would without eviction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.settings import KvEvictionConfig


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` positions."""
    return (num_tokens + block_size - 1) // block_size


def blocks_needed(prompt_tokens: int, max_tokens: int, block_size: int,
                  num_samples: int = 1) -> int:
    """Blocks a request may occupy at its longest: ceil((prompt + max_tokens) / block_size),
    and for several samples of one prompt, the prompt's full blocks once (shared) and each
    sample's blocks past them."""
    most = blocks_for_tokens(prompt_tokens + max_tokens, block_size)
    shared = prompt_tokens // block_size
    return shared + num_samples * (most - shared)


@dataclass(frozen=True)
class KvBudget:
    eviction: KvEvictionConfig = field(default_factory=KvEvictionConfig)

    @property
    def is_bounded(self) -> bool:
        """Whether generation is bounded by the policy rather than by prompt + max_tokens:
        then it may pass the pool and the model's context."""
        return self.eviction.is_on

    def bounded_blocks(self, block_size: int) -> int | None:
        """Blocks a sequence keeps at most under the policy (None: every token's)."""
        return self.eviction.budget_blocks(block_size) if self.is_bounded else None

    def blocks(self, prompt_tokens: int, max_tokens: int, block_size: int,
               num_samples: int = 1, keeps_all: bool = False) -> int:
        """Blocks a request of `prompt_tokens` and up to `max_tokens` (the first included)
        holds at most, its `num_samples` samples together; `keeps_all`: it opted out of
        eviction."""
        most = blocks_needed(prompt_tokens, max_tokens, block_size, num_samples)
        bound = None if keeps_all else self.bounded_blocks(block_size)
        if bound is None:
            return most
        per_sample = max(bound, blocks_for_tokens(prompt_tokens + 1, block_size))
        return min(most, num_samples * per_sample)
