"""A failed call to another process leaves its client adapter as a `kvferry.errors` class:
the class its status maps to, marked downstream, with the exact status kept, so a server
passing it on answers with the same status as before and names where it came from."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvferry import errors
from kvferry.rpc import grpc_util


def _rpc_error(code: grpc.StatusCode, details: str = "why") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize(("code", "cls"), [
    (grpc.StatusCode.UNAVAILABLE, errors.Unavailable),
    (grpc.StatusCode.NOT_FOUND, errors.NotFound),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhausted),
    (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgument),
    (grpc.StatusCode.ALREADY_EXISTS, errors.AlreadyExists),
    (grpc.StatusCode.DEADLINE_EXCEEDED, errors.DeadlineExceeded),
    (grpc.StatusCode.CANCELLED, errors.Cancelled),
    (grpc.StatusCode.ABORTED, errors.Aborted),
    (grpc.StatusCode.DATA_LOSS, errors.DataLoss),
    (grpc.StatusCode.INTERNAL, errors.Internal),
    (grpc.StatusCode.UNKNOWN, errors.Internal),  # kvferry never sends it
])
def test_each_status_becomes_its_class_and_keeps_its_code(code: grpc.StatusCode,
                                                         cls: type[errors.KvferryError]
                                                         ) -> None:
    error = grpc_util.from_rpc(_rpc_error(code, "pool full"))
    assert type(error) is cls
    assert error.downstream and str(error) == "pool full"
    assert grpc_util.status_for(error) == code  # UNKNOWN stays UNKNOWN, not INTERNAL
    # Passed on by a server, as a raw AioRpcError was: same code, naming where it came from.
    assert grpc_util.describe(error) == (code, "downstream: pool full")


def test_cancelled_is_an_abort_but_not_aborted() -> None:
    cancelled = grpc_util.from_rpc(_rpc_error(grpc.StatusCode.CANCELLED))
    aborted = grpc_util.from_rpc(_rpc_error(grpc.StatusCode.ABORTED))
    assert isinstance(cancelled, errors.Aborted) and not isinstance(aborted, errors.Cancelled)
    assert grpc_util.status_for(errors.Cancelled("x")) == grpc.StatusCode.CANCELLED


def test_own_errors_are_not_downstream() -> None:
    own = errors.Unavailable("no healthy prefill worker")
    assert not own.downstream and own.remote_code is None
    assert grpc_util.describe(own) == (grpc.StatusCode.UNAVAILABLE, "no healthy prefill worker")


def test_translated_turns_a_failed_call_into_its_error() -> None:
    async def call() -> None:
        with grpc_util.translated():
            raise _rpc_error(grpc.StatusCode.NOT_FOUND, "unknown request r")

    with pytest.raises(errors.NotFound, match="unknown request r") as caught:
        asyncio.run(call())
    assert isinstance(caught.value.__cause__, grpc.aio.AioRpcError)
