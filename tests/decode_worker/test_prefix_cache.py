"""Prefix caching on an in-process decode engine (the colocated path: reserve, local prefill,
decode): tokens are the same as without the cache, shared blocks are never written, eviction
under a small pool keeps every held block, salts never share, and a push skips the blocks a
reservation took from the cache."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from decode_worker.engine import DecodeEngine
from kvferry.cache.budget import blocks_for_tokens
from kvferry.cache.layout import KvLayout
from kvferry.cache.pool import KvPool
from kvferry.cache.prefix import Tier
from kvferry.cache.tiers.host import HostTier
from kvferry.cache.tiers.tiered import TieredCache
from kvferry.errors import InvalidArgument
from kvferry.model.config import load_model_config
from kvferry.model.sampling import SamplingParams
from kvferry.model.transformer import Transformer
from kvferry.transfer import wire
from kvferry_kernels.dispatch import get_attention_backend
from tests.decode_worker.engines import collect_tokens
from tests.waiting import until

BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model(qwen3_checkpoint: Path) -> Transformer:
    return Transformer(load_model_config(qwen3_checkpoint), get_attention_backend("torch"),
                       torch.float32, torch.device("cpu"))


def _engine(model: Transformer, num_blocks: int, caching: bool = True,
            host_blocks: int = 0) -> DecodeEngine:
    config = model.config
    pool = KvPool(config.num_layers, config.num_kv_heads, config.head_dim, BLOCK_SIZE,
                  num_blocks, torch.float32, torch.device("cpu"), prefix_caching=caching)
    host = HostTier(pool, host_blocks, pool.allocator.events) if host_blocks else None
    return DecodeEngine(model, pool, KvLayout.of_pool(pool, config.fingerprint),
                        cache=TieredCache(pool, host))


async def _generate(engine: DecodeEngine, request_id: str, prompt: list[int],
                    max_tokens: int, salt: str = "") -> tuple[list[int], int]:
    """Reserve, prefill locally, decode greedily: (tokens, prompt tokens found cached)."""
    await engine.reserve(request_id, len(prompt), max_tokens, 30.0, prompt, salt)
    first, _, num_cached, *_ = await engine.prefill_local(request_id, prompt, GREEDY)
    queue = engine.attach(request_id, first, GREEDY, max_tokens - 1, [])
    return await collect_tokens(queue, request_id, [first]), num_cached


def _run(engine: DecodeEngine, batches: list[list[tuple[list[int], int]]], salt: str = "",
         after_batch: Callable[[int], None] = lambda b: None) -> list[tuple[list[int], int]]:
    """Each batch's requests concurrently, batch after batch; results in order."""
    async def run() -> list[tuple[list[int], int]]:
        engine.start()
        results: list[tuple[list[int], int]] = []
        try:
            for b, batch in enumerate(batches):
                results += await asyncio.gather(*(
                    _generate(engine, f"r{b}.{i}", prompt, n, salt)
                    for i, (prompt, n) in enumerate(batch)))
                await until(lambda: engine.cache.is_idle, "the tier copies to finish")
                report = engine.cache.check_integrity()
                assert report.ok, report.error
                after_batch(b)
            return results
        finally:
            await engine.stop()
    return asyncio.run(run())


