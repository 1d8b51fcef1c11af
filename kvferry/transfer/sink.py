"""`KvSink`: what a transport's receiving end writes K/V into, a decode worker's
reservations (`decode_worker.kv_receiver.KvReceiver` implements it for the decode engine).

A push is one stream of pages for one reservation. `begin_push` opens it and returns its
epoch; a newer push for the same reservation supersedes it, so a silent sender's late pages
are refused instead of mixing two pushes' pages. A transport either hands the sink bytes
(`receive_chunk`: validated, then copied into the reservation's blocks) or writes the pages
itself where they lie (`writable`, then `mark_received` once it has checked them: NIXL's
READs land straight in the pool). `finish_push` ends a push whose every page came;
`fail_push` forgets a broken one's pages so the prompt can be pushed again.

Refusals are `kvferry.errors`: NotFound (no such reservation), InvalidArgument naming the
field, AlreadyExists (the K/V is complete: an earlier push delivered it), Aborted (a newer
push took over), DataLoss (non-finite values).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from kvferry.cache.layout import KvLayout
from kvferry.cache.pool import KvPool
from kvferry.transfer.wire import ChunkSpan


class PushTarget(NamedTuple):
    """Where a reservation's pages go, for a transport that writes them itself."""

    num_prompt_tokens: int
    block_table: list[int]
    received: torch.Tensor  # bool [layers, prompt blocks]: pages already in place


class KvSink(Protocol):
    layout: KvLayout  # what pushes must match (KvLayout.mismatch)
    pool: KvPool  # the pages; a transport writing in place fences the blocks it writes

    def begin_push(self, request_id: str) -> int:
        """Open a push into the reservation; its epoch, which the push's pages carry."""
        ...

    def receive_chunk(self, request_id: str, layout: KvLayout, num_tokens: int,
                      span: ChunkSpan, data: bytes, crc32: int,
                      epoch: int | None = None, is_draft: bool = False,
                      evicted: tuple[int, int] = (0, 0)) -> int:
        """Validate one chunk (`kvferry.transfer.wire` packing) and copy it in; its bytes.
        `is_draft`: a draft model's pages, into its own pool. `evicted`: the push's
        (num_evicted, num_rebased), where the prompt evicted K/V while prefilled."""
        ...

    def target(self, request_id: str) -> PushTarget:
        """The reservation's prompt length, blocks and received pages (NotFound if none)."""
        ...

    def writable(self, request_id: str, epoch: int | None) -> PushTarget:
        """`target`, once push `epoch` may still write into it (refused otherwise)."""
        ...

    def mark_received(self, request_id: str, epoch: int, span: ChunkSpan, nbytes: int) -> None:
        """Pages a transport wrote and checked in place are the reservation's now."""
        ...

    def finish_push(self, request_id: str, epoch: int | None = None) -> None:
        ...

    def fail_push(self, request_id: str, epoch: int | None = None) -> None:
        ...
