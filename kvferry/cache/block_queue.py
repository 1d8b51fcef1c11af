"""Allocation that waits: a bounded FIFO queue in front of a BlockAllocator.

When the pool cannot take a request, the request waits (in arrival order, so a large request
is not starved by small ones) instead of failing; past `max_waiting` waiters the caller gets
RESOURCE_EXHAUSTED at once. Whoever frees blocks calls `grant()`.

Two lanes: a `deferrable` allocation (a prefill worker's K/V held ahead of any decode
reservation) is granted only while no other allocation waits, so speculative work never
takes blocks that work already promised elsewhere is waiting for.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from kvferry.cache.allocator import BlockAllocator
from kvferry.errors import ResourceExhausted

Waiter = tuple[int, asyncio.Future[list[int]]]


class BlockQueue:
    def __init__(self, allocator: BlockAllocator, max_waiting: int,
                 may_grant: Callable[[], bool] = lambda: True,
                 on_wait: Callable[[], None] = lambda: None) -> None:
        self.allocator = allocator
        self.max_waiting = max_waiting
        self._may_grant = may_grant  # e.g. "no preempted sequence is waiting to resume"
        self._on_wait = on_wait  # a first-lane allocation just queued: the owner may free some
        self._waiters: deque[Waiter] = deque()
        self._deferrable: deque[Waiter] = deque()

    @property
    def num_waiting(self) -> int:
        return len(self._waiters) + len(self._deferrable)

    @property
    def blocks_awaited(self) -> int:
        """Blocks the waiters of the first lane ask for in all."""
        return sum(n for n, _ in self._waiters)

    def _fits(self, n: int) -> bool:
        return self._may_grant() and self.allocator.num_free >= n

    async def alloc(self, n: int, deferrable: bool = False) -> list[int]:
        if n > self.allocator.num_blocks:
            raise ResourceExhausted(f"need {n} K/V blocks; the pool has "
                                    f"{self.allocator.num_blocks}")
        lane = self._deferrable if deferrable else self._waiters
        if not self._waiters and not lane and self._fits(n):
            return self.allocator.alloc(n)
        if self.num_waiting >= self.max_waiting:
            raise ResourceExhausted(
                f"K/V pool full and {self.num_waiting} requests already waiting for blocks"
            )
        waiter: Waiter = (n, asyncio.get_running_loop().create_future())
        lane.append(waiter)
        if not deferrable:
            self._on_wait()
        try:
            return await waiter[1]
        except asyncio.CancelledError:
            if waiter in lane:
                lane.remove(waiter)
                self.grant()  # a smaller waiter behind this one may fit now
            elif waiter[1].done() and not waiter[1].cancelled():
                self.allocator.free(waiter[1].result())  # granted as we were cancelled
                self.grant()
            raise

    def grant(self) -> None:
        """Hand freed blocks to waiters, in order, while the first one fits; the deferrable
        lane only once the first lane is empty."""
        for lane in (self._waiters, self._deferrable):
            while lane and self._fits(lane[0][0]):
                n, future = lane.popleft()
                if not future.done():
                    future.set_result(self.allocator.alloc(n))
            if lane:
                return
