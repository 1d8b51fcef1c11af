"""In-process decode engines for the decode worker's tests: an fp32 CPU engine over its own
pool, a prompt's K/V pushed into it as a prefill worker would, and the tokens an attached
request streams."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import torch

from decode_worker.engine import DecodeEngine
from decode_worker.sequence import DecodeEvent, FinishedEvent, TokensEvent
from kvferry.cache.budget import blocks_for_tokens
from kvferry.cache.layout import KvLayout
from kvferry.cache.pool import KvPool
from kvferry.model.sampling import SamplingParams
from kvferry.model.transformer import Transformer
from tests.waiting import until, within

T = TypeVar("T")


def cpu_engine(model: Transformer, block_size: int, num_blocks: int,
               kv_cache_dtype: str = "auto", **options: object) -> DecodeEngine:
    """An engine over a float32 CPU pool of `num_blocks` blocks (pages of `kv_cache_dtype`);
    `options` go to DecodeEngine (stage_bytes, speculative, ...)."""
    config = model.config
    pool = KvPool(config.num_layers, config.num_kv_heads, config.head_dim, block_size,
                  num_blocks, torch.float32, torch.device("cpu"), kv_cache_dtype=kv_cache_dtype)
    return DecodeEngine(model, pool, KvLayout.of_pool(pool, config.fingerprint),
                        **options)  # type: ignore[arg-type]


def run_to_idle(engine: DecodeEngine, body: Callable[[], Awaitable[T]]) -> T:
    """`body` on the started engine; then, once every request is gone, integrity holds and
    every block is back; the engine stopped however it ended. What `body` returned."""
    async def run() -> T:
        engine.start()
        try:
            result = await body()
            await until(lambda: engine.is_idle and engine.cache.is_idle,
                        "every request gone, every tier copy done")
            stats = engine.stats(check_integrity=True)
            assert stats.integrity_ok, stats.integrity_error
            assert stats.free_blocks == engine.pool.num_usable_blocks, stats
            return result
        finally:
            await engine.stop()

    return asyncio.run(run())


# (block table, cache index, rotary position) of a sequence at one decode step
Step = tuple[list[int], int, int]
GREEDY = SamplingParams(temperature=0.0)


def serve_local(engine: DecodeEngine, prompt: list[int], max_tokens: int,
                params: SamplingParams = GREEDY) -> tuple[list[int], list[Step]]:
    """One request (greedy by default) prefilled here (colocated) and decoded to the end on
    the engine, alone: its tokens and, at each decode step, its sequence's `Step`. Every
    block comes back (`run_to_idle`)."""
    steps: list[Step] = []
    original = engine.steps._step

    def recording(batch: list, is_staged: bool = False) -> list[list[int]]:
        seq = batch[0]
        steps.append((list(seq.block_table), seq.cache_position, seq.rope_position))
        return original(batch, is_staged)

    engine.steps._step = recording  # type: ignore[method-assign]

    return run_to_idle(engine, lambda: generate_local(engine, "A", prompt, max_tokens,
                                                      params)), steps


async def generate_local(engine: DecodeEngine, request_id: str, prompt: list[int],
                         max_tokens: int, params: SamplingParams = GREEDY) -> list[int]:
    """One request prefilled here (colocated) on the started engine and decoded to the end:
    its tokens."""
    await engine.reserve(request_id, len(prompt), max_tokens, 60.0, prompt)
    first, *_ = await engine.prefill_local(request_id, prompt, params)
    queue = engine.attach(request_id, first, params, max_tokens - 1, [])
    return await collect_tokens(queue, request_id, [first])


def push_random_prompt(engine: DecodeEngine, request_id: str, num_tokens: int, seed: int
                       ) -> None:
    """The prompt's K/V as a prefill worker would push it: seeded random pages, one chunk."""
    from kvferry.transfer import wire

    layout, block_size = engine.layout, engine.pool.block_size
    num_blocks = blocks_for_tokens(num_tokens, block_size)
    sender = KvPool(layout.num_layers, layout.num_kv_heads, layout.head_dim, block_size,
                    num_blocks, torch.float32, torch.device("cpu"))
    sender.cache.copy_(torch.randn(sender.cache.shape,
                                   generator=torch.Generator().manual_seed(seed)))
    span = wire.ChunkSpan(0, layout.num_layers, 0, num_blocks)
    data = wire.pack_array(sender, list(range(num_blocks)), span).tobytes()
    engine.receiver.receive_chunk(request_id, layout, num_tokens, span, data, wire.crc32(data))
    engine.receiver.finish_push(request_id)


async def collect_tokens(queue: asyncio.Queue[DecodeEvent], request_id: str,
                         tokens: list[int]) -> list[int]:
    """`tokens` and then those an attached request streams, until it finishes."""
    tokens = list(tokens)
    while True:
        event = await within(queue.get(), f"{request_id}'s next update")
        if isinstance(event, FinishedEvent):
            return tokens
        assert isinstance(event, TokensEvent), event
        tokens += event.token_ids
