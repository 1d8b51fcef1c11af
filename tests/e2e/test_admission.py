"""Headroom admission without TTFT stalls: when no decode worker has room for a
request at its longest, the router still prefills it at once and streams its first token;
the K/V waits in the prefill worker's pool and is shipped once a reservation is made. The
tokens stay exact, and an abort while it waits leaves nothing held anywhere."""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest

from deploy import client
from deploy.launcher import Deployment
from kvferry.faults import tag
from kvferry.rpc import grpc_util
from kvferry.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.conftest import assert_pools_clean, worker_stats
from tests.deployments import respawn, routed

pytestmark = pytest.mark.slow

# Decode steps holding BIG or LONG (below) are slowed, so that they outlast what arrives
# after them on any machine: unpaced, BIG's 140 steps could end before SMALL came (no wait,
# nothing parked, nothing to kill or abort).
STEP_DELAY_S = 0.05
BIG = client.make_request(list(range(20, 60)), "big" + tag(decode_step_delay_s=STEP_DELAY_S),
                          temperature=0.0, max_tokens=140,
                          ignore_eos=True)  # 180 tokens: all 12 blocks of the decode pool
SMALL = client.make_request(list(range(70, 120)), temperature=0.0, max_tokens=20,
                            ignore_eos=True)


@pytest.fixture
def full_pool_deployment(qwen3_tiny_deployment: Deployment) -> Deployment:
    """The shared deployment of 12-block pools: two prefill workers, one decode worker."""
    return qwen3_tiny_deployment


async def _big_then_small(address: str, on_small_first_token=None
                          ) -> tuple[client.Completion, client.Completion, bool]:
    """BIG fills the decode pool; SMALL arrives once BIG streams. Returns both completions and
    whether BIG was still streaming when SMALL's first token came. `on_small_first_token`
    runs (in a thread) when SMALL's first token is in, while its K/V waits on a prefill
    worker."""
    async with grpc_util.channel(address) as chan:
        stub = generation_pb2_grpc.GenerationServiceStub(chan)
        big_streaming, big_done = asyncio.Event(), asyncio.Event()
        big_running_at_first = [False]

        async def big() -> client.Completion:
            completion = client.Completion()
            async for _, latest in client.stream(stub, BIG, timeout_s=120):
                completion = latest
                big_streaming.set()
            big_done.set()
            return completion

        async def small() -> client.Completion:
            await big_streaming.wait()
            completion = client.Completion()
            async for _, latest in client.stream(stub, SMALL, timeout_s=120):
                if not completion.token_ids and latest.token_ids:
                    big_running_at_first[0] = not big_done.is_set()
                    if on_small_first_token:
                        await asyncio.to_thread(on_small_first_token)
                completion = latest
            return completion

        got_big, got_small = await asyncio.gather(big(), small())
        return got_big, got_small, big_running_at_first[0]


def test_first_token_streams_while_decode_memory_is_full(
        full_pool_deployment: Deployment, qwen3_deployment: Deployment) -> None:
    expected = asyncio.run(client.generate_many(qwen3_deployment.router_address, [BIG, SMALL],
                                                120))
    got_big, got_small, big_was_running = asyncio.run(
        _big_then_small(full_pool_deployment.router_address))
    assert got_big.token_ids == expected[0].token_ids
    assert got_small.token_ids == expected[1].token_ids
    timing = got_small.finished.timing
    assert timing.admission_wait_s > 0  # it did wait for decode memory...
    assert big_was_running  # ...but its first token did not: it came while BIG streamed
    assert timing.kv_transfer_s > 0  # shipped from the prefill worker after the wait
    assert_pools_clean(full_pool_deployment)


def test_abort_while_waiting_for_decode_memory_frees_everything(
        full_pool_deployment: Deployment) -> None:
    async def run() -> generation_pb2.Finished | None:
        async with grpc_util.channel(full_pool_deployment.router_address) as chan:
            stub = generation_pb2_grpc.GenerationServiceStub(chan)
            big = asyncio.ensure_future(client.generate(full_pool_deployment.router_address,
                                                        BIG, 120))
            # Until BIG holds the decode pool (it decodes there).
            deadline = asyncio.get_running_loop().time() + 60
            while not any(s.role == "decode" and s.num_running for s in
                          await asyncio.to_thread(worker_stats, full_pool_deployment)):
                assert asyncio.get_running_loop().time() < deadline and not big.done()
                await asyncio.sleep(0.02)  # paces the polling
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
                killed.append(proc.name)
                return  # only the holder: the router may already be retrying on the other

    _, got_small, _ = asyncio.run(_big_then_small(full_pool_deployment.router_address,
                                                  kill_the_holder))
    assert len(killed) == 1
    respawn(killed[0], full_pool_deployment)  # for the tests that follow
    assert got_small.token_ids == expected.token_ids
    assert got_small.finished.timing.admission_wait_s > 0
    assert_pools_clean(full_pool_deployment)


