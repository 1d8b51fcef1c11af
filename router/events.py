"""What `router.engine.Router.generate` yields for one request, after its request id: text
chunks (`ChunkEvent`), then exactly one `DoneEvent` with the finish reason, token counts and
the request's `Timing`. `router.server` turns them into the public protobuf messages."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from kvferry.cache.prefix import TierTokens
from kvferry.model.logprobs import TokenLogprob
from kvferry.model.sampling import FinishReason


class ChunkEvent(NamedTuple):
    token_ids: list[int]
    text: str
    sample_index: int = 0  # parallel sampling: the sample these tokens belong to
    logprobs: tuple[TokenLogprob, ...] = ()  # sampling.logprobs: one per token id
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # sampling.prompt_logprobs: first chunk


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
    sample_index: int = 0  # parallel sampling: the sample that ended (one DoneEvent each)
    # the cache and transfer figures above are reported (--enable-prompt-tokens-details):
    # else they are unknown, and the APIs leave them out
    details: bool = False


@dataclass(slots=True)
class Ending:
    """How a request's stream ends, whichever way it does (`Router.run_one`'s one exit): its
    last chunk (these tokens and text, then the detokenizer's tail unless a stop string ended
    it) and its finish reason."""

    reason: FinishReason = FinishReason.ABORT
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    is_stopped: bool = False  # a stop string ended it: the held-back text is not sent
    always_chunk: bool = True  # send the last chunk even when it is empty
    logprobs: tuple[TokenLogprob, ...] = ()  # the last chunk's tokens' (sampling.logprobs)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # the prompt's, ending at its first token
    first_decode_step_s: float = 0.0  # what the decode worker reported, when it decoded
    num_draft_tokens: int = 0  # speculation: drafts verified by the decode worker it ended on
    num_accepted_tokens: int = 0  # of those, accepted

    def done(self, prompt_tokens: int, completion_tokens: int, timing: Timing) -> DoneEvent:
        """The request's DoneEvent: this ending's reason and the decode worker's figures."""
        return DoneEvent(self.reason, prompt_tokens, completion_tokens,
                         timing._replace(first_decode_step_s=self.first_decode_step_s),
                         num_draft_tokens=self.num_draft_tokens,
                         num_accepted_tokens=self.num_accepted_tokens)
