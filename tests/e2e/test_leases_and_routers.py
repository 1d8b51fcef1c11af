"""A request that waits longer than its reservation's lease still completes (the
router renews the leases of the reservations it holds), and two routers sharing workers can
run requests with the same public id at once, with an Abort through one never touching the
other's request (ids are scoped per router downstream)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest

from deploy import client
from deploy.launcher import Deployment, Process
from kvferry.faults import tag
from kvferry.rpc import grpc_util
from kvferry.v1 import generation_pb2
from tests.conftest import assert_alive, assert_pools_clean
from tests.deployments import routed

pytestmark = pytest.mark.slow

LONG_PROMPT = [i % 500 + 1 for i in range(300)]  # pushed in 4 chunks (one per layer)


def _request(prompt: list[int], max_tokens: int, request_id: str = ""
             ) -> generation_pb2.GenerateRequest:
    return client.make_request(prompt, request_id, temperature=0.0, max_tokens=max_tokens,
                               ignore_eos=True)


def _expected(reference: Deployment, request: generation_pb2.GenerateRequest) -> list[int]:
    plain = generation_pb2.GenerateRequest()
    plain.CopyFrom(request)
    plain.request_id = ""
    return asyncio.run(client.generate(reference.router_address, plain, 60)).token_ids


def test_a_request_waiting_past_its_lease_completes(qwen3_deployment: Deployment) -> None:
    """Lease 0.5 s; the push's chunks are 0.6 s apart, so the reservation outlives several
    leases before its K/V is in, and chunk arrivals alone would not keep it (each gap is
    longer than a lease): only the router's renewals do. On the shared workers, behind a
    router of its own; the slow push armed for this request alone (kvferry/faults.py)."""
    request = _request(LONG_PROMPT, 12, uuid.uuid4().hex + tag(push_chunk_delay_s=0.6))
    with routed(qwen3_deployment, "router-lease", ["--lease-s", "0.5"]) as deployment:
        got = asyncio.run(client.generate(deployment.router_address, request, 60))
        assert got.token_ids == _expected(qwen3_deployment, request)
        assert_pools_clean(deployment)
        assert_alive(deployment)
    assert deployment.log_dir is not None
    for decode in deployment.log_dir.glob("decode*.log"):
        assert not [line for line in decode.read_text().splitlines()
                    if f"request {request.request_id}@" in line and "lease expired" in line]


@pytest.fixture(scope="module")
def two_routers(qwen3_deployment: Deployment) -> Iterator[tuple[Deployment, Process]]:
    """The shared workers behind their own router and a second one."""
    with routed(qwen3_deployment, "router-1", []) as deployment, \
            routed(qwen3_deployment, "router-2", []) as second:
        yield deployment, second.processes[-1]


def test_same_id_on_two_routers_both_complete(two_routers: tuple[Deployment, Process],
                                              qwen3_deployment: Deployment) -> None:
    deployment, second = two_routers
    first = _request(LONG_PROMPT[:80], 16, "same-id")
    other = _request(LONG_PROMPT[100:150], 16, "same-id")

    async def both() -> list[client.Completion]:
        return await asyncio.gather(client.generate(deployment.router_address, first, 60),
                                    client.generate(second.address, other, 60))

    for _ in range(3):  # at the same moment, several times
        got_first, got_other = asyncio.run(both())
        assert got_first.request_id == got_other.request_id == "same-id"
        assert got_first.token_ids == _expected(qwen3_deployment, first)
        assert got_other.token_ids == _expected(qwen3_deployment, other)
    assert_pools_clean(deployment)


def test_abort_through_one_router_spares_the_other(two_routers: tuple[Deployment, Process],
                                                   qwen3_deployment: Deployment) -> None:
    deployment, second = two_routers
    victim = _request(LONG_PROMPT[:60], 300, "twin")
    survivor = _request(LONG_PROMPT[200:260], 300, "twin")

    async def run() -> tuple[client.Completion, client.Completion]:
        async with grpc_util.channel(deployment.router_address) as chan_a, \
                grpc_util.channel(second.address) as chan_b:
            stub_a, stub_b = client.public_stub(chan_a), client.public_stub(chan_b)
            started = [asyncio.Event(), asyncio.Event()]

            async def follow(i: int, stub, request) -> client.Completion:
                completion = client.Completion()
                async for _, completion in client.stream(stub, request, 120):
                    if completion.token_ids:
                        started[i].set()
                return completion

            tasks = [asyncio.create_task(follow(0, stub_a, victim)),
                     asyncio.create_task(follow(1, stub_b, survivor))]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            await stub_a.Abort(generation_pb2.AbortRequest(request_id="twin"), timeout=10)
            aborted, finished = await asyncio.gather(*tasks)
            return aborted, finished

    aborted, finished = asyncio.run(run())
    assert client.finish_reason_name(aborted.finished) == "FINISH_REASON_ABORT"
    assert client.finish_reason_name(finished.finished) == "FINISH_REASON_LENGTH"
    assert finished.token_ids == _expected(qwen3_deployment, survivor)
    assert_pools_clean(deployment)
