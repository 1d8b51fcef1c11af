"""Parallel sampling (sampling.n) on live deployments: one prefill and one push for the n
samples, and sample i token for token what a request of its own with seed + i gives;
disaggregated over gRPC and NIXL, and colocated; a stop string ends one sample alone; n is
refused past --max-samples and where seed + n overflows; every pool comes back clean."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from deploy import client
from deploy.launcher import Deployment, Process
from kvferry.cache.budget import blocks_for_tokens
from kvferry.faults import tag
from kvferry.rpc import grpc_util
from tests.conftest import (
    QWEN3_BLOCK_BYTES,
    assert_alive,
    assert_pools_clean,
    worker_stats,
)
from tests.deployments import kill_busy_decode, respawn

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 1000
N = 4
SEED = 4321


def _prompt(seed: int, length: int = PROMPT_TOKENS) -> list[int]:
    return torch.randint(1, 500, (length,), generator=torch.Generator().manual_seed(seed)
                         ).tolist()


def _queries(deployment: Deployment, role: str) -> int:
    """Prompt tokens the `role` workers looked up in their prefix caches: one prefill's
    prompt each time a prompt is prefilled."""
    return sum(s.prefix_cache_queries for s in worker_stats(deployment) if s.role == role)


def _alone(deployment: Deployment, prompt: list[int], max_tokens: int, **sampling: object
           ) -> list[list[int]]:
    """Each sample's tokens as requests of their own, seeds SEED + i."""
    requests = [client.make_request(prompt, max_tokens=max_tokens, seed=SEED + i, **sampling)
                for i in range(N)]
    done = asyncio.run(client.generate_many(deployment.router_address, requests, 120))
    return [c.token_ids for c in done]


@pytest.mark.parametrize("temperature", [0.8, 0.0], ids=["seeded", "greedy"])
def test_n_samples_prefill_and_ship_once_and_equal_requests_of_their_own(
        qwen3_deployment: Deployment, temperature: float) -> None:
    deployment = qwen3_deployment
    prompt = _prompt(int(temperature * 10))
    prefilled = _queries(deployment, "prefill")
    request = client.make_request(prompt, max_tokens=24, seed=SEED, n=N,
                                  temperature=temperature, ignore_eos=True)
    samples = asyncio.run(client.generate_samples(deployment.router_address, request, 120))
    # one prefill of the prompt, one push of its K/V
    assert _queries(deployment, "prefill") - prefilled == PROMPT_TOKENS
    usages = [s.finished.usage for s in samples if s.finished is not None]
    assert len(usages) == N
    pushed = blocks_for_tokens(PROMPT_TOKENS, 16) * QWEN3_BLOCK_BYTES
    assert {u.kv_bytes_shipped + u.kv_bytes_not_shipped for u in usages} == {pushed}
    assert all(u.completion_tokens == 24 == len(s.token_ids) for u, s in zip(usages, samples))
    assert [s.token_ids for s in samples] == _alone(deployment, prompt, 24,
                                                    temperature=temperature, ignore_eos=True)
    if temperature > 0:
        assert len({tuple(s.token_ids) for s in samples}) > 1
    assert_pools_clean(deployment)


@pytest.mark.parametrize("fixture", ["qwen3_nixl_deployment", "colocated_deployment"])
def test_samples_equal_requests_of_their_own_over_nixl_and_colocated(
        fixture: str, request: pytest.FixtureRequest) -> None:
    """Both deployments speculate too (tests/conftest.py): each sample drafts on its own."""
    deployment: Deployment = request.getfixturevalue(fixture)
    prompt = _prompt(11, 300)
    samples = asyncio.run(client.generate_samples(deployment.router_address,
                                                  client.make_request(
                                                      prompt, max_tokens=20, seed=SEED, n=N,
                                                      temperature=0.9, ignore_eos=True), 120))
    assert [s.token_ids for s in samples] == _alone(deployment, prompt, 20, temperature=0.9,
                                                    ignore_eos=True)
    assert [client.finish_reason_name(s.finished) for s in samples] == ["FINISH_REASON_LENGTH"] * N
    assert_pools_clean(deployment)
    assert_alive(deployment)


