"""What the router asks of every worker, whatever its role: Abort and GetStats (both worker
services answer them) and grpc.health.v1 (a draining worker answers NOT_SERVING).

`PrefillClient` and `DecodeClient` extend `WorkerClient` with their own service's calls.
Protobuf and gRPC stay in these adapters: callers get the records of `router.records`, and
a failed call raises the `kvferry.errors` class of its status (`grpc_util.from_rpc`), never
`grpc.aio.AioRpcError`. `Channel` is the connection type the router's `Worker` holds.
"""

from __future__ import annotations

import time
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvferry.rpc import convert, grpc_util
from kvferry.v1 import generation_pb2, worker_pb2
from router.records import WorkerStats

Channel = grpc.aio.Channel


class _WorkerStub(Protocol):
    """The calls PrefillServiceStub and DecodeServiceStub share."""

    async def Abort(self, request: generation_pb2.AbortRequest,  # noqa: N802 - gRPC names
                    timeout: float | None = None) -> generation_pb2.AbortResponse: ...

    async def GetStats(self, request: worker_pb2.GetStatsRequest,  # noqa: N802
                       timeout: float | None = None) -> worker_pb2.WorkerStats: ...


def stats_from_reply(msg: worker_pb2.WorkerStats) -> WorkerStats:
    return WorkerStats(convert.stats_from_proto(msg), convert.layout_from_proto(msg.layout))


class WorkerClient:
    """Abort and GetStats on one worker service's stub."""

    def __init__(self, stub: _WorkerStub) -> None:
        self._stub = stub

    async def abort(self, request_id: str, timeout_s: float | None) -> None:
        with grpc_util.translated():
            await self._stub.Abort(generation_pb2.AbortRequest(request_id=request_id),
                                   timeout=timeout_s)

    async def get_stats(self, timeout_s: float | None, cache_events_after: int = 0
                        ) -> WorkerStats:
        """Stats, with the prefix-cache events after the cursor `cache_events_after` (0: a
        snapshot of every key the worker holds)."""
        request = worker_pb2.GetStatsRequest(cache_events_after=cache_events_after)
        with grpc_util.translated():
            reply = await self._stub.GetStats(request, timeout=timeout_s)
        return stats_from_reply(reply)


async def is_serving(channel: grpc.aio.Channel, timeout_s: float, wait_for_ready: bool) -> bool:
    """True when the worker's overall health is SERVING. An unreachable worker raises
    `kvferry.errors.Unavailable` (or the error of whatever status the call failed with)."""
    with grpc_util.translated():
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=timeout_s,
            wait_for_ready=wait_for_ready)
    return health.status == health_pb2.HealthCheckResponse.SERVING


def remaining_s(deadline: float | None) -> float | None:
    """Seconds left before a monotonic `deadline` (None: no deadline), never zero."""
    return None if deadline is None else max(deadline - time.monotonic(), 0.001)
