"""gRPC edge of the router: the public GenerationService.

Requests are parsed here (a string field with invalid UTF-8 is answered INVALID_ARGUMENT
naming it, kvferry.rpc.proto_utf8), callers are identified (router/identity.py: API keys,
UNAUTHENTICATED without a valid one), open requests are capped by the router
(PublicLimits.max_streams, both fronts together, RESOURCE_EXHAUSTED past it), and failures
reach clients through router.public_errors."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import NamedTuple

import grpc
from google.protobuf.message import DecodeError

from kvferry import logs
from kvferry.errors import InvalidArgument, ResourceExhausted, Unauthenticated
from kvferry.rpc import convert, grpc_util
from kvferry.rpc.metrics import RouterMetrics
from kvferry.rpc.proto_utf8 import Malformed, invalid_utf8_field
from kvferry.rpc.security import TOKEN_METADATA_KEY
from kvferry.settings.sampling import KVFERRY_DEFAULTS, SamplingDefaults
from kvferry.v1 import generation_pb2, generation_pb2_grpc
from router.admission import Admission
from router.engine import Router
from router.events import ChunkEvent, DoneEvent
from router.identity import ApiKeys, Caller
from router.public_errors import public_status
from router.request import ChatMessage, GenerateInput
from router.stream_clock import StreamClock

log = logging.getLogger("kvferry.router")


def _input(request: generation_pb2.GenerateRequest,
           defaults: SamplingDefaults = KVFERRY_DEFAULTS) -> GenerateInput:
    which = request.WhichOneof("input")
    return GenerateInput(
        request_id=request.request_id,
        text=request.text if which == "text" else None,
        token_ids=list(request.token_ids.ids) if which == "token_ids" else None,
        messages=(tuple(ChatMessage(m.role, m.content) for m in request.messages.messages)
                  if which == "messages" else None),
        params=convert.sampling_from_proto(request.sampling, defaults=defaults),
        is_max_tokens_set=request.sampling.HasField("max_tokens"),
        cache_salt=request.cache_salt,
    )


def _cache_details(event: DoneEvent) -> dict[str, int]:
    """Usage's cache and transfer figures where they are reported (else left unset: unknown,
    not 0)."""
    if not event.details:
        return {}
    return {"cached_prompt_tokens": event.cached_prompt_tokens,
            "kv_bytes_not_shipped": event.kv_bytes_not_shipped,
            "kv_bytes_shipped": event.kv_bytes_shipped}


def _done_to_proto(request_id: str, event: DoneEvent) -> generation_pb2.GenerateResponse:
    t = event.timing
    return generation_pb2.GenerateResponse(
        request_id=request_id, sample_index=event.sample_index,
        finished=generation_pb2.Finished(
            reason=event.reason.value,
            usage=generation_pb2.Usage(prompt_tokens=event.prompt_tokens,
                                       completion_tokens=event.completion_tokens,
                                       **_cache_details(event),
                                       cached_host_tokens=event.cached_by_tier.host,
                                       cached_disk_tokens=event.cached_by_tier.disk,
                                       cached_store_tokens=event.cached_by_tier.store,
                                       num_draft_tokens=event.num_draft_tokens,
                                       num_accepted_tokens=event.num_accepted_tokens),
            timing=generation_pb2.Timing(
                queue_s=t.queue_s, prefill_s=t.prefill_s, kv_transfer_s=t.kv_transfer_s,
                first_decode_step_s=t.first_decode_step_s,
                time_to_first_token_s=t.time_to_first_token_s,
                admission_wait_s=t.admission_wait_s, num_migrations=t.num_migrations,
            ),
        ),
    )


class Unparsable(NamedTuple):
    """A request protobuf refused: the status it is answered with (INVALID_ARGUMENT, its
    message naming the field where it can)."""

    status: tuple[grpc.StatusCode, str]

    @staticmethod
    def of(error: InvalidArgument) -> Unparsable:
        return Unparsable(grpc_util.describe(error))


def _parser(message: type) -> Callable[[bytes], object]:
    def parse(data: bytes) -> object:
        try:
            return message.FromString(data)
        except DecodeError:
            try:
                field = invalid_utf8_field(data, message.DESCRIPTOR)
            except Malformed:
                field = None
            if field is None:
                return Unparsable.of(InvalidArgument(f"not a valid {message.__name__}"))
            return Unparsable.of(InvalidArgument(f"{field}: not valid UTF-8", field))
    return parse


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    """Every RPC first establishes its caller (router/identity.py): with API keys, a call
    without a valid `authorization: Bearer <key>` is refused UNAUTHENTICATED before its
    request is looked at; without keys, the caller's scope is its connection."""

    def __init__(self, router: Router, metrics: RouterMetrics | None = None,
                 keys: ApiKeys | None = None, model_name: str = "") -> None:
        self.router = router
        self.admission: Admission = router.admission  # each request's record, made here
        self.metrics = metrics
        self.keys = keys or ApiKeys()
        self.model_name = model_name  # GetModelInfo's, the OpenAI API's `model`

    async def _caller(self, context: grpc.aio.ServicerContext) -> Caller:
        if not self.keys.is_enabled:
            return Caller(None, f"grpc:{context.peer()}")
        given = next((value for key, value in context.invocation_metadata() or ()
                      if key == TOKEN_METADATA_KEY), None)
        tenant = self.keys.tenant_of(given)
        if tenant is None:
            await context.abort(*grpc_util.describe(Unauthenticated(
                "missing or invalid API key: send the metadata `authorization: Bearer <key>`")))
        return Caller(tenant, tenant.scope)

    async def Generate(self, request: generation_pb2.GenerateRequest | Unparsable,
                       context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        caller = await self._caller(context)
        if isinstance(request, Unparsable):
            await context.abort(*request.status)
        try:
            self.router.open.open_stream()
        except ResourceExhausted as exc:
            await context.abort(*grpc_util.describe(exc))
        try:
            async for response in self._generate(request, context, caller):
                yield response
        finally:
            self.router.open.close_stream()

    async def _generate(self, request: generation_pb2.GenerateRequest,
                        context: grpc.aio.ServicerContext, caller: Caller
                        ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        logs.request_id.set(request.request_id)  # until the relay names it (a new one if empty)
        request_id = ""
        clock = StreamClock(self.metrics)
        try:
            inp = _input(request, self.router.config.sampling_defaults)
            job = await self.admission.admit(inp, context.time_remaining(), caller)
            async with aclosing(self.router.relay(job, caller)) as events:
                async for event in events:
                    if isinstance(event, str):
                        request_id = event
                        logs.request_id.set(request_id)
                    elif isinstance(event, ChunkEvent):
                        clock.chunk(len(event.token_ids))
                        yield generation_pb2.GenerateResponse(
                            request_id=request_id,
                            chunk=generation_pb2.TokenChunk(
                                token_ids=event.token_ids, text=event.text,
                                logprobs=convert.logprobs_to_proto(event.logprobs),
                                prompt_logprobs=convert.logprobs_to_proto(
                                    event.prompt_logprobs)),
                            sample_index=event.sample_index,
                        )
                    else:
                        clock.done(event)
                        log.info("request %s done (%s): %d prompt + %d generated tokens, TTFT "
                                 "%.1f ms, %d migrations", request_id, event.reason.name.lower(),
                                 event.prompt_tokens, event.completion_tokens,
                                 event.timing.time_to_first_token_s * 1e3,
                                 event.timing.num_migrations)
                        yield _done_to_proto(request_id, event)
        except asyncio.CancelledError:
            clock.failed(grpc.StatusCode.CANCELLED.name)
            raise
        except Exception as exc:
            code, message = public_status(exc)
            clock.failed(code.name)
            await context.abort(code, message)

    async def Abort(self, request: generation_pb2.AbortRequest | Unparsable,
                    context: grpc.aio.ServicerContext) -> generation_pb2.AbortResponse:
        caller = await self._caller(context)
        if isinstance(request, Unparsable):
            await context.abort(*request.status)
        try:
            pending = self.router.abort(request.request_id, caller)
            if pending is not None:
                await pending
        except Exception as exc:
            await context.abort(*public_status(exc, request.request_id))
        return generation_pb2.AbortResponse()

    async def GetModelInfo(self, request: generation_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> generation_pb2.ModelInfo:
        await self._caller(context)
        cfg = self.router.config
        layout = next((w.layout for w in self.router.workers.workers if w.layout), None)
        return generation_pb2.ModelInfo(
            architecture=cfg.architecture, vocab_size=cfg.vocab_size,
            max_context_tokens=self.router.max_model_len(),
            eos_token_ids=list(cfg.eos_token_ids), model_fingerprint=cfg.fingerprint,
            block_size=layout.block_size if layout else 0,
            kv_dtype=layout.dtype if layout else "", model_name=self.model_name,
        )


SERVICE_NAMES = ["kvferry.v1.GenerationService"]


def add_to_server(server: grpc.aio.Server, router: Router,
                  metrics: RouterMetrics | None = None, keys: ApiKeys | None = None,
                  model_name: str = "") -> None:
    """GenerationService with the parsers above (the generated registration would answer an
    unparsable request with a bare INTERNAL)."""
    servicer = GenerationServicer(router, metrics, keys, model_name)
    pb = generation_pb2
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=_parser(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString),
        "Abort": grpc.unary_unary_rpc_method_handler(
            servicer.Abort, request_deserializer=_parser(pb.AbortRequest),
            response_serializer=pb.AbortResponse.SerializeToString),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetModelInfo, request_deserializer=pb.GetModelInfoRequest.FromString,
            response_serializer=pb.ModelInfo.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        SERVICE_NAMES[0], handlers),))