def test_a_stop_token_ends_its_sample_alone(qwen3_deployment: Deployment) -> None:
    """A stop token one sample meets ends that sample (STOP); the others go on to LENGTH."""
    deployment = qwen3_deployment
    prompt = _prompt(3, 40)
    free = asyncio.run(client.generate_samples(deployment.router_address, client.make_request(
        prompt, max_tokens=16, seed=SEED, n=N, temperature=1.0, ignore_eos=True), 60))
    stop = free[0].token_ids[5]  # sample 0's sixth token
    stopped = asyncio.run(client.generate_samples(deployment.router_address,
                                                  client.make_request(
                                                      prompt, max_tokens=16, seed=SEED, n=N,
                                                      temperature=1.0, ignore_eos=True,
                                                      stop_token_ids=[stop]), 60))
    for before, after in zip(free, stopped):
        cut = before.token_ids.index(stop) + 1 if stop in before.token_ids else None
        assert after.token_ids == before.token_ids[:cut]
        reason = "FINISH_REASON_STOP" if cut is not None else "FINISH_REASON_LENGTH"
        assert client.finish_reason_name(after.finished) == reason
    assert client.finish_reason_name(stopped[0].finished) == "FINISH_REASON_STOP"
    assert_pools_clean(deployment)


@pytest.mark.parametrize(("sampling", "field"), [
    ({"n": 17}, "sampling.n"),
    ({"n": -1}, "sampling.n"),
    ({"n": 3, "seed": (1 << 63) - 2}, "sampling.seed"),
])
def test_bad_n_is_refused_naming_the_field(qwen3_deployment: Deployment,
                                           sampling: dict[str, int], field: str) -> None:
    request = client.make_request([1, 2, 3], max_tokens=4, **sampling)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        asyncio.run(client.generate_samples(qwen3_deployment.router_address, request, 30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (caught.value.details() or "")


def test_samples_migrate_when_their_decode_worker_dies(qwen3_deployment: Deployment,
                                                       qwen3_2p2d_deployment: Deployment) -> None:
    """Kill -9 of the decode worker under a request of 3 samples: each unfinished sample goes
    on as a request of its own on the other pair and ends with exactly its undisturbed
    tokens; the surviving workers' pools come back clean."""
    deployment = qwen3_2p2d_deployment
    prompt = _prompt(21, 80)
    sampling = {"temperature": 1.0, "seed": SEED, "max_tokens": 200, "ignore_eos": True}
    undisturbed = [c.token_ids for c in asyncio.run(client.generate_many(
        qwen3_deployment.router_address,
        [client.make_request(prompt, **{**sampling, "seed": SEED + i}) for i in range(3)],
        120))]
    request = client.make_request(prompt, n=3, **sampling)
    # paced (10 ms a step): the steps after the kill point outlast the poll finding the victim
    request.request_id = "migrate-samples" + tag(decode_step_delay_s=0.01)

    async def run() -> tuple[list[client.Completion], Process]:
        samples = [client.Completion() for _ in range(3)]
        victim = None
        async with grpc_util.channel(deployment.router_address) as chan:
            async for msg in client.public_stub(chan).Generate(request, timeout=120):
                client.add_response(samples[msg.sample_index], msg, 0.0)
                if victim is None and len(samples[0].token_ids) >= 20:
                    victim = await kill_busy_decode(deployment)
        assert victim is not None
        return samples, victim

    samples, victim = asyncio.run(run())
    respawn(victim.name, deployment)
    assert [s.token_ids for s in samples] == undisturbed
    assert all(s.finished is not None and s.finished.timing.num_migrations >= 1
               for s in samples)
    assert_pools_clean(deployment)
