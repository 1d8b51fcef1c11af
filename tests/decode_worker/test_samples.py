"""Parallel sampling in an in-process decode engine (decode_worker/samples.py): n samples of
one reservation share the prompt's full blocks, each copies the partial last one, and sample i
decodes exactly what a request of its own with seed + i decodes; aborting one sample or the
whole request, preempting samples (a pool too small for all of them) and speculating leave
every block free and the pool's integrity intact."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from decode_worker.engine import DecodeEngine
from decode_worker.sequence import DecodeEvent, FinishedEvent, TokensEvent
from kvferry.cache.budget import blocks_for_tokens, blocks_needed
from kvferry.errors import InvalidArgument
from kvferry.model.config import load_model_config
from kvferry.model.sampling import FinishReason, SamplingParams
from kvferry.model.transformer import Transformer
from kvferry.settings import SpeculativeConfig
from kvferry_kernels.dispatch import get_attention_backend
from tests.decode_worker.engines import cpu_engine, push_random_prompt
from tests.waiting import until, within

BLOCK_SIZE = 4
MAX_TOKENS = 12
FIRST_TOKENS = [7, 7, 30, 41]  # the prefill worker's draws for samples 0..3
SEED = 1234
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, seed=SEED)


@pytest.fixture(scope="module")
def model(qwen3_checkpoint: Path) -> Transformer:
    return Transformer(load_model_config(qwen3_checkpoint), get_attention_backend("torch"),
                       torch.float32, torch.device("cpu"))


async def _collect(queue: asyncio.Queue[DecodeEvent], samples: int
                   ) -> tuple[dict[int, list[int]], dict[int, FinishReason]]:
    """Each sample's tokens and finish reason, until every sample finished."""
    tokens: dict[int, list[int]] = {i: [] for i in range(samples)}
    reasons: dict[int, FinishReason] = {}
    while len(reasons) < samples:
        event = await within(queue.get(), "the next decode event")
        if isinstance(event, TokensEvent):
            tokens[event.sample_index] += event.token_ids
        else:
            assert isinstance(event, FinishedEvent), event
            reasons[event.sample_index] = event.reason
    return tokens, reasons


def _run(engine: DecodeEngine, prompt: int, params: SamplingParams, samples: int,
         during=None) -> tuple[dict[int, list[int]], dict[int, FinishReason], list[int]]:
    """One request of `samples` samples (prompt K/V pushed, first tokens FIRST_TOKENS):
    each sample's tokens and reason, and the blocks every table held at its first step.
    `during(engine)` runs once the samples step. Afterwards every block is free."""
    async def run():
        engine.start()
        try:
            await engine.reserve("g", prompt, MAX_TOKENS, 30.0, num_samples=samples)
            push_random_prompt(engine, "g", prompt, 5)
            queue = engine.attach("g", FIRST_TOKENS[0], params, MAX_TOKENS - 1, [],
                                  sample_first_token_ids=FIRST_TOKENS[1:samples])
            await until(lambda: (len(engine.steps.running) == samples
                                 and engine.steps.num_steps > 0) or engine.steps.swapped,
                        "the samples forked and stepping")
            tables = [list(s.block_table) for s in engine.steps.running]
            if during is not None:
                during(engine)
            tokens, reasons = await _collect(queue, samples)
            await until(lambda: not engine.steps.running and engine.is_idle,
                        "the request gone")
            stats = engine.stats(check_integrity=True)
            assert stats.integrity_ok, stats.integrity_error
            assert stats.free_blocks == engine.pool.num_usable_blocks, stats
            return tokens, reasons, tables
        finally:
            await engine.stop()
    return asyncio.run(run())


def _alone(model: Transformer, prompt: int, params: SamplingParams, first: int
           ) -> list[int]:
    """A request of one sample with these parameters and first token."""
    tokens, _, _ = _run_single(cpu_engine(model, BLOCK_SIZE, 64), prompt, params, first)
    return tokens


def _run_single(engine: DecodeEngine, prompt: int, params: SamplingParams, first: int):
    async def run():
        engine.start()
        try:
            await engine.reserve("one", prompt, MAX_TOKENS, 30.0)
            push_random_prompt(engine, "one", prompt, 5)
            queue = engine.attach("one", first, params, MAX_TOKENS - 1, [])
            tokens, reasons = await _collect(queue, 1)
            return tokens[0], reasons[0], None
        finally:
            await engine.stop()
    return asyncio.run(run())


@pytest.mark.parametrize("prompt", [10, 12], ids=["partial-last-block", "whole-blocks"])
@pytest.mark.parametrize("params", [SAMPLED, SamplingParams(temperature=0.0)],
                         ids=["seeded", "greedy"])
def test_each_sample_equals_a_request_of_its_own(model: Transformer, prompt: int,
                                                 params: SamplingParams) -> None:
    engine = cpu_engine(model, BLOCK_SIZE, 64)
    tokens, reasons, tables = _run(engine, prompt, params, 4)
    for i in range(4):
        alone = _alone(model, prompt, params.for_sample(i), FIRST_TOKENS[i])
        assert tokens[i] == alone, f"sample {i}"
        assert reasons[i] is FinishReason.LENGTH
    # The prompt's full blocks are held once, by every sample; nothing else is shared.
    full = prompt // BLOCK_SIZE
    assert all(t[:full] == tables[0][:full] for t in tables)
    private = [b for t in tables for b in t[full:]]
    assert len(private) == len(set(private)) >= 4  # each sample's blocks past them its own
    assert not set(private) & set(tables[0][:full])
    if params.seed is not None:
        assert len({tuple(t) for t in tokens.values()}) > 1  # samples differ


