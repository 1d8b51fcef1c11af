"""Prompts sharing prefixes that end on
and off block boundaries, and a second chat turn, give greedy tokens identical to
`transformers` with prefix caching on (gRPC, NIXL and Ray transports, disaggregated and
colocated) and off; Usage reports what the caches saved (and, disaggregated, that the push
carried exactly the blocks the decode worker's cache lacked); different cache salts never
share; pools end clean."""

from __future__ import annotations

import asyncio
import contextlib
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
import torch

from deploy import client
from deploy.launcher import Deployment
from kvferry.cache.budget import blocks_for_tokens
from tests.conftest import DETAILS, QWEN3_BLOCK_BYTES, assert_alive, assert_pools_clean
from tests.deployments import reconfigured, routed
from tests.e2e.test_token_exact import _reference

pytestmark = pytest.mark.slow

BLOCK = 16  # the deployments' block size (the default)


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(1, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _generate(deployment: Deployment, prompts: list[list[int]], max_tokens: int = 12,
              salt: str = "") -> list[client.Completion]:
    requests = []
    for prompt in prompts:
        request = client.make_request(prompt, temperature=0.0, max_tokens=max_tokens,
                                      ignore_eos=True)
        request.cache_salt = salt
        requests.append(request)
    return asyncio.run(client.generate_many(deployment.router_address, requests, 120))


def _shared_prefix_rounds(deployment: Deployment, seed: int, salt: str = ""
                          ) -> tuple[list[list[int]], list[client.Completion]]:
    """A first request alone, then prompts sharing its prefix (on a block boundary, off it,
    the whole prompt again, shorter than it) at once, then all of them again; `salt`: the
    cache salt of them all (a test's own: what other tests cached never counts)."""
    prefix = _tokens(seed, 2 * BLOCK + 8)
    first = prefix + _tokens(seed + 1, 5)
    followers = [prefix[:2 * BLOCK] + _tokens(seed + 2, 7), prefix + _tokens(seed + 3, 20),
                 first, prefix[:2 * BLOCK], prefix[:BLOCK + 3]]
    prompts = [first] + followers + followers
    results = _generate(deployment, [first], salt=salt)
    results += _generate(deployment, followers, salt=salt)
    results += _generate(deployment, followers, salt=salt)
    return prompts, results


def _check_exact(checkpoint: Path, prompts: list[list[int]],
                 results: list[client.Completion]) -> None:
    for prompt, got in zip(prompts, results):
        assert got.token_ids == _reference(checkpoint, prompt, 12), f"{len(prompt)} tokens"


def _routed_on_caches(deployment: Deployment, name: str) -> AbstractContextManager[Deployment]:
    """`deployment` itself when it has one worker of each role; else its workers behind a
    router of their own that weighs the workers' prefix caches alone (no load, no recent
    demand), so every request goes to the prefill and decode worker holding its prefix. The
    shared router's default weights trade cached blocks for load: which worker a follower
    sent at once with four others lands on, and so what it finds cached, depends on timing."""
    if max(len(deployment.addresses("prefill")), len(deployment.addresses("decode"))) < 2:
        return contextlib.nullcontext(deployment)
    return routed(deployment, name, [*DETAILS, "--policy", "prefix", "--load-weight", "0",
                                     "--demand-weight", "0"])


@pytest.mark.parametrize("fixture", [
    "qwen3_deployment", "colocated_deployment", "qwen3_nixl_deployment",
    pytest.param("qwen3_ray_deployment", marks=pytest.mark.ray)])
def test_shared_prefixes_match_transformers(fixture: str, qwen3_checkpoint: Path,
                                            request: pytest.FixtureRequest) -> None:
    shared: Deployment = request.getfixturevalue(fixture)
    with _routed_on_caches(shared, "router-prefix-cache") as deployment:
        prompts, results = _shared_prefix_rounds(deployment, seed=1800,
                                                 salt=f"test_shared_prefixes-{fixture}")
    _check_exact(qwen3_checkpoint, prompts, results)
    cached = [r.finished.usage.cached_prompt_tokens for r in results]
    # Every full block found but the one holding the prompt's last token (recomputed): the
    # first round finds the first request's, the second also the followers' own.
    expected = [0] + [2 * BLOCK, 2 * BLOCK, 2 * BLOCK, BLOCK, BLOCK] + [
        2 * BLOCK, 3 * BLOCK, 2 * BLOCK, BLOCK, BLOCK]
    assert cached == expected
    if not shared.is_colocated:
        # One decode worker served the same requests as the prefill worker, so its cache
        # held the same blocks: the push skipped those and carried every other prompt block
        # once (a NIXL pull reads only those).
        not_shipped = [r.finished.usage.kv_bytes_not_shipped for r in results]
        assert not_shipped == [n // BLOCK * QWEN3_BLOCK_BYTES for n in expected]
        covered = [r.finished.usage.kv_bytes_shipped + r.finished.usage.kv_bytes_not_shipped
                   for r in results]
        assert covered == [blocks_for_tokens(len(p), BLOCK) * QWEN3_BLOCK_BYTES
                           for p in prompts]
    assert_pools_clean(shared)
    assert_alive(shared)


def test_a_second_chat_turn_reuses_the_first_on_both_sides(
        qwen3_checkpoint: Path, qwen3_deployment: Deployment) -> None:
    """Turn 2 = turn 1's prompt + its answer + a new message. The prefill worker holds turn
    1's prompt blocks; the decode worker holds those and the answer's, so the push skips
    them."""
    salt = "test_a_second_chat_turn"
    turn1 = _tokens(1900, 3 * BLOCK + 4)
    (first,) = _generate(qwen3_deployment, [turn1], max_tokens=2 * BLOCK, salt=salt)
    turn2 = turn1 + first.token_ids + _tokens(1901, 9)
    (second,) = _generate(qwen3_deployment, [turn2], salt=salt)
    assert second.token_ids == _reference(qwen3_checkpoint, turn2, 12)
    usage = second.finished.usage
    assert usage.cached_prompt_tokens == 3 * BLOCK  # turn 1's prompt, on the prefill worker
    # The decode worker holds turn 1's 52 prompt and 31 fed answer tokens: 5 full blocks of
    # turn 2's 93, so the push carries only the sixth.
    per_block = usage.kv_bytes_shipped
    assert per_block > 0 and usage.kv_bytes_not_shipped == 5 * per_block
    (again,) = _generate(qwen3_deployment, [turn2], salt=salt)
    assert again.token_ids == second.token_ids
    assert again.finished.usage.cached_prompt_tokens == 5 * BLOCK
    assert again.finished.usage.kv_bytes_not_shipped == 5 * per_block
    assert_pools_clean(qwen3_deployment)


def test_different_salts_never_share(qwen3_deployment: Deployment) -> None:
    prompt = _tokens(2000, 3 * BLOCK)
    (a,) = _generate(qwen3_deployment, [prompt], salt="test_different_salts-a")
    (b,) = _generate(qwen3_deployment, [prompt], salt="test_different_salts-b")
    (a2,) = _generate(qwen3_deployment, [prompt], salt="test_different_salts-a")
    assert a.token_ids == b.token_ids == a2.token_ids
    assert b.finished.usage.cached_prompt_tokens == 0
    assert b.finished.usage.kv_bytes_not_shipped == 0
    assert a2.finished.usage.cached_prompt_tokens == 2 * BLOCK


def test_caching_off_gives_the_same_tokens(qwen3_checkpoint: Path,
                                          qwen3_deployment: Deployment) -> None:
    """The shared deployment's workers restarted with --no-prefix-caching, then as they
    were."""
    deployment = qwen3_deployment
    with reconfigured(deployment, ["prefill-0", "decode-0"], ["--no-prefix-caching"]):
        prompts, results = _shared_prefix_rounds(deployment, seed=1800,
                                                 salt="test_caching_off")
        _check_exact(qwen3_checkpoint, prompts, results)
        assert all(r.finished.usage.cached_prompt_tokens == 0 for r in results)
        assert all(r.finished.usage.kv_bytes_not_shipped == 0 for r in results)
        assert_pools_clean(deployment)
