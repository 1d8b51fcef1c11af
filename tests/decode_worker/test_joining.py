"""A decode batch starting from idle waits for the rest of its wave (decode_worker/steps.py
`DEFAULT_JOINING`): requests attached a few milliseconds apart take their first step
together and so finish together; a lone one waits one gap."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from decode_worker.engine import DecodeEngine
from decode_worker.steps import DEFAULT_JOINING
from kvferry.model.config import load_model_config
from kvferry.model.prefill_batch import NO_GATHERING
from kvferry.model.sampling import SamplingParams
from kvferry.model.transformer import Transformer
from kvferry_kernels.dispatch import get_attention_backend
from tests.decode_worker.engines import collect_tokens, cpu_engine, push_random_prompt, run_to_idle

PROMPT, MAX_TOKENS = 10, 6
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model(qwen3_checkpoint: Path) -> Transformer:
    return Transformer(load_model_config(qwen3_checkpoint), get_attention_backend("torch"),
                       torch.float32, torch.device("cpu"))


def _first_and_last_steps(engine: DecodeEngine, apart_s: float, ids: list[str]
                          ) -> dict[str, tuple[int, int]]:
    """`ids` reserved and pushed, then attached `apart_s` apart; each one's first and last
    step number."""
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
        for request_id in ids:
            queues.append(engine.attach(request_id, 7, GREEDY, MAX_TOKENS - 1, []))
            await asyncio.sleep(apart_s)
        await asyncio.gather(*(collect_tokens(q, r, []) for q, r in zip(queues, ids)))

    run_to_idle(engine, run)
    return {r: (steps[0], steps[-1]) for r, steps in seen.items()}


def test_a_wave_attached_apart_steps_and_finishes_together(model: Transformer) -> None:
    apart = DEFAULT_JOINING.gap_s / 3
    steps = _first_and_last_steps(cpu_engine(model, 4, 32), apart, ["A", "B", "C"])
    assert len(set(steps.values())) == 1, steps
    # without joining, the first attached steps alone first (the split it prevents)
    engine = cpu_engine(model, 4, 32)
    engine.steps.joining = NO_GATHERING
    engine.steps._step = _slow(engine.steps._step, apart * 2)  # a step outlasts the gap
    steps = _first_and_last_steps(engine, apart, ["A", "B"])
    assert steps["A"][0] < steps["B"][0], steps


def test_a_lone_request_waits_one_gap_once(model: Transformer) -> None:
    engine = cpu_engine(model, 4, 32)
    started: list[float] = []
    original = engine.steps._step

    def timed(batch: list, is_staged: bool = False) -> list[list[int]]:
        started.append(time.monotonic())
        return original(batch, is_staged)

    engine.steps._step = timed  # type: ignore[method-assign]
    attached: list[float] = []

    async def run() -> None:
        await engine.reserve("A", PROMPT, MAX_TOKENS, 30.0)
        push_random_prompt(engine, "A", PROMPT, seed=0)
        attached.append(time.monotonic())
        await collect_tokens(engine.attach("A", 7, GREEDY, MAX_TOKENS - 1, []), "A", [])

    run_to_idle(engine, run)
    first_wait = started[0] - attached[0]
    assert DEFAULT_JOINING.gap_s <= first_wait < DEFAULT_JOINING.window_s + 0.05, first_wait


def _slow(step, seconds: float):
    def slow(batch: list, is_staged: bool = False) -> list[list[int]]:
        time.sleep(seconds)
        return step(batch, is_staged)
    return slow
