"""kvferry failures as the OpenAI API reports them: an error object
`{"error": {"message", "type", "param", "code"}}` with the HTTP status of the failure's gRPC
code. The message is the one a gRPC client gets (router/public_errors.py: no internals), with
the parameter named as the HTTP client sent it (`max_tokens`, not `sampling.max_tokens`)."""

from __future__ import annotations

from typing import NamedTuple

import grpc

from kvferry.errors import KvferryError
from router.http.reply import error_json
from router.http.schema import OpenAIRequest
from router.public_errors import public_status

HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
               grpc.StatusCode.NOT_FOUND: 404,
               grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503}
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
               404: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error",
               503: "service_unavailable_error"}  # others: server_error


class ApiError(NamedTuple):
    status: int  # HTTP
    body: str  # the error object, JSON
    code_name: str  # the gRPC status the same failure has (for the failure metrics)


def api_error(status: int, message: str, param: str | None, code: str | None,
              code_name: str) -> ApiError:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500
                           else "server_error")
    return ApiError(status, error_json(message, kind, param, code), code_name)


def failure(exc: BaseException, request_id: str, body: OpenAIRequest | None) -> ApiError:
    """What the client is told when its request fails with `exc`; details go to the log."""
    code, message = public_status(exc, request_id)
    param = None
    if isinstance(exc, KvferryError) and exc.field:
        param = exc.field if body is None else body.param(exc.field)
        if message.startswith(exc.field):
            message = param + message[len(exc.field):]
    status = HTTP_STATUS.get(code, 500)
    api_code = "model_not_found" if param == "model" and status == 404 else code.name.lower()
    return api_error(status, message, param, api_code, code.name)
