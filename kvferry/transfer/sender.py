"""The K/V sender interface: how a prefill worker's pages reach a decode worker's pool.

Each transport implements `KvSender` in its package's `send.py` (`kvferry/transfer/grpc/`,
`ray/`, `nixl/`); its receiving end, beside it in `receive.py`, writes into the decode
engine's `KvSink` (`kvferry/transfer/sink.py`), which validates against its reservations.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import NamedTuple, Protocol

from kvferry.cache.layout import KvLayout
from kvferry.cache.pool import KvPool


class PushResult(NamedTuple):
    num_bytes: int
    seconds: float


# ready(n): returns once the first n layers' K/V are final (pipelined push), or at once.
LayersReady = Callable[[int], Awaitable[None]]


class DraftPush(NamedTuple):
    """A draft model's prompt pages, pushed after the model's in the same push (as chunks
    marked is_draft) once `ready()` returns: where the prefill worker built them
    (--speculative-draft-kv ship). Only the grpc transport carries them."""

    layout: KvLayout
    pool: KvPool
    ready: Callable[[], Awaitable[None]]


class KvSender(Protocol):
    num_corrupt_pushes: int  # pushes the receiver refused as corrupted in flight

    # first_block: the receiver's prefix cache holds the blocks before it; they are not sent.
    # evicted: (num_evicted, num_rebased) of a prompt that evicted K/V while prefilled: only
    # the grpc transport takes it (the caller passes it to no other).
    async def push(
        self, address: str, request_id: str, layout: KvLayout, num_tokens: int,
        pool: KvPool, block_table: list[int], timeout_s: float | None,
        ready: LayersReady | None = None, first_block: int = 0,
        draft: DraftPush | None = None, evicted: tuple[int, int] = (0, 0),
    ) -> PushResult: ...

    async def close(self) -> None: ...
