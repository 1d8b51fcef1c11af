"""Issue 4, acceptance 1: 32 concurrent greedy requests give exactly the tokens each gives
alone — through batched prefill and the continuous-batching decode loop."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvferry import client
from kvferry.launcher import Deployment
from tests.conftest import assert_alive, assert_pools_clean

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

    async def together() -> list[client.Completion]:
        return await asyncio.gather(*(client.generate(deployment.router_address, r, 300)
                                      for r in requests))

    async def alone() -> list[client.Completion]:
        return [await client.generate(deployment.router_address, r, 300) for r in requests]

    concurrent = asyncio.run(together())
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

    async def run(address: str) -> list[client.Completion]:
        return await asyncio.gather(*(client.generate(address, r, 300) for r in requests))

    disaggregated = asyncio.run(run(qwen3_deployment.router_address))
    colocated = asyncio.run(run(colocated_deployment.router_address))
    for i, (a, b) in enumerate(zip(disaggregated, colocated)):
        assert a.token_ids == b.token_ids, f"request {i}"
        assert b.finished.timing.kv_transfer_s == 0.0  # nothing shipped when colocated
    assert_pools_clean(colocated_deployment)
