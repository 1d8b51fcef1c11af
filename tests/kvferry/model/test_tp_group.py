"""A tensor-parallel worker's ranks (kvferry/model/tp_group.py): rank 0 here, the others
processes it starts. Calls made on rank 0 run on every rank; greedy tokens equal the whole
model's; a rank that dies fails the next call with RankLost, and closing leaves no rank
behind. Pages read whole from a group of one size and written into one of another decode as
the whole model does. The ranks of the first group, of the group that fails to join (checked
among multiprocessing's children) and of the group that loses a rank are spawned, as a worker
without the test suite's zygote starts them; the others are forked by the zygote, as the
suite's workers' are."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
from pathlib import Path

import pytest
import torch

from decode_worker.engine import DecodeEngine
from deploy import zygote
from kvferry.cache.layout import KvLayout
from kvferry.cache.pool import KvPool
from kvferry.cache.tiers.host import HostTier
from kvferry.cache.tiers.tiered import TieredCache
from kvferry.model import tp_group, tp_wire
from kvferry.model.config import load_model_config
from kvferry.model.tp_group import (
    EXIT_PROTOCOL_ERROR,
    RankLost,
    RankSpec,
    TensorParallelModel,
    _send,
)
from kvferry.model.tp_rendezvous import Rendezvous
from kvferry.model.transformer import Transformer
from kvferry.settings import KvEvictionConfig
from kvferry_kernels.dispatch import get_attention_backend
from tests.decode_worker.engines import cpu_engine, generate_local, run_to_idle, serve_local
from tests.kvferry.model.greedy_split import decode_part, greedy, pool_of, prefill_part
from tests.listening import listeners, strangers

pytestmark = pytest.mark.slow  # processes per rank: a few seconds a group


def _spec(checkpoint: Path) -> RankSpec:
    return RankSpec(str(checkpoint), "auto", "torch", "float32", block_size=16, num_blocks=64)


def test_calls_on_rank_zero_decode_as_the_whole_model(qwen3_checkpoint: Path) -> None:
    config = load_model_config(qwen3_checkpoint)
    whole = Transformer(config, get_attention_backend("torch"))
    expected, expected_logits = greedy(whole, pool_of(whole))
    group = TensorParallelModel(_spec(qwen3_checkpoint), 2)
    try:
        assert group.pool.num_kv_heads == 1  # rank 0's half of the 2 K/V heads
        tokens, logits = greedy(group, group.pool)
        assert tokens == expected
        torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)
    finally:
        group.close()
    assert not any(p.is_alive() for p in group.ranks)


def test_a_rank_killed_fails_the_next_call_and_close_still_ends_the_rest(
        qwen3_checkpoint: Path) -> None:
    # spawned ranks, as production starts them: with zygote-forked ranks a CI run under load
    # once saw the call time out (60 s) instead of failing on the closed connection
    group = TensorParallelModel(_spec(qwen3_checkpoint), 4)
    try:
        os.kill(group.ranks[1].pid, signal.SIGKILL)  # rank 2 of 4
        group.ranks[1].join(60)
        assert not group.ranks[1].is_alive()  # gone before the call
        with pytest.raises(RankLost, match="tp-rank-2") as lost:
            greedy(group, group.pool)
        # its connection went: the collective failed on that (gloo says "closed by peer" or
        # "reset by peer", as the kernel tore it down), not on its timeout
        cause = str(lost.value.__cause__).lower()
        assert re.search(r"connection (closed|reset)", cause), cause
        assert "timed out" not in cause and "timeout" not in cause
    finally:
        group.close()
    assert not any(p.is_alive() for p in group.ranks)
    with pytest.raises(RankLost, match="closed"):
        group.prefill(torch.tensor([1]), [1], torch.tensor([0]), group.pool)


def test_the_ranks_listen_on_loopback_only_and_strangers_change_nothing(
        qwen3_checkpoint: Path) -> None:
    """No rendezvous port (a file store), gloo on the loopback interface: a rank's only
    listening sockets are gloo's, on 127.0.0.1. Garbage and a TCPStore handshake sent to
    each leave the ranks running and the tokens the whole model's."""
    config = load_model_config(qwen3_checkpoint)
    whole = Transformer(config, get_attention_backend("torch"))
    expected, _ = greedy(whole, pool_of(whole))
    group = TensorParallelModel(_spec(qwen3_checkpoint), 2, zygote.start_rank)
    try:
        assert not Path(group.rendezvous.directory).exists()  # gloo: gone once formed
        found = listeners([p.pid for p in group.ranks])
        assert found and all(f.address == "127.0.0.1" for f in found), found
        assert strangers(found) == []
        assert all(p.is_alive() for p in group.ranks)
        assert greedy(group, group.pool)[0] == expected
    finally:
        group.close()


