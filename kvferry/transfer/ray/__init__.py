"""The Ray K/V transport (`--kv-transport ray`, deployments on Ray): each layer group goes
into Ray's object store and its ref to the decode worker's actor (`send.py`), which checks
it and copies it into the reservation (`receive.py`). The receiving end is the actor's own
methods, not a gRPC call: `deploy/ray_launcher.py`'s actor hands them to
`receive.RayKvReceiver` over the decode engine's sink.
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
    from kvferry.transfer.ray.send import RayKvSender

    return RayKvSender(max_resends=options.max_resends,
                       corrupt_pushes=options.faults.corrupt_pushes)


def add_receiver(server: grpc.aio.Server, sink: KvSink, faults: Faults
                 ) -> Callable[[], None] | None:
    return None  # pages arrive through the Ray actor's methods, not the gRPC server
