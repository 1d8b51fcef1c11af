"""A prefill's cleanup (stop its push, free its blocks) runs to its end even when the call is
cancelled again while it unwinds: a stream the router cancels can be cancelled twice. Before,
the second cancel cut the cleanup short and the request's blocks leaked (found with draft-K/V
shipping under load: one block a round, tests/e2e/test_tensor_parallel_workers.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvferry.cache.layout import KvLayout
from kvferry.cache.pool import KvPool
from kvferry.transfer.sender import LayersReady, PushResult
from tests.prefill_worker.test_parked_kv import Call, RecordingSender, _assert_clean, _engine
from tests.waiting import until, within


class SlowToCancel(RecordingSender):
    """A transport whose push never completes and takes a while to unwind when cancelled
    (as a stream being closed does). The prefill's forward never runs either, so the first
    cancel finds the call waiting for its first token, and the cleanup cancels the push."""

    def __init__(self) -> None:
        super().__init__()
        self.unwinding = asyncio.Event()

    async def push(self, address: str, request_id: str, layout: KvLayout,
                   num_tokens: int, pool: KvPool, block_table: list[int],
                   timeout_s: float | None, ready: LayersReady | None = None,
                   **options: object) -> PushResult:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.unwinding.set()
            await asyncio.sleep(0.5)
            raise
        raise AssertionError("unreachable")


def test_a_prefill_cancelled_twice_still_frees_its_blocks(qwen3_checkpoint: Path) -> None:
    async def scenario() -> None:
        engine, _ = _engine(qwen3_checkpoint, num_blocks=4)
        sender = engine.sender = SlowToCancel()
        engine.batcher.submit = lambda job: None  # its forward never comes: it waits
        try:
            call = Call(engine, "r", decode_address="decode-a:1")
            await until(lambda: engine.pool.allocator.num_free == 2, "the prompt's 2 blocks")
            call.task.cancel()  # the router ends the stream: the cleanup stops the push
            await within(sender.unwinding.wait(), "the push unwinding")
            call.task.cancel()  # and again, while the cleanup waits for the push
            await asyncio.gather(call.task, return_exceptions=True)
            await until(lambda: engine.pool.allocator.num_free == 4, "the blocks freed")
            _assert_clean(engine)
            assert engine.stats().num_running == 0  # the request is gone, not half-ended
        finally:
            await engine.stop()

    asyncio.run(scenario())
