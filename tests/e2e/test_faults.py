"""Fault injection: a prefill worker killed mid push, a worker that stalls past the
client's deadline (SIGSTOP), a burst of client cancels and aborts, and the router killed
while workers hold reservations. Each scenario ends the same way: every client gets its full,
exact stream or a clear status; the surviving workers' pools are all free again; no process
is left behind. (Decode worker killed mid-stream: test_migration.py; a corrupted K/V chunk:
test_kv_corruption.py; SIGTERM drain: test_drain.py.)"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
import uuid
from collections.abc import Callable, Iterator

import grpc
import pytest

from deploy import client
from deploy.launcher import Deployment, Process
from kvferry.faults import tag
from kvferry.rpc import grpc_util
from kvferry.v1 import generation_pb2, generation_pb2_grpc, worker_pb2
from tests.conftest import assert_alive, assert_pools_clean, busy_process
from tests.deployments import respawn, routed

pytestmark = pytest.mark.slow

# Sleep between K/V chunks (one chunk per layer here: 4): a push outlives its first token by
# about a second, long enough to kill or stop the prefill worker in the middle of it. Armed
# per request (kvferry/faults.py): every request of this module carries it in its id.
PUSH_CHUNK_DELAY_S = 0.4
SLOW_PUSH = tag(push_chunk_delay_s=PUSH_CHUNK_DELAY_S)
# The kill tests find their victim by polling every worker's stats after the first token,
# which a loaded 2-core machine can stretch past a second: their pushes last 3 s.
KILL_PUSH_CHUNK_DELAY_S = 1.0
LEASE_S = 2.0
LONG_PROMPT = [i % 500 + 1 for i in range(300)]  # 19 blocks, pushed in 4 delayed chunks
SHORT_PROMPT = list(range(60, 100))


def sessions_alive(session_ids: set[int]) -> list[int]:
    """Pids of live processes (zombies included) in any of these sessions: every deployment
    process leads its own session, so this finds whatever it left behind."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # exited meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        if int(fields[3]) in session_ids:  # fields: state ppid pgrp session ...
            found.append(int(entry))
    return found


def _kill(victim: Process) -> None:
    os.kill(victim.popen.pid, signal.SIGKILL)
    victim.popen.wait(10)
    assert sessions_alive({victim.popen.pid}) == []


async def _kill_after_first_token(
        deployment: Deployment, request: generation_pb2.GenerateRequest, role: str,
        holds: Callable[[worker_pb2.WorkerStats], int] = lambda s: s.num_running,
) -> tuple[client.Completion, Process]:
    """Stream `request`; once its first token is out (the K/V push still under way), kill -9
    the `role` worker that `holds` it (see busy_process). Returns the whole stream and the
    killed worker (still listed: tests/deployments.respawn starts it again)."""
    async with grpc_util.channel(deployment.router_address) as chan:
        stub = generation_pb2_grpc.GenerationServiceStub(chan)
        completion, victim = client.Completion(), None
        async for _, latest in client.stream(stub, request, timeout_s=120):
            completion = latest
            if victim is None and completion.token_ids:
                victim = await asyncio.to_thread(busy_process, deployment, role, holds)
                assert victim is not None, "the push ended before the kill"
                await asyncio.to_thread(_kill, victim)
        assert victim is not None
        return completion, victim


@pytest.fixture(scope="module")
def faulty(qwen3_2p2d_deployment: Deployment) -> Iterator[Deployment]:
    """The shared 2 prefill + 2 decode workers behind a router with short leases."""
    with routed(qwen3_2p2d_deployment, "router-faults", ["--lease-s", str(LEASE_S)]) as view:
        yield view


