"""Lease renewal: a decode reservation is freed by its worker when its lease runs out before
decoding starts, which is meant for requests their router abandoned (it died, or lost the
worker). A live request may wait longer than one lease (a long prefill queue, a slow push),
so the router restarts the leases of every reservation it still holds and that is not
decoding yet, every third of a lease, one RenewLeases call per decode worker."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from kvferry.errors import KvferryError
from router.request import RouterRequest

log = logging.getLogger("kvferry.router")


async def renew_once(requests: Iterable[RouterRequest], lease_s: float) -> None:
    """One round over `requests`."""
    waiting: dict[str, tuple[object, list[str]]] = {}
    for state in requests:
        worker = state.decode_worker
        if (state.holds_decode and not state.is_decoding and worker is not None
                and worker.decode_client is not None):
            waiting.setdefault(worker.address, (worker.decode_client, []))[1].append(
                state.request_id)

    async def renew(address: str, client: object, ids: list[str]) -> None:
        try:  # ids the worker no longer holds were released: nothing to do for them
            await client.renew_leases(ids, lease_s, timeout_s=lease_s / 3)
        except KvferryError as exc:  # the request's own calls will see it too
            log.warning("lease renewal on %s failed: %s", address, type(exc).__name__)

    await asyncio.gather(*(renew(address, client, ids)
                           for address, (client, ids) in waiting.items()))


async def renew_loop(requests: Callable[[], Iterable[RouterRequest]], lease_s: float) -> None:
    """Forever: renew_once every third of a lease."""
    while True:
        await asyncio.sleep(lease_s / 3)
        await renew_once(requests(), lease_s)
