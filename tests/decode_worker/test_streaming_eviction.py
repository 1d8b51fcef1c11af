"""Streaming K/V eviction (kvferry/model/eviction.py) in an in-process colocated engine over
the tiny model: a sequence never holds more than its budget's blocks however long it runs,
even past the model's context; until its first eviction it decodes what full attention
decodes; re-basing (every kept key rotated back to its index in the cache) changes no token,
which checks the sinks' forward rotation against the classic formulation (the window rotated
back); what the prefix cache holds stays the prompt's own pages; every block comes back,
under preemption and abort too (there with H2O's policy as well)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from kvferry.model.config import load_model_config
from kvferry.model.eviction import HeavyHitterEviction
from kvferry.model.sampling import SamplingParams
from kvferry.model.transformer import Transformer
from kvferry.settings import KvEvictionConfig
from kvferry_kernels.dispatch import get_attention_backend
from tests.decode_worker.engines import collect_tokens, cpu_engine, run_to_idle, serve_local
from tests.waiting import until

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [5, 9, 13, 5, 9, 13, 7, 21, 40, 2]  # 10 tokens
SMALL = KvEvictionConfig("streaming", sink_tokens=4, window_tokens=16)  # 1 + 4 blocks of 4


@pytest.fixture(scope="module")
def model(qwen3_checkpoint: Path) -> Transformer:
    return Transformer(load_model_config(qwen3_checkpoint), get_attention_backend("torch"),
                       torch.float32, torch.device("cpu"))


def test_rotating_keys_composes_with_rope(model: Transformer) -> None:
    """A key rotated at p, then by s, is the key rotated at p + s (RoPE evaluated in float64:
    fp32 angles p * theta are themselves off by ~ulp(p) at p in the thousands)."""
    gen = torch.Generator().manual_seed(0)
    cfg = model.config
    k = torch.randn(5, cfg.num_kv_heads, cfg.head_dim, generator=gen, dtype=torch.float64)
    positions = torch.tensor([0, 3, 17, 100, 4000], dtype=torch.float64)

    def at(pos: torch.Tensor) -> torch.Tensor:
        angles = pos[:, None] * model.inv_freq.double()[None, :]
        emb = torch.cat((angles, angles), dim=-1)[:, None, :]
        half = cfg.head_dim // 2
        rotated = k * emb.cos() + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * emb.sin()
        return rotated.float()

    for shift in (1, 16, 1000, -3):
        torch.testing.assert_close(model.rotate_keys(at(positions), shift),
                                   at(positions + shift), atol=1e-5, rtol=1e-5)


def test_a_sequence_holds_its_budget_and_decodes_as_full_attention_until_it_evicts(
        model: Transformer) -> None:
    plain, _ = serve_local(cpu_engine(model, 4, 64), PROMPT, 120)
    engine = cpu_engine(model, 4, 64, eviction=SMALL)
    tokens, steps = serve_local(engine, PROMPT, 120)
    budget = SMALL.budget_blocks(4)
    assert budget == 5
    assert max(len(table) for table, _, _ in steps) == budget  # reached, never passed
    assert all(cached < budget * 4 for _, cached, _ in steps)
    assert engine.steps.eviction is not None and engine.steps.eviction.num_evicted_blocks > 20
    # Positions 10..19 fit the budget: full attention's tokens there.
    assert tokens[:10] == plain[:10]
    assert len(tokens) == 120


def test_rebasing_changes_no_token(model: Transformer) -> None:
    """Re-based whenever the rotary position reaches 24 (every kept key rotated back to its
    index in the cache, the sinks to their original keys: the classic positions within the
    cache) against never re-based (the sinks rotated forward): the same tokens."""
    never = cpu_engine(model, 4, 64, eviction=SMALL)
    often = cpu_engine(model, 4, 64, eviction=SMALL)
    assert often.steps.eviction is not None
    often.steps.eviction.max_position = 24
    want, steps_never = serve_local(never, PROMPT, 100)
    got, steps_often = serve_local(often, PROMPT, 100)
    assert max(rope for _, _, rope in steps_often) < 24
    assert max(rope for _, _, rope in steps_never) == 10 + 99 - 1  # text positions
    assert got == want


@pytest.mark.slow
def test_past_the_context_on_a_1024_token_budget(model: Transformer) -> None:
    """Past the model's context (4,096) and five times the budget: at most 64 blocks of 16 at
    every step (sinks 16 + window 1,008 = 1,024 tokens), re-based past 4,096."""
    config = KvEvictionConfig("streaming", sink_tokens=16, window_tokens=1008)
    engine = cpu_engine(model, 16, 80, eviction=config)
    num_tokens = 5_000
    assert num_tokens > model.config.max_position_embeddings
    tokens, steps = serve_local(engine, PROMPT, num_tokens)
    assert len(tokens) == num_tokens and len(steps) == num_tokens - 1
    assert max(len(table) for table, _, _ in steps) == config.budget_blocks(16) == 64
    assert max(rope for _, _, rope in steps) < model.config.max_position_embeddings


# The same budget (5 blocks of 4) under each policy.
H2O_SMALL = KvEvictionConfig("h2o", heavy_tokens=8, recent_tokens=12)  # 2 + 3 blocks of 4


@pytest.mark.parametrize("config", [SMALL, H2O_SMALL], ids=["streaming", "h2o"])
def test_preemption_and_abort_keep_eviction_whole(model: Transformer,
                                                  config: KvEvictionConfig) -> None:
    """Two evicting sequences on a pool too small for both at their budget (5 blocks each, 9
    usable): the newer one is swapped out with its kept blocks and its eviction state (H2O:
    its blocks' mass), and resumes where it was, each decoding what it decodes alone; a
    third, aborted after its evictions began, gives every block back. Integrity holds at
    the end, and the policy forgot every sequence."""
    prompt_b = [33, 2, 71, 33, 2, 71, 8, 19]
    alone = {rid: serve_local(cpu_engine(model, 4, 64, eviction=config), p, 80)[0]
             for rid, p in (("A", PROMPT), ("B", prompt_b))}
    engine = cpu_engine(model, 4, 9, eviction=config)

    async def one(request_id: str, prompt: list[int], abort_after: int = 0) -> list[int]:
        await engine.reserve(request_id, len(prompt), 80, 60.0, prompt)
        first, *_ = await engine.prefill_local(request_id, prompt, GREEDY)
        queue = engine.attach(request_id, first, GREEDY, 79, [])
        if abort_after:
            await until(lambda: engine._seqs[request_id].num_evicted > 0
                        and len(engine._seqs[request_id].tokens) >= abort_after, "evicting")
            engine.abort(request_id)
        return await collect_tokens(queue, request_id, [first])

    async def run() -> dict[str, list[int]]:
        a, b = await asyncio.gather(one("A", PROMPT), one("B", prompt_b))
        await one("C", PROMPT, abort_after=30)
        return {"A": a, "B": b}

    got = run_to_idle(engine, run)
    assert engine.pool.num_usable_blocks == 9
    assert engine.steps.num_preemptions > 0
    assert got == alone
    policy = engine.steps.eviction
    assert policy is not None and not policy._sinks
    if isinstance(policy, HeavyHitterEviction):
        assert not policy._mass
