"""What the router's client adapters (prefill_client, decode_client) hand the engine: kvferry's
own records, so that nothing past the adapters reads a protobuf message."""

from __future__ import annotations

from typing import NamedTuple

from kvferry.cache.layout import KvLayout
from kvferry.cache.prefix import TierTokens
from kvferry.cache.stats import PoolStats
from kvferry.model.logprobs import TokenLogprob
from kvferry.model.sampling import FinishReason, SamplingParams


class WorkerStats(NamedTuple):
    """A worker's GetStats answer: its pool telemetry and the K/V layout it serves."""

    pool: PoolStats
    layout: KvLayout


class FirstToken(NamedTuple):
    """The Prefill stream's first message: token N+1, sampled by the prefill worker."""

    token_id: int
    prefill_s: float
    num_cached_tokens: int = 0  # prompt tokens its prefix cache held
    cached_by_tier: TierTokens = TierTokens()  # of those, from each tier below its pool
    sample_token_ids: tuple[int, ...] = ()  # parallel sampling: samples 1..n-1's first tokens
    logprobs: tuple[TokenLogprob, ...] = ()  # sampling.logprobs: token_id's, then samples'
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # sampling.prompt_logprobs: prompt[1:]'s


class PrefillDone(NamedTuple):
    """The Prefill stream's last message: the decode worker accepted every K/V page."""

    kv_transfer_s: float
    kv_bytes: int


class PrefillStart(NamedTuple):
    """What a Prefill call asks of a worker (mirrors proto PrefillRequest)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    decode_address: str  # empty when the K/V stays where it is computed (local decode)
    is_local_decode: bool
    num_generated: int  # output number of the token it samples (non-zero after a migration)
    defer_push: bool  # park the K/V until a Ship names its decode worker
    cache_salt: str = ""
    skip_blocks: int = 0  # leading blocks the decode reservation holds already: not pushed
    num_samples: int = 1  # first tokens to draw (parallel sampling)


class DecodeStart(NamedTuple):
    """Start decoding a reserved request (mirrors proto DecodeRequest)."""

    request_id: str
    first_token_id: int
    sampling: SamplingParams
    max_new_tokens: int
    stop_token_ids: list[int]
    num_generated: int
    sample_first_token_ids: tuple[int, ...] = ()  # samples 1..n-1 (parallel sampling)


class DecodeFinished(NamedTuple):
    reason: FinishReason
    first_decode_step_s: float
    num_draft_tokens: int = 0  # speculation: drafts verified on this leg
    num_accepted_tokens: int = 0  # of those, accepted


class DecodeUpdate(NamedTuple):
    """Tokens one decode step produced for one request; its last update carries `finished`
    (a normal end) or `error_code` (a gRPC status number: the request failed there)."""

    request_id: str
    token_ids: list[int]
    finished: DecodeFinished | None = None
    error_code: int | None = None
    error_message: str = ""
    received_s: float = 0.0  # time.monotonic() when read off the decode stream
    sample_index: int = 0  # the sample these tokens (and this finish) belong to
    logprobs: tuple[TokenLogprob, ...] = ()  # sampling.logprobs: one per token id
