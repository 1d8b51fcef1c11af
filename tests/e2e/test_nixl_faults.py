"""The fault tests on `--kv-transport nixl`, where the decode worker
READs each layer group from the prefill worker's pool. Every group's READ is slowed (the fault
nixl_read_delay_s, armed for this module's requests alone: kvferry/faults.py) so that each
fault lands while a READ is writing into a reservation's blocks: the prefill worker killed,
the client cancelling, the router killed (the reservation's lease then expires), the decode
worker killed. Each ends with the exact stream or a clear status, and every surviving pool
all free with its integrity intact: no block came back to the pool while a READ could still
write into it. (A corrupted transfer:
test_kv_corruption.py; decode killed mid-stream: test_migration.py; the fence itself, block
by block: tests/kvferry/transfer/test_nixl_puller.py.)"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import Iterator

import grpc
import pytest

from deploy import client
from deploy.launcher import Deployment
from kvferry.faults import tag
from kvferry.rpc import grpc_util
from kvferry.v1 import generation_pb2, generation_pb2_grpc
from tests.conftest import assert_alive, assert_pools_clean
from tests.deployments import respawn, routed
from tests.e2e.test_faults import (
    LONG_PROMPT,
    _expected,
    _kill_after_first_token,
    _router_log,
    sessions_alive,
)

pytestmark = pytest.mark.slow

READ_DELAY_S = 1.5  # per group (one here: the prompt's K/V is under nixl/send.py's 4 MiB minimum)
# The kill tests find their victim by polling every worker's stats after the first token,
# which a loaded 2-core machine can stretch past a second: their READs last 3 s.
KILL_READ_DELAY_S = 3.0
LEASE_S = 2.0


def _request(prompt: list[int], max_tokens: int, read_delay_s: float = READ_DELAY_S
             ) -> generation_pb2.GenerateRequest:
    """A greedy request whose every NIXL READ is slow, with a cache salt of its own (no
    cached block spares it a READ)."""
    request_id = uuid.uuid4().hex + tag(nixl_read_delay_s=read_delay_s)
    request = client.make_request(prompt, request_id, temperature=0.0, max_tokens=max_tokens,
                                  ignore_eos=True)
    request.cache_salt = request_id
    return request


@pytest.fixture(scope="module")
def faulty(qwen3_nixl_deployment: Deployment) -> Iterator[Deployment]:
    """The shared NIXL workers (2 prefill, 2 decode) behind a router with short leases."""
    with routed(qwen3_nixl_deployment, "router-nixl-faults", ["--lease-s", str(LEASE_S)]
                ) as view:
        yield view


def test_prefill_worker_killed_mid_read_is_prefilled_again(
        faulty: Deployment, qwen3_nixl_deployment: Deployment,
        qwen3_deployment: Deployment) -> None:
    request = _request(LONG_PROMPT, 30, KILL_READ_DELAY_S)
    got, victim = asyncio.run(_kill_after_first_token(faulty, request, "prefill"))
    respawn(victim.name, qwen3_nixl_deployment, faulty)
    assert got.token_ids == _expected(qwen3_deployment, request)
    assert "retrying" in _router_log(faulty)
    assert_pools_clean(faulty)
    assert_alive(faulty)


def test_client_cancel_mid_read_frees_blocks_once_the_read_is_over(
        faulty: Deployment) -> None:
    async def run() -> None:
        async with grpc_util.channel(faulty.router_address) as chan:
            stub = generation_pb2_grpc.GenerationServiceStub(chan)
            call = stub.Generate(_request(LONG_PROMPT, 30))
            async for _ in call:  # the first token is out; the READs are under way
                call.cancel()
                break

    asyncio.run(run())
    assert_pools_clean(faulty)
    assert_alive(faulty)


def test_router_killed_mid_read_lease_expires_and_blocks_come_back(
        qwen3_nixl_deployment: Deployment, qwen3_deployment: Deployment) -> None:
    base = qwen3_nixl_deployment
    request = _request(LONG_PROMPT, 20)
    with routed(base, "router-nixl-killed", ["--lease-s", str(LEASE_S)]) as doomed:
        router = doomed.processes[-1]

        async def run() -> grpc.StatusCode:
            async with grpc_util.channel(doomed.router_address) as chan:
                stub = generation_pb2_grpc.GenerationServiceStub(chan)
                try:
                    async for _, latest in client.stream(stub, request, timeout_s=60):
                        if latest.token_ids:
                            os.kill(router.popen.pid, signal.SIGKILL)
                except grpc.aio.AioRpcError as exc:
                    return exc.code()
                return grpc.StatusCode.OK

        assert asyncio.run(run()) == grpc.StatusCode.UNAVAILABLE
        router.popen.wait(10)
        assert sessions_alive({router.popen.pid}) == []
    assert_pools_clean(base, timeout_s=LEASE_S + 10)
    assert base.log_dir is not None
    assert any(f"request {request.request_id}@" in line and "lease expired" in line
               for decode in base.log_dir.glob("decode*.log")
               for line in decode.read_text().splitlines())
    again = _request(LONG_PROMPT, 16)
    assert asyncio.run(client.generate(base.router_address, again, 60)).token_ids == \
        _expected(qwen3_deployment, again)
    assert_pools_clean(base)
    assert_alive(base)


def test_decode_worker_killed_mid_read_migrates(qwen3_nixl_deployment: Deployment,
                                                qwen3_deployment: Deployment) -> None:
    deployment = qwen3_nixl_deployment
    request = _request(LONG_PROMPT, 30, KILL_READ_DELAY_S)
    expected = _expected(qwen3_deployment, request)
    got, victim = asyncio.run(_kill_after_first_token(deployment, request, "decode",
                                                      lambda s: s.reserved_blocks))
    respawn(victim.name, deployment)
    assert got.token_ids == expected
    assert got.finished.timing.num_migrations == 1
    assert got.finished.reason == generation_pb2.FINISH_REASON_LENGTH
    assert_pools_clean(deployment)
    assert_alive(deployment)