def test_a_group_that_cannot_form_leaves_no_rank_and_no_rendezvous(
        qwen3_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 failing to join (a rank that died starting, a mesh a local process broke) ends
    the ranks it started and removes the rendezvous before the error goes up."""
    made: list[Rendezvous] = []

    class Recorded(Rendezvous):
        @classmethod
        def fresh(cls) -> Rendezvous:
            made.append(Rendezvous.fresh())
            return made[-1]

    def broken(*args: object) -> None:
        raise RuntimeError("mesh broken")

    monkeypatch.setattr(tp_group, "Rendezvous", Recorded)
    monkeypatch.setattr(tp_group, "join", broken)
    with pytest.raises(RuntimeError, match="mesh broken"):
        TensorParallelModel(_spec(qwen3_checkpoint), 2)
    assert [p for p in mp.active_children() if p.name.startswith("tp-rank")] == []
    assert len(made) == 1 and not Path(made[0].directory).exists()


def test_a_call_outside_the_schema_stops_the_rank(qwen3_checkpoint: Path) -> None:
    """A header the schema refuses (here: an absurd length) stops the rank before it
    allocates anything; the next call fails with RankLost naming it."""
    group = TensorParallelModel(_spec(qwen3_checkpoint), 2, zygote.start_rank)
    try:
        preamble = torch.tensor([tp_wire.MAGIC, tp_wire.VERSION, 0, 1 << 40])
        _send(tp_wire.Wire(preamble, torch.empty(0, dtype=torch.int64), []), group._control)
        group.ranks[0].join(30)
        assert group.ranks[0].exitcode == EXIT_PROTOCOL_ERROR
        with pytest.raises(RankLost, match="tp-rank-1"):
            greedy(group, group.pool)
    finally:
        group.close()


def _side(checkpoint: Path, size: int) -> tuple[Transformer | TensorParallelModel, KvPool]:
    """A worker's model split `size` ways (1: whole), and its pool."""
    if size == 1:
        whole = Transformer(load_model_config(checkpoint), get_attention_backend("torch"))
        return whole, pool_of(whole)
    group = TensorParallelModel(_spec(checkpoint), size, zygote.start_rank)
    return group, group.pool


@pytest.mark.parametrize("sizes", [(1, 2), (2, 1), (2, 2), (2, 4), (4, 2)],
                         ids=["1-2", "2-1", "2-2", "2-4", "4-2"])
def test_kv_prefilled_at_one_size_decodes_at_another(qwen3_checkpoint: Path,
                                                     sizes: tuple[int, int]) -> None:
    """Prefill split P ways, its pages read whole, written into a decode side split D ways
    (the same block ids), decoded there: the whole model's tokens. One group at a time."""
    config = load_model_config(qwen3_checkpoint)
    whole = Transformer(config, get_attention_backend("torch"))
    expected, _ = greedy(whole, pool_of(whole))
    prefill, pool = _side(qwen3_checkpoint, sizes[0])
    try:
        tables, tokens, _ = prefill_part(prefill, pool)
        blocks = [b for table in tables for b in table]
        pages = pool.read_pages(blocks)
    finally:
        if isinstance(prefill, TensorParallelModel):
            prefill.close()
    assert pages.shape[4] == config.num_kv_heads  # every head, whatever the split
    decode, pool = _side(qwen3_checkpoint, sizes[1])
    try:
        for table in tables:  # the same block ids on the decode side
            assert pool.allocator.alloc(len(table)) == table
        pool.write_pages(blocks, pages)
        assert decode_part(decode, pool, tables, tokens) == expected
    finally:
        if isinstance(decode, TensorParallelModel):
            decode.close()


def test_a_block_copied_on_every_rank_reads_back_whole(qwen3_checkpoint: Path) -> None:
    group = TensorParallelModel(_spec(qwen3_checkpoint), 2, zygote.start_rank)
    try:
        tables, _, _ = prefill_part(group, group.pool)
        src = tables[1][:2]
        dst = group.pool.allocator.alloc(2)
        group.pool.copy_blocks(src, dst)
        torch.testing.assert_close(group.pool.read_pages(dst), group.pool.read_pages(src), rtol=0,
                                   atol=0)
        assert group.pool.read_pages(src).abs().sum() > 0
    finally:
        group.close()


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("sizes", [(1, 2), (2, 1), (2, 2)], ids=["1-2", "2-1", "2-2"])
def test_quantized_pages_move_whole_between_sizes(qwen3_checkpoint: Path,
                                                  sizes: tuple[int, int],
                                                  kv_cache_dtype: str) -> None:
    """Quantized pages (values, then a scale per token and head) split by head on each rank,
    read whole (every head's values and scales in the whole page's layout) and written into
    another split: the tokens the whole model gives with quantized pages, and the pages
    written read back bit for bit."""
    config = load_model_config(qwen3_checkpoint)
    whole = Transformer(config, get_attention_backend("torch"))

    def quantized_side(size: int) -> tuple[Transformer | TensorParallelModel, KvPool]:
        if size == 1:
            cfg = whole.config
            return whole, KvPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, 64,
                                 torch.float32, kv_cache_dtype=kv_cache_dtype)
        group = TensorParallelModel(RankSpec(str(qwen3_checkpoint), "auto", "torch",
                                             "float32", 16, 64,
                                             kv_cache_dtype=kv_cache_dtype), size,
                                    zygote.start_rank)
        return group, group.pool

    expected, _ = greedy(*quantized_side(1))
    _, reference = quantized_side(1)
    tables, _, _ = prefill_part(whole, reference)
    blocks = [b for table in tables for b in table]
    reference_pages = reference.read_pages(blocks)  # the whole model's layout of them
    prefill, pool = quantized_side(sizes[0])
    try:
        tables, tokens, _ = prefill_part(prefill, pool)
        pages = pool.read_pages(blocks)
    finally:
        if isinstance(prefill, TensorParallelModel):
            prefill.close()
    assert pages.shape == reference_pages.shape and pages.dtype == torch.uint8
    decode, pool = quantized_side(sizes[1])
    try:
        for table in tables:
            assert pool.allocator.alloc(len(table)) == table
        pool.write_pages(blocks, pages)
        torch.testing.assert_close(pool.read_pages(blocks), pages, rtol=0, atol=0)
        assert decode_part(decode, pool, tables, tokens) == expected
    finally:
        if isinstance(decode, TensorParallelModel):
            decode.close()


