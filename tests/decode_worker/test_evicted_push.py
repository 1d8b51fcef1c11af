"""A prompt that evicted K/V while a prefill worker prefilled it (`--kv-eviction`, gRPC) arrives
as its kept pages with its eviction state (KvChunk.num_evicted, num_rebased): the decode
worker writes them at the head of the reservation, takes the state, and gives back the blocks
the reservation held past them. Inconsistent or impossible states are refused naming the
field, before any byte is written; a reservation for a prompt past the budget shares no
cached blocks (its pages will not be the prompt's)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from decode_worker.engine import DecodeEngine
from kvferry.cache.budget import blocks_for_tokens
from kvferry.cache.layout import KvLayout
from kvferry.cache.pool import KvPool
from kvferry.errors import InvalidArgument
from kvferry.model.config import load_model_config
from kvferry.model.transformer import Transformer
from kvferry.settings import KvEvictionConfig
from kvferry.transfer import wire
from kvferry_kernels.dispatch import get_attention_backend

BLOCK = 4
PROMPT = 37  # 10 blocks; the budget below holds 5 (20 tokens)
EVICTED = 20  # 5 blocks gone while prefilled: 17 tokens kept, in 5 blocks
STREAMING = KvEvictionConfig("streaming", sink_tokens=4, window_tokens=16)


def _engine(checkpoint: Path, eviction: KvEvictionConfig | None) -> DecodeEngine:
    config = load_model_config(checkpoint)
    model = Transformer(config, get_attention_backend("torch"), torch.float32,
                        torch.device("cpu"))
    pool = KvPool(config.num_layers, config.num_kv_heads, config.head_dim, BLOCK, 32,
                  torch.float32, torch.device("cpu"))
    return DecodeEngine(model, pool, KvLayout.of_pool(pool, config.fingerprint),
                        eviction=eviction)


@pytest.fixture
def engine(qwen3_checkpoint: Path) -> Iterator[DecodeEngine]:
    engine = _engine(qwen3_checkpoint, STREAMING)
    yield engine
    engine.steps.executor.shutdown(wait=True)


def _kept_pages(engine: DecodeEngine, blocks: int) -> tuple[KvPool, wire.ChunkSpan, bytes]:
    layout = engine.layout
    sender = KvPool(layout.num_layers, layout.num_kv_heads, layout.head_dim, BLOCK, blocks,
                    torch.float32, torch.device("cpu"))
    sender.cache.copy_(torch.randn(sender.cache.shape, generator=torch.Generator().manual_seed(3)))
    span = wire.ChunkSpan(0, layout.num_layers, 0, blocks)
    return sender, span, wire.pack_array(sender, list(range(blocks)), span).tobytes()


def test_the_kept_pages_lead_the_table_and_the_rest_go_back(engine: DecodeEngine) -> None:
    asyncio.run(engine.reserve("A", PROMPT, 8, 30.0, list(range(PROMPT))))
    seq = engine._seqs["A"]
    assert seq.num_cached_blocks == 0 and len(seq.block_table) == 10
    free = engine.pool.allocator.num_free
    kept = blocks_for_tokens(PROMPT - EVICTED, BLOCK)
    sender, span, data = _kept_pages(engine, kept)
    epoch = engine.receiver.begin_push("A")
    # Two chunks of the same push: layers split, each carrying the state.
    half = engine.layout.num_layers // 2
    for part in (wire.ChunkSpan(0, half, 0, kept),
                 wire.ChunkSpan(half, engine.layout.num_layers, 0, kept)):
        payload = wire.pack_array(sender, list(range(kept)), part).tobytes()
        engine.receiver.receive_chunk("A", engine.layout, PROMPT, part, payload,
                                      wire.crc32(payload), epoch, evicted=(EVICTED, 4))
    engine.receiver.finish_push("A", epoch)
    assert seq.receipt.is_complete and (seq.num_evicted, seq.num_rebased) == (EVICTED, 4)
    # The kept 17 tokens and the first token's slot: blocks_for_tokens(18) = 5.
    assert len(seq.block_table) == 5
    assert engine.pool.allocator.num_free == free + 5
    pages = engine.pool.cache[:, :, seq.block_table[:kept]]
    assert torch.equal(pages, sender.cache[:, :, :kept])
    engine.abort("A")
    assert engine.pool.allocator.num_free == engine.pool.num_usable_blocks


@pytest.mark.parametrize(("evicted", "field"), [
    ((18, 0), "num_evicted"),  # not whole blocks
    ((40, 0), "num_evicted"),  # the whole prompt and more
    ((20, 24), "num_evicted"),  # more re-based than evicted
    ((0, 4), "num_rebased"),  # re-based, nothing evicted
], ids=["partial-block", "past-the-prompt", "rebased-past-evicted", "rebased-alone"])
def test_impossible_states_are_refused_before_a_write(engine: DecodeEngine,
                                                      evicted: tuple[int, int],
                                                      field: str) -> None:
    asyncio.run(engine.reserve("A", PROMPT, 8, 30.0))
    _, span, data = _kept_pages(engine, 4)
    before = engine.pool.cache.clone()
    epoch = engine.receiver.begin_push("A")
    with pytest.raises(InvalidArgument) as exc:
        engine.receiver.receive_chunk("A", engine.layout, PROMPT, span, data,
                                      wire.crc32(data), epoch, evicted=evicted)
    assert exc.value.field == field
    assert torch.equal(engine.pool.cache, before)


def test_a_push_keeps_one_state_and_covers_its_kept_pages(engine: DecodeEngine) -> None:
    asyncio.run(engine.reserve("A", PROMPT, 8, 30.0))
    kept = blocks_for_tokens(PROMPT - EVICTED, BLOCK)
    sender, _, _ = _kept_pages(engine, kept)
    epoch = engine.receiver.begin_push("A")
    first = wire.ChunkSpan(0, 1, 0, kept)
    payload = wire.pack_array(sender, list(range(kept)), first).tobytes()
    engine.receiver.receive_chunk("A", engine.layout, PROMPT, first, payload,
                                  wire.crc32(payload), epoch, evicted=(EVICTED, 0))
    second = wire.ChunkSpan(1, 2, 0, kept)
    payload = wire.pack_array(sender, list(range(kept)), second).tobytes()
    with pytest.raises(InvalidArgument) as exc:  # another state mid-push
        engine.receiver.receive_chunk("A", engine.layout, PROMPT, second, payload,
                                      wire.crc32(payload), epoch, evicted=(EVICTED - 4, 0))
    assert exc.value.field == "num_evicted"
    past = wire.ChunkSpan(1, 2, kept, 1)  # a block past the kept ones
    payload = bytes(engine.layout.bytes_per_layer_block)
    with pytest.raises(InvalidArgument) as exc:
        engine.receiver.receive_chunk("A", engine.layout, PROMPT, past, payload,
                                      wire.crc32(payload), epoch, evicted=(EVICTED, 0))
    assert exc.value.field == "block_start"
    with pytest.raises(InvalidArgument) as exc:  # layers 1.. never came
        engine.receiver.finish_push("A", epoch)
    assert exc.value.field == "data"


def test_a_worker_without_a_policy_refuses_an_evicted_push(qwen3_checkpoint: Path) -> None:
    engine = _engine(qwen3_checkpoint, None)
    try:
        asyncio.run(engine.reserve("A", PROMPT, 8, 30.0))
        _, span, data = _kept_pages(engine, 5)
        with pytest.raises(InvalidArgument) as exc:
            engine.receiver.receive_chunk("A", engine.layout, PROMPT, span, data,
                                          wire.crc32(data), evicted=(EVICTED, 0))
        assert exc.value.field == "num_evicted" and "--kv-eviction" in str(exc.value)
    finally:
        engine.steps.executor.shutdown(wait=True)


def test_a_prompt_past_the_budget_shares_no_cached_blocks(engine: DecodeEngine) -> None:
    """The same 37-token prompt twice: its first reservation's blocks were indexed, yet
    the second shares none (a prompt within the budget would)."""
    prompt = list(range(5, 5 + PROMPT))
    short = list(range(100, 112))

    async def run() -> tuple[int, int]:
        for rid, tokens in (("long", prompt), ("short", short)):
            await engine.reserve(rid, len(tokens), 4, 30.0, tokens)
            _, span, data = _kept_pages(engine, blocks_for_tokens(len(tokens), BLOCK))
            engine.receiver.receive_chunk(rid, engine.layout, len(tokens), span, data,
                                          wire.crc32(data))
            engine.receiver.finish_push(rid)
            engine.abort(rid)
        again_long = await engine.reserve("long-2", len(prompt), 4, 30.0, prompt)
        again_short = await engine.reserve("short-2", len(short), 4, 30.0, short)
        return again_long.num_cached_blocks, again_short.num_cached_blocks

    long_cached, short_cached = asyncio.run(run())
    assert long_cached == 0 and short_cached > 0
