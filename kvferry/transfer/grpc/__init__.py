"""The gRPC K/V transport (`--kv-transport grpc`, the default): the prefill worker streams
~1 MiB checksummed chunks over a client-streaming `KvTransferService.PushKv` call
(`send.py`); the decode worker writes each into the reservation with one copy
(`receive.py`). `chunk_codec.py` keeps the protobuf wire format with one payload copy a side.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc

    from kvferry.faults import Faults
    from kvferry.transfer.sender import KvSender
    from kvferry.transfer.sink import KvSink
    from kvferry.transfer.transport import SenderOptions


def make_sender(options: SenderOptions) -> KvSender:
    from kvferry.transfer.grpc.send import GrpcKvSender

    return GrpcKvSender.from_options(options)


def add_receiver(server: grpc.aio.Server, sink: KvSink, faults: Faults
                 ) -> Callable[[], None] | None:
    import grpc

    from kvferry.transfer.grpc import chunk_codec, receive

    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        chunk_codec.KV_TRANSFER_SERVICE, {"PushKv": receive.handler(sink)}),))
    return None
