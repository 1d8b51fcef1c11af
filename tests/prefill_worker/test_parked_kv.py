"""Parked K/V (deferred prefills waiting to be shipped) never starves a prefill that holds a
decode reservation: such a prefill evicts parked K/V, newest first, and a deferred prefill
takes no block a reserved one waits for. Evicted requests are prefilled again later; Ship
answers NOT_FOUND for them. No block leaks either way."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from kvferry.cache.layout import KvLayout
from kvferry.cache.pool import KvPool
from kvferry.errors import Aborted, NotFound
from kvferry.model.config import load_model_config
from kvferry.model.sampling import SamplingParams
from kvferry.model.transformer import Transformer
from kvferry.transfer.sender import DraftPush, LayersReady, PushResult
from kvferry_kernels.dispatch import get_attention_backend
from prefill_worker.engine import FirstTokenEvent, PrefillEngine, PushedEvent
from tests.waiting import until, within

BLOCK_SIZE = 16
PROMPT = list(range(10, 30))  # 20 tokens: 2 blocks
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


class RecordingSender:
    """Stands in for a transport: records what each push would send."""

    num_corrupt_pushes = 0

    def __init__(self) -> None:
        self.pushes: dict[str, tuple[str, torch.Tensor]] = {}
        # request id -> an event its push waits for: the request holds its blocks till then
        self.gates: dict[str, asyncio.Event] = {}

    async def push(self, address: str, request_id: str, layout: KvLayout,
                   num_tokens: int, pool: KvPool, block_table: list[int],
                   timeout_s: float | None, ready: LayersReady | None = None,
                   first_block: int = 0, draft: DraftPush | None = None) -> PushResult:
        assert draft is None  # this engine has no draft model
        if ready is not None:
            await ready(layout.num_layers)
        if request_id in self.gates:
            await self.gates[request_id].wait()
        pages = pool.cache[:, :, block_table].clone()
        self.pushes[request_id] = (address, pages)
        return PushResult(pages.numel() * pages.element_size(), 0.0)

    async def close(self) -> None:
        return None


def _engine(checkpoint: Path, num_blocks: int) -> tuple[PrefillEngine, RecordingSender]:
    config = load_model_config(checkpoint)
    model = Transformer(config, get_attention_backend("torch"), torch.float32, "cpu")
    # No prefix cache: every call parks its own blocks (they all send the same prompt).
    pool = KvPool(config.num_layers, config.num_kv_heads, config.head_dim, BLOCK_SIZE,
                  num_blocks, torch.float32, prefix_caching=False)
    sender = RecordingSender()
    engine = PrefillEngine(model, pool, KvLayout.of_pool(pool, config.fingerprint), sender)
    engine.start()
    return engine, sender


class Call:
    """Drives one Prefill as the gRPC servicer would: reads its events in a task."""

    def __init__(self, engine: PrefillEngine, request_id: str, decode_address: str = "",
                 defer: bool = False, prompt: list[int] = PROMPT) -> None:
        self.events: list[FirstTokenEvent | PushedEvent] = []
        self.first_token = asyncio.Event()
        self.task = asyncio.ensure_future(self._run(
            engine.prefill(request_id, prompt, GREEDY, decode_address, 30.0,
                           defer_push=defer)))

    async def _run(self, events: AsyncIterator[FirstTokenEvent | PushedEvent]) -> None:
        async for event in events:
            self.events.append(event)
            self.first_token.set()


def _assert_clean(engine: PrefillEngine) -> None:
    stats = engine.stats(check_integrity=True)
    assert stats.integrity_ok, stats.integrity_error
    assert stats.free_blocks == stats.total_blocks
    assert stats.num_parked == 0


def test_a_reserved_prefill_evicts_the_newest_parked_kv(qwen3_checkpoint: Path) -> None:
    async def scenario() -> None:
        engine, sender = _engine(qwen3_checkpoint, num_blocks=4)
        try:
            old = Call(engine, "old", defer=True)
            await within(old.first_token.wait(), "old's first token")
            new = Call(engine, "new", defer=True)
            await within(new.first_token.wait(), "new's first token")
            assert engine.stats().num_parked == 2 and engine.pool.allocator.num_free == 0

            reserved = Call(engine, "reserved", decode_address="decode-a:1")
            await within(reserved.task, "the reserved prefill")  # would wait for "new" forever
            assert sender.pushes["reserved"][0] == "decode-a:1"
            assert isinstance(reserved.events[-1], PushedEvent)
            with pytest.raises(Aborted, match="evicted"):
                await within(new.task, "the evicted prefill")
            assert engine.stats().num_evictions == 1

            with pytest.raises(NotFound, match="no deferred prefill 'new'"):
                engine.ship("new", "decode-b:1")
            engine.ship("old", "decode-b:1")  # the older one kept its K/V
            await within(old.task, "the shipped prefill")
            assert sender.pushes["old"][0] == "decode-b:1"
            assert [type(e) for e in old.events] == [FirstTokenEvent, PushedEvent]
            _assert_clean(engine)
        finally:
            await engine.stop()

    asyncio.run(scenario())


def test_evicted_and_kept_kv_match_a_fresh_prefill(qwen3_checkpoint: Path) -> None:
    """Eviction frees only the newest parked request's blocks: the kept request's K/V is what
    a prefill of its prompt alone writes."""
    async def scenario() -> tuple[torch.Tensor, torch.Tensor]:
        engine, sender = _engine(qwen3_checkpoint, num_blocks=4)
        try:
            kept = Call(engine, "kept", defer=True)
            await within(kept.first_token.wait(), "kept's first token")
            evicted = Call(engine, "evicted", defer=True, prompt=PROMPT[::-1])
            await within(evicted.first_token.wait(), "evicted's first token")
            reserved = Call(engine, "reserved", decode_address="d:1", prompt=PROMPT[::-1])
            await within(reserved.task, "the reserved prefill")
            with pytest.raises(Aborted, match="evicted"):
                await within(evicted.task, "the evicted prefill")
            engine.ship("kept", "d:1")
            await within(kept.task, "the kept prefill")
            _assert_clean(engine)

            alone = Call(engine, "alone", decode_address="d:1")
            await within(alone.task, "the prefill alone")
            return sender.pushes["kept"][1], sender.pushes["alone"][1]
        finally:
            await engine.stop()

    kept, alone = asyncio.run(scenario())
    # [layers, 2, blocks, block_size, ...] -> the prompt's slots (the rest is stale)
    assert torch.equal(kept.flatten(2, 3)[:, :, :len(PROMPT)],
                       alone.flatten(2, 3)[:, :, :len(PROMPT)])


def test_a_deferred_prefill_parking_while_a_reserved_one_waits_is_evicted_at_once(
        qwen3_checkpoint: Path) -> None:
    """Both deferred prefills took the whole pool before the reserved one came; the first to
    park makes room at once (its first token still streams), the other stays parked."""
    async def scenario() -> None:
        engine, sender = _engine(qwen3_checkpoint, num_blocks=4)
        try:
            first = Call(engine, "first", defer=True)
            second = Call(engine, "second", defer=True)
            reserved = Call(engine, "reserved", decode_address="d:1")
            await within(reserved.task, "the reserved prefill")
            # Settled: each deferred prefill has ended (evicted) or is parked.
            await until(lambda: sum(c.task.done() for c in (first, second))
                        + engine.stats().num_parked == 2, "both deferred prefills settled")
            assert engine.stats().num_evictions == 1
            assert engine.stats().num_parked == 1
            done = [c for c in (first, second) if c.task.done()]
            assert len(done) == 1 and isinstance(done[0].task.exception(), Aborted)
            assert isinstance(done[0].events[0], FirstTokenEvent)
            waiting = second if done[0] is first else first
            engine.ship("second" if waiting is second else "first", "d:2")
            await within(waiting.task, "the parked prefill, shipped")
            _assert_clean(engine)
        finally:
            await engine.stop()

    asyncio.run(scenario())


def test_a_deferred_prefill_takes_no_block_a_reserved_one_waits_for(
        qwen3_checkpoint: Path) -> None:
    async def scenario() -> None:
        engine, sender = _engine(qwen3_checkpoint, num_blocks=4)
        try:
            # busy holds its 3 blocks until its push is let through (without the gate it
            # could finish before the reserved one ever waited).
            sender.gates["busy"] = asyncio.Event()
            busy = Call(engine, "busy", decode_address="d:1", prompt=PROMPT + PROMPT[:20])
            reserved = Call(engine, "reserved", decode_address="d:1", prompt=PROMPT * 2)
            await until(lambda: engine.blocks.num_waiting == 1, "the reserved prefill queued")
            deferred = Call(engine, "deferred", defer=True, prompt=PROMPT[:5])  # 1 block
            await until(lambda: engine.blocks.num_waiting == 2, "the deferred prefill queued")
            assert not deferred.first_token.is_set() and engine.pool.allocator.num_free == 1
            sender.gates["busy"].set()
            await within(asyncio.gather(busy.task, reserved.task), "the reserved prefills")
            await within(deferred.first_token.wait(), "deferred's first token")
            # The deferred one fitted in the block left free all along, yet went last.
            assert list(sender.pushes) == ["busy", "reserved"]
            assert engine.stats().num_evictions == 0
            engine.abort("deferred")
            with pytest.raises(asyncio.CancelledError):  # abort cancels the caller's call
                await within(deferred.task, "the aborted prefill")
            _assert_clean(engine)
        finally:
            await engine.stop()

    asyncio.run(scenario())