def _tokens(seed: int, n: int, vocab: int) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_shared_blocks_are_never_written_and_tokens_match(model: Transformer) -> None:
    vocab = model.config.vocab_size
    prefix = _tokens(1, 13, vocab)  # 3 full blocks and one token
    first = [(prefix, 6)]
    # On a block boundary (12 tokens shared) and off it (13), decoding long on top of them.
    followers = [(prefix[:12] + _tokens(2, 5, vocab), 20), (prefix + _tokens(3, 9, vocab), 20),
                 (prefix, 20)]
    cached = _engine(model, 64)
    allocator = cached.pool.allocator
    seen: dict[int, torch.Tensor] = {}

    def snapshot(batch: int) -> None:
        if batch == 0:  # the first request's blocks, before anything decodes on top of them
            for block_id in allocator._block_of.values():
                seen[block_id] = cached.pool.cache[:, :, block_id].clone()

    results = _run(cached, [first, followers], after_batch=snapshot)
    assert len(seen) >= 3
    compared = 0
    for block_id, before in seen.items():
        if block_id in allocator._key_of:  # still indexed: the same bytes, bit for bit
            after = cached.pool.cache[:, :, block_id]
            assert torch.equal(after.view(torch.int32), before.view(torch.int32)), block_id
            compared += 1
    assert compared >= 3, "the shared prefix blocks were evicted: nothing was compared"
    plain = _run(_engine(model, 64, caching=False), [first, followers])
    assert [t for t, _ in results] == [t for t, _ in plain]
    assert [c for _, c in results] == [0, 12, 12, 12]  # the last prompt block is recomputed
    assert [c for _, c in plain] == [0, 0, 0, 0]


def test_eviction_under_a_small_pool_keeps_tokens_and_integrity(model: Transformer) -> None:
    vocab = model.config.vocab_size
    prefixes = [_tokens(10 + p, 16, vocab) for p in range(4)]
    batches = [[(prefixes[(b + i) % 4] + _tokens(100 * b + i, 3, vocab), 8) for i in range(2)]
               for b in range(6)]
    small = _engine(model, 16)  # two requests of up to 7 blocks: the cache must give way
    results = _run(small, batches)
    assert small.pool.allocator.events.seq > 0
    evicted = sum(len(e.removed) for e in small.pool.allocator.events._log)
    assert evicted > 0, "the pool never had to evict: the test does not test eviction"
    assert any(c for _, c in results), "nothing was ever found in the cache"
    plain = _run(_engine(model, 64, caching=False), batches)
    assert [t for t, _ in results] == [t for t, _ in plain]
    assert small.pool.allocator.num_free == 16


def test_a_prefix_the_pool_evicted_comes_back_from_the_host_tier(model: Transformer) -> None:
    """A small pool evicts every conversation between its turns; the host tier holds them
    all, so each second turn is promoted from host memory, and the tokens match an engine
    without any cache."""
    vocab = model.config.vocab_size
    prompts = [_tokens(30 + p, 17, vocab) for p in range(4)]  # 4 full blocks and a token
    first = [[(prompt, 4)] for prompt in prompts]
    again = [[(prompt + _tokens(40 + p, 3, vocab), 4)] for p, prompt in enumerate(prompts)]
    tiered = _engine(model, 12, host_blocks=64)
    results = _run(tiered, first + again)
    stats = tiered.stats(check_integrity=True)
    assert stats.integrity_ok, stats.integrity_error
    host, = stats.tiers
    assert host.tier is Tier.HOST and host.num_promotions >= 3
    assert [c for _, c in results[4:]] == [16] * 4  # every second turn: 4 blocks cached
    assert host.hit_tokens + stats.prefix_cache_hits == 4 * 16
    assert host.hit_tokens >= 3 * 16  # the pool kept at most the last one
    plain = _run(_engine(model, 64, caching=False), first + again)
    assert [t for t, _ in results] == [t for t, _ in plain]


def test_prefills_of_64_tokens_or_more_measure_seconds_per_token(model: Transformer) -> None:
    measured: list[float] = []
    for length in (20, 70):
        engine = _engine(model, 64)
        _run(engine, [[(_tokens(length, length, model.config.vocab_size), 2)]],
             after_batch=lambda _, e=engine: measured.append(e.stats().prefill_s_per_token))
    assert measured[0] == 0.0  # 20 tokens: all overhead, not counted
    assert measured[1] > 0.0


def test_different_salts_never_share(model: Transformer) -> None:
    prompt = _tokens(5, 20, model.config.vocab_size)
    engine = _engine(model, 64)
    async def run() -> list[int]:
        engine.start()
        try:
            counts = []
            for i, salt in enumerate(["a", "b", "a", ""]):
                _, num_cached = await _generate(engine, f"s{i}", prompt, 4, salt)
                counts.append(num_cached)
            return counts
        finally:
            await engine.stop()
    assert asyncio.run(run()) == [0, 0, 16, 0]


