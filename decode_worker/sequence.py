"""Per-request state on a decode worker, the events its Decode stream carries, and the
paging inputs of one decode step."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple, Protocol

import torch

from decode_worker.receipt import KvReceipt
from kvferry.cache.budget import KvBudget
from kvferry.cache.pool import KvPool
from kvferry.cache.prefix import NO_TIER_TOKENS, TierTokens
from kvferry.errors import InvalidArgument, NotFound, ResourceExhausted
from kvferry.model.grammar import Guide
from kvferry.model.logprobs import TokenLogprob
from kvferry.model.penalties import History
from kvferry.model.sampling import FinishReason, SamplingParams


class Phase(Enum):
    RESERVED = "reserved"  # blocks held, waiting for K/V and/or the Decode call
    RUNNING = "running"  # in the step loop
    SWAPPED = "swapped"  # preempted: K/V copied to host memory, blocks given back
    DONE = "done"  # blocks released


class TokensEvent(NamedTuple):
    request_id: str
    token_ids: list[int]
    sample_index: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()  # SamplingParams.logprobs: one per token


class FinishedEvent(NamedTuple):
    request_id: str
    reason: FinishReason
    first_step_s: float
    num_draft_tokens: int = 0  # speculation: drafts verified for it
    num_accepted_tokens: int = 0  # of those, accepted
    sample_index: int = 0


class ErrorEvent(NamedTuple):
    request_id: str
    error: Exception


DecodeEvent = TokensEvent | FinishedEvent | ErrorEvent


@dataclass(slots=True, eq=False)  # identity: samples of one request may look alike
class DecodeSeq:
    request_id: str
    num_prompt_tokens: int
    max_tokens: int  # first token included
    block_table: list[int]
    lease_deadline: float  # monotonic; restarted by renew_lease while the request is alive
    receipt: KvReceipt  # what it has received of its prompt's K/V (decode_worker/receipt.py)
    arrival: int  # admission order: preemption takes the newest first
    params: SamplingParams | None = None
    guide: Guide | None = None  # its matcher, where params has a constraint (set with params)
    max_new_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    tokens: list[int] = field(default_factory=list)  # first token (from prefill) + generated
    events: asyncio.Queue[DecodeEvent] | None = None
    phase: Phase = Phase.RESERVED
    is_aborted: bool = False
    first_step_s: float = 0.0
    output_offset: int = 0  # outputs generated before tokens[0] (after a migration)
    abort_step: int = 0  # the engine's step count when its abort arrived
    swapped_kv: torch.Tensor | None = None  # [layers, 2, blocks, block_size, kv_heads, D]
    lease_s: float = 0.0  # the lease's length, from Reserve or the latest renewal
    # Prefix caching: the prompt (as Reserve gave it; [] when it did not), the seed of its
    # block keys, and the leading blocks shared from the cache (whose pages no push carries).
    prompt_token_ids: list[int] = field(default_factory=list)
    cache_seed: bytes = b""
    num_cached_blocks: int = 0
    cached_by_tier: TierTokens = NO_TIER_TOKENS  # of those, promoted from lower tiers
    # Speculative decoding: drafts verified for it, and of those, accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # A draft model's pages shipped with the prompt's (--speculative-draft-kv ship): once the
    # push ended with all of them, the leading positions whose draft K/V is in place (the
    # draft model takes it over at its first step: decode_worker/spec/draft_model.py).
    draft_kv_tokens: int = 0
    # K/V eviction (docs/kv-eviction-design.md): tokens whose K/V left the cache (the table
    # holds the rest, in order), and of those, the ones its rotary positions no longer count
    # (re-based). 0 and 0 without eviction: cache index, rotary and text positions coincide.
    num_evicted: int = 0
    num_rebased: int = 0
    # Parallel sampling (decode_worker/samples.py). Reserved with num_samples > 1, the request
    # is sample 0 and holds `spare_blocks` for the others; attached, it knows their first
    # tokens; admitted, the others are forked from it and `group` lists all of them, sample 0
    # first (each its own DecodeSeq, the engine's table holding sample 0 alone).
    num_samples: int = 1
    sample_index: int = 0
    spare_blocks: list[int] = field(default_factory=list)
    sample_first_tokens: list[int] = field(default_factory=list)
    group: list[DecodeSeq] | None = None

    @property
    def key(self) -> tuple[str, int]:
        """The request and the sample: what tells a sample from its siblings."""
        return self.request_id, self.sample_index

    @property
    def members(self) -> list[DecodeSeq]:
        """The samples of its request (itself alone when it has one)."""
        return self.group if self.group is not None else [self]

    def renew_lease(self, lease_s: float | None = None) -> None:
        """Restart the lease (for `lease_s` seconds from now; default: its last length)."""
        if lease_s is not None:
            self.lease_s = lease_s
        self.lease_deadline = time.monotonic() + self.lease_s

    def history(self) -> History:
        """What its penalties and constraint read: the request's prompt, and every token it
        produced (after a migration, the context's tail holds the earlier legs' outputs)."""
        start = self.num_prompt_tokens - self.output_offset
        return History(self.prompt_token_ids[:start],
                       self.prompt_token_ids[start:] + self.tokens, self.guide)

    @property
    def next_position(self) -> int:
        """Position in the text of the token the next step feeds."""
        return self.num_prompt_tokens + len(self.tokens) - 1

    @property
    def cache_position(self) -> int:
        """Index in the cache of that token's K/V (its slot: `block_table` at it)."""
        return self.next_position - self.num_evicted

    @property
    def rope_position(self) -> int:
        """Position that token is rotated at (docs/kv-eviction-design.md 3.1)."""
        return self.next_position - self.num_rebased

    @property
    def tokens_left(self) -> int:
        """Tokens it may still generate (the first token, from prefill, not counted)."""
        return self.max_new_tokens - (len(self.tokens) - 1)


