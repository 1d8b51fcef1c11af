"""Headroom admission without TTFT stalls (issue 5): when no decode worker has room for a
request at its longest, the router still prefills it at once and streams its first token;
the K/V waits in the prefill worker's pool and is shipped once a reservation is made. The
tokens stay exact, and an abort while it waits leaves nothing held anywhere."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvferry import client, grpc_util
from kvferry.launcher import Deployment
from kvferry.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.conftest import assert_pools_clean
from tests.e2e.test_memory_pressure import BLOCK_BYTES

pytestmark = pytest.mark.slow

BIG = client.make_request(list(range(20, 60)), temperature=0.0, max_tokens=140,
                          ignore_eos=True)  # 180 tokens: all 12 blocks of the decode pool
SMALL = client.make_request(list(range(70, 120)), temperature=0.0, max_tokens=20,
                            ignore_eos=True)


@pytest.fixture(scope="module")
def full_pool_deployment(qwen3_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
                         ) -> Iterator[Deployment]:
    deployment = Deployment(model=str(qwen3_checkpoint), kv_pool_size=f"{12 * BLOCK_BYTES}B",
                            num_prefill=2,
                            role_args={"prefill": ["--kv-pool-size", "64MiB"]},
                            log_dir=tmp_path_factory.mktemp("admission-logs")).start()
    yield deployment
    deployment.stop()


async def _big_then_small(address: str, on_small_first_token=None
                          ) -> tuple[client.Completion, client.Completion, float]:
    """BIG fills the decode pool; SMALL arrives once BIG streams. Returns both completions and
    how long BIG ran after SMALL was sent. `on_small_first_token` runs (in a thread) when
    SMALL's first token is in, while its K/V waits on a prefill worker."""
    async with grpc_util.channel(address) as chan:
        stub = generation_pb2_grpc.GenerationServiceStub(chan)
        big_streaming = asyncio.Event()
        big_done = [0.0]

        async def big() -> client.Completion:
            completion = client.Completion()
            async for _, latest in client.stream(stub, BIG, timeout_s=120):
                completion = latest
                big_streaming.set()
            big_done[0] = time.perf_counter()
            return completion

        async def small() -> tuple[client.Completion, float]:
            await big_streaming.wait()
            sent = time.perf_counter()
            completion = client.Completion()
            async for _, latest in client.stream(stub, SMALL, timeout_s=120):
                if on_small_first_token and not completion.token_ids and latest.token_ids:
                    await asyncio.to_thread(on_small_first_token)
                completion = latest
            return completion, sent

        got_big, (got_small, sent) = await asyncio.gather(big(), small())
        return got_big, got_small, big_done[0] - sent


def test_first_token_streams_while_decode_memory_is_full(
        full_pool_deployment: Deployment, qwen3_deployment: Deployment) -> None:
    expected = asyncio.run(client.generate_many(qwen3_deployment.router_address, [BIG, SMALL],
                                                120))
    got_big, got_small, big_left_s = asyncio.run(
        _big_then_small(full_pool_deployment.router_address))
    assert got_big.token_ids == expected[0].token_ids
    assert got_small.token_ids == expected[1].token_ids
    timing = got_small.finished.timing
    assert timing.admission_wait_s > 0  # it did wait for decode memory...
    assert got_small.ttft_s < big_left_s  # ...but its first token did not
    assert timing.kv_transfer_s > 0  # shipped from the prefill worker after the wait
    assert_pools_clean(full_pool_deployment)


def test_abort_while_waiting_for_decode_memory_frees_everything(
        full_pool_deployment: Deployment) -> None:
    async def run() -> generation_pb2.Finished | None:
        async with grpc_util.channel(full_pool_deployment.router_address) as chan:
            stub = generation_pb2_grpc.GenerationServiceStub(chan)
            big = asyncio.ensure_future(client.generate(full_pool_deployment.router_address,
                                                        BIG, 120))
            await asyncio.sleep(0.3)
            request = generation_pb2.GenerateRequest()
            request.CopyFrom(SMALL)
            request.request_id = "waits-then-aborted"
            finished, aborted = None, False
            async for _, latest in client.stream(stub, request, timeout_s=120):
                if latest.token_ids and not aborted:  # the first token: it waits for memory
                    aborted = True
                    await stub.Abort(generation_pb2.AbortRequest(
                        request_id="waits-then-aborted"), timeout=10)
                finished = latest.finished
            await big
            return finished

    finished = asyncio.run(run())
    assert finished is not None and finished.reason == generation_pb2.FINISH_REASON_ABORT
    assert finished.usage.completion_tokens == 1
    assert_pools_clean(full_pool_deployment)


def test_prefill_worker_lost_while_holding_deferred_kv(full_pool_deployment: Deployment,
                                                      qwen3_deployment: Deployment) -> None:
    """SMALL's K/V waits on a prefill worker for decode memory; that worker is killed: the
    router prefills SMALL again on the other one once it has a reservation."""
    expected = asyncio.run(client.generate(qwen3_deployment.router_address, SMALL, 120))
    killed: list[str] = []

    def kill_the_holder() -> None:
        for proc in [p for p in full_pool_deployment.processes if p.name.startswith("prefill")]:
            with grpc.insecure_channel(proc.address) as chan:
                stats = worker_pb2_grpc.PrefillServiceStub(chan).GetStats(
                    worker_pb2.GetStatsRequest(), timeout=10)
            if stats.num_running:
                os.kill(proc.popen.pid, signal.SIGKILL)
                proc.popen.wait(10)
                full_pool_deployment.processes.remove(proc)
                killed.append(proc.name)
                return  # only the holder: the router may already be retrying on the other

    _, got_small, _ = asyncio.run(_big_then_small(full_pool_deployment.router_address,
                                                  kill_the_holder))
    assert len(killed) == 1
    assert got_small.token_ids == expected.token_ids
    assert got_small.finished.timing.admission_wait_s > 0
    assert_pools_clean(full_pool_deployment)