def test_the_reservation_holds_a_spare_block_per_further_sample(model: Transformer) -> None:
    engine = cpu_engine(model, BLOCK_SIZE, 64)

    async def run() -> None:
        granted = await engine.reserve("g", 10, MAX_TOKENS, 30.0, num_samples=4)
        assert granted.num_blocks == blocks_for_tokens(11, BLOCK_SIZE) + 3
        stats = engine.stats()
        assert stats.projected_blocks == blocks_needed(10, MAX_TOKENS, BLOCK_SIZE, 4)
        with pytest.raises(InvalidArgument, match="sample_first_token_ids"):
            engine.attach("g", 7, SAMPLED, MAX_TOKENS - 1, [], sample_first_token_ids=[1])
        engine.abort("g")
        assert engine.is_idle and engine.pool.allocator.num_free == engine.pool.num_usable_blocks
    asyncio.run(run())


def test_aborting_one_sample_leaves_the_others(model: Transformer) -> None:
    engine = cpu_engine(model, BLOCK_SIZE, 64)
    tokens, reasons, _ = _run(engine, 10, SAMPLED, 4, during=lambda e: e.abort("g", 2))
    assert reasons[2] is FinishReason.ABORT
    assert [reasons[i] for i in (0, 1, 3)] == [FinishReason.LENGTH] * 3
    for i in (0, 1, 3):
        assert tokens[i] == _alone(model, 10, SAMPLED.for_sample(i), FIRST_TOKENS[i])


def test_aborting_the_request_ends_every_sample(model: Transformer) -> None:
    engine = cpu_engine(model, BLOCK_SIZE, 64)
    _, reasons, _ = _run(engine, 10, SAMPLED, 4, during=lambda e: e.abort("g"))
    assert set(reasons.values()) == {FinishReason.ABORT}


def test_preempted_samples_resume_bit_for_bit(model: Transformer) -> None:
    """An older request and a request of 4 samples in a pool too small for both at their
    longest: samples (the newest) are swapped out and back, and every sequence still decodes
    its own tokens."""
    engine = cpu_engine(model, BLOCK_SIZE, blocks_needed(10, MAX_TOKENS, BLOCK_SIZE, 4) + 3)

    async def run() -> tuple[list[int], dict[int, list[int]]]:
        engine.start()
        try:
            await engine.reserve("x", 10, MAX_TOKENS, 30.0)
            push_random_prompt(engine, "x", 10, 5)
            older = engine.attach("x", 9, SAMPLED, MAX_TOKENS - 1, [])
            await engine.reserve("g", 10, MAX_TOKENS, 30.0, num_samples=4)
            push_random_prompt(engine, "g", 10, 5)
            group = engine.attach("g", FIRST_TOKENS[0], SAMPLED, MAX_TOKENS - 1, [],
                                  sample_first_token_ids=FIRST_TOKENS[1:])
            (alone, _), (tokens, _) = await asyncio.gather(_collect(older, 1),
                                                           _collect(group, 4))
            await until(lambda: engine.is_idle, "both requests gone")
            stats = engine.stats(check_integrity=True)
            assert stats.integrity_ok, stats.integrity_error
            assert stats.free_blocks == engine.pool.num_usable_blocks, stats
            return alone[0], tokens
        finally:
            await engine.stop()

    older, tokens = asyncio.run(run())
    assert engine.steps.num_preemptions > 0
    assert older == _alone(model, 10, SAMPLED, 9)
    for i in range(4):
        assert tokens[i] == _alone(model, 10, SAMPLED.for_sample(i), FIRST_TOKENS[i])


def test_samples_speculate_each_on_its_own(model: Transformer) -> None:
    """n-gram drafts per sample (each its own proposer): the tokens do not change."""
    engine = cpu_engine(model, BLOCK_SIZE, 64,
                        speculative=SpeculativeConfig("ngram", 3, 1, 2, is_adaptive=False))
    tokens, _, _ = _run(engine, 10, SAMPLED, 4)
    assert engine.steps.drafting is not None and engine.steps.drafting.num_draft_tokens > 0
    for i in range(4):
        assert tokens[i] == _alone(model, 10, SAMPLED.for_sample(i), FIRST_TOKENS[i])


def test_the_prompt_s_blocks_are_held_once(model: Transformer) -> None:
    """n = 4 on a 1,000-token prompt (62 full blocks of 16 and 8 tokens in a 63rd): at every
    step the pool holds the 62 full blocks once and one block per sample, 66 in all, where
    four requests of their own would hold 4 x 63."""
    engine = cpu_engine(model, 16, 300)
    used: list[int] = []
    step = engine.steps._step

    def spy(batch, *args):  # type: ignore[no-untyped-def]
        used.append(engine.pool.num_usable_blocks - engine.pool.allocator.num_free)
        return step(batch, *args)

    engine.steps._step = spy  # type: ignore[method-assign]

    async def run() -> None:
        engine.start()
        try:
            await engine.reserve("g", 1000, 8, 30.0, num_samples=4)
            push_random_prompt(engine, "g", 1000, 5)
            queue = engine.attach("g", FIRST_TOKENS[0], SAMPLED, 7, [],
                                  sample_first_token_ids=FIRST_TOKENS[1:])
            tokens, _ = await _collect(queue, 4)
            assert all(len(t) == 7 for t in tokens.values())
            await until(lambda: engine.is_idle, "the request gone")
        finally:
            await engine.stop()

    asyncio.run(run())
    assert used and set(used) == {62 + 4}, used
