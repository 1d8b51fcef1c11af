"""The decode worker's end of the gRPC K/V transport: `KvTransferService.PushKv`, a
client-streaming call of ~1 MiB chunks (`send.GrpcKvSender`), each written into the
reservation by the `KvSink` with one copy.

Chunks come parsed by `chunk_codec.decode` (the payload a view into the received bytes).
A stream carries one request's push: its first chunk opens the push (`begin_push`: a newer
push supersedes an unfinished one), its end finishes it; a refusal or a broken stream
forgets the push's pages so the prompt can be pushed again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from kvferry import logs, trace
from kvferry.errors import InvalidArgument
from kvferry.rpc import convert, grpc_util
from kvferry.transfer import wire
from kvferry.transfer.grpc import chunk_codec
from kvferry.transfer.sink import KvSink
from kvferry.v1 import worker_pb2


class PushKvReceiver:
    def __init__(self, sink: KvSink) -> None:
        self.sink = sink

    async def PushKv(  # noqa: N802 - the gRPC method's name
        self, request_iterator: AsyncIterator[chunk_codec.ReceivedChunk | worker_pb2.KvChunk],
        context: grpc.aio.ServicerContext,
    ) -> worker_pb2.PushKvResponse:
        request_id = ""
        written = 0
        epoch: int | None = None  # this stream's push, once begun
        try:
            async for chunk in request_iterator:
                if request_id and chunk.request_id != request_id:
                    raise InvalidArgument("one push carries one request_id", "request_id")
                if not request_id:
                    logs.request_id.set(chunk.request_id)
                    request_id = chunk.request_id
                    epoch = self.sink.begin_push(request_id)
                span = wire.ChunkSpan(chunk.layer_start, chunk.layer_end, chunk.block_start,
                                      chunk.num_blocks)
                received_from = time.monotonic()
                written += self.sink.receive_chunk(
                    request_id, convert.layout_from_proto(chunk.layout), chunk.num_tokens,
                    span, chunk.data, chunk.crc32, epoch, chunk.is_draft,
                    (chunk.num_evicted, chunk.num_rebased),
                )
                if tracer := trace.get():
                    tracer.event("kv", t0=received_from, t1=time.monotonic(), id=request_id,
                                 bytes=len(chunk.data))
            if not request_id:
                raise InvalidArgument("empty push", "request_id")
            self.sink.finish_push(request_id, epoch)
        except asyncio.CancelledError:
            if epoch is not None:
                self.sink.fail_push(request_id, epoch)
            raise
        except Exception as exc:
            if epoch is not None:
                self.sink.fail_push(request_id, epoch)
            await grpc_util.abort_with(context, exc, request_id)
        return worker_pb2.PushKvResponse(bytes_written=written)


def handler(sink: KvSink) -> grpc.RpcMethodHandler:
    """`PushKv` into `sink`, its chunks parsed by `chunk_codec.decode`."""
    return grpc.stream_unary_rpc_method_handler(
        PushKvReceiver(sink).PushKv, request_deserializer=chunk_codec.decode,
        response_serializer=worker_pb2.PushKvResponse.SerializeToString)
