"""Prefill load accounting: a prompt counts as pending work on its prefill worker
until that prefill ends (the K/V pushed, or the prefill failed), not until the request ends,
so a worker whose requests are all decoding elsewhere looks idle to the prefill policy."""

from __future__ import annotations

import asyncio
from typing import NamedTuple

import grpc

from kvferry.model.sampling import SamplingParams
from kvferry.rpc.grpc_util import from_rpc
from router.downstream import Downstream
from router.policies.routing import HeadroomPolicy, LocalPrefill
from router.prefill_leg import PrefillLeg
from router.records import FirstToken, PrefillDone, PrefillStart
from router.request import RouterRequest
from router.workers.registry import WorkerSet
from router.workers.worker import Worker


class _Call:
    """A Prefill stream that sends a FirstToken then a PrefillDone, or fails on its first read."""

    def __init__(self, error: grpc.StatusCode | None) -> None:
        self._error = error
        self._msgs: list[FirstToken | PrefillDone] = [FirstToken(7, 0.01), PrefillDone(0.02, 64)]

    async def read(self) -> FirstToken | PrefillDone | None:
        if self._error is not None:
            raise from_rpc(grpc.aio.AioRpcError(self._error, grpc.aio.Metadata(),  # as adapted
                                                grpc.aio.Metadata(), "worker gone"))
        return self._msgs.pop(0) if self._msgs else None

    def cancel(self) -> bool:
        return True

    def done(self) -> bool:
        return not self._msgs


class _PrefillClient:
    def __init__(self, error: grpc.StatusCode | None = None) -> None:
        self.error = error
        self.request_ids: list[str] = []

    def prefill(self, start: PrefillStart, timeout_s: float | None) -> _Call:
        self.request_ids.append(start.request_id)
        return _Call(self.error)


class _Legs(NamedTuple):
    """The router's two sides of a request, as `router.engine.Router` composes them."""

    downstream: Downstream
    prefill: PrefillLeg


def _setup(pending: dict[str, int], failing: str = "") -> tuple[_Legs, dict[str, Worker]]:
    """Prefill workers named by `pending` (their stats' pending prompt tokens), and d1."""
    workers = WorkerSet("fp")
    for address, tokens in pending.items():
        error = grpc.StatusCode.UNAVAILABLE if address == failing else None
        worker = Worker(address, "prefill", channel=None, is_healthy=True,
                        pending_prefill_tokens=tokens, prefill_client=_PrefillClient(error))
        workers.workers.append(worker)
    workers.workers.append(Worker("d1", "decode", channel=None, is_healthy=True))
    legs = _Legs(Downstream(workers, HeadroomPolicy(), lease_s=30.0, admission_timeout_s=1.0),
                 PrefillLeg(workers, HeadroomPolicy(), LocalPrefill()))
    return legs, {w.address: w for w in workers.workers}


def _reserved(request_id: str, by_name: dict[str, Worker]) -> RouterRequest:
    """A request with a decode reservation on d1, as `Downstream.reserve` leaves it."""
    state = RouterRequest(request_id)
    state.decode_worker = by_name["d1"]
    by_name["d1"].add_in_flight(request_id, 4, 0)
    return state


async def _prefill(legs: _Legs, state: RouterRequest, num_prompt: int) -> None:
    prompt, params = list(range(num_prompt)), SamplingParams()
    assert await legs.prefill.first_token(state, prompt, params, None, 0) is not None
    assert await legs.prefill.prefill_done(state, prompt, params, None, 0) is not None


def test_the_prompt_leaves_the_prefill_worker_when_its_kv_is_pushed() -> None:
    legs, by_name = _setup({"p1": 0})
    p1 = by_name["p1"]
    state = _reserved("a", by_name)

    async def run() -> None:
        prompt, params = list(range(800)), SamplingParams()
        await legs.prefill.first_token(state, prompt, params, None, 0)
        assert (p1.pending_tokens, p1.num_in_flight) == (800, 1)  # still pushing its K/V
        await legs.prefill.prefill_done(state, prompt, params, None, 0)
        assert (p1.pending_tokens, p1.num_in_flight) == (0, 0)  # decoding on d1 now
        await legs.downstream.release(state)

    asyncio.run(run())
    assert (p1.pending_tokens, p1.num_in_flight) == (0, 0)  # counted off once, not twice
    assert by_name["d1"].num_in_flight == 0


def test_a_worker_whose_requests_all_decode_elsewhere_gets_the_next_prefill() -> None:
    legs, by_name = _setup({"p1": 0, "p2": 100})

    async def run() -> None:
        await _prefill(legs, _reserved("long", by_name), 800)  # on p1: 0 < 100
        await _prefill(legs, _reserved("next", by_name), 50)  # "long" is decoding

    asyncio.run(run())
    assert by_name["p1"].prefill_client.request_ids == ["long", "next"]  # type: ignore[union-attr]
    assert by_name["p2"].prefill_client.request_ids == []  # type: ignore[union-attr]


def test_a_failed_prefill_leaves_no_count_on_either_worker() -> None:
    legs, by_name = _setup({"p1": 0, "p2": 100}, failing="p1")
    state = _reserved("a", by_name)

    async def run() -> None:
        await _prefill(legs, state, 300)  # p1 is unavailable: retried on p2
        await legs.downstream.release(state)

    asyncio.run(run())
    assert state.failed_prefill == {"p1"}
    for name in ("p1", "p2"):
        assert (by_name[name].pending_tokens - by_name[name].pending_prefill_tokens,
                by_name[name].num_in_flight) == (0, 0)
