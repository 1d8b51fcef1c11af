"""Worker discovery from DNS: a Kubernetes headless Service resolves to one address per
ready pod. Each name is re-resolved periodically and the router's workers follow."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

from router.workers.registry import WorkerSet

log = logging.getLogger("kvferry.router")

Resolver = Callable[[str, int], Awaitable[set[str]]]


def split_host_port(name: str) -> tuple[str, int]:
    host, _, port = name.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"dns name must be HOST:PORT, got {name!r}")
    return host, int(port)


async def resolve(host: str, port: int) -> set[str]:
    """Every IPv4/IPv6 address `host` resolves to, as HOST:PORT strings."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses = set()
    for family, _, _, _, sockaddr in infos:
        ip = sockaddr[0]
        addresses.add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return addresses


async def discover_once(workers: WorkerSet, names: dict[str, str],
                        resolver: Resolver = resolve) -> None:
    """names: role -> HOST:PORT. A name that does not resolve keeps the current workers."""
    for role, name in names.items():
        host, port = split_host_port(name)
        try:
            addresses = await resolver(host, port)
        except OSError as exc:
            log.warning("resolving %s workers at %s failed: %s", role, name, exc)
            continue
        await workers.sync_role(role, addresses)


async def discovery_loop(workers: WorkerSet, names: dict[str, str], interval_s: float) -> None:
    while True:
        await discover_once(workers, names)
        await asyncio.sleep(interval_s)
