"""Run blocking model work off the event loop without ever abandoning it half-done."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TypeVar

T = TypeVar("T")


async def run_to_completion(executor: Executor, fn: Callable[..., T], *args: object) -> T:
    """Run `fn(*args)` in `executor`. If the caller is cancelled, wait for `fn` to finish
    before re-raising: model work writes into pool blocks, and blocks must not be freed (and
    handed to another request) while a forward pass still writes into them."""
    future = asyncio.get_running_loop().run_in_executor(executor, fn, *args)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        try:
            await future
        except Exception:  # the work's own failure is moot: the caller is gone
            pass
        raise
