"""gRPC plumbing shared by every server: options, health, error mapping, readiness line."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvferry import errors

MAX_MESSAGE_BYTES = 64 << 20  # internal messages (K/V chunks aim at ~1 MiB)
PUBLIC_MAX_RECEIVE_BYTES = 4 << 20  # the router's public port: prompts are text or token ids
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
READY_PREFIX = "KVFERRY_READY"

log = logging.getLogger("kvferry")

_STATUS = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.Aborted: grpc.StatusCode.ABORTED,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def status_for(exc: errors.KvferryError) -> grpc.StatusCode:
    if isinstance(exc, errors.Remote):
        return status_code(exc.code)
    for cls, code in _STATUS.items():
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def describe(exc: errors.KvferryError) -> tuple[grpc.StatusCode, str]:
    """Status code and message (prefixed with the field it names, if any) of an error."""
    message = str(exc)
    if exc.field and not message.startswith(exc.field):
        message = f"{exc.field}: {message}"
    return status_for(exc), message


def status_code(value: int) -> grpc.StatusCode:
    """The StatusCode whose number is `value` (INTERNAL when unknown)."""
    return next((c for c in grpc.StatusCode if c.value[0] == value), grpc.StatusCode.INTERNAL)


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException,
                     request_id: str) -> None:
    """Map an exception to a status and abort the RPC. Unexpected ones become INTERNAL."""
    if isinstance(exc, errors.KvferryError):
        await context.abort(*describe(exc))
    if isinstance(exc, grpc.aio.AioRpcError):
        # A downstream call failed: pass its status through, naming where it came from.
        await context.abort(exc.code(), f"downstream: {exc.details()}")
    log.exception("request %s: internal error", request_id, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


def make_server(max_concurrent_rpcs: int | None = None,
                max_receive_bytes: int = MAX_MESSAGE_BYTES,
                interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> grpc.aio.Server:
    """A server capped at `max_receive_bytes` per incoming message (bigger ones fail with
    RESOURCE_EXHAUSTED before any handler runs)."""
    options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_receive_message_length", max_receive_bytes)]
    return grpc.aio.server(options=options, maximum_concurrent_rpcs=max_concurrent_rpcs,
                           interceptors=list(interceptors))


def add_health(server: grpc.aio.Server) -> health.aio.HealthServicer:
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return servicer


def add_reflection(server: grpc.aio.Server, service_names: list[str]) -> None:
    """Server reflection (grpcurl, grpcui) for these services, health and itself."""
    from grpc_reflection.v1alpha import reflection

    reflection.enable_server_reflection(
        [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)


async def set_serving(servicer: health.aio.HealthServicer, service_names: list[str],
                      serving: bool) -> None:
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ["", *service_names]:
        await servicer.set(name, status)


def announce_ready(port: int, metrics_port: int = 0) -> None:
    """Tell a parent launcher which ports we bound (ports may be 0 = any free port)."""
    print(f"{READY_PREFIX} metrics_port={metrics_port} port={port}", flush=True)
    sys.stdout.flush()


def channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
