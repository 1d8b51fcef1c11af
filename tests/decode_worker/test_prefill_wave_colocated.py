"""A colocated worker gathering a wave of prompts (kvferry/model/prefill_batch.py `Gathering`,
issue 62) never holds its decoding: while a prompt waits for the rest of its wave, the
sequences already running keep stepping, and the prompt is prefilled once the window closes
(nobody else arrived); both streams run to their end."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from kvferry.model.config import load_model_config
from kvferry.model.prefill_batch import Gathering
from kvferry.model.transformer import Transformer
from kvferry_kernels.dispatch import get_attention_backend
from tests.decode_worker.engines import GREEDY, collect_tokens, cpu_engine, run_to_idle
from tests.waiting import until

PROMPT = [5 + (i * 7) % 60 for i in range(12)]
PROMPT_B = [3 + (i * 5) % 50 for i in range(10)]


@pytest.fixture(scope="module")
def model(qwen3_checkpoint: Path) -> Transformer:
    return Transformer(load_model_config(qwen3_checkpoint), get_attention_backend("torch"),
                       torch.float32, torch.device("cpu"))


def test_decoding_goes_on_while_a_colocated_prompt_gathers(model: Transformer) -> None:
    engine = cpu_engine(model, 4, 128)
    steps = engine.steps
    steps.batcher.gathering = Gathering(gap_s=0.3, window_s=1.0)
    forward = steps.batcher._forward
    steps_at_forward: list[int] = []

    def recording(items: list) -> list:
        steps_at_forward.append(steps.num_steps)
        return forward(items)

    steps.batcher._forward = recording  # type: ignore[method-assign]

    async def body() -> tuple[list[int], list[int], int]:
        await engine.reserve("A", len(PROMPT), 400, 60.0, PROMPT)
        first_a, *_ = await engine.prefill_local("A", PROMPT, GREEDY)  # alone: waits the gap
        stream_a = engine.attach("A", first_a, GREEDY, 399, [])
        await until(lambda: steps.num_steps > 0, "A decoding")
        await engine.reserve("B", len(PROMPT_B), 2, 60.0, PROMPT_B)
        submitted_at_step = steps.num_steps
        first_b, *_ = await asyncio.wait_for(engine.prefill_local("B", PROMPT_B, GREEDY), 30.0)
        stream_b = engine.attach("B", first_b, GREEDY, 1, [])
        tokens_b = await collect_tokens(stream_b, "B", [first_b])
        tokens_a = await collect_tokens(stream_a, "A", [first_a])
        return tokens_a, tokens_b, submitted_at_step

    tokens_a, tokens_b, submitted_at_step = run_to_idle(engine, body)
    assert len(steps_at_forward) == 2  # A's prefill, then B's
    # A kept stepping through B's 0.3 s gathering wait (its steps take milliseconds)
    assert steps_at_forward[1] >= submitted_at_step + 2
    assert len(tokens_a) == 400 and len(tokens_b) == 2
