"""Reservation leases on a decode worker: a reservation nobody works on any more is freed.

Reserve sets a lease; the router renews it (RenewLeases) while the request lives, and every
K/V chunk renews it too. A reservation still waiting for its K/V or its Decode call when its
lease runs out is finished with an error, so a router or prefill worker that vanished never
strands blocks."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from decode_worker.sequence import DecodeEvent, DecodeSeq, ErrorEvent, Phase
from kvferry.errors import Aborted, InvalidArgument

log = logging.getLogger("kvferry.decode")

CHECK_INTERVAL_S = 0.25


class LeaseKeeper:
    """Renews and expires the leases of `seqs` (the engine's, read-only here); expiry goes
    through the engine's `finish`, which releases the blocks."""

    def __init__(self, seqs: Mapping[str, DecodeSeq],
                 finish: Callable[[DecodeSeq, DecodeEvent], None]) -> None:
        self._seqs = seqs
        self._finish = finish

    def renew(self, request_ids: list[str], lease_s: float) -> list[str]:
        """Restart the leases of these reservations; returns the ids not held here."""
        if lease_s <= 0:
            raise InvalidArgument("lease_s must be > 0", "lease_s")
        for seq in filter(None, map(self._seqs.get, request_ids)):
            seq.renew_lease(lease_s)
        return [r for r in request_ids if r not in self._seqs]

    async def run(self) -> None:
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            now = time.monotonic()
            for seq in list(self._seqs.values()):
                if seq.phase is Phase.RESERVED and not seq.is_aborted and (
                        now > seq.lease_deadline):
                    log.warning("request %s: lease expired before decoding began (nothing "
                                "renewed it for %.1f s)", seq.request_id, seq.lease_s,
                                extra={"request_id": seq.request_id})
                    self._finish(seq, ErrorEvent(seq.request_id,
                                                 Aborted("lease expired before K/V arrived")))