@pytest.mark.parametrize("policy", [
    KvEvictionConfig("streaming", sink_tokens=16, window_tokens=48),
    KvEvictionConfig("h2o", heavy_tokens=32, recent_tokens=32)], ids=["streaming", "h2o"])
def test_eviction_on_a_split_pool_decodes_as_the_whole_model(
        qwen3_checkpoint: Path, policy: KvEvictionConfig) -> None:
    """Eviction's page operations on a group's pool go through the group: the sinks' keys
    read whole (every head, gathered from the ranks), re-rotated on rank 0 and written back
    split, a shared sink block copied on every rank, blocks dropped from the tables every
    rank is handed; H2O's attention mass summed over the ranks (each attends with its own
    heads). A prompt past the budget, prefilled evicting as it goes, then 60 tokens: the
    whole model's tokens under the same policy, within the budget throughout."""
    config = load_model_config(qwen3_checkpoint)
    whole = Transformer(config, get_attention_backend("torch"))
    options = {"eviction": policy, "chunk_size": 32, "token_budget": 64}
    prompt = [5 + (i * 7) % 60 for i in range(90)]
    want = serve_local(cpu_engine(whole, 16, 64, **options), prompt, 60)[0]
    group = TensorParallelModel(_spec(qwen3_checkpoint), 2, zygote.start_rank)
    try:
        engine = DecodeEngine(group, group.pool,  # type: ignore[arg-type]
                              KvLayout.of_pool(group.pool, config.fingerprint), **options)
        got, steps = serve_local(engine, prompt, 60)
    finally:
        group.close()
    assert got == want
    assert max(len(table) for table, _, _ in steps) <= policy.budget_blocks(16)
    assert engine.steps.eviction is not None
    assert engine.steps.eviction.num_evicted_blocks >= (90 + 60) // 16 - 4


def test_a_prefix_pushed_out_of_a_split_pool_comes_back_from_host_memory(
        qwen3_checkpoint: Path) -> None:
    """The host tier under a group's pool holds whole blocks (every K/V head, read through
    the group) and writes them back split: a prompt whose blocks other requests pushed out
    of the pool is served from host memory, with the whole model's tokens."""
    config = load_model_config(qwen3_checkpoint)
    whole = Transformer(config, get_attention_backend("torch"))
    prompt = [3 + (i * 11) % 200 for i in range(100)]  # 6 full blocks of 16
    others = [[7 + (i * 13 + seed) % 200 for i in range(300)] for seed in range(1, 5)]
    want = serve_local(cpu_engine(whole, 16, 64), prompt, 20)[0]
    group = TensorParallelModel(_spec(qwen3_checkpoint), 2, zygote.start_rank)
    try:
        pool = group.pool
        # room for every block the five requests cache: the prompt's stay in host memory
        cache = TieredCache(pool, HostTier(pool, 96, pool.allocator.events))
        engine = DecodeEngine(group, pool,  # type: ignore[arg-type]
                              KvLayout.of_pool(pool, config.fingerprint), cache=cache)
        assert cache.host is not None and cache.host.data.shape[-2] == group.num_kv_heads

        async def serve_all() -> tuple[list[int], list[int]]:
            first = await generate_local(engine, "first", prompt, 20)
            for n, other in enumerate(others):  # 20 blocks each: the prompt's leave the pool
                await generate_local(engine, f"other-{n}", other, 20)
            return first, await generate_local(engine, "again", prompt, 20)

        first, again = run_to_idle(engine, serve_all)
        (host,) = cache.stats()
    finally:
        group.close()
    assert first == again == want
    assert host.num_promotions >= 1 and host.hit_tokens >= 6 * 16
