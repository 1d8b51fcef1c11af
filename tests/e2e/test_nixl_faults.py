"""Issue 19, acceptance 1: the fault tests on `--kv-transport nixl`, where the decode worker
READs each layer group from the prefill worker's pool. Every group's READ is slowed
(KVFERRY_FAULT_NIXL_READ_DELAY_S) so that each fault lands while a READ is writing into a
reservation's blocks: the prefill worker killed, the client cancelling, the router killed
(the reservation's lease then expires), the decode worker killed. Each ends with the exact
stream or a clear status, and every surviving pool all free with its integrity intact: no
block came back to the pool while a READ could still write into it. (A corrupted transfer:
test_kv_corruption.py; decode killed mid-stream: test_migration.py; the fence itself, block
by block: tests/decode_worker/test_nixl_puller.py.)"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from deploy import client
from deploy.launcher import Deployment
from kvferry.rpc import grpc_util
from kvferry.v1 import generation_pb2, generation_pb2_grpc
from tests.conftest import NIXL, assert_alive, assert_pools_clean
from tests.e2e.test_faults import (
    LONG_PROMPT,
    _expected,
    _kill_after_first_token,
    _request,
    _spawn_router,
    sessions_alive,
)

pytestmark = pytest.mark.slow

READ_DELAY_S = 1.5  # per group (one here: the prompt's K/V is under nixl_push's 4 MiB minimum)
LEASE_S = 2.0
SLOW_READS = {"KVFERRY_FAULT_NIXL_READ_DELAY_S": str(READ_DELAY_S)}


@pytest.fixture(scope="module")
def faulty(qwen3_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Deployment]:
    """2 prefill + 1 decode worker on NIXL, slow READs, short router leases."""
    deployment = Deployment(model=str(qwen3_checkpoint), num_prefill=2, worker_args=NIXL,
                            env=SLOW_READS, router_args=["--lease-s", str(LEASE_S)],
                            log_dir=tmp_path_factory.mktemp("nixl-faults-logs")).start()
    spawned = {p.popen.pid for p in deployment.processes}
    deployment.spawned = spawned  # type: ignore[attr-defined]  # routers added later too
    yield deployment
    deployment.stop()
    assert sessions_alive(spawned) == []


def test_prefill_worker_killed_mid_read_is_prefilled_again(
        faulty: Deployment, qwen3_deployment: Deployment) -> None:
    request = _request(LONG_PROMPT, 30)
    got = asyncio.run(_kill_after_first_token(faulty, request, "prefill"))
    assert got.token_ids == _expected(qwen3_deployment, request)
    assert "retrying" in (faulty.log_dir / "router.log").read_text()
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
        faulty: Deployment, qwen3_deployment: Deployment) -> None:
    router = next(p for p in faulty.processes if p.name == "router")

    async def run() -> grpc.StatusCode:
        async with grpc_util.channel(faulty.router_address) as chan:
            stub = generation_pb2_grpc.GenerationServiceStub(chan)
            try:
                async for _, latest in client.stream(stub, _request(LONG_PROMPT, 20),
                                                     timeout_s=60):
                    if latest.token_ids:
                        os.kill(router.popen.pid, signal.SIGKILL)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

    assert asyncio.run(run()) == grpc.StatusCode.UNAVAILABLE
    router.popen.wait(10)
    faulty.processes.remove(router)
    assert_pools_clean(faulty, timeout_s=LEASE_S + 10)
    assert "lease expired" in (faulty.log_dir / "decode-0.log").read_text()
    _spawn_router(faulty)
    request = _request(LONG_PROMPT, 16)
    assert asyncio.run(client.generate(faulty.router_address, request, 60)).token_ids == \
        _expected(qwen3_deployment, request)
    assert_pools_clean(faulty)
    assert_alive(faulty)


def test_decode_worker_killed_mid_read_migrates(qwen3_checkpoint: Path,
                                                qwen3_deployment: Deployment,
                                                tmp_path: Path) -> None:
    request = _request(LONG_PROMPT, 30)
    expected = _expected(qwen3_deployment, request)
    with Deployment(model=str(qwen3_checkpoint), num_decode=2, worker_args=NIXL,
                    env=SLOW_READS, log_dir=tmp_path) as deployment:
        spawned = {p.popen.pid for p in deployment.processes}
        got = asyncio.run(_kill_after_first_token(deployment, request, "decode",
                                                  lambda s: s.reserved_blocks))
        assert got.token_ids == expected
        assert got.finished.timing.num_migrations == 1
        assert got.finished.reason == generation_pb2.FINISH_REASON_LENGTH
        assert_pools_clean(deployment)
    assert sessions_alive(spawned) == []
