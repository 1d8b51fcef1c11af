"""A request aborted while it waits for decode headroom reserves nothing: a reservation
made after the abort would only take blocks that the running requests need to grow into.
The decode worker then swaps a running request out for nothing; a CI run once hung there
(the swapped request was never woken)."""

from __future__ import annotations

import asyncio

from kvferry.cache.layout import KvLayout
from router.downstream import Downstream
from router.policies.routing import HeadroomPolicy
from router.request import RouterRequest
from router.workers.registry import WorkerSet
from router.workers.worker import Worker
from tests.waiting import until, within

LAYOUT = KvLayout(2, 2, 64, 16, "bfloat16", "fp")


class _DecodeClient:
    def __init__(self) -> None:
        self.reserved: list[str] = []

    async def reserve(self, request_id: str, prompt_token_ids: list[int], max_tokens: int,
                      lease_s: float, timeout_s: float | None, cache_salt: str = "",
                      num_samples: int = 1, shares_cache: bool = True) -> int:
        self.reserved.append(request_id)
        return 0


class _MovedClock:
    """Admission's clock: it moves only when the fake stats refresh says time passed."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


STEP_S = 0.25  # virtual seconds between two of admission's headroom checks


def _full_worker() -> tuple[Downstream, Worker, _DecodeClient, list[float]]:
    """One decode worker whose 12 blocks are all promised to a running request; and when
    (on admission's clock) each headroom re-check refreshed the stats."""
    client = _DecodeClient()
    worker = Worker("d1", "decode", channel=None, layout=LAYOUT, is_healthy=True,
                    total_blocks=12, projected_blocks=12, decode_client=client)  # type: ignore[arg-type]
    workers = WorkerSet("fp")
    workers.workers.append(worker)
    clock = _MovedClock()
    refreshed_at: list[float] = []

    async def unchanged() -> None:  # the worker stays full while the request waits
        clock.now += STEP_S
        refreshed_at.append(clock.now)

    workers.refresh_shared = unchanged  # type: ignore[method-assign]
    downstream = Downstream(workers, HeadroomPolicy(), lease_s=30.0, admission_timeout_s=60.0)
    downstream.clock = clock
    return downstream, worker, client, refreshed_at


def test_a_request_aborted_while_waiting_for_headroom_reserves_nothing() -> None:
    downstream, worker, client, refreshed_at = _full_worker()
    state = RouterRequest("waits")

    async def run() -> float:
        waiting = asyncio.ensure_future(downstream.reserve(state, list(range(70)), 20, None))
        await until(lambda: len(refreshed_at) >= 3, "three headroom checks")
        assert not waiting.done()  # no headroom: it waits
        state.is_aborted = True
        return await within(waiting, "the aborted request's reserve")

    waited = asyncio.run(run())
    assert waited == refreshed_at[-1]  # until the check that saw the abort
    assert client.reserved == []
    assert not state.holds_decode and state.decode_worker is None
    assert worker.in_flight == {}


def test_a_request_that_gets_headroom_reserves() -> None:
    downstream, worker, client, refreshed_at = _full_worker()
    worker.projected_blocks = 0
    state = RouterRequest("fits")
    waited = asyncio.run(downstream.reserve(state, list(range(70)), 20, None))
    assert waited == 0.0 and refreshed_at == []  # it never waited
    assert client.reserved == ["fits"]
    assert state.holds_decode and state.decode_worker is worker
