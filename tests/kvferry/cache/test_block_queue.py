"""BlockQueue: FIFO waiting for K/V blocks, and the deferrable lane that never takes blocks
another allocation is waiting for."""

from __future__ import annotations

import asyncio

import pytest

from kvferry.cache.allocator import BlockAllocator
from kvferry.cache.block_queue import BlockQueue
from kvferry.errors import ResourceExhausted


async def _settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)  # paces: one turn of the event loop


def test_waiters_are_granted_in_order_as_blocks_free() -> None:
    async def scenario() -> list[str]:
        queue = BlockQueue(BlockAllocator(4), max_waiting=8)
        held = await queue.alloc(4)
        order: list[str] = []

        async def want(name: str, n: int) -> None:
            blocks = await queue.alloc(n)
            order.append(name)
            queue.allocator.free(blocks)
            queue.grant()

        tasks = [asyncio.ensure_future(want(name, n)) for name, n in (("a", 3), ("b", 1))]
        await _settle()
        assert order == []  # the pool is full: both wait
        queue.allocator.free(held)
        queue.grant()
        await asyncio.gather(*tasks)
        assert queue.allocator.num_free == 4
        return order

    assert asyncio.run(scenario()) == ["a", "b"]


def test_deferrable_allocation_waits_while_another_waits() -> None:
    """A deferrable request does not take freed blocks from a waiter ahead of it in the
    other lane, even when it arrived first, and even when it would fit."""
    async def scenario() -> None:
        queue = BlockQueue(BlockAllocator(4), max_waiting=8)
        held = await queue.alloc(4)
        deferred = asyncio.ensure_future(queue.alloc(1, deferrable=True))
        await _settle()
        urgent = asyncio.ensure_future(queue.alloc(3))
        await _settle()
        assert queue.blocks_awaited == 3  # the first lane only
        queue.allocator.free(held[:3])
        queue.grant()
        await _settle()
        assert urgent.done() and not deferred.done()
        queue.allocator.free(held[3:])
        queue.grant()
        await _settle()
        assert deferred.done()
        assert queue.num_waiting == 0

    asyncio.run(scenario())


def test_deferrable_allocation_does_not_jump_the_queue_when_blocks_are_free() -> None:
    async def scenario() -> None:
        queue = BlockQueue(BlockAllocator(4), max_waiting=8)
        held = await queue.alloc(2)
        urgent = asyncio.ensure_future(queue.alloc(4))
        await _settle()
        deferred = asyncio.ensure_future(queue.alloc(1, deferrable=True))
        await _settle()
        assert not deferred.done()  # 2 blocks are free, but they are promised
        queue.allocator.free(held)
        queue.grant()
        await _settle()
        assert urgent.done() and not deferred.done()
        queue.allocator.free(urgent.result())
        queue.grant()
        await _settle()
        assert deferred.done()

    asyncio.run(scenario())


def test_an_allocation_that_must_wait_calls_on_wait_and_can_be_served_at_once() -> None:
    """on_wait lets the owner free something (the prefill worker evicts parked K/V): what it
    frees goes to the waiter that called it before the allocation even yields."""
    async def scenario() -> None:
        allocator = BlockAllocator(4)
        parked = allocator.alloc(4)
        calls: list[int] = []

        def on_wait() -> None:
            calls.append(queue.blocks_awaited)
            allocator.free(parked)
            queue.grant()

        queue = BlockQueue(allocator, max_waiting=8, on_wait=on_wait)
        blocks = await queue.alloc(3)
        assert len(blocks) == 3 and calls == [3]
        await queue.alloc(1, deferrable=True)  # fits: no call
        assert calls == [3]

    asyncio.run(scenario())


def test_cancelled_head_waiter_lets_the_next_one_in() -> None:
    async def scenario() -> None:
        queue = BlockQueue(BlockAllocator(4), max_waiting=8)
        held = await queue.alloc(2)
        big = asyncio.ensure_future(queue.alloc(4))
        await _settle()
        small = asyncio.ensure_future(queue.alloc(2))
        await _settle()
        assert not small.done()  # FIFO: behind the big one
        big.cancel()
        await _settle()
        assert small.done() and len(small.result()) == 2
        queue.allocator.free(held)

    asyncio.run(scenario())


def test_bounds_are_refused_with_resource_exhausted() -> None:
    async def scenario() -> None:
        queue = BlockQueue(BlockAllocator(4), max_waiting=1)
        with pytest.raises(ResourceExhausted, match="pool has 4"):
            await queue.alloc(5)
        held = await queue.alloc(4)
        waiter = asyncio.ensure_future(queue.alloc(1, deferrable=True))
        await _settle()
        with pytest.raises(ResourceExhausted, match="already waiting"):
            await queue.alloc(1)
        waiter.cancel()
        queue.allocator.free(held)

    asyncio.run(scenario())
