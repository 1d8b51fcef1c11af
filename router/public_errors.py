"""What a public client is told when its request fails: a status code and a message written
for it, never internals. Worker addresses, downstream transport errors and exception text
stay in the router's log (under the request id), which the message points to. Errors arrive
as `kvferry.errors`, a downstream call's translated by its client adapter."""

from __future__ import annotations

import logging
import re

import grpc

from kvferry import logs
from kvferry.errors import KvferryError
from kvferry.rpc import grpc_util

log = logging.getLogger("kvferry.router")

# Downstream statuses whose details describe the cluster (connection errors, addresses,
# internal failures), not the request: the client gets the code and a generic message.
_OPAQUE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
           grpc.StatusCode.CANCELLED)
# host:port or bare IPv4/IPv6 addresses that a message may still carry.
_ADDRESS = re.compile(r"(ipv[46]:)?(\[[0-9a-fA-F]*:[0-9a-fA-F:]*\]|\b\d{1,3}(\.\d{1,3}){3}\b)"
                      r"(:\d+)?"
                      r"|\b[\w.-]+:\d{2,5}\b")


def scrub(message: str) -> str:
    """`message` with every network address replaced by `<worker>`."""
    return _ADDRESS.sub("<worker>", message)


def public_status(exc: BaseException, request_id: str | None = None
                  ) -> tuple[grpc.StatusCode, str]:
    """The status and message a public client gets for `exc`; details go to the log, under
    `request_id` (by default the one the handler's log lines carry, `kvferry.logs`)."""
    if request_id is None:
        request_id = logs.request_id.get()
    if isinstance(exc, KvferryError) and exc.downstream:
        code = grpc_util.status_for(exc)
        log.warning("request %s: downstream %s: %s", request_id, code.name, exc)
        if code in _OPAQUE:
            return code, (f"a worker failed ({code.name}); details are in the router's log "
                          f"under request {request_id}")
        return code, f"downstream: {scrub(str(exc))}"
    if isinstance(exc, KvferryError):
        code, message = grpc_util.describe(exc)
        if code in _OPAQUE:
            log.warning("request %s: %s: %s", request_id, code.name, message)
        return code, scrub(message)
    log.error("request %s: internal error", request_id, exc_info=exc)
    return grpc.StatusCode.INTERNAL, (f"internal error; details are in the router's log "
                                      f"under request {request_id}")
