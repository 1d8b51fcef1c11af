"""Client adapter for a worker's PrefillService: Prefill, Ship, Abort and GetStats.

Protobuf and gRPC stay here: callers pass and get the records of `router.records`, and a
failed call raises the `kvferry.errors` class of its status (`grpc_util.from_rpc`), which the
router's failover reads.
"""

from __future__ import annotations

import grpc

from kvferry.cache.prefix import TierTokens
from kvferry.rpc import convert, grpc_util
from kvferry.v1 import worker_pb2, worker_pb2_grpc
from router.records import FirstToken, PrefillDone, PrefillStart
from router.workers.client import WorkerClient


class PrefillCall:
    """One Prefill stream: a FirstToken, then a PrefillDone."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self._call = call

    async def read(self) -> FirstToken | PrefillDone | None:
        """The next message; None when the stream ended. Cancelling the call makes a pending
        read raise `asyncio.CancelledError`."""
        with grpc_util.translated():
            msg = await self._call.read()
        if msg is grpc.aio.EOF:
            return None
        if msg.WhichOneof("kind") == "done":
            return PrefillDone(msg.done.kv_transfer_s, msg.done.kv_bytes)
        first = msg.first_token
        return FirstToken(first.token_id, first.prefill_s, first.num_cached_tokens,
                          TierTokens(first.num_cached_host_tokens, first.num_cached_disk_tokens,
                                     first.num_cached_store_tokens),
                          tuple(first.sample_token_ids),
                          convert.logprobs_from_proto(first.logprobs),
                          convert.logprobs_from_proto(first.prompt_logprobs))

    def cancel(self) -> bool:
        return self._call.cancel()

    def done(self) -> bool:
        return self._call.done()


class PrefillClient(WorkerClient):
    def __init__(self, channel: grpc.aio.Channel) -> None:
        super().__init__(worker_pb2_grpc.PrefillServiceStub(channel))
        self._stub: worker_pb2_grpc.PrefillServiceStub

    def prefill(self, start: PrefillStart, timeout_s: float | None) -> PrefillCall:
        request = worker_pb2.PrefillRequest(
            request_id=start.request_id, prompt_token_ids=start.prompt_token_ids,
            sampling=convert.sampling_to_proto(start.sampling),
            decode_address=start.decode_address, is_local_decode=start.is_local_decode,
            num_generated=start.num_generated, defer_push=start.defer_push,
            cache_salt=start.cache_salt, skip_blocks=start.skip_blocks,
            num_samples=start.num_samples,
        )
        return PrefillCall(self._stub.Prefill(request, timeout=timeout_s))

    async def ship(self, request_id: str, decode_address: str, skip_blocks: int,
                   timeout_s: float | None) -> None:
        with grpc_util.translated():
            await self._stub.Ship(worker_pb2.ShipRequest(
                request_id=request_id, decode_address=decode_address,
                skip_blocks=skip_blocks), timeout=timeout_s)