class Reservation(NamedTuple):
    num_blocks: int  # blocks the reservation holds
    num_cached_blocks: int  # of those, leading prompt blocks the prefix cache supplied


def check_reservation(request_id: str, num_prompt_tokens: int, max_tokens: int, lease_s: float,
                      seqs: Mapping[str, DecodeSeq], context: int, pool: KvPool,
                      num_samples: int = 1, budget: KvBudget | None = None) -> None:
    """A Reserve's fields, each named when wrong; RESOURCE_EXHAUSTED when the request could
    not fit in `pool` even alone (at most what `budget` says it holds). With K/V eviction a
    request may run past the context: it holds its prompt's blocks, then at most the
    policy's."""
    budget = budget or KvBudget()
    if not request_id:
        raise InvalidArgument("request_id must be non-empty", "request_id")
    if request_id in seqs:
        raise InvalidArgument(f"request_id {request_id!r} already reserved", "request_id")
    if num_prompt_tokens < 1:
        raise InvalidArgument("num_prompt_tokens must be >= 1", "num_prompt_tokens")
    if max_tokens < 1:
        raise InvalidArgument("max_tokens must be >= 1", "max_tokens")
    if num_prompt_tokens > context or (not budget.is_bounded
                                       and num_prompt_tokens + max_tokens > context):
        raise InvalidArgument(f"prompt {num_prompt_tokens} + max_tokens {max_tokens} exceeds "
                              f"the context of {context}", "max_tokens")
    if lease_s <= 0:
        raise InvalidArgument("lease_s must be > 0", "lease_s")
    if num_samples < 1:
        raise InvalidArgument("num_samples must be >= 1", "num_samples")
    most = budget.blocks(num_prompt_tokens, max_tokens, pool.block_size, num_samples)
    if most > pool.num_usable_blocks:
        samples = f" ({num_samples} samples)" if num_samples > 1 else ""
        raise ResourceExhausted(f"request needs up to {most} K/V blocks{samples}; the pool "
                                f"has {pool.num_usable_blocks}")


def lookup(seqs: Mapping[str, DecodeSeq], request_id: str) -> DecodeSeq:
    """The request's state; NOT_FOUND when the worker does not hold it."""
    seq = seqs.get(request_id)
    if seq is None:
        raise NotFound(f"no reservation for request_id {request_id!r}", "request_id")
    return seq


class PagedSeq(Protocol):
    """A sequence as a decode step sees it: its blocks, the cache index the token it feeds
    next is written at, and the position that token is rotated at."""

    block_table: list[int]

    @property
    def cache_position(self) -> int: ...

    @property
    def rope_position(self) -> int: ...


class PagedRow(NamedTuple):
    """One query row as `step_inputs` sees it: a sequence's table, the cache index it writes
    and its rotary position (a speculative step's draft rows, a draft model's steps)."""

    block_table: list[int]
    cache_position: int
    rope_position: int


@dataclass(eq=False)
class PlainSeq:
    """A sequence that keeps all its K/V, stepped by hand (benchmarks, tests): its table and
    the position it feeds next, which is also its cache index and its rotary position."""

    block_table: list[int]
    next_position: int

    @property
    def cache_position(self) -> int:
        return self.next_position

    @property
    def rope_position(self) -> int:
        return self.next_position


class StepInputs(NamedTuple):
    """A decode step's paging inputs, on the host."""

    positions: torch.Tensor  # [B] int64: the rotary position of each sequence's token
    slots: torch.Tensor  # [B] int64: its cache index's pool slot (block * block_size + offset)
    block_tables: torch.Tensor  # [B, width] int32, padded with block 0
    seq_lens: torch.Tensor  # [B] int32: tokens each row attends (its cache index + 1)


def step_inputs(batch: Sequence[PagedSeq], block_size: int) -> StepInputs:
    cached = [s.cache_position for s in batch]
    width = max(len(s.block_table) for s in batch)
    # [B, width], padded with block 0: attention never reads past a sequence's length.
    table = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in batch],
                         dtype=torch.int32)
    slots = [s.block_table[p // block_size] * block_size + p % block_size
             for s, p in zip(batch, cached)]
    return StepInputs(torch.tensor([s.rope_position for s in batch]),
                      torch.tensor(slots, dtype=torch.int64), table,
                      torch.tensor(cached, dtype=torch.int32) + 1)
