"""A public client's failed call, said in one line with what to do about it: a
client command (`generate`, `chat`, `bench`) prints `kvferry: COMMAND: ...` and exits 1,
never a traceback. The hints name the likely cause from what gRPC reports: nothing listening,
TLS on one side only, a CA that does not match, a missing API key."""

from __future__ import annotations

import grpc

EXIT_UNREACHABLE = 1


class Unreachable(ConnectionError):
    """A call that could not be made, its message the one line to print."""


def _hint(code: grpc.StatusCode, details: str, address: str, is_tls: bool) -> str:
    text = details.lower()
    if code == grpc.StatusCode.UNAVAILABLE:
        if is_tls and ("ssl" in text or "handshake" in text or "certificate" in text):
            return ("the TLS handshake failed: does the router speak TLS, is --tls-ca the CA "
                    "that signed its certificate, and is --tls-server-name its name?")
        if not is_tls and ("socket closed" in text or "connection reset" in text
                           or "ssl" in text):
            return "the router may speak TLS: give --tls-ca"
        return f"is `kvferry serve` (or the router) running at {address}?"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return "give the router's API key: --api-key or $KVFERRY_API_KEY"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"the router at {address} did not answer in time"
    return ""


def rpc_error_line(command: str, exc: grpc.aio.AioRpcError | grpc.RpcError, address: str,
                   is_tls: bool) -> str:
    """`kvferry: generate: UNAVAILABLE at 127.0.0.1:50051: <details> (is ... running?)`."""
    code = exc.code()
    details = " ".join((exc.details() or "").split())  # gRPC's details may span lines
    hint = _hint(code, details, address, is_tls)
    return (f"kvferry: {command}: {code.name} at {address}: {details}"
            + (f"; {hint}" if hint else ""))
