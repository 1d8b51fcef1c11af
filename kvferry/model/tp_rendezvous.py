"""Where a tensor-parallel worker's ranks meet, and the interface they talk on: nothing
another host can reach (docs/security.md, "Ports"; docs/tensor-parallel.md).

- The rendezvous is a `file://` store in a private directory (mode 0700, from
  `tempfile.mkdtemp`), fresh for each group, removed once every rank has joined (gloo needs
  it no more) or, on CUDA, when the group closes: no TCPStore, whose server would listen on
  every interface whatever address `tcp://` names.
- The ranks are processes of one host (rank 0 starts the others), so gloo and NCCL are
  pinned to the loopback interface (`GLOO_SOCKET_IFNAME`, `NCCL_SOCKET_IFNAME`): otherwise
  gloo listens on whatever the hostname resolves to (a pod's IP) and NCCL on its first
  non-loopback interface.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import struct
import sys
import tempfile
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address
_LOOPBACK = "127.0.0.1"


def _ipv4_of(name: str) -> str | None:
    """The IPv4 address of interface `name` (None where it has none or this is not Linux)."""
    request = struct.pack("256s", name.encode()[:15])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
        except OSError:
            return None
    return socket.inet_ntoa(reply[20:24])


def loopback_interface() -> str:
    """The name of the interface holding 127.0.0.1 ("lo" on Linux); where none is found,
    the platform's usual name for it."""
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == _LOOPBACK:
            return name
    return "lo0" if sys.platform == "darwin" else "lo"


def pin_to_loopback() -> str:
    """gloo's and NCCL's sockets on the loopback interface, for this process and the ranks it
    starts afterwards (they inherit the environment). Returns the interface's name."""
    name = loopback_interface()
    os.environ["GLOO_SOCKET_IFNAME"] = name
    os.environ["NCCL_SOCKET_IFNAME"] = name
    return name


@dataclass(frozen=True)
class Rendezvous:
    """A group's meeting point: a file in a directory only this user can enter."""

    directory: str

    @classmethod
    def fresh(cls) -> Rendezvous:
        return cls(tempfile.mkdtemp(prefix="kvferry-tp-"))  # mode 0700

    @property
    def init_method(self) -> str:
        return f"file://{os.path.join(self.directory, 'store')}"

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def join(rank: int, size: int, rendezvous: Rendezvous, device: torch.device,
         timeout_s: float) -> dist.ProcessGroup | None:
    """Join the group: gloo on CPU; NCCL on CUDA, this rank's device made current first.
    Returns the group that carries calls' headers (host memory): None, the default group,
    on CPU; on CUDA a gloo group beside NCCL's."""
    pin_to_loopback()
    backend = "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "nccl"
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=rendezvous.init_method, rank=rank,
                            world_size=size, timeout=timeout)
    if backend == "gloo":
        return None
    return dist.new_group(backend="gloo", timeout=timeout)
