"""Which TCP ports processes listen on, read from /proc (IPv4 and IPv6), and a stranger who
connects to one with no credentials: garbage bytes, then a torch.distributed TCPStore
client's handshake (docs/security.md, "Ports")."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

LISTEN = "0A"  # the TCP state column of /proc/net/tcp*


class Listener(NamedTuple):
    pid: int
    address: str  # "127.0.0.1", "::", ...
    port: int

    @property
    def is_wildcard(self) -> bool:
        return ipaddress.ip_address(self.address).is_unspecified


def _address(hex_address: str) -> str:
    """/proc/net/tcp's address column: 32-bit words in host byte order (little endian)."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def _listening_inodes() -> dict[int, tuple[str, int]]:
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != LISTEN:
                continue
            address, port = fields[1].split(":")
            found[int(fields[9])] = (_address(address), int(port, 16))
    return found


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed since the listing
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:["):-1]))
    return inodes


def listeners(pids: list[int]) -> list[Listener]:
    """Every listening TCP socket (IPv4 and IPv6) the processes `pids` hold."""
    table = _listening_inodes()
    return [Listener(pid, *table[inode]) for pid in pids
            for inode in sorted(_socket_inodes(pid)) if inode in table]


def children(pid: int) -> list[int]:
    """A process's child processes (its tensor-parallel ranks, for a worker)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(child) for child in path.read_text().split()]


GARBAGE = (b"\xff" * 3, b"GET / HTTP/1.1\r\n\r\n", os.urandom(4096), b"\x00" * 8,
           (1).to_bytes(8, "little") + os.urandom(64))

# A TCPStore client's handshake blocks past its timeout on a port that is no store: each runs
# on a thread of a process of its own, which exits once the timeout has passed.
_STORE_CLIENTS = """
import os, sys, threading
from datetime import timedelta
import torch.distributed as dist

def join(host, port):
    try:
        store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=1))
        store.set("rank", b"evil")
        print("joined", port, flush=True)
    except Exception:
        pass

for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    threading.Thread(target=join, args=(host, int(port)), daemon=True).start()
threading.Event().wait(3)
os._exit(0)
"""


def _host(listener: Listener) -> str:
    """Where to reach it: its own address, or loopback for a wildcard."""
    if listener.is_wildcard:
        return "::1" if ":" in listener.address else "127.0.0.1"
    return listener.address


def strangers(found: list[Listener], timeout_s: float = 1.0) -> list[int]:
    """Connect to each listener as someone without credentials: each garbage payload on a
    connection of its own, then a TCPStore client's handshake. The ports where a store
    let the stranger in (none, where no process runs a TCPStore)."""
    for listener in found:
        for payload in GARBAGE:
            try:
                with socket.create_connection((_host(listener), listener.port),
                                              timeout=timeout_s) as conn:
                    conn.sendall(payload)
            except OSError:
                continue  # refused or reset: nothing reached the process
    targets = [f"{_host(listener)}:{listener.port}" for listener in found]
    done = subprocess.run([sys.executable, "-c", _STORE_CLIENTS, *targets], check=True,
                          capture_output=True, text=True, timeout=120)
    return [int(line.split()[1]) for line in done.stdout.splitlines()
            if line.startswith("joined")]
