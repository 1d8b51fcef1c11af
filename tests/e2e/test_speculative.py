"""Speculative decoding (n-gram drafts) on live deployments: greedy output is still
token-identical to transformers generate, disaggregated over NIXL and colocated, on prompts
whose answers repeat spans (so drafts are made, accepted and rolled back), and every pool
comes back clean. The shared NIXL and colocated deployments speculate (tests/conftest.py), so
every other test there runs with drafts too."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from deploy import client
from deploy.launcher import Deployment
from tests.conftest import assert_alive, assert_pools_clean
from tests.e2e.test_metrics import scrape, value

pytestmark = pytest.mark.slow

MAX_TOKENS = 48


def _prompts() -> list[list[int]]:
    """Spans repeated with a period, so the continuation is likely to repeat them too."""
    gen = torch.Generator().manual_seed(7)
    prompts = []
    for period, length in ((3, 40), (5, 61), (8, 100), (13, 150), (4, 17)):
        span = torch.randint(1, 500, (period,), generator=gen).tolist()
        prompts.append((span * (length // period + 1))[:length])
    return prompts


def speculation(deployment: Deployment) -> tuple[float, float]:
    """Draft and accepted tokens over the deployment's decode-side workers."""
    drafted = accepted = 0.0
    for process in deployment.processes:
        if process.name.startswith(("decode", "colocated")):
            samples = scrape(process.metrics_port)
            drafted += value(samples, "kvferry_spec_decode_draft_tokens_total")
            accepted += value(samples, "kvferry_spec_decode_accepted_tokens_total")
    return drafted, accepted


def greedy_matches_transformers(deployment: Deployment, checkpoint: Path
                                ) -> list[client.Completion]:
    """The repeating prompts served greedily, each token-identical to transformers generate
    on `checkpoint`; the completions."""
    prompts = _prompts()
    requests = [client.make_request(p, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
                for p in prompts]
    results = asyncio.run(client.generate_many(deployment.router_address, requests, 300))
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    for prompt, got in zip(prompts, results):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), do_sample=False, eos_token_id=None,
                              max_new_tokens=MAX_TOKENS, pad_token_id=0)
        assert got.token_ids == out[0, len(prompt):].tolist(), f"prompt of {len(prompt)}"
    return results


@pytest.mark.parametrize("fixture", ["qwen3_nixl_deployment", "colocated_deployment"])
def test_greedy_with_ngram_drafts_matches_transformers(fixture: str, qwen3_checkpoint: Path,
                                                        request: pytest.FixtureRequest) -> None:
    deployment: Deployment = request.getfixturevalue(fixture)
    drafted0, accepted0 = speculation(deployment)
    results = greedy_matches_transformers(deployment, qwen3_checkpoint)
    drafted1, accepted1 = speculation(deployment)
    drafted, accepted = drafted1 - drafted0, accepted1 - accepted0
    assert drafted > 0, "no drafts were made: the test checks nothing speculative"
    assert 0 < accepted < drafted, (drafted, accepted)  # some accepted, some rolled back
    # Each request's usage reports its own drafts; together they are the workers' counts
    # (these requests ran alone on the deployment: the tests of a module run one by one).
    usages = [got.finished.usage for got in results if got.finished is not None]
    assert len(usages) == len(results)
    assert sum(u.num_draft_tokens for u in usages) == drafted
    assert sum(u.num_accepted_tokens for u in usages) == accepted
    assert all(u.num_accepted_tokens <= u.num_draft_tokens for u in usages)
    assert_pools_clean(deployment)
    assert_alive(deployment)