# Parked K/V against a reservation: LONG leaves the decode pool 1 block of headroom, so the
# two 6-block prompts are deferred and their K/V fills the prefill worker's 12-block pool;
# TINY then fits the headroom, is reserved at once, and needs 1 prefill block. LONG's decode
# steps are slowed (LONG_STEP_DELAY_S: 150 steps, 30 s) and the client cancels it once TINY is
# done, so the ordering does not rest on how long the rest takes on a loaded machine (paced at
# 7.5 s, a clean-clone CI run once saw LONG end first) and the test does not wait 30 s.
LONG_STEP_DELAY_S = 0.2
LONG = client.make_request(list(range(200, 220)),
                           "long" + tag(decode_step_delay_s=LONG_STEP_DELAY_S),
                           temperature=0.0, max_tokens=150,
                           ignore_eos=True)  # 170 tokens: 11 of the decode pool's 12 blocks
PARKED = [client.make_request(list(range(300 + 7 * i, 390 + 7 * i)), temperature=0.0,
                              max_tokens=10, ignore_eos=True) for i in range(2)]  # 90 tokens
TINY = client.make_request(list(range(500, 510)), temperature=0.0, max_tokens=6,
                           ignore_eos=True)


def _prefill_stats(deployment: Deployment) -> worker_pb2.WorkerStats:
    return next(s for s in worker_stats(deployment) if s.role == "prefill")


def _log_tail(deployment: Deployment, lines: int = 30) -> str:
    """The last lines of the view's router log and of its prefill worker's, for a failure."""
    if deployment.log_dir is None:
        return ""
    tails = []
    for name in ("router-one-prefill", "prefill-0"):
        path = deployment.log_dir / f"{name}.log"
        if path.exists():
            tails.append(f"--- {name}\n" + "\n".join(path.read_text().splitlines()[-lines:]))
    return "\n".join(tails)


def test_a_reserved_request_is_not_held_behind_parked_kv(
        qwen3_tiny_deployment: Deployment, qwen3_deployment: Deployment) -> None:
    """Without eviction TINY would wait for LONG to end: the parked requests wait for decode
    memory LONG holds, and TINY for prefill memory they hold. (All 8 requests of
    test_memory_pressure arriving at once stalled that way, for the 30 s admission timeout.)"""
    with routed(qwen3_tiny_deployment, "router-one-prefill", [],
                only=["prefill-0", "decode-0"]) as one_prefill:
        _parked_kv_is_evicted_for_a_reservation(one_prefill, qwen3_deployment)


def _parked_kv_is_evicted_for_a_reservation(small_pools_deployment: Deployment,
                                            qwen3_deployment: Deployment) -> None:
    """The test above, behind a router that knows one of the two prefill workers (the
    parked prompts must fill that one's pool)."""
    plain_long = generation_pb2.GenerateRequest()
    plain_long.CopyFrom(LONG)
    plain_long.request_id = ""
    expected = asyncio.run(client.generate_many(qwen3_deployment.router_address,
                                                [plain_long, *PARKED, TINY], 120))
    evictions = _prefill_stats(small_pools_deployment).num_parked_evictions

    async def run() -> tuple[list[client.Completion], list[str]]:
        async with grpc_util.channel(small_pools_deployment.router_address) as chan:
            stub = generation_pb2_grpc.GenerationServiceStub(chan)
            long_streaming = asyncio.Event()
            parked = [asyncio.Event() for _ in PARKED]
            ended: list[str] = []  # names, in the order their streams ended by themselves

            async def run_one(name: str, request: generation_pb2.GenerateRequest,
                              first_token: asyncio.Event | None = None,
                              completion: client.Completion | None = None
                              ) -> client.Completion:
                completion = completion or client.Completion()
                async for msg, _ in client.stream(stub, request, timeout_s=120):
                    client.add_response(completion, msg, 0.0)
                    if first_token is not None and completion.token_ids:
                        first_token.set()
                ended.append(name)
                return completion

            long_so_far = client.Completion()
            long_call = asyncio.ensure_future(run_one("long", LONG, long_streaming, long_so_far))
            await long_streaming.wait()
            waiting = [asyncio.ensure_future(run_one(f"parked{i}", r, parked[i]))
                       for i, r in enumerate(PARKED)]
            await asyncio.gather(*(e.wait() for e in parked))
            tiny = await run_one("tiny", TINY)
            long_call.cancel()  # LONG's stream ends; the parked requests get its memory
            await asyncio.gather(long_call, return_exceptions=True)
            return [long_so_far, *await asyncio.gather(*waiting), tiny], ended

    got, ended = asyncio.run(run())
    # TINY went by LONG (which ends only when cancelled after it): LONG was still streaming.
    assert ended[0] == "tiny", (ended, _log_tail(small_pools_deployment))
    long_tokens = got[0].token_ids
    assert 0 < len(long_tokens) < len(expected[0].token_ids)
    assert long_tokens == expected[0].token_ids[:len(long_tokens)]
    assert [c.token_ids for c in got[1:]] == [c.token_ids for c in expected[1:]]
    prefill = _prefill_stats(small_pools_deployment)
    # The newer parked request, prefilled again.
    assert prefill.num_parked_evictions - evictions == 1
    assert prefill.num_parked == 0
    assert_pools_clean(small_pools_deployment)
