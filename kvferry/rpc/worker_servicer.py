"""Abort and GetStats, the same on every worker servicer (prefill, decode, local prefill)."""

from __future__ import annotations

from typing import Protocol

import grpc

from kvferry.cache.stats import PoolStats
from kvferry.rpc import convert, grpc_util
from kvferry.v1 import generation_pb2, worker_pb2


class _Engine(Protocol):
    def abort(self, request_id: str) -> None: ...

    def stats(self, check_integrity: bool = False) -> PoolStats: ...


class AbortAndStats:
    """Mixin: list it before the generated servicer base. Needs `engine`, `role` and
    `layout_msg` attributes."""

    engine: _Engine
    role: str
    layout_msg: worker_pb2.KvLayout

    async def Abort(self, request: generation_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> generation_pb2.AbortResponse:
        try:
            self.engine.abort(request.request_id)
        except Exception as exc:
            await grpc_util.abort_with(context, exc, request.request_id)
        return generation_pb2.AbortResponse()

    async def GetStats(self, request: worker_pb2.GetStatsRequest,
                       context: grpc.aio.ServicerContext) -> worker_pb2.WorkerStats:
        return convert.stats_to_proto(self.role, self.engine.stats(request.check_integrity),
                                      self.layout_msg)
