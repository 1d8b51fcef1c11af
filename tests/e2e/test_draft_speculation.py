"""Speculative decoding with a draft model (`--speculative-method draft --speculative-model
DIR`, a one-layer seeded model sharing the tiny model's tokenizer) on live deployments,
disaggregated with the draft's prompt K/V recomputed on the decode worker
(`--speculative-draft-kv recompute`) and built by the prefill worker and shipped (the default
over grpc), and colocated: greedy output token-identical to
transformers generate, seeded output equal to the deployment without drafts, drafts verified
and rolled back, the decode worker's draft prefilling the prompts only where they were not
shipped, every pool clean. (Recomputed drafting happens once the K/V is in the decode worker,
after any transport: NIXL changes nothing there, and the n-gram tests run over it. Shipping
needs the grpc transport.)"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy import client
from deploy.launcher import Deployment
from tests.conftest import assert_alive, assert_pools_clean
from tests.deployments import reconfigured
from tests.e2e.test_metrics import scrape, value
from tests.e2e.test_speculative import (
    MAX_TOKENS,
    _prompts,
    greedy_matches_transformers,
    speculation,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["recomputed", "colocated", "shipped"])
def deployment(request: pytest.FixtureRequest, qwen3_checkpoint: Path, draft_checkpoint: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    mode = ["--speculative-draft-kv", "recompute"] if request.param == "recomputed" else []
    started = Deployment(
        model=str(qwen3_checkpoint), is_colocated=request.param == "colocated",
        log_dir=tmp_path_factory.mktemp(f"draft-{request.param}"),
        worker_args=["--speculative-method", "draft", "--speculative-model",
                     str(draft_checkpoint), "--num-speculative-tokens", "3",
                     "--metrics-port", "0", *mode]).start()
    started.draft_kv = request.param  # type: ignore[attr-defined]
    try:
        yield started
    finally:
        started.stop()


def test_greedy_with_a_draft_model_matches_transformers(deployment: Deployment,
                                                        qwen3_checkpoint: Path) -> None:
    before = draft_prefill_tokens(deployment)
    results = greedy_matches_transformers(deployment, qwen3_checkpoint)
    drafted, accepted = speculation(deployment)
    assert drafted > 0 and accepted < drafted, (drafted, accepted)
    usage = [r.finished.usage for r in results if r.finished is not None]
    assert sum(u.num_draft_tokens for u in usage) > 0
    prompts = sum(len(p) for p in _prompts())
    outputs = sum(len(r.token_ids) for r in results)
    prefilled = draft_prefill_tokens(deployment) - before
    if deployment.draft_kv == "shipped":  # type: ignore[attr-defined]
        assert prefilled <= outputs < prompts, (prefilled, outputs, prompts)
    else:
        assert prefilled >= prompts, (prefilled, prompts)
    assert_pools_clean(deployment)
    assert_alive(deployment)


def draft_prefill_tokens(deployment: Deployment) -> float:
    """Positions the decode-side workers' draft models prefilled so far."""
    return sum(value(scrape(p.metrics_port), "kvferry_spec_decode_draft_prefill_tokens_total")
               for p in deployment.processes if p.name.startswith(("decode", "colocated")))


def test_seeded_samples_with_a_draft_model_equal_those_without(
        deployment: Deployment, qwen3_deployment: Deployment) -> None:
    """n = 3 samples, seeded: as the deployment without speculation samples them."""
    request = client.make_request(_prompts()[2], temperature=0.9, seed=5, n=3,
                                  max_tokens=MAX_TOKENS, ignore_eos=True)
    got = asyncio.run(client.generate_samples(deployment.router_address, request, 120))
    want = asyncio.run(client.generate_samples(qwen3_deployment.router_address, request, 120))
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    assert_pools_clean(deployment)


def test_greedy_with_a_draft_model_over_nixl_matches_transformers(
        qwen3_nixl_deployment: Deployment, qwen3_checkpoint: Path,
        draft_checkpoint: Path) -> None:
    """The shared NIXL deployment's decode workers restarted drafting with the draft model:
    NIXL carries no draft pages, so each decode worker recomputes the draft's prompt K/V;
    greedy output token-identical to transformers."""
    deployment = qwen3_nixl_deployment
    flags = ["--speculative-method", "draft", "--speculative-model", str(draft_checkpoint),
             "--num-speculative-tokens", "3"]
    with reconfigured(deployment, ["decode-0", "decode-1"], flags):
        results = greedy_matches_transformers(deployment, qwen3_checkpoint)
        usage = [r.finished.usage for r in results if r.finished is not None]
        drafted = sum(u.num_draft_tokens for u in usage)
        assert drafted > sum(u.num_accepted_tokens for u in usage) >= 0, usage
        assert draft_prefill_tokens(deployment) >= sum(len(p) for p in _prompts())
        assert_pools_clean(deployment)
        assert_alive(deployment)