def _request(prompt: list[int], max_tokens: int, request_id: str = "",
             push_chunk_delay_s: float = PUSH_CHUNK_DELAY_S) -> generation_pb2.GenerateRequest:
    """A greedy request whose K/V push is slow (SLOW_PUSH by default)."""
    slow = tag(push_chunk_delay_s=push_chunk_delay_s)
    return client.make_request(prompt, (request_id or uuid.uuid4().hex) + slow,
                               temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _expected(deployment: Deployment, request: generation_pb2.GenerateRequest) -> list[int]:
    plain = generation_pb2.GenerateRequest()
    plain.CopyFrom(request)
    plain.request_id = ""  # no faults, any id
    return asyncio.run(client.generate(deployment.router_address, plain, 120)).token_ids


def _router_log(view: Deployment) -> str:
    assert view.log_dir is not None
    return (view.log_dir / f"{view.processes[-1].name}.log").read_text()


def test_prefill_worker_killed_mid_push_is_prefilled_again(
        faulty: Deployment, qwen3_2p2d_deployment: Deployment,
        qwen3_deployment: Deployment) -> None:
    request = _request(LONG_PROMPT, 30, push_chunk_delay_s=KILL_PUSH_CHUNK_DELAY_S)
    expected = _expected(qwen3_deployment, request)

    got, victim = asyncio.run(_kill_after_first_token(faulty, request, "prefill"))
    assert got.token_ids == expected
    assert got.finished.reason == generation_pb2.FINISH_REASON_LENGTH
    assert "unavailable" in (log := _router_log(faulty))
    assert "retrying" in log
    respawn(victim.name, qwen3_2p2d_deployment, faulty)
    assert_pools_clean(faulty)
    assert_alive(faulty)


async def _stream_until_stopped(deployment: Deployment, request: generation_pb2.GenerateRequest,
                                role: str, deadline_s: float, num_tokens: int
                                ) -> tuple[grpc.aio.AioRpcError, Process]:
    """Stream `request` with a deadline; once `num_tokens` arrived, SIGSTOP the busy `role`
    worker. Returns the stream's error and the stopped worker."""
    async with grpc_util.channel(deployment.router_address) as chan:
        stub = generation_pb2_grpc.GenerationServiceStub(chan)
        stopped = None
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            async for _, latest in client.stream(stub, request, timeout_s=deadline_s):
                if stopped is None and len(latest.token_ids) >= num_tokens:
                    stopped = await asyncio.to_thread(busy_process, deployment, role)
                    assert stopped is not None
                    os.kill(stopped.popen.pid, signal.SIGSTOP)
        assert stopped is not None
        return exc.value, stopped


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_stalled_worker_gives_deadline_exceeded(role: str, faulty: Deployment,
                                                qwen3_deployment: Deployment) -> None:
    # decode: stopped mid-stream; prefill: stopped mid push, after the first token.
    deadline_s = 5.0
    request = (_request(SHORT_PROMPT, 3000) if role == "decode"
               else _request(LONG_PROMPT, 20))
    error, stopped = asyncio.run(
        _stream_until_stopped(faulty, request, role, deadline_s, 5 if role == "decode" else 1))
    try:
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error.details()
    finally:
        os.kill(stopped.popen.pid, signal.SIGCONT)
    assert_pools_clean(faulty, timeout_s=15)
    assert_alive(faulty)
    again = _request(SHORT_PROMPT, 12)
    got = asyncio.run(client.generate(faulty.router_address, again, 60))
    assert got.token_ids == _expected(qwen3_deployment, again)


def test_workers_back_from_a_stall_serve_the_next_request(
        faulty: Deployment, qwen3_deployment: Deployment) -> None:
    """Every prefill worker stalls until the router marks them all unhealthy, then resumes:
    the very next request is served (the router checks them again instead of failing it
    with "no healthy prefill worker")."""
    request = _request(SHORT_PROMPT, 8)
    expected = _expected(qwen3_deployment, request)
    stalled = [p for p in faulty.processes
               if p.name.startswith("prefill") and p.popen.poll() is None]
    assert stalled
    marked = [f"prefill worker {p.address} unreachable" for p in stalled]
    logged_before = _router_log(faulty)
    for proc in stalled:
        os.kill(proc.popen.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 60
        while not all(_router_log(faulty).count(m) > logged_before.count(m) for m in marked):
            assert time.monotonic() < deadline, "the router never marked them unhealthy"
            time.sleep(0.1)  # paces the polling of the router's log
    finally:
        for proc in stalled:
            os.kill(proc.popen.pid, signal.SIGCONT)
    got = asyncio.run(client.generate(faulty.router_address, request, 60))
    assert got.token_ids == expected
    assert_pools_clean(faulty)


def test_router_killed_while_workers_hold_reservations(qwen3_2p2d_deployment: Deployment,
                                                      qwen3_deployment: Deployment) -> None:
    """One request decoding (its DecodeStream breaks with the router) and one whose decode
    reservation waits for its K/V (the push dies with the prefill call; the lease frees it)."""
    decoding, pushing = _request(SHORT_PROMPT, 3000), _request(LONG_PROMPT, 20)
    base = qwen3_2p2d_deployment
    with routed(base, "router-killed", ["--lease-s", str(LEASE_S)]) as doomed:
        router = doomed.processes[-1]

        async def run() -> list[grpc.StatusCode]:
            async with grpc_util.channel(doomed.router_address) as chan:
                stub = generation_pb2_grpc.GenerationServiceStub(chan)
                seen = {0: asyncio.Event(), 1: asyncio.Event()}

                async def consume(i: int, request: generation_pb2.GenerateRequest,
                                  num_tokens: int) -> grpc.StatusCode:
                    try:
                        async for _, latest in client.stream(stub, request, timeout_s=120):
                            if len(latest.token_ids) >= num_tokens:
                                seen[i].set()
                    except grpc.aio.AioRpcError as exc:
                        return exc.code()
                    return grpc.StatusCode.OK

                first = asyncio.ensure_future(consume(0, decoding, 3))
                await asyncio.wait_for(seen[0].wait(), 60)
                second = asyncio.ensure_future(consume(1, pushing, 1))
                await asyncio.wait_for(seen[1].wait(), 60)  # first token out, push under way
                os.kill(router.popen.pid, signal.SIGKILL)
                return list(await asyncio.gather(first, second))

        codes = asyncio.run(run())
        assert codes == [grpc.StatusCode.UNAVAILABLE] * 2
        router.popen.wait(10)
        assert sessions_alive({router.popen.pid}) == []
    assert_pools_clean(base, timeout_s=LEASE_S + 10)
    assert any("lease expired" in (base.log_dir / f"{p.name}.log").read_text()
               for p in base.processes if p.name.startswith("decode"))

    with routed(base, "router-after", ["--lease-s", str(LEASE_S)]) as fresh:
        request = _request(LONG_PROMPT, 16)
        got = asyncio.run(client.generate(fresh.router_address, request, 60))
        assert got.token_ids == _expected(qwen3_deployment, request)
        assert_pools_clean(fresh)
        assert_alive(fresh)


def test_burst_of_cancels_and_aborts(qwen3_deployment: Deployment) -> None:
    """40 concurrent streams of random lengths: a quarter run to the end, the rest are
    cancelled by the client or aborted through the Abort RPC at random moments."""
    address = qwen3_deployment.router_address
    check = _request(SHORT_PROMPT, 24)
    before = _expected(qwen3_deployment, check)
    rng = random.Random(9)
    plans = [(i % 4, [rng.randint(1, 500) for _ in range(rng.randint(4, 300))],
              rng.randint(4, 150), rng.uniform(0.0, 1.5)) for i in range(40)]

    async def one(stub: generation_pb2_grpc.GenerationServiceStub, i: int, mode: int,
                  prompt: list[int], max_tokens: int, after_s: float) -> str:
        request = _request(prompt, max_tokens, f"burst-{i}")
        task = asyncio.ensure_future(client.collect(stub, request, timeout_s=120))
        if mode == 1:  # client-side cancel
            await asyncio.sleep(after_s)  # paces: the plan's moment to cancel
            task.cancel()
        elif mode >= 2:  # Abort RPC (it may find the request finished already)
            await asyncio.sleep(after_s / (mode - 1))  # paces: the plan's moment to abort
            try:
                await stub.Abort(generation_pb2.AbortRequest(request_id=request.request_id),
                                 timeout=30)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.NOT_FOUND, exc.details()
        try:
            got = await task
        except asyncio.CancelledError:
            return "cancelled"
        reason = got.finished.reason
        if reason == generation_pb2.FINISH_REASON_ABORT:
            return "aborted"
        assert reason == generation_pb2.FINISH_REASON_LENGTH
        assert len(got.token_ids) == max_tokens
        return "complete"

    async def burst() -> list[str]:
        async with grpc_util.channel(address) as chan:
            stub = generation_pb2_grpc.GenerationServiceStub(chan)
            return list(await asyncio.gather(*(one(stub, i, *plan)
                                               for i, plan in enumerate(plans))))

    outcomes = asyncio.run(burst())
    assert all(o == "complete" for o, plan in zip(outcomes, plans) if plan[0] == 0)
    assert {"cancelled", "aborted"} <= set(outcomes)
    assert_pools_clean(qwen3_deployment)
    assert_alive(qwen3_deployment)
    assert _expected(qwen3_deployment, check) == before


def test_decode_worker_killed_mid_push_migrates(qwen3_2p2d_deployment: Deployment,
                                                 qwen3_deployment: Deployment) -> None:
    """The decode worker holding the reservation dies while the K/V is being pushed to it:
    the request migrates (another decode worker, prompt + first token prefilled again)."""
    deployment = qwen3_2p2d_deployment
    request = _request(LONG_PROMPT, 30, push_chunk_delay_s=KILL_PUSH_CHUNK_DELAY_S)
    expected = _expected(qwen3_deployment, request)
    got, victim = asyncio.run(_kill_after_first_token(deployment, request, "decode",
                                                      lambda s: s.reserved_blocks))
    assert got.token_ids == expected
    assert got.finished.timing.num_migrations == 1
    respawn(victim.name, deployment)
    assert_pools_clean(deployment)
    assert_alive(deployment)


@pytest.mark.parametrize("num_broken", [1, 5], ids=["once", "every-time"])
def test_push_broken_between_serving_workers_is_prefilled_again_once(
        num_broken: int, qwen3_2p2d_deployment: Deployment,
        qwen3_deployment: Deployment) -> None:
    """A push fails UNAVAILABLE while both workers still serve (a cut link has healed but
    the prefill worker's connection died): the router prefills the prompt again and pushes
    afresh, once. Broken once, the stream is exact; broken every time, the client gets
    UNAVAILABLE after that one retry, and no block is left behind."""
    rng = random.Random(num_broken)
    prompt = [rng.randrange(1, 500) for _ in range(200)]  # 13 blocks no cache holds
    request_id = uuid.uuid4().hex + tag(break_pushes=num_broken)
    request = client.make_request(prompt, request_id, temperature=0.0, max_tokens=12,
                                  ignore_eos=True)
    deployment = qwen3_2p2d_deployment
    retried = f"request {request_id}@"
    if num_broken == 1:
        got = asyncio.run(client.generate(deployment.router_address, request, 60))
        assert got.token_ids == _expected(qwen3_deployment, request)
    else:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            asyncio.run(client.generate(deployment.router_address, request, 60))
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE, exc.value.details()
        assert "a worker failed (UNAVAILABLE)" in (exc.value.details() or "")
    lines = [line for line in _router_log(deployment).splitlines() if retried in line]
    assert sum("prefilling again" in line for line in lines) == 1, lines
    assert "link broken (fault injection)" in lines[0]
    assert_pools_clean(deployment)
    assert_alive(deployment)
