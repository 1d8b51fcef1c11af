"""HTTP edge of the router: the OpenAI-compatible API, FastAPI served by uvicorn on the router
process's own event loop, beside the gRPC server (`HttpFront.start` / `stop`).

Like router/server.py it only translates. Bodies become `GenerateInput`s
(router/http/schema.py) and run through the router engine and its validation, as gRPC
Generates do; the engine's events become JSON bodies or server-sent events
(router/http/stream.py, router/http/reply.py); a failure becomes an OpenAI error object
carrying the message a gRPC client would get, the parameter named as the client sent it, and the
HTTP status of its gRPC code (router/http/errors.py).

A stream's headers wait for the request's first event, so a refusal before any token
(validation, overload) gets its own status; a later failure arrives as an error event. Every
token step is a chunk, as over gRPC and as vLLM streams completions: a token whose text is held
back (an incomplete UTF-8 character) goes out with empty text, so the first token and every
later one reach the client when they are sampled, not when their text becomes whole. A client
that goes away cancels its request: the engine's generator is closed, which releases it on every
worker. Requests count into the router's Prometheus metrics as gRPC ones do
(router/stream_clock.py); their failures under the gRPC status name the failure has there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import uuid
from collections.abc import AsyncIterator
from typing import TypeVar

import grpc
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from kvferry import logs
from kvferry.errors import NotFound, ResourceExhausted
from kvferry.rpc.grpc_util import PUBLIC_MAX_RECEIVE_BYTES
from kvferry.rpc.metrics import RouterMetrics
from kvferry.settings import SecuritySettings
from router.engine import Router
from router.http.batch import relay_all
from router.http.body import BodyParser, BodyRefusal
from router.http.conn import ConnectionLimits, bounded_protocol, fd_bounded_connections
from router.http.errors import ApiError, api_error, failure
from router.http.reply import Reply, TokenNames, model_list_json
from router.http.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIRequest,
    body_error,
    served_model_name,
)
from router.http.stream import (
    ClientGone,
    Event,
    EventStream,
    collect,
    first_event,
    sse,
    until_disconnect,
)
from router.identity import ApiKeys, Caller
from router.request import Admitted
from router.stream_clock import StreamClock

log = logging.getLogger("kvferry.router")
R = TypeVar("R", bound=OpenAIRequest)
MIN_BODY_VALUES = 1 << 16  # JSON values a body may hold, at the least (see HttpFront)


class KeyCheck:
    """ASGI middleware: with API keys, every `/v1/` request must carry `Authorization: Bearer
    <key>`; others get 401 and an OpenAI error object before their body is read. The key's
    tenant goes into the request's state (`request.state.tenant`)."""

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and self.keys.is_enabled
                and scope["path"].startswith("/v1/")):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            tenant = self.keys.tenant_of(given)
            if tenant is None:
                error = api_error(401, "missing or invalid API key: send the header "
                                  "`Authorization: Bearer <key>`", None, "invalid_api_key",
                                  "UNAUTHENTICATED")
                await Response(error.body, 401, media_type="application/json",
                               headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
            scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


class _Server(uvicorn.Server):
    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # the router process owns SIGTERM and drains us


class HttpFront:
    """The OpenAI-compatible API of one router: POST /v1/chat/completions, POST
    /v1/completions, GET /v1/models, GET /health. The port is bound at construction (0: a
    free one, then in `port`); `start` serves it, `stop` drains open streams for up to the
    drain timeout, then cancels what is left."""

    def __init__(self, router: Router, model: str, host: str, port: int,
                 security: SecuritySettings, require_client_auth: bool,
                 metrics: RouterMetrics | None, drain_timeout_s: float,
                 keys: ApiKeys | None = None, served_name: str | None = None) -> None:
        self.router = router
        self.model = served_model_name(model, served_name)
        self._model_names = {self.model, model}  # the name, or the --model given
        self.metrics = metrics
        self.keys = keys or ApiKeys()
        self._names: TokenNames | None = None  # tokens as logprobs name them (made once)
        self.is_serving = False
        limits = router.limits
        # A request needs at most a value per token of context (token-id prompts, stop ids)
        # and a few per message: more is refused before it reaches pydantic.
        self._bodies = BodyParser(limits.max_chat_messages, max(
            MIN_BODY_VALUES, 4 * router.config.max_position_embeddings
            + 16 * limits.max_chat_messages))
        connections = ConnectionLimits(limits.http_max_header_bytes,
                                       float(limits.http_header_timeout_s),
                                       fd_bounded_connections(limits.http_max_connections))
        tls: dict[str, object] = {}
        if security.tls_cert is not None:
            tls = {"ssl_certfile": security.tls_cert, "ssl_keyfile": security.tls_key}
            if require_client_auth:
                tls.update(ssl_ca_certs=security.tls_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        self.scheme = "https" if tls else "http"
        config = uvicorn.Config(self._app(), log_config=None, access_log=False,
                                lifespan="off", ws="none", http=bounded_protocol(connections),
                                timeout_keep_alive=limits.http_keep_alive_s,
                                timeout_graceful_shutdown=drain_timeout_s, **tls)
        self._server = _Server(config)
        self._socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host = host
        self.port: int = self._socket.getsockname()[1]
        self._task: asyncio.Task[None] | None = None

    def _app(self) -> ASGIApp:
        # Bodies are capped as the gRPC port caps messages (413 past it).
        app = FastAPI(title="kvferry", summary="OpenAI-compatible API of a kvferry router",
                      max_body_size=PUBLIC_MAX_RECEIVE_BYTES)
        app.add_api_route("/v1/chat/completions", self._chat, methods=["POST"])
        app.add_api_route("/v1/completions", self._completions, methods=["POST"])
        app.add_api_route("/v1/models", self._models, methods=["GET"])
        app.add_api_route("/health", self._health, methods=["GET"])
        app.add_api_route("/metrics", self._metrics, methods=["GET"])
        app.add_exception_handler(RequestValidationError, self._invalid_body)  # type: ignore[arg-type]
        app.add_exception_handler(HTTPException, self._http_error)  # type: ignore[arg-type]
        return KeyCheck(app, self.keys)

    async def start(self) -> None:
        self._bodies.start()
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():  # failed to start (a bad certificate)
                await self._task
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        self.is_serving = True
        log.info("OpenAI-compatible HTTP API on %s://%s:%d/v1", self.scheme, self.host,
                 self.port)

    async def stop(self) -> None:
        self.is_serving = False
        self._server.should_exit = True
        if self._task is not None:
            await self._task
        if self._server.server_state.tasks:  # cut off at the timeout: let them release
            await asyncio.wait(set(self._server.server_state.tasks), timeout=5.0)
        self._bodies.close()

    # ---- endpoints ---------------------------------------------------------------------
    async def _chat(self, request: Request) -> Response:
        body = await self._body(request, ChatCompletionRequest)
        if isinstance(body, Response):
            return body
        return await self._generate(request, body, "chatcmpl-")

    async def _completions(self, request: Request) -> Response:
        body = await self._body(request, CompletionRequest)
        if isinstance(body, Response):
            return body
        return await self._generate(request, body, "cmpl-")

    async def _body(self, request: Request, model: type[R]) -> R | Response:
        """The body as `model`, or the response refusing it (router/http/body.py: large
        bodies are parsed off the event loop, and what comes back is bounded)."""
        data = await self._bodies.read(request)
        if isinstance(data, BodyRefusal):
            code = "invalid_argument" if data.status == 400 else "resource_exhausted"
            return _response(api_error(data.status, data.message, data.param, code,
                                       code.upper()))
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            param, message = body_error(exc.errors())
            return _response(api_error(400, message, param, "invalid_argument",
                                       "INVALID_ARGUMENT"))

    async def _models(self) -> Response:
        return Response(model_list_json(self.model, self.router.max_model_len()),
                        media_type="application/json")

    async def _metrics(self) -> Response:
        """The router's Prometheus metrics, on the API port as vLLM serves them."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if self.metrics is None:
            return _response(api_error(404, "GET /metrics: this router keeps no metrics",
                                       None, "not_found", "NOT_FOUND"))
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def _health(self) -> Response:
        return Response(status_code=200 if self.is_serving else 503)

    async def _invalid_body(self, request: Request, exc: RequestValidationError) -> Response:
        param, message = body_error(exc.errors())
        return _response(api_error(400, message, param, "invalid_argument", "INVALID_ARGUMENT"))

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        allowed = (exc.headers or {}).get("Allow")
        message = f"{request.method} {request.url.path}: {exc.detail}" + (
            f" (this path takes {allowed})" if allowed else "")
        code = str(exc.detail).lower().replace(" ", "_")
        return _response(api_error(exc.status_code, message, None, code, ""))

    # ---- one request -------------------------------------------------------------------
    async def _generate(self, request: Request, body: OpenAIRequest, prefix: str) -> Response:
        request_id = prefix + uuid.uuid4().hex
        logs.request_id.set(request_id)
        clock = StreamClock(self.metrics)
        try:
            self.router.open.open_stream()
        except ResourceExhausted as exc:
            return self._failed(clock, failure(exc, request_id, body))
        tenant = getattr(request.state, "tenant", None)
        # without keys, ids are made up here: no other client knows one
        caller = Caller(tenant, "http" if tenant is None else tenant.scope)
        events: AsyncIterator[str | Event] | None = None
        is_streaming, opened = False, 1
        try:
            if body.model is not None and body.model not in self._model_names:
                raise NotFound(f"model: {body.model!r} is not served here; this server serves "
                               f"{self.model!r} (GET /v1/models)", "model")
            inputs = body.to_inputs(request_id, self.router.config.sampling_defaults)
            for _ in inputs[1:]:  # each prompt of a batch counts against --max-streams
                self.router.open.open_stream()
                opened += 1
            jobs = [await until_disconnect(request, self.router.admission.admit(inp, None,
                                                                                caller))
                    for inp in inputs]
            events = (self.router.relay(jobs[0], caller) if len(jobs) == 1
                      else relay_all(self.router, jobs, caller, request_id, body.n))
            reply, num_choices = self._reply(request_id, body, jobs), len(jobs) * body.n
            if not body.stream:
                return Response(await until_disconnect(request, collect(
                    events, reply, clock, num_choices)), media_type="application/json")
            first = await until_disconnect(request, first_event(events))
            is_streaming = True
            return EventStream(sse(events, first, reply, clock, body, num_choices),
                               lambda: self._close(events, clock, opened))
        except ClientGone:  # counted as cancelled by _close
            return Response(status_code=499)  # nobody reads it
        except Exception as exc:
            return self._failed(clock, failure(exc, request_id, body))
        finally:
            if not is_streaming:
                await self._close(events, clock, opened)

    def _reply(self, request_id: str, body: OpenAIRequest, jobs: list[Admitted]) -> Reply:
        """How the answer to `body` (admitted as `jobs`, one per prompt) is written."""
        echo = (body.echo_of([job.prompt for job in jobs], self.router.tokenizer)
                if isinstance(body, CompletionRequest) and body.echo else None)
        has_logprobs = jobs[0].params.logprobs is not None
        if has_logprobs and self._names is None:
            self._names = TokenNames(self.router.tokenizer)
        return Reply(request_id, self.model, isinstance(body, ChatCompletionRequest),
                     body.include_usage, body.return_token_ids,
                     self._names if has_logprobs else None, echo, body.n,
                     body.tool_use() if isinstance(body, ChatCompletionRequest) else None)

    def _failed(self, clock: StreamClock, answer: ApiError) -> Response:
        clock.failed(answer.code_name)
        return _response(answer)

    async def _close(self, events: AsyncIterator[str | Event] | None,
                     clock: StreamClock, opened: int = 1) -> None:
        """The request is over for this front: its generator closed (which releases it on
        the workers if it was still running), its `opened` slots freed, a cut-off stream
        counted."""
        for _ in range(opened):
            self.router.open.close_stream()
        clock.failed(grpc.StatusCode.CANCELLED.name)  # no-op once done or failed was recorded
        if events is not None:
            await events.aclose()  # type: ignore[attr-defined]


def _response(error: ApiError) -> Response:
    return Response(error.body, error.status, media_type="application/json")
