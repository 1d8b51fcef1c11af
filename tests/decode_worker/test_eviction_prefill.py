"""A prompt past the K/V budget on a colocated worker, prefilled in chunks that evict as they go
(kvferry/model/prefill_batch.py with kvferry/model/eviction.py): up to the budget, then a
block at a time, each chunk attending over what the decode step would have kept. So the
tokens are those of the same prompt fed one token at a time through the decode step with the
policy bounding before each (the reference StreamingLLM's evaluation runs; under H2O the
prefill's attention reports its mass as the decode step's does), and a request
re-prefilled with its prompt and the tokens it had generated (what a migration does)
continues with exactly the tokens it would have generated. Parallel samples forked from an
evicted prompt each decode what one request does; every block comes back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from decode_worker.engine import DecodeEngine
from decode_worker.receipt import KvReceipt
from decode_worker.sequence import DecodeSeq, step_inputs
from kvferry.cache.pool import KvPool
from kvferry.model.config import load_model_config
from kvferry.model.eviction import make_eviction
from kvferry.model.sampling import SamplingParams
from kvferry.model.transformer import Transformer
from kvferry.settings import KvEvictionConfig, SpeculativeConfig
from kvferry_kernels import kv_quant
from kvferry_kernels.dispatch import get_attention_backend
from tests.decode_worker.engines import cpu_engine, run_to_idle, serve_local

GREEDY = SamplingParams(temperature=0.0)
BLOCK = 4
STREAMING = KvEvictionConfig("streaming", sink_tokens=4, window_tokens=16)  # 1 + 4 blocks
H2O = KvEvictionConfig("h2o", heavy_tokens=8, recent_tokens=12)  # 2 + 3 blocks
PROMPT = [5 + (i * 7) % 60 for i in range(37)]  # 10 blocks' worth: twice the budget


@pytest.fixture(scope="module")
def model(qwen3_checkpoint: Path) -> Transformer:
    return Transformer(load_model_config(qwen3_checkpoint), get_attention_backend("torch"),
                       torch.float32, torch.device("cpu"))


def _stepwise(model: Transformer, config: KvEvictionConfig, prompt: list[int], count: int,
              kv_cache_dtype: str = "auto") -> list[int]:
    """The reference: `prompt` fed one token at a time through the decode step, the policy
    bounding the sequence before each step, then `count` greedy tokens."""
    cfg = model.config
    pool = KvPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK, 32, torch.float32,
                  torch.device("cpu"), prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    policy = make_eviction(config, model, pool)
    assert policy is not None
    seq = DecodeSeq(request_id="ref", num_prompt_tokens=0, max_tokens=len(prompt) + count,
                    block_table=[], lease_deadline=0.0, receipt=KvReceipt(np.zeros((1, 1), bool)),
                    arrival=0, tokens=[prompt[0]])
    out: list[int] = []
    for t in range(len(prompt) + count - 1):
        policy.bound(seq)
        if len(seq.block_table) * BLOCK <= seq.cache_position:
            seq.block_table += pool.allocator.alloc(1)
        assert len(seq.block_table) <= policy.budget_blocks
        rows = step_inputs([seq], BLOCK)
        mass = (torch.zeros(1, rows.block_tables.shape[1] * BLOCK) if policy.wants_mass
                else None)
        logits = model.decode(torch.tensor([seq.tokens[-1]]), rows.positions, rows.slots,
                              rows.block_tables, pool, seq_lens=rows.seq_lens, mass=mass)
        if mass is not None:
            policy.observe([seq], mass)
        nxt = prompt[t + 1] if t + 1 < len(prompt) else int(logits.argmax(dim=-1))
        if t + 1 >= len(prompt):
            out.append(nxt)
        seq.tokens.append(nxt)
    return out


def _engine(model: Transformer, config: KvEvictionConfig, kv_cache_dtype: str = "auto"
            ) -> DecodeEngine:
    return cpu_engine(model, BLOCK, 64, kv_cache_dtype, eviction=config, chunk_size=16,
                      token_budget=64)


def test_a_prompt_past_the_budget_is_prefilled_as_decoding_it_would_have(
        model: Transformer) -> None:
    engine = _engine(model, STREAMING)
    chunks: list[tuple[int, int, int]] = []  # (tokens, cache index, table length) planned
    plan = engine.steps.batcher._plan

    def recording() -> list:
        items = plan()
        chunks.extend((it.end - it.start, it.start - it.evicted, len(it.job.block_table))
                      for it in items)
        return items

    engine.steps.batcher._plan = recording  # type: ignore[method-assign]
    got = serve_local(engine, PROMPT, 40)[0]
    assert got == _stepwise(model, STREAMING, PROMPT, 40)
    # Up to the budget in chunks of at most 16, then a block at a time from index 16 (the
    # oldest window block evicted before each): every chunk within the budget's 20 tokens.
    assert [n for n, _, _ in chunks] == [16, 4, 4, 4, 4, 4, 1]
    assert all(start + n <= 20 for n, start, _ in chunks)
    assert [start for _, start, _ in chunks][2:] == [16] * 5


def test_a_migrated_request_continues_with_the_tokens_it_would_have_generated(
        model: Transformer) -> None:
    """The router's migration re-prefills prompt + the tokens streamed so far on another
    worker: here, after 23 of 60 tokens, on a fresh engine."""
    whole = serve_local(_engine(model, STREAMING), PROMPT, 60)[0]
    moved = serve_local(_engine(model, STREAMING), PROMPT + whole[:23], 60 - 23)[0]
    assert moved == whole[23:]


def test_h2o_prefills_a_long_prompt_as_decoding_it_would_have(model: Transformer) -> None:
    """The prefill's attention reports each chunk's mass (summed over its tokens: what the
    decode steps over the same tokens add one by one), so H2O picks the same blocks to
    evict while prefilling as decoding the prompt would have; the budget holds at every
    step, and a migrated request continues as it would have."""
    got, steps = serve_local(_engine(model, H2O), PROMPT, 40)
    assert got == _stepwise(model, H2O, PROMPT, 40)
    assert max(len(table) for table, _, _ in steps) <= H2O.budget_blocks(BLOCK)
    moved = serve_local(_engine(model, H2O), PROMPT + got[:23], 40 - 23)[0]
    assert moved == got[23:]


def test_samples_forked_from_an_evicted_prompt_each_decode_as_one_request(
        model: Transformer) -> None:
    """Greedy samples forked after the prompt evicted (sharing its kept blocks, the sinks
    rotated for 20 evicted tokens): each the same tokens as a request of one sample, so
    no sample rewrote a sink another reads."""
    engine = _engine(model, STREAMING)
    alone = serve_local(_engine(model, STREAMING), PROMPT, 30)[0]

    async def run() -> dict[int, list[int]]:
        await engine.reserve("S", len(PROMPT), 30, 60.0, PROMPT, num_samples=3)
        local = await engine.prefill_local("S", PROMPT, GREEDY)
        queue = engine.attach("S", local.token_id, GREEDY, 29, [],
                              sample_first_token_ids=local.sample_token_ids)
        tokens: dict[int, list[int]] = {0: [local.token_id]}
        for i, first in enumerate(local.sample_token_ids, start=1):
            tokens[i] = [first]
        done = 0
        while done < 3:
            event = await queue.get()
            if hasattr(event, "token_ids"):
                tokens[event.sample_index] += event.token_ids
            else:
                done += 1
        return tokens

    got = run_to_idle(engine, run)
    assert got == {0: alone, 1: alone, 2: alone}


def test_a_request_that_opts_out_keeps_every_token(model: Transformer) -> None:
    """sampling.kv_eviction "none" on an evicting worker: the long prompt is prefilled whole
    and the sequence grows past the budget, decoding what a worker without eviction
    decodes; nothing is evicted."""
    kept = SamplingParams(temperature=0.0, kv_eviction="none")
    plain = serve_local(cpu_engine(model, BLOCK, 64), PROMPT, 30)[0]
    engine = _engine(model, STREAMING)
    got, steps = serve_local(engine, PROMPT, 30, kept)
    assert got == plain
    assert engine.steps.eviction is not None and engine.steps.eviction.num_evicted_blocks == 0
    longest = max(len(table) for table, _, _ in steps)
    assert longest == -(-(len(PROMPT) + 29) // BLOCK) > STREAMING.budget_blocks(BLOCK)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("config", [STREAMING, H2O], ids=["streaming", "h2o"])
def test_quantized_pages_evict_as_stepwise_decoding_would(
        model: Transformer, config: KvEvictionConfig, kv_cache_dtype: str) -> None:
    """Eviction on int8 and fp8 pages: the prompt prefilled past the budget gives the tokens
    of the stepwise reference on the same pages, within the budget at every step, and a
    migrated request continues as it would have (its sinks re-rotated from the same first
    values, so quantized to the same codes)."""
    engine = _engine(model, config, kv_cache_dtype)
    got, steps = serve_local(engine, PROMPT, 40)
    assert got == _stepwise(model, config, PROMPT, 40, kv_cache_dtype)
    assert max(len(table) for table, _, _ in steps) <= config.budget_blocks(BLOCK)
    assert engine.steps.eviction is not None and engine.steps.eviction.num_evicted_blocks > 0
    moved = serve_local(_engine(model, config, kv_cache_dtype), PROMPT + got[:23], 40 - 23)[0]
    assert moved == got[23:]


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_sinks_are_rotated_from_their_first_values(
        model: Transformer, kv_cache_dtype: str) -> None:
    """Each eviction rewrites the sinks' keys as the quantization of their first stored
    values rotated by every token evicted so far (one rotation from the original, so the
    rounding never compounds), with a new scale per token and head; their values and every
    other page are left as they were."""
    cfg = model.config
    pool = KvPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK, 16, torch.float32,
                  torch.device("cpu"), prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    policy = make_eviction(STREAMING, model, pool)
    assert policy is not None
    budget = STREAMING.budget_blocks(BLOCK)
    table = pool.allocator.alloc(budget)
    torch.manual_seed(0)
    pool.write_keys(torch.tensor(table), torch.randn(cfg.num_layers, budget, BLOCK,
                                                     cfg.num_kv_heads, cfg.head_dim))
    sink = torch.tensor(table[:1])
    first = pool.read_keys(sink)
    seq = DecodeSeq(request_id="q", num_prompt_tokens=0, max_tokens=4 * BLOCK * budget,
                    block_table=list(table), lease_deadline=0.0,
                    receipt=KvReceipt(np.zeros((1, 1), bool)), arrival=0,
                    tokens=list(range(budget * BLOCK + 1)))
    for evicted in (1, 2):
        before = pool.cache.clone()
        policy.bound(seq)
        assert seq.num_evicted == evicted * BLOCK and len(seq.block_table) == budget - 1
        values, scale = kv_quant.quantize(model.rotate_keys(first, evicted * BLOCK),
                                          kv_cache_dtype)
        want = kv_quant.dequantize(values, scale)
        assert torch.equal(pool.read_keys(sink), want)
        assert not torch.allclose(want, first, atol=0.1)  # really rotated
        changed = (pool.cache != before).nonzero()
        assert changed[:, 1].unique().tolist() == [0] and changed[:, 2].unique().tolist() == [
            table[0]]  # keys of the sink block only
        seq.block_table.append(pool.allocator.alloc(1)[0])
        seq.tokens += [0] * BLOCK


def test_ngram_speculation_under_streaming_eviction_decodes_what_decoding_alone_does(
        model: Transformer) -> None:
    """N-gram drafts verified while the window moves: a step's drafts never reach past the
    sequence's next eviction (there decoding them one at a time would evict between them), so
    the greedy tokens are those of the same policy without speculation, many drafts are
    accepted, every table stays within the budget and every block comes back."""
    prompt = [7 + (i * 5) % 9 for i in range(37)]  # repeats: the n-gram proposer finds drafts
    alone = serve_local(_engine(model, STREAMING), prompt, 120)[0]
    speculative = SpeculativeConfig("ngram", 3, 1, 2, is_adaptive=False)
    engine = cpu_engine(model, BLOCK, 64, eviction=STREAMING, chunk_size=16, token_budget=64,
                        speculative=speculative)
    got, steps = serve_local(engine, prompt, 120)
    assert got == alone
    drafting = engine.steps.drafting
    assert drafting is not None and drafting.num_accepted_tokens >= 30, drafting
    assert len(steps) < 120 - 30  # steps that kept several tokens each
    assert max(len(table) for table, _, _ in steps) <= STREAMING.budget_blocks(BLOCK)
    assert engine.steps.eviction is not None
    assert engine.steps.eviction.num_evicted_blocks >= (37 + 120) // BLOCK - 5


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_the_dense_stage_follows_the_moving_window(model: Transformer,
                                                   kv_cache_dtype: str) -> None:
    """Streaming eviction with the dense K/V stage (the CPU default for quantized pages): the
    stage's rows are indexed by cache index, as the tables are, and a row is copied in again
    once its sequence evicted (a block gone, the sinks re-rotated). Every decode step reads
    the stage, and the tokens are the stepwise reference's, which reads the pages."""
    engine = cpu_engine(model, BLOCK, 64, kv_cache_dtype, eviction=STREAMING, chunk_size=16,
                        token_budget=64, stage_bytes=64 << 20)
    staged: list[bool] = []
    original = engine.steps._step

    def recording(batch: list, is_staged: bool = False) -> list[list[int]]:
        staged.append(is_staged)
        return original(batch, is_staged)

    engine.steps._step = recording  # type: ignore[method-assign]
    got = serve_local(engine, PROMPT, 40)[0]
    assert got == _stepwise(model, STREAMING, PROMPT, 40, kv_cache_dtype)
    assert staged and all(staged)
    stage = engine.steps.stage
    assert stage is not None and engine.steps.eviction is not None
    # copied in at the first step, then again after each of the ~10 evictions while decoding
    assert stage.num_gathered_tokens >= 10 * (STREAMING.budget_blocks(BLOCK) - 1) * BLOCK
