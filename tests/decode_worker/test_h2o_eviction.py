"""Heavy-hitter K/V eviction (H2O over whole blocks, kvferry/model/eviction.py) in an
in-process colocated engine over the tiny model: each step's attention mass reaches the
policy (every head's probabilities, every layer's, sum to heads x layers); past the budget
the lightest block older than the recent window leaves and nothing else moves; a sequence
never holds more than its budget however long it runs, even past the model's context; until
its first eviction it decodes what full attention decodes; re-basing changes no token.
(Preemption and abort: test_streaming_eviction.py, under both policies.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from decode_worker.receipt import KvReceipt
from decode_worker.sequence import DecodeSeq
from kvferry.cache.pool import KvPool
from kvferry.model.config import load_model_config
from kvferry.model.eviction import HeavyHitterEviction
from kvferry.model.transformer import Transformer
from kvferry.settings import KvEvictionConfig
from kvferry_kernels.dispatch import get_attention_backend
from tests.decode_worker.engines import cpu_engine, serve_local

PROMPT = [5, 9, 13, 5, 9, 13, 7, 21, 40, 2]  # 10 tokens
SMALL = KvEvictionConfig("h2o", heavy_tokens=8, recent_tokens=12)  # 2 + 3 blocks of 4


@pytest.fixture(scope="module")
def model(qwen3_checkpoint: Path) -> Transformer:
    return Transformer(load_model_config(qwen3_checkpoint), get_attention_backend("torch"),
                       torch.float32, torch.device("cpu"))


def _seq(table: list[int], tokens: int) -> DecodeSeq:
    return DecodeSeq(request_id="r", num_prompt_tokens=tokens, max_tokens=100,
                     block_table=table, lease_deadline=0.0,
                     receipt=KvReceipt(np.zeros((1, 1), bool)), arrival=0, tokens=[1])


def test_the_lightest_older_block_leaves(model: Transformer) -> None:
    """Budget 5 blocks (2 heavy + 3 recent), the table full: the next token's block makes
    the recent window the last 2 blocks and the new one; of the 3 older blocks the one with
    the least mass leaves (equal mass: the later one), with its mass; nothing else moves."""
    cfg = model.config
    pool = KvPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4, 16, torch.float32,
                  torch.device("cpu"), prefix_caching=False)
    policy = HeavyHitterEviction(SMALL, model, pool)
    assert policy.budget_blocks == 5 and policy.recent_blocks == 3
    table = pool.allocator.alloc(5)
    seq = _seq(list(table), 20)  # 20 tokens written: the next one needs a sixth block
    mass = torch.zeros(1, 24)
    mass[0, 0:4] = torch.tensor([3.0, 0.5, 0.5, 0.0])  # block 0: 4.0
    mass[0, 4:8] = 0.25  # block 1: 1.0
    mass[0, 8:12] = 1.0  # block 2: 4.0
    mass[0, 12:16] = 0.0  # block 3: recent, lightest of all
    policy.observe([seq], mass)
    policy.observe([seq], mass)  # accumulated: 8, 2, 8, 0, 0
    assert policy.needs(seq)
    free_before = pool.allocator.num_free
    policy.bound(seq)
    assert seq.block_table == [table[0], table[2], table[3], table[4]]
    assert policy._mass[seq.key] == [8.0, 8.0, 0.0, 0.0]
    assert seq.num_evicted == 4 and seq.cache_position == 16
    assert pool.allocator.num_free == free_before + 1
    assert not policy.needs(seq)
    # Equal mass: the later block leaves, so a prompt with no mass yet keeps its first.
    new = pool.allocator.alloc(1)[0]
    seq.block_table.append(new)
    seq.num_prompt_tokens += 4
    policy._mass[seq.key] = [5.0, 5.0, 5.0, 0.0, 0.0]
    policy.bound(seq)
    assert seq.block_table == [table[0], table[2], table[4], new]


def test_each_steps_mass_is_every_heads_probability(model: Transformer) -> None:
    """What a step hands the policy is, for each sequence, heads x layers in all (each
    query head's softmax sums to one in every layer), spread over its kept blocks; what the
    prefill hands it, that for each prompt token."""
    engine = cpu_engine(model, 4, 64, eviction=SMALL)
    policy = engine.steps.eviction
    assert isinstance(policy, HeavyHitterEviction)
    seen: list[list[float]] = []
    observe = policy.observe

    def recording(batch: list[DecodeSeq], mass: torch.Tensor) -> None:
        before = list(policy._mass.get(batch[0].key, []))
        observe(batch, mass)
        after = policy._mass[batch[0].key]
        seen.append([a - (before[i] if i < len(before) else 0.0)
                     for i, a in enumerate(after)])

    policy.observe = recording  # type: ignore[method-assign]
    serve_local(engine, PROMPT, 30)
    heads = model.config.num_heads * model.config.num_layers
    assert len(seen) == 1 + 29  # the prompt's prefill (one chunk of 10 tokens), each step
    assert sum(seen[0]) == pytest.approx(heads * len(PROMPT), rel=1e-4)
    for step in seen[1:]:
        assert sum(step) == pytest.approx(heads, rel=1e-4)
    assert all(m >= 0.0 for step in seen for m in step)


def test_a_sequence_holds_its_budget_and_decodes_as_full_attention_until_it_evicts(
        model: Transformer) -> None:
    plain, _ = serve_local(cpu_engine(model, 4, 64), PROMPT, 120)
    engine = cpu_engine(model, 4, 64, eviction=SMALL)
    policy = engine.steps.eviction
    assert isinstance(policy, HeavyHitterEviction)
    victims: list[tuple[int, int]] = []  # (table length, index evicted)
    evict = policy._evict_oldest

    def recording(seq: DecodeSeq) -> bool:
        before = list(seq.block_table)
        done = evict(seq)
        gone = [i for i, block in enumerate(before) if i >= len(seq.block_table)
                or seq.block_table[i] != block]
        victims.append((len(before), gone[0]))
        assert seq.block_table == before[:gone[0]] + before[gone[0] + 1:]  # order kept
        return done

    policy._evict_oldest = recording  # type: ignore[method-assign]
    tokens, steps = serve_local(engine, PROMPT, 120)
    budget = SMALL.budget_blocks(4)
    assert max(len(table) for table, _, _ in steps) == budget  # reached, never passed
    assert all(cached < budget * 4 for _, cached, _ in steps)
    assert engine.steps.eviction is not None and engine.steps.eviction.num_evicted_blocks > 20
    # Never the recent window: a block that left was older than the table's last 2 (the
    # next token's block the third); the others kept their order.
    assert len(victims) == policy.num_evicted_blocks
    assert all(index < length - 2 for length, index in victims)
    assert any(index > 0 for _, index in victims)  # chosen by mass, not always the oldest
    # Positions 10..19 fit the budget: full attention's tokens there.
    assert tokens[:10] == plain[:10]
    assert len(tokens) == 120


def test_rebasing_changes_no_token(model: Transformer) -> None:
    """Re-based whenever the rotary position reaches 24 (every kept key moved back by the
    tokens evicted since: every distance kept) against never re-based: the same tokens."""
    never = cpu_engine(model, 4, 64, eviction=SMALL)
    often = cpu_engine(model, 4, 64, eviction=SMALL)
    assert often.steps.eviction is not None
    often.steps.eviction.max_position = 24
    want, _ = serve_local(never, PROMPT, 100)
    got, steps_often = serve_local(often, PROMPT, 100)
    assert max(rope for _, _, rope in steps_often) < 24
    assert got == want


@pytest.mark.slow
def test_five_thousand_tokens_on_a_1024_token_budget(model: Transformer) -> None:
    """Past the model's context (4,096) and far past the budget: at most 64 blocks of 16."""
    config = KvEvictionConfig("h2o", heavy_tokens=512, recent_tokens=512)
    engine = cpu_engine(model, 16, 80, eviction=config)
    tokens, steps = serve_local(engine, PROMPT, 5_000)
    assert len(tokens) == 5_000
    assert max(len(table) for table, _, _ in steps) == config.budget_blocks(16) == 64
    assert max(rope for _, _, rope in steps) < model.config.max_position_embeddings
