"""Waiting in tests for something to happen, never for time to pass: an event awaited, or a
condition polled, each under a deadline that only a hang reaches (a loaded 2-core CI machine
is slow, not stuck) and whose failure names what never happened. No elapsed time is ever
asserted here."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

DEADLINE_S = 60.0
POLL_S = 0.01


async def within(awaitable: Awaitable[T], what: str, deadline_s: float = DEADLINE_S) -> T:
    """`await awaitable`, failing with an AssertionError naming `what` if it hangs."""
    try:
        return await asyncio.wait_for(awaitable, deadline_s)
    except TimeoutError:
        raise AssertionError(f"not within {deadline_s:.0f} s: {what}") from None


async def until(condition: Callable[[], object], what: str,
                deadline_s: float = DEADLINE_S) -> None:
    """Return once `condition()` holds (polled on the event loop)."""
    give_up = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > give_up:
            raise AssertionError(f"not within {deadline_s:.0f} s: {what}")
        await asyncio.sleep(POLL_S)  # paces: the poll


def until_sync(condition: Callable[[], object], what: str,
               deadline_s: float = DEADLINE_S, poll_s: float = POLL_S) -> None:
    """`until` for a test without an event loop (processes, threads)."""
    give_up = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > give_up:
            raise AssertionError(f"not within {deadline_s:.0f} s: {what}")
        time.sleep(poll_s)  # paces: the poll
