"""What `router.engine.Router.generate` yields for one request, after its request id: text
chunks (`ChunkEvent`), then exactly one `DoneEvent` with the finish reason, token counts and
the request's `Timing`. `router.server` turns them into the public protobuf messages."""

from __future__ import annotations

from typing import NamedTuple

from kvferry.cache.prefix import TierTokens
from kvferry.model.sampling import FinishReason


class ChunkEvent(NamedTuple):
    token_ids: list[int]
    text: str


class Timing(NamedTuple):
    queue_s: float
    prefill_s: float
    kv_transfer_s: float
    first_decode_step_s: float
    time_to_first_token_s: float
    admission_wait_s: float = 0.0
    num_migrations: int = 0


class DoneEvent(NamedTuple):
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    timing: Timing
    cached_prompt_tokens: int = 0  # found in the first prefill's prefix cache
    kv_bytes_not_shipped: int = 0  # K/V the decode worker's prefix cache held already
    kv_bytes_shipped: int = 0  # K/V pushed to decode workers, every leg
    cached_by_tier: TierTokens = TierTokens()  # of cached_prompt_tokens, from lower tiers
    num_draft_tokens: int = 0  # speculation: drafts verified (on the decode worker it ended on)
    num_accepted_tokens: int = 0  # of those, accepted
