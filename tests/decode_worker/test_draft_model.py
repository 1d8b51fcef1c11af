"""Speculative decoding with a draft model (decode_worker/spec/draft_model.py) in an in-process
colocated engine: the prompt prefilled here, the draft's K/V recomputed in its own pool.
Greedy and seeded tokens equal those of decoding without drafts, with the model as its own
draft (drafts nearly always accepted) and with an unrelated one-layer draft (mostly rejected,
rolled back across 4-token blocks); preemption (a draft's K/V lost with the swap) changes
nothing; every block comes back and the pool's integrity holds."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from decode_worker.engine import DecodeEngine
from decode_worker.spec.draft_model import DraftModel, check_draft, draft_pool
from kvferry.model.config import load_model_config
from kvferry.model.sampling import SamplingParams
from kvferry.model.transformer import Transformer
from kvferry.settings import SpeculativeConfig
from kvferry_kernels.dispatch import get_attention_backend
from tests.decode_worker.engines import collect_tokens, cpu_engine, run_to_idle

BLOCK_SIZE = 4
MAX_TOKENS = 24
PROMPTS = {"A": [5, 9, 13, 5, 9, 13, 7, 21, 40, 2, 9], "B": list(range(30, 47))}
GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.8, top_k=20, seed=99)


def _load(path: Path) -> Transformer:
    return Transformer(load_model_config(path), get_attention_backend("torch"), torch.float32,
                       torch.device("cpu"))


@pytest.fixture(scope="module")
def model(qwen3_checkpoint: Path) -> Transformer:
    return _load(qwen3_checkpoint)


def _engine(model: Transformer, draft: Transformer | None, blocks: int = 60) -> DecodeEngine:
    speculative = (SpeculativeConfig("draft", 3, is_adaptive=False, model="draft")
                   if draft is not None else None)
    engine = cpu_engine(model, BLOCK_SIZE, blocks, speculative=speculative)
    if draft is not None:
        assert engine.steps.drafting is not None
        engine.steps.drafting.draft = DraftModel(draft, draft_pool(draft, engine.pool))
    return engine


def _decode(engine: DecodeEngine, params: SamplingParams) -> dict[str, list[int]]:
    """Both prompts prefilled here and decoded together; each one's tokens."""
    async def one(request_id: str) -> list[int]:
        prompt = PROMPTS[request_id]
        await engine.reserve(request_id, len(prompt), MAX_TOKENS, 30.0, prompt)
        first, *_ = await engine.prefill_local(request_id, prompt, params)
        queue = engine.attach(request_id, first, params, MAX_TOKENS - 1, [])
        return await collect_tokens(queue, request_id, [first])

    async def both() -> dict[str, list[int]]:
        a, b = await asyncio.gather(one("A"), one("B"))
        return {"A": a, "B": b}

    return run_to_idle(engine, both)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_the_model_as_its_own_draft(model: Transformer, qwen3_checkpoint: Path,
                                    params: SamplingParams) -> None:
    plain = _decode(_engine(model, None), params)
    engine = _engine(model, _load(qwen3_checkpoint))
    assert _decode(engine, params) == plain
    drafting = engine.steps.drafting
    assert drafting is not None and drafting.num_draft_tokens > 0
    if params is GREEDY:  # its own argmax: accepted but for float rounding at near-ties
        assert drafting.num_accepted_tokens >= 0.9 * drafting.num_draft_tokens, drafting


def test_an_unrelated_draft_changes_nothing(model: Transformer, draft_checkpoint: Path) -> None:
    for params in (GREEDY, SEEDED):
        plain = _decode(_engine(model, None), params)
        engine = _engine(model, _load(draft_checkpoint))
        assert _decode(engine, params) == plain
        drafting = engine.steps.drafting
        assert drafting is not None and drafting.num_draft_tokens > 0
        assert drafting.num_accepted_tokens < drafting.num_draft_tokens  # rolled back


def test_preemption_loses_only_the_draft_s_k_v(model: Transformer,
                                               qwen3_checkpoint: Path) -> None:
    """A pool too small for both requests at their longest: one is swapped out and back
    (its draft K/V recomputed from the start), and the tokens do not change."""
    plain = _decode(_engine(model, None), GREEDY)
    engine = _engine(model, _load(qwen3_checkpoint), blocks=14)
    assert _decode(engine, GREEDY) == plain
    assert engine.steps.num_preemptions > 0


def test_a_draft_of_another_vocabulary_is_refused(model: Transformer,
                                                  tmp_path: Path) -> None:
    from kvferry.model.checkpoint import ModelSpec, make_model

    other = _load(make_model(tmp_path / "other", ModelSpec(vocab_size=256, num_layers=1)))
    with pytest.raises(ValueError, match="speculative_model"):
        check_draft(model, other)
