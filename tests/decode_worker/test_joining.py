"""A decode batch starting from idle waits for the rest of its wave (decode_worker/steps.py
`DEFAULT_JOINING`): requests attached a few milliseconds apart take their first step
together and so finish together; the wait ends after a gap with nobody joining, or at the
window."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from decode_worker.engine import DecodeEngine
from decode_worker.steps import DEFAULT_JOINING
from kvferry.model.config import load_model_config
from kvferry.model.prefill_batch import NO_GATHERING, Gathering
from kvferry.model.sampling import SamplingParams
from kvferry.model.transformer import Transformer
from kvferry_kernels.dispatch import get_attention_backend
from tests.decode_worker.engines import collect_tokens, cpu_engine, push_random_prompt, run_to_idle
from tests.waiting import until

PROMPT, MAX_TOKENS = 10, 6
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model(qwen3_checkpoint: Path) -> Transformer:
    return Transformer(load_model_config(qwen3_checkpoint), get_attention_backend("torch"),
                       torch.float32, torch.device("cpu"))


def _first_and_last_steps(engine: DecodeEngine, delays_s: list[float], ids: list[str],
                          after_first_step: bool = False) -> dict[str, tuple[int, int]]:
    """`ids` reserved and pushed, then attached, each `delays_s[i]` after the one before
    (with `after_first_step`, the second once the first's first step began); each one's
    first and last step number."""
    seen: dict[str, list[int]] = {}
    original = engine.steps._step

    def recording(batch: list, is_staged: bool = False) -> list[list[int]]:
        for seq in batch:
            seen.setdefault(seq.request_id, []).append(engine.steps.num_steps)
        return original(batch, is_staged)

    engine.steps._step = recording  # type: ignore[method-assign]

    async def run() -> None:
        for i, request_id in enumerate(ids):
            await engine.reserve(request_id, PROMPT, MAX_TOKENS, 30.0)
            push_random_prompt(engine, request_id, PROMPT, seed=i)
        queues = []
        for i, (request_id, delay) in enumerate(zip(ids, delays_s)):
            await asyncio.sleep(delay)
            if after_first_step and i == 1:
                await until(lambda: ids[0] in seen, "the first one's first step")
            queues.append(engine.attach(request_id, 7, GREEDY, MAX_TOKENS - 1, []))
        await asyncio.gather(*(collect_tokens(q, r, []) for q, r in zip(queues, ids)))

    run_to_idle(engine, run)
    return {r: (steps[0], steps[-1]) for r, steps in seen.items()}


def test_a_wave_attached_apart_steps_and_finishes_together(model: Transformer) -> None:
    engine = cpu_engine(model, 4, 32)
    assert engine.steps.joining == DEFAULT_JOINING
    engine.steps.joining = Gathering(gap_s=0.5, window_s=2.0)  # margins no machine misses
    steps = _first_and_last_steps(engine, [0.0, 0.1, 0.1], ["A", "B", "C"])
    assert len(set(steps.values())) == 1, steps
    # without joining, the first attached steps alone first (the split it prevents)
    engine = cpu_engine(model, 4, 32)
    engine.steps.joining = NO_GATHERING
    steps = _first_and_last_steps(engine, [0.0, 0.0], ["A", "B"], after_first_step=True)
    assert steps["A"][0] < steps["B"][0], steps


def test_the_window_bounds_the_wait_and_a_gap_ends_it(model: Transformer) -> None:
    engine = cpu_engine(model, 4, 32)
    engine.steps.joining = Gathering(gap_s=0.5, window_s=0.6)
    # B (0.4 s after A) joins it; C (0.45 s after B, so within its gap, but 0.85 s after A:
    # past the window) does not
    steps = _first_and_last_steps(engine, [0.0, 0.4, 0.45], ["A", "B", "C"])
    assert steps["A"] == steps["B"] and steps["C"][0] > steps["A"][0], steps
    engine = cpu_engine(model, 4, 32)
    engine.steps.joining = Gathering(gap_s=0.1, window_s=5.0)
    # a lone request starts once the gap passed with nobody joining, long before the window
    steps = _first_and_last_steps(engine, [0.0, 1.0], ["A", "B"])
    assert steps["B"][0] > steps["A"][0], steps
