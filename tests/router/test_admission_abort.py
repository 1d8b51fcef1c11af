"""A request aborted while it waits for decode headroom reserves nothing: a reservation
made after the abort would only take blocks that the running requests need to grow into.
The decode worker then swaps a running request out for nothing; a CI run once hung there
(the swapped request was never woken)."""

from __future__ import annotations

import asyncio

from kvferry.cache.layout import KvLayout
from router.downstream import Downstream
from router.policy import HeadroomPolicy
from router.request import RouterRequest
from router.workers import Worker, WorkerSet

LAYOUT = KvLayout(2, 2, 64, 16, "bfloat16", "fp")


class _DecodeClient:
    def __init__(self) -> None:
        self.reserved: list[str] = []

    async def reserve(self, request_id: str, prompt_token_ids: list[int], max_tokens: int,
                      lease_s: float, timeout_s: float | None, cache_salt: str = "") -> int:
        self.reserved.append(request_id)
        return 0


def _full_worker() -> tuple[Downstream, Worker, _DecodeClient]:
    """One decode worker whose 12 blocks are all promised to a running request."""
    client = _DecodeClient()
    worker = Worker("d1", "decode", channel=None, layout=LAYOUT, is_healthy=True,
                    total_blocks=12, projected_blocks=12, decode_client=client)  # type: ignore[arg-type]
    workers = WorkerSet("fp")
    workers.workers.append(worker)

    async def unchanged() -> None:  # the worker stays full while the request waits
        return None

    workers.refresh_shared = unchanged  # type: ignore[method-assign]
    downstream = Downstream(workers, HeadroomPolicy(), lease_s=30.0, local_prefill_threshold=0,
                            admission_timeout_s=60.0)
    return downstream, worker, client


def test_a_request_aborted_while_waiting_for_headroom_reserves_nothing() -> None:
    downstream, worker, client = _full_worker()
    state = RouterRequest("waits")

    async def run() -> float:
        waiting = asyncio.ensure_future(downstream.reserve(state, list(range(70)), 20, None))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # no headroom: it waits
        state.is_aborted = True
        return await asyncio.wait_for(waiting, 5)

    waited = asyncio.run(run())
    assert waited >= 0.2
    assert client.reserved == []
    assert not state.holds_decode and state.decode_worker is None
    assert worker.in_flight == {}


def test_a_request_that_gets_headroom_reserves() -> None:
    downstream, worker, client = _full_worker()
    worker.projected_blocks = 0
    state = RouterRequest("fits")
    waited = asyncio.run(downstream.reserve(state, list(range(70)), 20, None))
    assert waited < 1.0
    assert client.reserved == ["fits"]
    assert state.holds_decode and state.decode_worker is worker
