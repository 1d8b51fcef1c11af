"""Allocation that waits: a bounded FIFO queue in front of a BlockAllocator.

When the pool cannot take a request, the request waits (in arrival order, so a large request
is not starved by small ones) instead of failing; past `max_waiting` waiters the caller gets
RESOURCE_EXHAUSTED at once. Whoever frees blocks calls `grant()`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from kvferry.errors import ResourceExhausted
from kvferry.kv_pool import BlockAllocator


class BlockQueue:
    def __init__(self, allocator: BlockAllocator, max_waiting: int,
                 may_grant: Callable[[], bool] = lambda: True) -> None:
        self.allocator = allocator
        self.max_waiting = max_waiting
        self._may_grant = may_grant  # e.g. "no preempted sequence is waiting to resume"
        self._waiters: deque[tuple[int, asyncio.Future[list[int]]]] = deque()

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    def _fits(self, n: int) -> bool:
        return self._may_grant() and self.allocator.num_free >= n

    async def alloc(self, n: int) -> list[int]:
        if n > self.allocator.num_blocks:
            raise ResourceExhausted(f"need {n} K/V blocks; the pool has "
                                    f"{self.allocator.num_blocks}")
        if not self._waiters and self._fits(n):
            return self.allocator.alloc(n)
        if len(self._waiters) >= self.max_waiting:
            raise ResourceExhausted(
                f"K/V pool full and {len(self._waiters)} requests already waiting for blocks"
            )
        waiter = (n, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        try:
            return await waiter[1]
        except asyncio.CancelledError:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            elif waiter[1].done() and not waiter[1].cancelled():
                self.allocator.free(waiter[1].result())  # granted as we were cancelled
            raise

    def grant(self) -> None:
        """Hand freed blocks to waiters, in order, while the first one fits."""
        while self._waiters and self._fits(self._waiters[0][0]):
            n, future = self._waiters.popleft()
            if not future.done():
                future.set_result(self.allocator.alloc(n))
