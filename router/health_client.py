"""Client adapter for grpc.health.v1 on a worker: a draining worker answers NOT_SERVING."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


async def is_serving(channel: grpc.aio.Channel, timeout_s: float, wait_for_ready: bool) -> bool:
    """True when the worker's overall health is SERVING. An unreachable worker raises
    `grpc.aio.AioRpcError`."""
    health = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=""), timeout=timeout_s,
        wait_for_ready=wait_for_ready)
    return health.status == health_pb2.HealthCheckResponse.SERVING
