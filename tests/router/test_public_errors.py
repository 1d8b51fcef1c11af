"""What public clients are told about failures: codes kept, internals (worker addresses,
transport errors, exception text) left in the router's log."""

from __future__ import annotations

import grpc
import pytest

from kvferry.errors import Internal, InvalidArgument, Remote, ResourceExhausted
from kvferry.rpc.grpc_util import from_rpc
from router.public_errors import public_status, scrub


class _RpcError(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize("message", [
    "no decode worker can hold the request (10.1.2.3:50051: pool full)",
    "failed to connect to ipv4:127.0.0.1:40123",
    "decode-0.decode.svc.cluster.local:50051 refused",
    "peer [::1]:9000 reset",
])
def test_addresses_are_scrubbed(message: str) -> None:
    cleaned = scrub(message)
    assert "<worker>" in cleaned
    for secret in ("10.1.2.3", "127.0.0.1", "cluster.local", "::1", "50051", "9000"):
        assert secret not in cleaned


def test_own_errors_keep_their_code_and_field() -> None:
    code, message = public_status(InvalidArgument("too long", "request_id"), "r1")
    assert (code, message) == (grpc.StatusCode.INVALID_ARGUMENT, "request_id: too long")
    code, message = public_status(ResourceExhausted("full (decode-0:50051: no room)"), "r1")
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "50051" not in message


def test_downstream_transport_errors_become_generic() -> None:
    code, message = public_status(from_rpc(_RpcError(grpc.StatusCode.UNAVAILABLE,
                                            "failed to connect to all addresses; last error: "
                                            "ipv4:10.0.0.7:50051: Connection refused")), "r2")
    assert code == grpc.StatusCode.UNAVAILABLE
    assert "10.0.0.7" not in message and "refused" not in message and "r2" in message


def test_downstream_request_errors_pass_through() -> None:
    code, message = public_status(from_rpc(_RpcError(grpc.StatusCode.DATA_LOSS,
                                            "crc32: chunk checksum mismatch")), "r3")
    assert code == grpc.StatusCode.DATA_LOSS and "checksum mismatch" in message


def test_unexpected_exceptions_say_nothing_of_themselves() -> None:
    code, message = public_status(KeyError("secret internals"), "r4")
    assert code == grpc.StatusCode.INTERNAL
    assert "secret" not in message and "KeyError" not in message and "r4" in message
    code, message = public_status(Remote("decode worker: decode step failed",
                                         grpc.StatusCode.INTERNAL.value[0]), "r5")
    assert code == grpc.StatusCode.INTERNAL and "decode step failed" in message
    assert public_status(Internal("boom"), "r6")[0] == grpc.StatusCode.INTERNAL


@pytest.mark.parametrize("message", [
    "input.messages[1].role: 'narrator' is not one of system, developer, user, assistant",
    "sampling.stop[12]: too long", "prompt 12 + max_tokens 5 exceeds the context of 4096",
])
def test_field_names_and_numbers_survive(message: str) -> None:
    assert scrub(message) == message


def test_a_decode_workers_unexpected_exception_stays_in_its_log() -> None:
    """An exception that is not kvferry's own (a bug, a library error) becomes a generic
    INTERNAL on the internal stream: its text never reaches the router, so never a client."""
    from decode_worker.sequence import ErrorEvent
    from decode_worker.server import _merge

    [update] = _merge([ErrorEvent("r7", KeyError("secret_key_table at decode-0:50051"))])
    assert update.error_code == grpc.StatusCode.INTERNAL.value[0]
    assert "secret" not in update.error_message and "50051" not in update.error_message
    code, message = public_status(Remote(update.error_message, update.error_code), "r7")
    assert code == grpc.StatusCode.INTERNAL and "secret" not in message
    [update] = _merge([ErrorEvent("r8", InvalidArgument("bad", "first_token_id"))])
    assert update.error_message == "first_token_id: bad"  # kvferry's own: kept, field named
