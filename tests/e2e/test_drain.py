"""Drain on SIGTERM: the worker reports NOT_SERVING at once and takes no new
requests, its in-flight stream finishes in place within --drain-timeout-s (or, past that
timeout, migrates), then the process exits 0. Clients see exactly the undisturbed tokens.
On the shared 2p2d deployment: the drained worker is started again afterwards."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy import client
from deploy.launcher import Deployment, Process
from kvferry.faults import tag
from kvferry.rpc import grpc_util
from kvferry.rpc.grpc_util import CHANNEL_OPTIONS
from kvferry.v1 import generation_pb2, generation_pb2_grpc
from tests.conftest import assert_pools_clean, busy_process
from tests.deployments import reconfigured, respawn

pytestmark = pytest.mark.slow

PROMPT = list(range(40, 120))


def _health(address: str) -> int:
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as chan:
        return health_pb2_grpc.HealthStub(chan).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5).status


async def _reports_not_serving(address: str, within_s: float = 60.0) -> bool:
    """Health turns NOT_SERVING after SIGTERM (before the drain ends and it closes)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if await asyncio.to_thread(_health, address) == (
                health_pb2.HealthCheckResponse.NOT_SERVING):
            return True
        await asyncio.sleep(0.02)  # paces the polling
    return False


async def _router_logs(deployment: Deployment, line: str, after: int) -> None:
    """Until the router has logged `line` past byte `after` of its log (it has seen what the
    line says; earlier tests on the shared deployment may have logged the same line)."""
    assert deployment.log_dir is not None
    deadline = time.monotonic() + 60
    while line not in (deployment.log_dir / "router.log").read_text()[after:]:
        assert time.monotonic() < deadline, f"the router never logged {line!r}"
        await asyncio.sleep(0.02)  # paces the polling


def _drain(deployment: Deployment, request: generation_pb2.GenerateRequest
           ) -> tuple[client.Completion, client.Completion, Process]:
    """Stream `request`; once it has 10 tokens, SIGTERM the decode worker serving it, check
    that it says NOT_SERVING and that the router stops sending it work, and wait for it to
    exit 0. Returns the stream, a short request sent during the drain, and the victim."""
    assert deployment.log_dir is not None
    log_size = (deployment.log_dir / "router.log").stat().st_size

    async def run() -> tuple[client.Completion, client.Completion, Process]:
        async with grpc_util.channel(deployment.router_address) as chan:
            stub = generation_pb2_grpc.GenerationServiceStub(chan)
            completion = client.Completion()
            victim, other = None, None
            async for _, latest in client.stream(stub, request, timeout_s=120):
                completion = latest
                if victim is None and len(completion.token_ids) >= 10:
                    victim = await asyncio.to_thread(busy_process, deployment, "decode")
                    assert victim is not None
                    victim.popen.send_signal(signal.SIGTERM)
                    assert await _reports_not_serving(victim.address)
                    await _router_logs(deployment, f"decode worker {victim.address} is "
                                       "not serving (draining)", log_size)
                    # New work goes elsewhere while the victim drains.
                    other = await client.generate(
                        deployment.router_address,
                        client.make_request(PROMPT, temperature=0.0, max_tokens=8,
                                            ignore_eos=True), 60)
            assert victim is not None and other is not None
            code = await asyncio.to_thread(victim.popen.wait, 30)
            assert code == 0, f"{victim.name} exited with {code}"
            return completion, other, victim

    return asyncio.run(run())


@pytest.mark.parametrize("migrates", [False, True], ids=["finishes-in-place", "migrates"])
def test_sigterm_drains_a_decode_worker(migrates: bool, qwen3_2p2d_deployment: Deployment
                                        ) -> None:
    """The shared 2p2d workers drain for up to 30 s (the default): the stream of 400 tokens
    finishes on the draining worker. Restarted with --drain-timeout-s 5, a stream of 200
    (each step held 40 ms by a fault, so at least 7.6 s remain when the drain starts)
    outlives the drain and migrates; the 5 s leave the router, which polls health every
    refresh, time to see the drain on a loaded machine (0.3 s did not)."""
    deployment = qwen3_2p2d_deployment
    max_tokens = 200 if migrates else 400
    request = client.make_request(PROMPT, temperature=0.0, max_tokens=max_tokens,
                                  ignore_eos=True)
    undisturbed = asyncio.run(client.generate(deployment.router_address, request, 120))
    if migrates:
        slow = client.make_request(PROMPT, "drained" + tag(decode_step_delay_s=0.04),
                                   temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        with reconfigured(deployment, ["decode-0", "decode-1"], ["--drain-timeout-s", "5"]):
            got, other, _ = _drain(deployment, slow)
    else:
        got, other, victim = _drain(deployment, request)
        respawn(victim.name, deployment)
    assert got.token_ids == undisturbed.token_ids
    assert other.token_ids == undisturbed.token_ids[:8]
    assert got.finished.timing.num_migrations == (1 if migrates else 0)
    assert_pools_clean(deployment)


def test_sigterm_drains_a_prefill_worker_once_its_push_is_acknowledged(
        qwen3_2p2d_deployment: Deployment) -> None:
    """SIGTERM to the prefill worker whose push is still open (the push_done_delay_s fault
    holds its acknowledgement 3 s after the decode worker took the K/V): it says NOT_SERVING
    at once, new prompts go to the other prefill worker, and it exits 0 only after the push
    ended, so the request finishes with the undisturbed tokens, never prefilled again."""
    deployment = qwen3_2p2d_deployment
    request = client.make_request(PROMPT, temperature=0.0, max_tokens=24, ignore_eos=True)
    undisturbed = asyncio.run(client.generate(deployment.router_address, request, 120))
    held = client.make_request(PROMPT, "drain-prefill" + tag(push_done_delay_s=3.0),
                               temperature=0.0, max_tokens=24, ignore_eos=True)

    async def run() -> tuple[client.Completion, client.Completion, Process]:
        async with grpc_util.channel(deployment.router_address) as chan:
            stub = generation_pb2_grpc.GenerationServiceStub(chan)
            stream = asyncio.ensure_future(client.collect(stub, held, 120))
            victim = None
            while victim is None:  # the push is open from the first token on
                victim = await asyncio.to_thread(busy_process, deployment, "prefill")
                await asyncio.sleep(0.02)  # paces the polling
            victim.popen.send_signal(signal.SIGTERM)
            assert await _reports_not_serving(victim.address)
            other = await client.generate(deployment.router_address, request, 60)
            got = await stream
            code = await asyncio.to_thread(victim.popen.wait, 30)
            assert code == 0, f"{victim.name} exited with {code}"
            return got, other, victim

    got, other, victim = asyncio.run(run())
    respawn(victim.name, deployment)
    assert got.token_ids == undisturbed.token_ids and other.token_ids == undisturbed.token_ids
    assert got.finished.timing.num_migrations == 0
    # it waited for the held acknowledgement: had it exited before, the router would have
    # prefilled the request again elsewhere (router/prefill_leg.py logs each time it does;
    # the new request may be retried, refused by the draining worker before the router saw
    # it leave)
    assert deployment.log_dir is not None
    again = [line for line in (deployment.log_dir / "router.log").read_text().splitlines()
             if "drain-prefill" in line and ("retrying" in line or "prefilling again" in line)]
    assert not again, again
    assert_pools_clean(deployment)
