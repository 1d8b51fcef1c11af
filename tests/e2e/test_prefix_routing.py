"""Routing on the prefix cache: after one request leaves a long
prefix in a decode worker's cache, requests sharing that prefix all go to that worker (its
`kvferry_prefix_cache_hits_total` grows by the prefix each time, the other worker's not at
all), even while a long request there makes the other worker the emptier one (headroom alone
would send them there), and, with conditional disaggregation, each prefills there without a
K/V transfer: only its short uncached suffix is left to compute."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from deploy import client
from deploy.launcher import Deployment
from kvferry.faults import tag
from kvferry.settings import DEFAULT_BLOCK_SIZE
from kvferry.v1 import generation_pb2
from tests.conftest import METRICS, assert_pools_clean
from tests.deployments import routed
from tests.e2e.test_metrics import scrape, value
from tests.waiting import until_sync

pytestmark = pytest.mark.slow

PREFIX = list(range(200, 200 + 8 * DEFAULT_BLOCK_SIZE))  # 8 full blocks
THRESHOLD = 32  # prompts with fewer uncached tokens prefill on the decode worker
HITS = "kvferry_prefix_cache_hits_total"
QUERIES = "kvferry_prefix_cache_queries_total"
CACHED = "kvferry_prefix_cache_blocks"
SALT = "test_prefix_routing"
POLL_S = 0.05  # a scrape of every worker, or of the router, per poll


@pytest.fixture(scope="module")
def prefix_deployment(qwen3_2p2d_deployment: Deployment) -> Iterator[Deployment]:
    # Prefix weight 8: the 8 cached blocks (64) outweigh the long request's 34 blocks there
    # plus the few a finished request's stats may still show (9).
    with routed(qwen3_2p2d_deployment, "router-prefix", [
            "--policy", "prefix", "--prefix-weight", "8",
            "--local-prefill-threshold", str(THRESHOLD), *METRICS]) as deployment:
        yield deployment


def _request(suffix: list[int], max_tokens: int = 4, request_id: str = ""
             ) -> generation_pb2.GenerateRequest:
    request = client.make_request(PREFIX + suffix, request_id, temperature=0.0,
                                  max_tokens=max_tokens, ignore_eos=True)
    request.cache_salt = SALT  # what other tests left in the shared workers' caches never hits
    return request


def _decode_metrics(deployment: Deployment) -> dict[str, tuple[float, float, float]]:
    """Each decode worker's (prefix-cache hits, cached blocks, prefix-cache queries)."""
    samples = {p.name: scrape(p.metrics_port) for p in deployment.processes
               if p.name.startswith("decode")}
    return {name: (value(s, HITS), value(s, CACHED), value(s, QUERIES))
            for name, s in samples.items()}


def _router_view(deployment: Deployment, holder: str, *names: str) -> list[float]:
    """What the router believes about decode worker `holder`, from one scrape: its
    `kvferry_router_worker_<name>` samples."""
    address = next(p.address for p in deployment.processes if p.name == holder)
    samples = scrape(deployment.processes[-1].metrics_port)
    return [value(samples, f"kvferry_router_worker_{name}", worker=address, role="decode")
            for name in names]


async def _follow_ups(deployment: Deployment, holder: str, before: float
                      ) -> tuple[list[client.Completion], client.Completion]:
    """A long request sharing the prefix (it goes to the holder and keeps it the fuller
    worker), then, while it decodes, four short ones, one after another."""
    address = deployment.router_address
    # Its steps paced (10 ms each: 4 s in all), so that it still runs when the router's
    # second stats snapshot and the four short requests come, however fast the machine.
    long = asyncio.ensure_future(client.generate(
        address, _request([9, 9, 9], 400, "long" + tag(decode_step_delay_s=0.01)), 120))
    deadline = time.monotonic() + 30
    while (await asyncio.to_thread(_decode_metrics, deployment))[holder][0] == before:
        assert time.monotonic() < deadline and not long.done(), "the long request went astray"
        await asyncio.sleep(0.05)  # paces the polling
    # The router sees it running there: a stats snapshot asked for after it started (the
    # second applied from here; the first may have been on its way) counts it.
    refreshes, = _router_view(deployment, holder, "stats_refreshes_total")

    def seen_running() -> bool:
        now, running = _router_view(deployment, holder, "stats_refreshes_total", "num_running")
        return now >= refreshes + 2 and running >= 1

    await asyncio.to_thread(until_sync, seen_running, "the router saw the long request running",
                            poll_s=POLL_S)
    short = [await client.generate(address, _request([300 + i, 301 + i, 302 + i]), 60)
             for i in range(4)]
    return short, await long


def test_requests_sharing_a_prefix_go_where_it_is_cached(prefix_deployment: Deployment
                                                         ) -> None:
    deployment = prefix_deployment
    start = _decode_metrics(deployment)
    first = asyncio.run(client.generate(deployment.router_address, _request([5, 6, 7]), 60))
    assert first.finished.timing.kv_transfer_s > 0  # nothing cached yet: pushed
    deadline = time.monotonic() + 30
    while True:
        before = _decode_metrics(deployment)
        grown = [name for name, now in before.items() if now[1] > start[name][1]]
        if grown:
            break
        assert time.monotonic() < deadline, "no decode worker cached the prefix"
        time.sleep(0.1)  # paces the polling
    holder = grown[0]
    # The router's mirror of the holder's cache catches up with it, the prefix among it: it
    # counts every block indexed there, at least the blocks only the cache holds.
    until_sync(lambda: _router_view(deployment, holder, "cached_blocks")[0] >= before[holder][1],
               "the router's mirror showed the holder's cache", poll_s=POLL_S)
    short, long = asyncio.run(_follow_ups(deployment, holder, before[holder][0]))
    after = _decode_metrics(deployment)
    hits = {name: after[name][0] - before[name][0] for name in after}
    assert hits[holder] >= 5 * len(PREFIX), hits
    assert all(hits[name] == 0 for name in hits if name != holder), hits
    # Every follow-up's prompt was looked up there (131 tokens each), and only there.
    queries = {name: after[name][2] - before[name][2] for name in after}
    assert queries[holder] >= 5 * (len(PREFIX) + 3), queries
    assert all(queries[name] == 0 for name in queries if name != holder), queries
    # The decode worker held all but 3 tokens: prefilled there, nothing shipped.
    assert all(c.finished.timing.kv_transfer_s == 0.0 for c in [*short, long])
    assert [len(c.token_ids) for c in [*short, long]] == [4, 4, 4, 4, 400]
    assert_pools_clean(deployment)
