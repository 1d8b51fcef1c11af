"""gRPC plumbing shared by every server: options, health, error mapping, readiness line."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvferry import errors

MAX_MESSAGE_BYTES = 64 << 20  # internal messages (K/V chunks aim at ~1 MiB)
PUBLIC_MAX_RECEIVE_BYTES = 4 << 20  # the router's public port: prompts are text or token ids
# HTTP/2 keepalive: a peer behind a cut link sends no RST and no FIN, so without pings a
# stream to it (the router's DecodeStream, a Prefill call, a K/V push) would wait for TCP to
# give up, which takes many minutes. An end pings after its keepalive time without incoming
# data and closes the connection (UNAVAILABLE on every call on it) when the ack is later than
# its timeout (on channels gRPC also sets TCP_USER_TIMEOUT to it, so unacknowledged bytes
# end the connection as well: what a cut link trips first). A ping is a 17-byte frame
# per idle connection: nothing next to K/V traffic. Acks come from gRPC's I/O threads, not
# the Python event loop, so a busy process still answers well inside the timeouts (a false
# alarm would cost one needless migration).
#
# Channels (the router, prefill workers pushing K/V): 5 s + 5 s. A silent worker is found
# 5-10 s after it went quiet (a ping may leave at once or up to 5 s later) and its requests
# migrate; a worker that stalls for less than 5 s is never taken for lost (the client's
# deadline covers that case: tests/e2e/test_faults.py stalls a worker for about 3 s).
KEEPALIVE_TIME_MS = 5_000
KEEPALIVE_TIMEOUT_MS = 5_000
# Servers: 2 s + 6 s. They free a vanished router's DecodeStream blocks and drop a K/V push
# from a silent prefill worker (forgetting its partial pages) within ~8 s. The order against
# the channels' 5-10 s no longer matters: a newer push for the same reservation supersedes an
# unfinished one (push epochs). Not shorter: 1 s + 2 s closed a live router's DecodeStream
# with GOAWAY when a loaded 2-core test run starved every process for ~3-9 s (a local Ray
# instance starting its actors beside it), and the request then failed.
SERVER_KEEPALIVE_TIME_MS = 2_000
SERVER_KEEPALIVE_TIMEOUT_MS = 6_000


def _keepalive(time_ms: int, timeout_ms: int) -> list[tuple[str, int]]:
    return [("grpc.keepalive_time_ms", time_ms), ("grpc.keepalive_timeout_ms", timeout_ms),
            # How long a ping waits for its ack: 1 minute unless set (measured: a stopped
            # peer, whose kernel still ACKs TCP, went unnoticed for 60 s with only the above).
            ("grpc.http2.ping_timeout_ms", timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),  # idle DecodeStream channels too
            ("grpc.http2.max_pings_without_data", 0)]  # keep pinging while nothing is sent


# Reconnecting to a peer that was lost: gRPC's default backoff grows to 120 s (1 s x 1.6 per
# failure), so a worker back after a few seconds' stall or a restart could stay unreachable
# from this channel for many seconds more. Capped at 1 s: one TCP connect a second to a dead
# address is nothing.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100),
                     ("grpc.max_reconnect_backoff_ms", 1_000)]


def _channel_options(keepalive_time_ms: int, keepalive_timeout_ms: int
                     ) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            *_keepalive(keepalive_time_ms, keepalive_timeout_ms), *RECONNECT_OPTIONS]


CHANNEL_OPTIONS = _channel_options(KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS)
# Public clients (`kvferry generate`, `chat`, `bench`, the planner's profiler, the tests'
# client): 20 s + 20 s. A client cannot migrate its request, so a false alarm only fails it:
# it rides out a stall of its router, or of the whole machine (a loaded 2-core test run once
# paused every process for about 9 s, and a 5 s client keepalive failed a request the router
# then served), and still finds a router behind a cut link within 40 s, not TCP's minutes.
PUBLIC_KEEPALIVE_TIME_MS = 20_000
PUBLIC_KEEPALIVE_TIMEOUT_MS = 20_000
PUBLIC_CHANNEL_OPTIONS = _channel_options(PUBLIC_KEEPALIVE_TIME_MS, PUBLIC_KEEPALIVE_TIMEOUT_MS)
# Servers accept their clients' pings: the default policing (one ping per 5 minutes without
# data, two strikes) would answer a 5 s keepalive with GOAWAY "too_many_pings".
SERVER_KEEPALIVE_OPTIONS = [
    *_keepalive(SERVER_KEEPALIVE_TIME_MS, SERVER_KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 3),
]
READY_PREFIX = "KVFERRY_READY"

log = logging.getLogger("kvferry")

_STATUS = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.Cancelled: grpc.StatusCode.CANCELLED,
    errors.Aborted: grpc.StatusCode.ABORTED,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.DataLoss: grpc.StatusCode.DATA_LOSS,
    errors.Internal: grpc.StatusCode.INTERNAL,
}


_ERROR_FOR = {code: cls for cls, code in _STATUS.items()}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the kernel has free on `host` now, for a server or a rendezvous to bind
    next (another process may take it meanwhile: for local processes and tests)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def status_for(exc: errors.KvferryError) -> grpc.StatusCode:
    if exc.remote_code is not None:
        return status_code(exc.remote_code)
    for cls, code in _STATUS.items():
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def describe(exc: errors.KvferryError) -> tuple[grpc.StatusCode, str]:
    """Status code and message (prefixed with the field it names, if any) of an error. A
    downstream call's failure passes its status through, naming where it came from."""
    message = str(exc)
    if exc.downstream:
        return status_for(exc), f"downstream: {message}"
    if exc.field and not message.startswith(exc.field):
        message = f"{exc.field}: {message}"
    return status_for(exc), message


