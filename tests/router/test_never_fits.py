"""A request no decode worker's whole pool could hold is a bad request (INVALID_ARGUMENT, HTTP
400 naming `max_tokens` or the prompt), not RESOURCE_EXHAUSTED (429), which OpenAI clients
retry forever; one that fits the largest pool goes on. No processes: the
workers are the router's view of them."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvferry.cache.layout import KvLayout
from kvferry.errors import InvalidArgument
from kvferry.settings import SecuritySettings
from router.downstream import Downstream
from router.engine import Router
from router.http.front import HttpFront
from router.policies.routing import HeadroomPolicy
from router.workers.registry import WorkerSet
from router.workers.worker import Worker
from tests.router.test_bad_text_and_numbers import CONFIG, FakeTokenizer

LAYOUT = KvLayout(2, 2, 32, 16, "float32", "fp")


def _workers(*total_blocks: int, roles: tuple[str, ...] = ("decode",)) -> WorkerSet:
    workers = WorkerSet("fp")
    for i, blocks in enumerate(total_blocks):
        workers.workers.append(Worker(f"d{i}", roles[i % len(roles)], channel=None,
                                      layout=LAYOUT, total_blocks=blocks, is_healthy=True))
    return workers


def _downstream(workers: WorkerSet) -> Downstream:
    return Downstream(workers, HeadroomPolicy(), 30.0, 30.0)


def test_the_largest_pool_decides() -> None:
    downstream = _downstream(_workers(8, 64))  # 128 and 1024 tokens
    downstream.check_fits(1000, 24)  # exactly the largest pool: fits
    with pytest.raises(InvalidArgument) as exc:
        downstream.check_fits(1000, 25)
    assert exc.value.field == "sampling.max_tokens" and "1024 tokens" in str(exc.value)
    assert "at most 24" in str(exc.value)
    with pytest.raises(InvalidArgument) as exc:
        downstream.check_fits(1024, 1)  # the prompt and its first decode slot
    assert exc.value.field == "input"


def test_a_refusal_is_confirmed_on_fresh_stats() -> None:
    """A decode worker restarted at its address with a larger pool: the router's last
    snapshot says 128 tokens, the worker now holds 1024. The request is checked again on
    fresh stats before it is refused, and goes on; one that fits no fresh pool still fails."""
    workers = _workers(8)
    downstream = _downstream(workers)
    refreshed = []

    async def refresh_shared() -> None:  # the worker's GetStats, as the restarted worker answers
        refreshed.append(True)
        workers.workers[0].total_blocks = 64

    workers.refresh_shared = refresh_shared  # type: ignore[method-assign]
    asyncio.run(downstream.check_fits_fresh(1000, 24))
    assert refreshed == [True]
    asyncio.run(downstream.check_fits_fresh(100, 24))  # fits the snapshot: no stats call
    assert refreshed == [True]
    with pytest.raises(InvalidArgument) as exc:
        asyncio.run(downstream.check_fits_fresh(1000, 25))
    assert exc.value.field == "sampling.max_tokens" and len(refreshed) == 2


def test_unhealthy_and_prefill_workers_do_not_count_and_unknown_pools_refuse_nothing() -> None:
    workers = _workers(8, 64, roles=("decode", "prefill"))
    with pytest.raises(InvalidArgument):
        _downstream(workers).check_fits(100, 100)  # the 1024-token pool is a prefill's
    workers.workers[0].is_healthy = False
    _downstream(workers).check_fits(100, 100)  # no decode pool known: left to reserve
    _downstream(_workers(8, roles=("colocated",))).check_fits(100, 28)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": [1] * 1000, "max_tokens": 100}, "max_tokens"),
    ("/v1/completions", {"prompt": [1] * 1100, "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 2000}, "max_completion_tokens"),
])
def test_http_never_fits_is_400_naming_the_parameter(path: str, body: dict, param: str) -> None:
    async def main() -> httpx.Response:
        router = Router(CONFIG, FakeTokenizer(), _workers(64))
        front = HttpFront(router, "/models/tiny", "127.0.0.1", 0, SecuritySettings(), False,
                          None, 1.0)
        await front.start()
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{front.port}") as client:
                return await client.post(path, content=json.dumps(body),
                                         headers={"content-type": "application/json"})
        finally:
            await front.stop()

    response = asyncio.run(main())
    error = response.json()["error"]
    assert response.status_code == 400, error
    assert error["param"] == param and error["code"] == "invalid_argument", error
    assert "K/V pool" in error["message"]
