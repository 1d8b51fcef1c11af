"""What a K/V transport package provides, and how a worker gets its transport's ends.

A transport package (one per entry of `kvferry.settings.KV_TRANSPORTS`) exports two functions,
which import its heavy parts (Ray, NIXL) only when called:
- `make_sender(options: SenderOptions) -> KvSender`: the prefill worker's end.
- `add_receiver(server, sink: KvSink, faults: Faults) -> Callable[[], None] | None`: its end
  on a decode worker, registered on the worker's gRPC server (methods of
  `KvTransferService`, or nothing when the pages come another way, as Ray's do); it returns
  what closes it when the worker stops (None: nothing to close).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, cast

import grpc

from kvferry.faults import Faults
from kvferry.rpc import security
from kvferry.settings import KV_TRANSPORTS
from kvferry.transfer.grpc.chunk_codec import KV_TRANSFER_SERVICE
from kvferry.transfer.sender import KvSender
from kvferry.transfer.sink import KvSink

# Every decode worker serves the gRPC transport's PushKv besides its own transport's end: a
# deployment may mix senders, and `bench/bench_kv_transfer.py` pushes both ways to one worker.
BASELINE = "grpc"


@dataclass(frozen=True)
class SenderOptions:
    max_resends: int = 2  # resend a push corrupted in flight this many times
    credentials: security.Credentials = security.PLAINTEXT  # TLS for gRPC control calls
    faults: Faults = field(default_factory=Faults)  # for tests: kvferry/faults.py


class Transport(Protocol):
    def make_sender(self, options: SenderOptions) -> KvSender: ...

    def add_receiver(self, server: grpc.aio.Server, sink: KvSink, faults: Faults
                     ) -> Callable[[], None] | None: ...


def load(name: str) -> Transport:
    """The transport package `name` names in KV_TRANSPORTS."""
    return cast(Transport, importlib.import_module(KV_TRANSPORTS[name]))


def make_sender(name: str, options: SenderOptions) -> KvSender:
    return load(name).make_sender(options)


def add_receivers(server: grpc.aio.Server, sink: KvSink, name: str, faults: Faults
                  ) -> Callable[[], None]:
    """A decode worker's ends: the baseline's and `name`'s. A `KvTransferService` method
    neither serves is refused naming `kv_transport` (a prefill worker configured for
    another transport). Returns what closes them."""
    closers = [load(each).add_receiver(server, sink, faults)
               for each in dict.fromkeys((BASELINE, name))]
    server.add_generic_rpc_handlers((_Refusal(name),))

    def close() -> None:
        for closer in closers:
            if closer is not None:
                closer()

    return close


class _Refusal(grpc.GenericRpcHandler):
    """The `KvTransferService` methods no registered end serves (consulted last)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def service(self, handler_call_details: grpc.HandlerCallDetails
                ) -> grpc.RpcMethodHandler | None:
        service, _, method = handler_call_details.method.strip("/").rpartition("/")
        if service != KV_TRANSFER_SERVICE:
            return None
        message = (f"kv_transport: this worker runs --kv-transport {self.name}, which does not "
                   f"serve {method}")

        async def refuse(request_iterator: object, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

        return grpc.stream_unary_rpc_method_handler(refuse)