def from_rpc(exc: grpc.aio.AioRpcError) -> errors.KvferryError:
    """The kvferry error for a failed call to another process: the class its status maps
    to (Internal for those kvferry never sends), with `downstream` set and the exact status
    kept in `remote_code`."""
    code = exc.code()
    error = _ERROR_FOR.get(code, errors.Internal)(exc.details() or "")
    error.remote_code = code.value[0]
    error.downstream = True
    return error


@contextlib.contextmanager
def translated() -> Iterator[None]:
    """Around a client adapter's calls: a failed RPC leaves as `from_rpc`'s error."""
    try:
        yield
    except grpc.aio.AioRpcError as exc:
        raise from_rpc(exc) from exc


def status_code(value: int) -> grpc.StatusCode:
    """The StatusCode whose number is `value` (INTERNAL when unknown)."""
    return next((c for c in grpc.StatusCode if c.value[0] == value), grpc.StatusCode.INTERNAL)


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException,
                     request_id: str) -> None:
    """Map an exception to a status and abort the RPC. Unexpected ones become INTERNAL."""
    if isinstance(exc, grpc.aio.AioRpcError):  # a call no adapter translated
        exc = from_rpc(exc)
    if isinstance(exc, errors.KvferryError):
        await context.abort(*describe(exc))
    log.exception("request %s: internal error", request_id, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


def make_server(max_concurrent_rpcs: int | None = None,
                max_receive_bytes: int = MAX_MESSAGE_BYTES,
                interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> grpc.aio.Server:
    """A server capped at `max_receive_bytes` per incoming message (bigger ones fail with
    RESOURCE_EXHAUSTED before any handler runs)."""
    options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_receive_message_length", max_receive_bytes),
               *SERVER_KEEPALIVE_OPTIONS]
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


def announce_ready(port: int, metrics_port: int = 0, http_port: int | None = None) -> bool:
    """Tell a parent launcher which ports we bound (ports may be 0 = any free port); the
    router's HTTP port too when it serves one. False when the launcher is gone (it closed
    the pipe: stopped by Ctrl-C while this process started); stdout then goes to /dev/null,
    so that nothing fails on it again at exit."""
    http = "" if http_port is None else f" http_port={http_port}"
    try:
        print(f"{READY_PREFIX} metrics_port={metrics_port} port={port}{http}", flush=True)
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return False
    return True


class Ready(NamedTuple):
    """The ports a process announced it bound; 0: not served."""

    port: int
    metrics_port: int
    http_port: int


def parse_ready(line: str) -> Ready | None:
    """The ports of an `announce_ready` line (None for any other line)."""
    if not line.startswith(READY_PREFIX):
        return None
    fields = dict(item.split("=") for item in line.split()[1:])
    return Ready(int(fields["port"]), int(fields["metrics_port"]),
                 int(fields.get("http_port", 0)))


def channel(address: str) -> grpc.aio.Channel:
    """A plaintext channel to a router's public port (PUBLIC_CHANNEL_OPTIONS)."""
    return grpc.aio.insecure_channel(address, options=PUBLIC_CHANNEL_OPTIONS)
