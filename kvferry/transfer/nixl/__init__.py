"""The NIXL K/V transport (`--kv-transport nixl`): the prefill worker registers its pool with
a NIXL agent and announces each layer group on a `KvTransferService.PullKv` stream
(`send.py`); the decode worker READs the group straight into the reservation's blocks and
checks it there (`receive.py`). `agent.py` holds an agent's life (UCX's environment, the
ordered close), `pages.py` where pages lie in a pool and the in-place checks.
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
    from kvferry.transfer.nixl.send import NixlKvSender

    return NixlKvSender.from_options(options)


def add_receiver(server: grpc.aio.Server, sink: KvSink, faults: Faults
                 ) -> Callable[[], None] | None:
    import grpc

    from kvferry.transfer.grpc.chunk_codec import KV_TRANSFER_SERVICE
    from kvferry.transfer.nixl.receive import NixlPuller, handler

    puller = NixlPuller(sink, read_delay_s=faults.nixl_read_delay_s)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        KV_TRANSFER_SERVICE, {"PullKv": handler(puller)}),))
    return puller.close
