"""With temperature above 0, tokens sampled with speculation follow the distribution of those
sampled without: a two-sample chi-square test through the decode worker's step loop.

Two sets of requests on the tiny seeded model (the same prompt K/V, different seeds: the
two sides share no random stream, so the test compares distributions, not draws): one set
decodes plainly, the other verifies drafts. The drafts are each output position's most
frequent token on the plain side, so they are accepted often (and rejected often), and a
verifier biased towards its drafts would show at once. For each of the three sampled output
positions the counts of both sides are compared by the chi-square test of homogeneity
(tokens seen fewer than MIN_EXPECTED times on the two sides together are pooled into one
category), each at the level FALSE_ALARM of test_sampling_distribution.py, so the test as a
whole raises a false alarm with probability under 3 x 2e-5 (< 1e-4; that module's docstring
measures the asymptotic law's real rate).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest
import torch

from decode_worker.engine import DecodeEngine
from kvferry.model.config import load_model_config
from kvferry.model.sampling import SamplingParams
from kvferry.model.transformer import Transformer
from kvferry.settings import SpeculativeConfig
from kvferry_kernels.dispatch import get_attention_backend
from tests.decode_worker.engines import collect_tokens, cpu_engine, push_random_prompt
from tests.kvferry.model.test_sampling_distribution import FALSE_ALARM, _chi2_critical

BLOCK_SIZE = 4
PROMPT = 10
MAX_TOKENS = 4  # the first token (given, as a prefill worker's) and three sampled
NUM_REQUESTS = 1500  # per side
CONCURRENT = 100
POOL_BLOCKS = CONCURRENT * 6
FIRST_TOKEN = 7
MIN_EXPECTED = 20  # a token's count on both sides together, below which it is pooled
PARAMS = {"temperature": 0.8, "top_k": 6}


@pytest.fixture(scope="module")
def model(qwen3_checkpoint: Path) -> Transformer:
    return Transformer(load_model_config(qwen3_checkpoint), get_attention_backend("torch"),
                       torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def plain(model: Transformer) -> list[list[int]]:
    """The plain side: seeds 0..NUM_REQUESTS-1 without drafts."""
    return _sample(cpu_engine(model, BLOCK_SIZE, POOL_BLOCKS), range(NUM_REQUESTS))


def _modes(sample: list[list[int]]) -> list[int]:
    return [Counter(t[i] for t in sample).most_common(1)[0][0] for i in range(MAX_TOKENS - 1)]


class ModeDrafts:
    """Drafts the most frequent token of each output position (a fixed guess per position)."""

    def __init__(self, modes: list[int]) -> None:
        self.modes = modes
        self.seen = 0

    def extend(self, tokens: list[int]) -> None:
        self.seen += len(tokens)

    def propose(self, k: int) -> list[int]:
        # It has seen the outputs so far (no prompt: the test reserves without its tokens),
        # the first one given; modes[j] is the mode of output j + 1.
        index = self.seen - 1
        return self.modes[index: index + k]


def _sample(engine: DecodeEngine, seeds: range) -> list[list[int]]:
    """Each seed's generated tokens (the first, given, left out); CONCURRENT at a time."""
    async def one(request_id: str, seed: int) -> list[int]:
        await engine.reserve(request_id, PROMPT, MAX_TOKENS, 30.0)
        push_random_prompt(engine, request_id, PROMPT, 0)  # the same prompt for all
        queue = engine.attach(request_id, FIRST_TOKEN, SamplingParams(**PARAMS, seed=seed),
                              MAX_TOKENS - 1, [])
        return await collect_tokens(queue, request_id, [])

    async def run() -> list[list[int]]:
        engine.start()
        try:
            out: list[list[int]] = []
            for start in range(0, len(seeds), CONCURRENT):
                batch = seeds[start: start + CONCURRENT]
                out += await asyncio.gather(*(one(f"r{seed}", seed) for seed in batch))
            stats = engine.stats(check_integrity=True)
            assert stats.integrity_ok, stats.integrity_error
            return out
        finally:
            await engine.stop()
    return asyncio.run(run())


def _homogeneity(a: Counter[int], b: Counter[int]) -> tuple[float, int]:
    """Chi-square statistic of two equal-sized samples' counts, and its degrees of freedom."""
    pooled_a = pooled_b = 0
    statistic, categories = 0.0, 0
    for token in set(a) | set(b):
        if a[token] + b[token] < MIN_EXPECTED:
            pooled_a, pooled_b = pooled_a + a[token], pooled_b + b[token]
            continue
        statistic += (a[token] - b[token]) ** 2 / (a[token] + b[token])
        categories += 1
    if pooled_a + pooled_b:
        statistic += (pooled_a - pooled_b) ** 2 / (pooled_a + pooled_b)
        categories += 1
    return statistic, categories - 1


def test_sampling_with_drafts_follows_the_distribution_without(
        model: Transformer, plain: list[list[int]]) -> None:
    assert all(len(t) == MAX_TOKENS - 1 for t in plain)
    modes = _modes(plain)
    engine = cpu_engine(model, BLOCK_SIZE, POOL_BLOCKS,
                        speculative=SpeculativeConfig("ngram", 3, is_adaptive=False))
    assert engine.steps.drafting is not None
    engine.steps.drafting.make_proposer = lambda seq: ModeDrafts(modes)
    seeds = range(10**6, 10**6 + NUM_REQUESTS)  # streams the plain side never used
    speculative = _sample(engine, seeds)
    drafting = engine.steps.drafting
    # drafts were verified and both accepted and rejected, often
    assert drafting.num_accepted_tokens > NUM_REQUESTS // 4, drafting
    assert drafting.num_draft_tokens - drafting.num_accepted_tokens > NUM_REQUESTS // 4
    for i in range(MAX_TOKENS - 1):
        statistic, df = _homogeneity(Counter(t[i] for t in plain),
                                     Counter(t[i] for t in speculative))
        assert df >= 2, f"output {i + 1}: too few tokens to compare"
        assert statistic < _chi2_critical(df, FALSE_ALARM), (i + 1, statistic, df)


def test_the_test_sees_a_verifier_biased_towards_its_drafts(
        model: Transformer, plain: list[list[int]]) -> None:
    """The same comparison against a sample of other seeds in which a third of the tokens
    were replaced by the draft (a verifier accepting too readily): the chi-square rejects it
    at every position (the test has power)."""
    other = _sample(cpu_engine(model, BLOCK_SIZE, POOL_BLOCKS),
                    range(10**6, 10**6 + NUM_REQUESTS))
    modes = _modes(plain)
    gen = torch.Generator().manual_seed(0)
    biased = [[modes[i] if torch.rand(1, generator=gen).item() < 1 / 3 else token
               for i, token in enumerate(t)] for t in other]
    for i in range(MAX_TOKENS - 1):
        statistic, df = _homogeneity(Counter(t[i] for t in plain),
                                     Counter(t[i] for t in biased))
        assert statistic > _chi2_critical(df, FALSE_ALARM), (i + 1, statistic, df)

