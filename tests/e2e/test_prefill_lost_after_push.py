"""Issue 16: a prefill worker killed (kill -9) just after its K/V push completed, before its
`done` reached the router. The router prefills the prompt again on another worker, whose push
finds the reservation's K/V complete (ALREADY_EXISTS) and counts as delivered; the client gets
its exact stream and every pool ends free.

KVFERRY_FAULT_PUSH_DONE_DELAY_S opens the window: once the decode worker has accepted a push,
the prefill worker logs so and holds the push's done back for that long."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from deploy import client
from deploy.launcher import Deployment, Process
from kvferry.rpc import grpc_util
from kvferry.v1 import generation_pb2, generation_pb2_grpc
from tests.conftest import METRICS, assert_alive, assert_pools_clean, worker_stats
from tests.e2e.test_faults import LONG_PROMPT, _kill, sessions_alive
from tests.e2e.test_metrics import scrape, value

pytestmark = pytest.mark.slow

DONE_DELAY_S = 5.0
HELD = "K/V push accepted; holding its done"  # grpc_push.py, after the decode worker's ack
ALREADY_THERE = "K/V already complete on the decode worker"  # grpc_push.py, ALREADY_EXISTS
RETRIES = "kvferry_prefill_retries_total"


def _holding_push(deployment: Deployment, timeout_s: float = 60.0) -> Process:
    """The prefill worker whose push the decode worker has accepted, its done held back."""
    assert deployment.log_dir is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in deployment.processes:
            log = deployment.log_dir / f"{proc.name}.log"
            if proc.name.startswith("prefill") and HELD in log.read_text():
                return proc
        time.sleep(0.05)
    raise AssertionError("no prefill worker completed its push")


async def _kill_once_delivered(deployment: Deployment, request: generation_pb2.GenerateRequest
                               ) -> tuple[client.Completion, Process]:
    """Stream `request`; after its first token, wait until its push has been accepted and kill
    -9 the prefill worker that sent it, while the decode worker has not begun decoding (so the
    router has not had the push's done). Returns the whole stream and the killed worker."""
    async with grpc_util.channel(deployment.router_address) as chan:
        stub = generation_pb2_grpc.GenerationServiceStub(chan)
        completion, victim = client.Completion(), None
        async for _, latest in client.stream(stub, request, timeout_s=120):
            completion = latest
            if victim is None and completion.token_ids:
                victim = await asyncio.to_thread(_holding_push, deployment)
                stats = await asyncio.to_thread(worker_stats, deployment)
                decode = next(s for s in stats if s.role == "decode")
                assert decode.num_running == 0 and decode.reserved_blocks > 0, decode
                await asyncio.to_thread(_kill, deployment, victim)
        assert victim is not None
        return completion, victim


def test_prefill_worker_killed_after_its_push_completed(
        qwen3_checkpoint: Path, qwen3_deployment: Deployment, tmp_path: Path) -> None:
    request = client.make_request(LONG_PROMPT, temperature=0.0, max_tokens=30, ignore_eos=True)
    expected = asyncio.run(client.generate(qwen3_deployment.router_address, request, 120))
    with Deployment(model=str(qwen3_checkpoint), num_prefill=2, log_dir=tmp_path,
                    env={"KVFERRY_FAULT_PUSH_DONE_DELAY_S": str(DONE_DELAY_S)},
                    router_args=METRICS) as deployment:
        spawned = {p.popen.pid for p in deployment.processes}
        router_port = next(p.metrics_port for p in deployment.processes if p.name == "router")
        before = value(scrape(router_port), RETRIES)

        got, victim = asyncio.run(_kill_once_delivered(deployment, request))
        assert got.token_ids == expected.token_ids
        assert got.finished.reason == generation_pb2.FINISH_REASON_LENGTH
        assert got.finished.timing.num_migrations == 0  # the same decode reservation
        assert value(scrape(router_port), RETRIES) - before == 1
        survivor = next(p for p in deployment.processes if p.name.startswith("prefill"))
        assert survivor is not victim
        assert ALREADY_THERE in (tmp_path / f"{survivor.name}.log").read_text()
        assert_pools_clean(deployment)
        assert_alive(deployment)
    assert sessions_alive(spawned) == []
