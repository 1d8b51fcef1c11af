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

from deploy import client
from deploy.launcher import Deployment
from tests.conftest import assert_alive, assert_pools_clean
from tests.e2e.test_speculative import (
    MAX_TOKENS,
    _prompts,
    greedy_matches_transformers,
    speculation,
)

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


def test_greedy_with_a_draft_model_matches_transformers(deployment: Deployment,
                                                        qwen3_checkpoint: Path) -> None:
    results = greedy_matches_transformers(deployment, qwen3_checkpoint)
    drafted, accepted = speculation(deployment)
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
