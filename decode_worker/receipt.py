"""What a reservation has received of its prompt's K/V (decode_worker/kv_receiver.py, and the
colocated prefill of decode_worker/engine.py): the pages delivered, by layer and block, the
push now filling them, the draft model's pages, and the eviction state the push announced.
Its own methods change it; a `DecodeSeq` holds one."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvferry.transfer.wire import ChunkSpan


@dataclass(slots=True, eq=False)
class KvReceipt:
    received: np.ndarray  # [layers, prompt blocks] pages delivered so far
    is_complete: bool = False  # every page in place: the sequence may step
    epoch: int = 0  # the push now filling `received` (a newer one supersedes it)
    # A draft model's pages pushed with the prompt's (--speculative-draft-kv ship): those
    # delivered by the push now filling `received` (None: none yet).
    draft_received: np.ndarray | None = None
    # The push's (num_evicted, num_rebased), from its first chunk (None: none yet).
    eviction: tuple[int, int] | None = None

    def reset(self, num_cached_blocks: int) -> None:
        """Nothing pushed yet: only the leading pages shared from the prefix cache are in
        place."""
        self.received[:] = False
        self.received[:, :num_cached_blocks] = True
        self.draft_received = None

    def begin_push(self, num_cached_blocks: int) -> int:
        """A push starts, superseding any unfinished one (whose pages are forgotten): its
        epoch, which its chunks carry."""
        self.epoch += 1
        self.reset(num_cached_blocks)
        self.eviction = None
        return self.epoch

    def mark(self, span: ChunkSpan) -> None:
        """The pages of `span` were written."""
        self.received[span.layer_start: span.layer_end,
                      span.block_start: span.block_start + span.num_blocks] = True

    def num_missing(self, kept_blocks: int) -> int:
        """Pages of the first `kept_blocks` blocks not delivered yet."""
        return int((~self.received[:, :kept_blocks]).sum())

    def num_draft_missing(self) -> int:
        """Draft pages not delivered yet (0 when the push carries none)."""
        return 0 if self.draft_received is None else int((~self.draft_received).sum())

    def complete(self) -> None:
        """Every page in place (those a push left out because the prompt evicted them, or a
        local prefill wrote, counted as delivered)."""
        self.received[:] = True
        self.is_complete = True

    def copy(self) -> KvReceipt:
        """A sample's own receipt, forked from its request's."""
        draft = None if self.draft_received is None else self.draft_received.copy()
        return KvReceipt(self.received.copy(), self.is_complete, self.epoch, draft,
                         self.eviction)
