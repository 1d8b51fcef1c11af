"""Typed exceptions used inside kvferry; each server maps them to gRPC status codes.

A failed call to another kvferry process is translated into these by its client adapter
(`kvferry.rpc.grpc_util.from_rpc`): the class says what happened, `downstream` says it came
from another process and `remote_code` keeps the exact status number it answered with, so
nothing past the adapters reads gRPC status codes, and a router still tells its public
clients no more than the status of a worker's failure."""

from __future__ import annotations

import re


class KvferryError(Exception):
    """Base class. `field` names the offending input field when there is one."""

    # Set on an error translated from another process's answer: the status number it
    # answered with (a gRPC StatusCode value) and whether it came from a downstream call.
    remote_code: int | None = None
    downstream: bool = False

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class InvalidArgument(KvferryError):
    """Bad input from the caller (INVALID_ARGUMENT)."""


class NotFound(KvferryError):
    """Unknown request id (NOT_FOUND)."""


class AlreadyExists(KvferryError):
    """What a call would create is there already (ALREADY_EXISTS): a K/V push to a
    reservation whose K/V is complete."""


class Unauthenticated(KvferryError):
    """A public call without a valid API key (UNAUTHENTICATED; HTTP 401)."""


class ResourceExhausted(KvferryError):
    """Not enough K/V blocks or queue room (RESOURCE_EXHAUSTED)."""


class Unavailable(KvferryError):
    """A worker is down or draining (UNAVAILABLE)."""


class Aborted(KvferryError):
    """The request was aborted or its lease ran out while in flight (ABORTED/CANCELLED)."""


class Cancelled(Aborted):
    """The call was cancelled before it was answered (CANCELLED): the other side may
    have acted on it."""


class DeadlineExceeded(KvferryError):
    """The request's deadline passed (DEADLINE_EXCEEDED)."""


class DataLoss(KvferryError):
    """Data that arrived intact but cannot be right: pushed K/V holding inf or NaN
    (DATA_LOSS)."""


class Internal(KvferryError):
    """A failure of kvferry itself, not of the request (INTERNAL); the message is meant for
    clients and carries no internals (those go to the log)."""


class Remote(KvferryError):
    """A downstream worker reported this request failed with gRPC status number `code`."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code
        self.remote_code = code


def missing_model(path: object) -> str:
    """Why a --model path that does not exist is refused: said plainly, and for what looks
    like a Hugging Face id (`org/name`), that nothing is downloaded."""
    text = str(path)
    message = f"model: {text} does not exist"
    if re.fullmatch(r"[\w.-]+/[\w.-]+", text) and not text.startswith((".", "/")):
        message += (" (it looks like a Hugging Face id: kvferry downloads nothing; give a "
                    "local checkpoint directory or GGUF file, or no --model for the default)")
    return message
