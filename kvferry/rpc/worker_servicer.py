"""What every worker servicer shares: Abort and GetStats over an engine (prefill, decode and
local prefill servicers alike), and the edge of a Prefill stream (request id in the logs,
sampling parameters, one status mapping) for the two PrefillService servicers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Generic, Protocol, TypeVar

import grpc

from kvferry import logs
from kvferry.cache.layout import KvLayout
from kvferry.cache.prefix import NO_TIER_TOKENS, TierTokens
from kvferry.cache.stats import PoolStats
from kvferry.cache.tiers.tiered import TieredCache
from kvferry.model.logprobs import TokenLogprob
from kvferry.rpc import convert, grpc_util
from kvferry.v1 import generation_pb2, worker_pb2


class WorkerEngine(Protocol):
    """What a worker servicer needs of its engine."""

    def abort(self, request_id: str) -> None: ...

    def stats(self, check_integrity: bool = False) -> PoolStats: ...

    @property
    def cache(self) -> TieredCache: ...


EngineT = TypeVar("EngineT", bound=WorkerEngine)


class WorkerServicer(Generic[EngineT]):
    """Abort and GetStats over `engine`. A servicer lists it before the generated servicer
    base, whose methods answer UNIMPLEMENTED."""

    def __init__(self, engine: EngineT, role: str, layout: KvLayout) -> None:
        self.engine = engine
        self.role = role  # WorkerStats.role: "prefill", "decode" or "colocated"
        self.layout_msg = convert.layout_to_proto(layout)

    async def Abort(self, request: generation_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> generation_pb2.AbortResponse:
        try:
            self.engine.abort(request.request_id)
        except Exception as exc:
            await grpc_util.abort_with(context, exc, request.request_id)
        return generation_pb2.AbortResponse()

    async def GetStats(self, request: worker_pb2.GetStatsRequest,
                       context: grpc.aio.ServicerContext) -> worker_pb2.WorkerStats:
        msg = convert.stats_to_proto(self.role, self.engine.stats(request.check_integrity),
                                     self.layout_msg)
        convert.add_cache_events(msg, self.engine.cache.events_since(request.cache_events_after))
        return msg


class PrefillStreamServicer(WorkerServicer[EngineT]):
    """PrefillService's Prefill, once: a subclass turns one request into its responses
    (`_responses`); errors it raises end the call with their status code."""

    async def _responses(self, request: worker_pb2.PrefillRequest,
                         context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[worker_pb2.PrefillResponse]:
        raise NotImplementedError
        yield  # an async generator, like its overrides

    async def Prefill(self, request: worker_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[worker_pb2.PrefillResponse]:
        logs.request_id.set(request.request_id)
        try:
            responses = self._responses(request, context)
            # aclosing: if we are cancelled while suspended at our own yield, the responses
            # (and the engine generator they close in turn) run their cleanup right away.
            async with aclosing(responses):
                async for response in responses:
                    yield response
        except Exception as exc:
            await grpc_util.abort_with(context, exc, request.request_id)


def first_token(token_id: int, prefill_s: float, num_cached_tokens: int = 0,
                by_tier: TierTokens = NO_TIER_TOKENS, sample_token_ids: Sequence[int] = (),
                logprobs: Sequence[TokenLogprob] = (),
                prompt_logprobs: Sequence[TokenLogprob] = ()) -> worker_pb2.PrefillResponse:
    return worker_pb2.PrefillResponse(first_token=worker_pb2.FirstToken(
        token_id=token_id, prefill_s=prefill_s, num_cached_tokens=num_cached_tokens,
        num_cached_host_tokens=by_tier.host, num_cached_disk_tokens=by_tier.disk,
        num_cached_store_tokens=by_tier.store, sample_token_ids=sample_token_ids,
        logprobs=convert.logprobs_to_proto(logprobs),
        prompt_logprobs=convert.logprobs_to_proto(prompt_logprobs)))
