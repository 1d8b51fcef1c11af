"""gRPC edge of the prefill worker: PrefillService."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc

from kvferry.rpc import convert, grpc_util
from kvferry.rpc.worker_servicer import PrefillStreamServicer, first_token
from kvferry.v1 import worker_pb2, worker_pb2_grpc
from prefill_worker.engine import FirstTokenEvent, PrefillEngine


class PrefillServicer(PrefillStreamServicer[PrefillEngine],
                      worker_pb2_grpc.PrefillServiceServicer):
    def __init__(self, engine: PrefillEngine) -> None:
        super().__init__(engine, "prefill", engine.layout)

    async def _responses(self, request: worker_pb2.PrefillRequest,
                         context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[worker_pb2.PrefillResponse]:
        events = self.engine.prefill(
            request.request_id, list(request.prompt_token_ids),
            convert.sampling_from_proto(request.sampling), request.decode_address,
            context.time_remaining(), request.num_generated, request.defer_push,
            request.cache_salt, request.skip_blocks, max(request.num_samples, 1),
        )
        # aclosing: if we are cancelled while suspended at our own yield, the engine's
        # generator still runs its cleanup (frees the blocks) right away.
        async with aclosing(events):
            async for event in events:
                if isinstance(event, FirstTokenEvent):
                    yield first_token(*event)
                else:
                    yield worker_pb2.PrefillResponse(done=worker_pb2.PrefillDone(
                        kv_transfer_s=event.kv_transfer_s, kv_bytes=event.kv_bytes))

    async def Ship(self, request: worker_pb2.ShipRequest,
                   context: grpc.aio.ServicerContext) -> worker_pb2.ShipResponse:
        try:
            self.engine.ship(request.request_id, request.decode_address, request.skip_blocks)
        except Exception as exc:
            await grpc_util.abort_with(context, exc, request.request_id)
        return worker_pb2.ShipResponse()


SERVICE_NAMES = ["kvferry.v1.PrefillService"]


def add_to_server(server: grpc.aio.Server, engine: PrefillEngine) -> None:
    worker_pb2_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(engine), server)
