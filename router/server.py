"""gRPC edge of the router: the public GenerationService."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc

from kvferry import convert, grpc_util
from kvferry.v1 import generation_pb2, generation_pb2_grpc
from router.engine import ChunkEvent, DoneEvent, Router
from router.validation import GenerateInput


def _input(request: generation_pb2.GenerateRequest) -> GenerateInput:
    which = request.WhichOneof("input")
    return GenerateInput(
        request_id=request.request_id,
        text=request.text if which == "text" else None,
        token_ids=list(request.token_ids.ids) if which == "token_ids" else None,
        params=convert.sampling_from_proto(request.sampling),
        is_max_tokens_set=request.sampling.HasField("max_tokens"),
    )


def _done_to_proto(request_id: str, event: DoneEvent) -> generation_pb2.GenerateResponse:
    t = event.timing
    return generation_pb2.GenerateResponse(
        request_id=request_id,
        finished=generation_pb2.Finished(
            reason=event.reason.value,
            usage=generation_pb2.Usage(prompt_tokens=event.prompt_tokens,
                                       completion_tokens=event.completion_tokens),
            timing=generation_pb2.Timing(
                queue_s=t.queue_s, prefill_s=t.prefill_s, kv_transfer_s=t.kv_transfer_s,
                first_decode_step_s=t.first_decode_step_s,
                time_to_first_token_s=t.time_to_first_token_s,
                admission_wait_s=t.admission_wait_s, num_migrations=t.num_migrations,
            ),
        ),
    )


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    async def Generate(self, request: generation_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        request_id = request.request_id
        try:
            events = self.router.generate(_input(request), context.time_remaining())
            async with aclosing(events):
                async for event in events:
                    if isinstance(event, str):
                        request_id = event
                    elif isinstance(event, ChunkEvent):
                        yield generation_pb2.GenerateResponse(
                            request_id=request_id,
                            chunk=generation_pb2.TokenChunk(token_ids=event.token_ids,
                                                            text=event.text),
                        )
                    else:
                        yield _done_to_proto(request_id, event)
        except Exception as exc:
            await grpc_util.abort_with(context, exc, request_id)

    async def Abort(self, request: generation_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> generation_pb2.AbortResponse:
        try:
            pending = self.router.abort(request.request_id)
            if pending is not None:
                await pending
        except Exception as exc:
            await grpc_util.abort_with(context, exc, request.request_id)
        return generation_pb2.AbortResponse()

    async def GetModelInfo(self, request: generation_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> generation_pb2.ModelInfo:
        cfg = self.router.config
        layout = next((w.layout for w in self.router.workers.workers if w.layout), None)
        return generation_pb2.ModelInfo(
            architecture=cfg.architecture, vocab_size=cfg.vocab_size,
            max_context_tokens=cfg.max_position_embeddings,
            eos_token_ids=list(cfg.eos_token_ids), model_fingerprint=cfg.fingerprint,
            block_size=layout.block_size if layout else 0,
            kv_dtype=layout.dtype if layout else "",
        )


SERVICE_NAMES = ["kvferry.v1.GenerationService"]


def add_to_server(server: grpc.aio.Server, router: Router) -> None:
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(GenerationServicer(router), server)