def test_a_push_carries_only_the_blocks_the_cache_lacks(model: Transformer) -> None:
    engine = _engine(model, 64)
    prompt = _tokens(6, 18, model.config.vocab_size)  # 4 full blocks and 2 tokens
    layout = engine.layout
    num_blocks = blocks_for_tokens(len(prompt), BLOCK_SIZE)
    sender = KvPool(layout.num_layers, layout.num_kv_heads, layout.head_dim, BLOCK_SIZE,
                    num_blocks, torch.float32)
    sender.cache.normal_(generator=torch.Generator().manual_seed(0))

    def chunk(span: wire.ChunkSpan) -> bytes:
        return wire.pack_array(sender, list(range(num_blocks)), span).tobytes()

    async def run() -> None:
        engine.start()
        try:
            await _generate(engine, "first", prompt, 4)
            granted = await engine.reserve("second", len(prompt), 4, 30.0, prompt)
            assert granted.num_cached_blocks == 4  # max_shared_blocks(18, 4)
            overlap = wire.ChunkSpan(0, layout.num_layers, 3, 2)
            with pytest.raises(InvalidArgument, match="overlaps"):
                data = chunk(overlap)
                engine.receiver.receive_chunk("second", layout, len(prompt), overlap, data,
                                              wire.crc32(data))
            spans = wire.plan_chunks(layout, len(prompt), first_block=4)
            assert {(s.block_start, s.num_blocks) for s in spans} == {(4, 1)}
            for span in spans:
                data = chunk(span)
                engine.receiver.receive_chunk("second", layout, len(prompt), span, data,
                                              wire.crc32(data))
            engine.receiver.finish_push("second")
            engine.abort("second")
            assert engine.pool.allocator.check_integrity().ok
        finally:
            await engine.stop()
    asyncio.run(run())


def test_preempting_a_request_on_shared_blocks_keeps_tokens(model: Transformer) -> None:
    """B shares A's prompt blocks; growth fills the pool and B (the newest) is swapped out:
    its references go, A keeps the shared blocks, and B comes back into private blocks."""
    vocab = model.config.vocab_size
    prefix = _tokens(20, 12, vocab)  # 3 full blocks
    prompts = {"A": prefix + [7], "B": prefix + [8]}

    def run(engine: DecodeEngine) -> tuple[dict[str, tuple[list[int], int]], int]:
        async def go() -> dict[str, tuple[list[int], int]]:
            # Both prompts are in before either decodes, so they grow in the same steps
            # whatever the machine's speed: A's prefill indexes the blocks B's shares.
            engine.start()
            try:
                firsts: dict[str, tuple[int, int]] = {}
                for rid in ("A", "B"):
                    await engine.reserve(rid, len(prompts[rid]), 16, 30.0, prompts[rid])
                    first, _, cached, *_ = await engine.prefill_local(rid, prompts[rid], GREEDY)
                    firsts[rid] = first, cached
                queues = {rid: engine.attach(rid, first, GREEDY, 15, [])
                          for rid, (first, _) in firsts.items()}
                return {rid: (await collect_tokens(queue, rid, [firsts[rid][0]]), firsts[rid][1])
                        for rid, queue in queues.items()}
            finally:
                await engine.stop()
        results = asyncio.run(go())
        report = engine.pool.allocator.check_integrity()
        assert report.ok, report.error
        assert engine.pool.allocator.num_free == engine.pool.num_blocks
        return results, engine.steps.num_preemptions

    # A holds 4 blocks and B 1 more at first; each grows to 8 (29 positions): 9 cannot hold
    # both, so B is preempted.
    got, preemptions = run(_engine(model, 9))
    assert preemptions >= 1, "nothing was preempted: the test does not test preemption"
    assert got["B"][1] == 12  # B's reservation shared A's three prompt blocks
    plain, _ = run(_engine(model, 64, caching=False))
    assert {k: t for k, (t, _) in got.items()} == {k: t for k, (t, _) in plain.items()}
