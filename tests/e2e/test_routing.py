"""Router behaviour across workers: conditional disaggregation takes the local
path below the threshold and the remote path above it; a prefill worker that dies before
the first token is retried on another, transparently, as the router's
`kvferry_prefill_retries_total` shows."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import pytest

from deploy import client
from deploy.launcher import Deployment, Process
from kvferry.rpc import grpc_util
from kvferry.v1 import generation_pb2, generation_pb2_grpc
from tests.conftest import METRICS, assert_pools_clean
from tests.deployments import respawn, routed
from tests.e2e.test_metrics import scrape, value

pytestmark = pytest.mark.slow

THRESHOLD = 32
RETRIES = "kvferry_prefill_retries_total"
OPEN_ON = "kvferry_router_worker_num_in_flight"


@pytest.fixture(scope="module")
def two_prefill_deployment(qwen3_2p2d_deployment: Deployment) -> Iterator[Deployment]:
    """The shared two-prefill deployment behind a router with a local-prefill threshold."""
    with routed(qwen3_2p2d_deployment, "router-routing",
                ["--local-prefill-threshold", str(THRESHOLD), *METRICS]) as deployment:
        yield deployment


def _request(prompt: list[int]) -> generation_pb2.GenerateRequest:
    return client.make_request(prompt, temperature=0.0, max_tokens=12, ignore_eos=True)


def _generate(address: str, prompts: list[list[int]]) -> list[client.Completion]:
    return asyncio.run(client.generate_many(address, [_request(p) for p in prompts], 120))


def test_conditional_disaggregation_paths(two_prefill_deployment: Deployment,
                                          qwen3_deployment: Deployment) -> None:
    short, long = list(range(40, 40 + THRESHOLD - 1)), list(range(40, 40 + THRESHOLD + 20))
    got = _generate(two_prefill_deployment.router_address, [short, long])
    expected = _generate(qwen3_deployment.router_address, [short, long])
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    local, remote = got
    assert local.finished.timing.kv_transfer_s == 0.0  # prefilled on the decode worker
    assert remote.finished.timing.kv_transfer_s > 0.0  # shipped from a prefill worker
    assert_pools_clean(two_prefill_deployment)


def _open_on(router_port: int, worker: Process) -> float:
    """Requests the router has open on prefill `worker` now (its prompts not yet prefilled)."""
    return value(scrape(router_port), OPEN_ON, worker=worker.address, role="prefill")


async def _stream_then_kill(address: str, router_port: int, prompts: list[list[int]],
                            victim: Process) -> tuple[list[client.Completion], int]:
    """Stream every prompt at once (the victim is stopped, so the ones sent to it wait there
    for their first token); once the others' first tokens are out, kill -9 the victim.
    Returns the completions and how many streams had no token yet at the kill."""
    async with grpc_util.channel(address) as chan:
        stub = generation_pb2_grpc.GenerationServiceStub(chan)
        progress = [client.Completion() for _ in prompts]
        any_token = asyncio.Event()

        async def one(i: int, prompt: list[int]) -> client.Completion:
            async for _, latest in client.stream(stub, _request(prompt), timeout_s=120):
                progress[i] = latest
                any_token.set()
            return progress[i]

        streams = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(prompts)]
        await asyncio.wait_for(any_token.wait(), 60)  # the live worker serves its share
        # The others' first tokens are out: every stream still without one is a prompt the
        # router has open on the stopped victim.
        deadline = time.monotonic() + 60
        while (num_waiting := sum(not c.token_ids for c in progress)) != (
                await asyncio.to_thread(_open_on, router_port, victim)):
            assert time.monotonic() < deadline, "streams neither served nor on the victim"
            await asyncio.sleep(0.05)  # paces the polling
        os.kill(victim.popen.pid, signal.SIGKILL)
        return list(await asyncio.gather(*streams)), num_waiting


def test_dead_prefill_worker_is_retried_transparently(two_prefill_deployment: Deployment,
                                                      qwen3_2p2d_deployment: Deployment,
                                                      qwen3_deployment: Deployment) -> None:
    """prefill-0 is stopped with requests on their way to it, then killed before their first
    token: the router sends each of them to prefill-1 (its retry counter moves by as many),
    and every client gets its exact stream."""
    deployment = two_prefill_deployment
    prompts = [list(range(100 + i, 100 + i + 60)) for i in range(6)]  # all above threshold
    expected = _generate(qwen3_deployment.router_address, prompts)
    victim = next(p for p in deployment.processes if p.name == "prefill-0")
    router = deployment.processes[-1]
    router_port = router.metrics_port
    before = value(scrape(router_port), RETRIES)
    os.kill(victim.popen.pid, signal.SIGSTOP)  # healthy to the router for ~2 s more
    try:
        got, num_waiting = asyncio.run(_stream_then_kill(deployment.router_address, router_port,
                                                         prompts, victim))
    finally:
        if victim.popen.poll() is None:
            os.kill(victim.popen.pid, signal.SIGKILL)
        victim.popen.wait(10)
    respawn("prefill-0", qwen3_2p2d_deployment, deployment)  # for the tests that follow
    retries = value(scrape(router_port), RETRIES) - before
    assert num_waiting >= 1, "no request reached the stopped prefill worker"
    assert 1 <= retries <= num_waiting
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert all(c.finished.reason == generation_pb2.FINISH_REASON_LENGTH for c in got)
    assert all(c.finished.timing.kv_transfer_s > 0 for c in got)
    assert "retrying" in (deployment.log_dir / f"{router.name}.log").read_text()
    assert_pools_clean(deployment)
