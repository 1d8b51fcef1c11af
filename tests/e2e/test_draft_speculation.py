"""Speculative decoding with a draft model (`--speculative-method draft --speculative-model
DIR`, a one-layer seeded model sharing the tiny model's tokenizer) on live deployments,
disaggregated and colocated: greedy output token-identical to transformers generate, seeded
output equal to the deployment without drafts, drafts verified and rolled back, every pool
clean. (Drafting happens once the K/V is in the decode worker, after any transport: NIXL
changes nothing here, and the n-gram tests run over it.)"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from deploy import client
from deploy.launcher import Deployment
from tests.conftest import assert_alive, assert_pools_clean
from tests.e2e.test_metrics import scrape, value
from tests.e2e.test_speculative import MAX_TOKENS, _prompts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def deployment(request: pytest.FixtureRequest, qwen3_checkpoint: Path, draft_checkpoint: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    started = Deployment(
        model=str(qwen3_checkpoint), is_colocated=request.param == "colocated",
        log_dir=tmp_path_factory.mktemp(f"draft-{request.param}"),
        worker_args=["--speculative-method", "draft", "--speculative-model",
                     str(draft_checkpoint), "--num-speculative-tokens", "3",
                     "--metrics-port", "0"]).start()
    try:
        yield started
    finally:
        started.stop()


def _drafted(deployment: Deployment) -> tuple[float, float]:
    drafted = accepted = 0.0
    for process in deployment.processes:
        if process.name.startswith(("decode", "colocated")):
            samples = scrape(process.metrics_port)
            drafted += value(samples, "kvferry_spec_decode_draft_tokens_total")
            accepted += value(samples, "kvferry_spec_decode_accepted_tokens_total")
    return drafted, accepted


def test_greedy_with_a_draft_model_matches_transformers(deployment: Deployment,
                                                        qwen3_checkpoint: Path) -> None:
    prompts = _prompts()
    requests = [client.make_request(p, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
                for p in prompts]
    results = asyncio.run(client.generate_many(deployment.router_address, requests, 300))
    hf = AutoModelForCausalLM.from_pretrained(qwen3_checkpoint, dtype=torch.float32).eval()
    for prompt, got in zip(prompts, results):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), do_sample=False, eos_token_id=None,
                              max_new_tokens=MAX_TOKENS, pad_token_id=0)
        assert got.token_ids == out[0, len(prompt):].tolist(), f"prompt of {len(prompt)}"
    drafted, accepted = _drafted(deployment)
    assert drafted > 0 and accepted < drafted, (drafted, accepted)
    usage = [r.finished.usage for r in results if r.finished is not None]
    assert sum(u.num_draft_tokens for u in usage) > 0
    assert_pools_clean(deployment)
    assert_alive(deployment)


def test_seeded_samples_with_a_draft_model_equal_those_without(
        deployment: Deployment, qwen3_deployment: Deployment) -> None:
    """n = 3 samples, seeded: as the deployment without speculation samples them."""
    request = client.make_request(_prompts()[2], temperature=0.9, seed=5, n=3,
                                  max_tokens=MAX_TOKENS, ignore_eos=True)
    got = asyncio.run(client.generate_samples(deployment.router_address, request, 120))
    want = asyncio.run(client.generate_samples(qwen3_deployment.router_address, request, 120))
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    assert_pools_clean(deployment)
