"""32 concurrent greedy requests give exactly the tokens each gives
alone — through batched prefill and the continuous-batching decode loop."""

from __future__ import annotations

import asyncio

import pytest
import torch

from deploy import client
from deploy.launcher import Deployment
from kvferry.faults import tag
from tests.conftest import assert_alive, assert_pools_clean, worker_stats

pytestmark = pytest.mark.slow

NUM_REQUESTS = 32


def _requests() -> list:
    gen = torch.Generator().manual_seed(7)
    requests = []
    for i in range(NUM_REQUESTS):
        length = int(torch.randint(1, 200, (1,), generator=gen))
        prompt = torch.randint(1, 512, (length,), generator=gen).tolist()
        requests.append(client.make_request(prompt, temperature=0.0, max_tokens=8 + i % 24,
                                            ignore_eos=i % 3 == 0))
    return requests


def check_concurrent_equals_alone(deployment: Deployment) -> None:
    requests = _requests()

    async def alone() -> list[client.Completion]:
        return [await client.generate(deployment.router_address, r, 300) for r in requests]

    concurrent = asyncio.run(client.generate_many(deployment.router_address, requests, 300))
    sequential = asyncio.run(alone())
    for i, (a, b) in enumerate(zip(concurrent, sequential)):
        assert a.token_ids == b.token_ids, f"request {i}"
        assert a.finished.reason == b.finished.reason
    assert_pools_clean(deployment)
    assert_alive(deployment)


def test_concurrent_equals_alone_disaggregated(qwen3_deployment: Deployment) -> None:
    check_concurrent_equals_alone(qwen3_deployment)


def test_concurrent_equals_alone_colocated(colocated_deployment: Deployment) -> None:
    check_concurrent_equals_alone(colocated_deployment)


def test_colocated_and_disaggregated_give_identical_tokens(
        qwen3_deployment: Deployment, colocated_deployment: Deployment) -> None:
    requests = _requests()

    disaggregated = asyncio.run(client.generate_many(qwen3_deployment.router_address, requests,
                                                     300))
    colocated = asyncio.run(client.generate_many(colocated_deployment.router_address, requests,
                                                 300))
    for i, (a, b) in enumerate(zip(disaggregated, colocated)):
        assert a.token_ids == b.token_ids, f"request {i}"
        assert b.finished.timing.kv_transfer_s == 0.0  # nothing shipped when colocated
    assert_pools_clean(colocated_deployment)


@pytest.mark.parametrize("fixture", ["qwen3_2p2d_deployment", "colocated_deployment"],
                         ids=["disaggregated", "colocated"])
def test_chunked_prefill_gives_the_same_tokens(fixture: str, qwen3_deployment: Deployment,
                                               request: pytest.FixtureRequest) -> None:
    """Prompts up to ~200 tokens through 48-token chunks and an 80-token batch budget (the
    shared deployments' CHUNKED flags): the chunks attend over their own cached chunks and
    interleave with other requests' steps."""
    chunked: Deployment = request.getfixturevalue(fixture)
    assert "--prefill-chunk-size" in chunked.worker_args
    requests = _requests()
    got = asyncio.run(client.generate_many(chunked.router_address, requests, 300))
    assert_pools_clean(chunked)
    expected = asyncio.run(client.generate_many(qwen3_deployment.router_address, requests, 300))
    for i, (a, b) in enumerate(zip(got, expected)):
        assert a.token_ids == b.token_ids, f"request {i}"


def test_cancelled_prefills_are_dropped_or_abandoned(qwen3_2p2d_deployment: Deployment) -> None:
    """A burst of long prompts through a small prefill budget (CHUNKED), cancelled while the
    prefill workers still hold prompt tokens to compute: nothing is left held anywhere."""
    deployment = qwen3_2p2d_deployment

    def pending_prefill_tokens() -> int:
        return sum(s.num_pending_prefill_tokens for s in worker_stats(deployment))

    async def burst() -> int:
        prompts = [list(range(1 + i, 301 + i)) for i in range(8)]
        # Each batch holding one of them waits 0.5 s before its forward (a per-request fault),
        # so the prompts are still pending when the polling looks, on any machine.
        slow = tag(prefill_batch_delay_s=0.5)
        tasks = [asyncio.ensure_future(client.generate(
            deployment.router_address,
            client.make_request(p, f"burst{i}{slow}", max_tokens=50, ignore_eos=True), 60))
            for i, p in enumerate(prompts)]
        pending = 0
        while not pending and not all(t.done() for t in tasks):
            pending = await asyncio.to_thread(pending_prefill_tokens)
            await asyncio.sleep(0.01)  # paces the polling
        for task in tasks:
            task.cancel()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(o, asyncio.CancelledError) or isinstance(o, client.Completion)
                   for o in outcomes), outcomes
        return pending

    assert asyncio.run(burst()) > 0  # cancelled with prompt tokens still to prefill
    assert_pools_clean(deployment)
    assert_alive(deployment)
    got = asyncio.run(client.generate(deployment.router_address, client.make_request(
        list(range(5, 105)), max_tokens=5, ignore_eos=True), 60))
    assert len(got.token_ids) == 5
