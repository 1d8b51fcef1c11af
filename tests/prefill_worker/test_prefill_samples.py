"""Parallel sampling on a prefill worker: one forward, n first tokens, sample i drawn as a
request of its own with seed + i would draw it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvferry.errors import InvalidArgument
from kvferry.model.sampling import SamplingParams
from prefill_worker.engine import FirstTokenEvent, PrefillEngine
from tests.prefill_worker.test_parked_kv import PROMPT, _engine

SAMPLED = SamplingParams(temperature=1.0, seed=99, max_tokens=8)


async def _first(engine: PrefillEngine, request_id: str, params: SamplingParams,
                 num_samples: int = 1) -> FirstTokenEvent:
    events = engine.prefill(request_id, PROMPT, params, "", 30.0, num_samples=num_samples)
    event = await anext(events)
    await events.aclose()
    assert isinstance(event, FirstTokenEvent)
    return event


def test_n_first_tokens_from_one_forward_equal_n_requests(qwen3_checkpoint: Path) -> None:
    async def run() -> None:
        engine, _ = _engine(qwen3_checkpoint, 32)
        try:
            group = await _first(engine, "g", SAMPLED, num_samples=6)
            tokens = [group.token_id, *group.sample_token_ids]
            assert len(tokens) == 6
            alone = [(await _first(engine, f"r{i}", SAMPLED.for_sample(i))).token_id
                     for i in range(6)]
            assert tokens == alone
            assert len(set(tokens)) > 1  # the seeds differ, so do the draws (seed 99)
            with pytest.raises(InvalidArgument, match="num_samples"):
                await _first(engine, "bad", SAMPLED, num_samples=0)
        finally:
            await engine.stop()
    asyncio.run(run())
