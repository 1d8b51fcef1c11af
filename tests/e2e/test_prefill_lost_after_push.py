"""A prefill worker killed (kill -9) just after its K/V push completed, before its
`done` reached the router. The router prefills the prompt again on another worker, whose push
finds the reservation's K/V complete (ALREADY_EXISTS) and counts as delivered; the client gets
its exact stream and every pool ends free.

The fault push_done_delay_s, armed for this test's request alone (kvferry/faults.py), opens
the window: once the decode worker has accepted the push, the prefill worker logs so and holds
the push's done back for that long."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from deploy import client
from deploy.launcher import Deployment, Process
from kvferry.faults import tag
from kvferry.rpc import grpc_util
from kvferry.v1 import generation_pb2, generation_pb2_grpc
from tests.conftest import assert_alive, assert_pools_clean, worker_stats
from tests.deployments import respawn
from tests.e2e.test_faults import LONG_PROMPT, _kill
from tests.e2e.test_metrics import scrape, value

pytestmark = pytest.mark.slow

DONE_DELAY_S = 5.0
HELD = "K/V push accepted; holding its done"  # grpc/send.py, after the decode worker's ack
ALREADY_THERE = "K/V already complete on the decode worker"  # grpc/send.py, ALREADY_EXISTS
RETRIES = "kvferry_prefill_retries_total"


def _logged(deployment: Deployment, proc: Process, request_id: str, message: str) -> bool:
    """Whether `proc` logged `message` about request `request_id` (`request <id>@...: ...`)."""
    assert deployment.log_dir is not None
    return any(f"request {request_id}@" in line and message in line
               for line in (deployment.log_dir / f"{proc.name}.log").read_text().splitlines())


def _holding_push(deployment: Deployment, request_id: str, timeout_s: float = 60.0
                  ) -> Process:
    """The prefill worker whose push the decode worker has accepted, its done held back."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in deployment.processes:
            if proc.name.startswith("prefill") and _logged(deployment, proc, request_id, HELD):
                return proc
        time.sleep(0.05)  # paces the polling of the logs
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
                victim = await asyncio.to_thread(_holding_push, deployment, request.request_id)
                stats = await asyncio.to_thread(worker_stats, deployment)
                holding = [s for s in stats if s.role == "decode" and s.reserved_blocks > 0]
                assert holding and all(s.num_running == 0 for s in holding), stats
                await asyncio.to_thread(_kill, victim)
        assert victim is not None
        return completion, victim


def test_prefill_worker_killed_after_its_push_completed(
        qwen3_2p2d_deployment: Deployment, qwen3_deployment: Deployment) -> None:
    deployment = qwen3_2p2d_deployment
    request = client.make_request(LONG_PROMPT, uuid.uuid4().hex, temperature=0.0,
                                  max_tokens=30, ignore_eos=True)
    expected = asyncio.run(client.generate(qwen3_deployment.router_address, request, 120))
    request.request_id += tag(push_done_delay_s=DONE_DELAY_S)
    router_port = deployment.processes[-1].metrics_port
    before = value(scrape(router_port), RETRIES)

    got, victim = asyncio.run(_kill_once_delivered(deployment, request))
    respawn(victim.name, deployment)
    assert got.token_ids == expected.token_ids
    assert got.finished.reason == generation_pb2.FINISH_REASON_LENGTH
    assert got.finished.timing.num_migrations == 0  # the same decode reservation
    assert value(scrape(router_port), RETRIES) - before == 1
    survivors = [p for p in deployment.processes
                 if p.name.startswith("prefill") and p.name != victim.name]
    assert any(_logged(deployment, p, request.request_id, ALREADY_THERE) for p in survivors)
    assert_pools_clean(deployment)
    assert_alive(deployment)
