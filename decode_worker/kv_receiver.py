"""The decode engine's `kvferry.transfer.sink.KvSink`: the receiving side of K/V pushes into
its reservations, whichever transport carries them (each transport's receiving end, in
`kvferry/transfer/<name>/receive.py`, calls it).

A push is one stream of chunks for one reservation. `begin_push` opens it and returns its
epoch; a newer push for the same reservation supersedes it, so a silent sender's late chunks
are refused instead of mixing two pushes' pages. Each chunk is validated (layout, prompt
length, span, checksum, overlap, finite values) before one copy into the reservation's
blocks: a chunk holding inf or NaN, or a quantized page whose scale would dequantize to inf,
is refused with DATA_LOSS and nothing of it is written (attention would spread it: 0 x NaN is
NaN).

With a draft model (`DraftPages`), a push may also carry the draft's pages of the prompt
(`is_draft` chunks, validated the same way against the draft's layout and pool). A push
carries all of them or none: one that ends with some missing is refused; one that delivered
them all sets the sequence's `draft_kv_tokens`, so the draft model starts after the prompt.

A prompt that evicted K/V while it was prefilled (`--kv-eviction`, gRPC pushes) arrives as its
kept pages (blocks 0.. of `num_tokens - num_evicted` tokens) with its eviction state, the same
in every chunk; once complete, the sequence takes that state and gives back the blocks its
reservation held past them (docs/kv-eviction-design.md 3.4).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np

from decode_worker.sequence import DecodeSeq, Phase, lookup
from kvferry.cache.budget import blocks_for_tokens
from kvferry.cache.layout import KvLayout
from kvferry.cache.pool import KvPool
from kvferry.errors import Aborted, AlreadyExists, DataLoss, InvalidArgument
from kvferry.transfer import wire
from kvferry.transfer.sink import PushTarget


class DraftPages(NamedTuple):
    """A draft model's pool on this worker, which pushes may fill for the prompt too."""

    layout: KvLayout
    pool: KvPool


class KvReceiver:
    """Writes pushed pages into the engine's reservations (`seqs`, read-only here: the engine
    creates and releases them). Calls `on_complete` once a reservation's K/V is all in."""

    def __init__(self, layout: KvLayout, pool: KvPool, seqs: Mapping[str, DecodeSeq],
                 on_complete: Callable[[DecodeSeq], None], draft: DraftPages | None = None,
                 evicts: bool = False) -> None:
        self.layout = layout
        self.evicts = evicts  # this worker runs a K/V eviction policy: evicted pushes fit
        self.pool = pool
        self.seqs = seqs
        self.draft = draft
        self._on_complete = on_complete
        self.kv_bytes_received = 0

    def begin_push(self, request_id: str) -> int:
        """A push stream starts: it supersedes any unfinished one for the same reservation (a
        prefill worker that went silent mid-push while the router had another one push
        again), whose pages are forgotten and whose later chunks are refused. Returns the
        push's epoch, which its chunks carry."""
        seq = self._check_incomplete(lookup(self.seqs, request_id))
        epoch = seq.receipt.begin_push(seq.num_cached_blocks)
        seq.renew_lease()  # a prefill worker is at work on it
        return epoch

    def _check_incomplete(self, seq: DecodeSeq) -> DecodeSeq:
        """A push may still fill this reservation. A complete one not yet decoding answers
        ALREADY_EXISTS: a prefill worker lost just after its push ended makes the router
        prefill again, and the second push finds the same prompt's K/V in place."""
        if seq.phase is not Phase.RESERVED:
            raise InvalidArgument(f"request {seq.request_id!r} is already decoding",
                                  "request_id")
        if seq.receipt.is_complete:
            raise AlreadyExists(f"K/V for {seq.request_id!r} is already complete",
                                "request_id")
        return seq

    def _check_epoch(self, seq: DecodeSeq, epoch: int | None) -> None:
        if epoch is not None and epoch != seq.receipt.epoch:
            raise Aborted(f"push for {seq.request_id!r} superseded by a newer one")

    def check_writable(self, seq: DecodeSeq, epoch: int | None) -> None:
        """Push `epoch` may still write into `seq`'s pages."""
        self._check_epoch(seq, epoch)
        self._check_incomplete(seq)

    def target(self, request_id: str) -> PushTarget:
        seq = lookup(self.seqs, request_id)
        return PushTarget(seq.num_prompt_tokens, list(seq.block_table), seq.receipt.received)

    def writable(self, request_id: str, epoch: int | None) -> PushTarget:
        seq = lookup(self.seqs, request_id)
        self.check_writable(seq, epoch)
        return PushTarget(seq.num_prompt_tokens, list(seq.block_table), seq.receipt.received)

    def mark_received(self, request_id: str, epoch: int, span: wire.ChunkSpan,
                      nbytes: int) -> None:
        seq = lookup(self.seqs, request_id)
        self.check_writable(seq, epoch)
        seq.receipt.mark(span)
        seq.renew_lease()
        self.kv_bytes_received += nbytes

    def receive_chunk(self, request_id: str, layout: KvLayout, num_tokens: int,
                      span: wire.ChunkSpan, data: bytes, crc32: int,
                      epoch: int | None = None, is_draft: bool = False,
                      evicted: tuple[int, int] = (0, 0)) -> int:
        """Validate one chunk against layout and reservation, then write it. Returns bytes.
        `epoch`: from begin_push; None for a caller that opened no push. `is_draft`: the
        draft model's pages (refused where this worker runs none). `evicted`: the push's
        (num_evicted, num_rebased)."""
        seq = lookup(self.seqs, request_id)
        self.check_writable(seq, epoch)
        layout_here, pool, received = self._destination(seq, is_draft)
        problem = layout_here.mismatch(layout)
        if problem:
            raise InvalidArgument(problem, "layout")
        if num_tokens != seq.num_prompt_tokens:
            raise InvalidArgument(
                f"num_tokens {num_tokens} != reserved prompt length {seq.num_prompt_tokens}",
                "num_tokens",
            )
        self._check_eviction(seq, evicted)
        wire.check_span(layout_here, num_tokens - evicted[0], span, len(data))
        if wire.crc32(data) != crc32:
            raise InvalidArgument("chunk checksum mismatch: corrupted in flight", "crc32")
        if not wire.is_finite(data, pool):
            raise DataLoss("chunk holds non-finite K/V (inf or NaN, or a quantized page's scale "
                           "that dequantizes to inf); nothing written", "data")
        rows = slice(span.layer_start, span.layer_end)
        cols = slice(span.block_start, span.block_start + span.num_blocks)
        if received[rows, cols].any():
            raise InvalidArgument("chunk overlaps pages already received", "block_start")
        wire.unpack_into(pool, seq.block_table, span, data)
        received[rows, cols] = True
        seq.renew_lease()
        self.kv_bytes_received += len(data)
        return len(data)

    def _check_eviction(self, seq: DecodeSeq, evicted: tuple[int, int]) -> None:
        """The first chunk's eviction state is the push's; every later one must carry it."""
        if seq.receipt.eviction is not None:
            if evicted != seq.receipt.eviction:
                raise InvalidArgument(f"num_evicted, num_rebased {evicted} differ from the "
                                      f"push's first chunk's {seq.receipt.eviction}",
                                      "num_evicted")
            return
        num_evicted, num_rebased = evicted
        if num_evicted:
            if not self.evicts:
                raise InvalidArgument("an evicted prompt pushed to a decode worker without "
                                      "--kv-eviction", "num_evicted")
            if (num_evicted % self.pool.block_size or num_evicted >= seq.num_prompt_tokens
                    or not 0 <= num_rebased <= num_evicted):
                raise InvalidArgument(f"num_evicted {num_evicted} (num_rebased {num_rebased}) "
                                      f"not whole blocks of the {seq.num_prompt_tokens}-token "
                                      f"prompt", "num_evicted")
            if seq.num_cached_blocks:
                raise InvalidArgument("an evicted prompt pushed into a reservation that "
                                      "shares cached blocks", "num_evicted")
        elif num_rebased:
            raise InvalidArgument("num_rebased without num_evicted", "num_rebased")
        seq.receipt.eviction = evicted

    def _destination(self, seq: DecodeSeq, is_draft: bool) -> tuple[KvLayout, KvPool, np.ndarray]:
        """The layout, pool and delivered-pages map a chunk goes to. The draft's map starts
        with its first chunk; a draft page of a block from the prefix cache is refused (other
        sequences read it: its draft K/V is recomputed instead)."""
        receipt = seq.receipt
        if not is_draft:
            return self.layout, self.pool, receipt.received
        if self.draft is None:
            raise InvalidArgument("draft pages pushed to a decode worker without a draft model "
                                  "(--speculative-method draft)", "is_draft")
        if seq.num_cached_blocks:
            raise InvalidArgument("draft pages pushed for a prompt whose first blocks came "
                                  "from this worker's prefix cache", "is_draft")
        if receipt.draft_received is None:
            receipt.draft_received = wire.coverage(self.draft.layout, seq.num_prompt_tokens)
        return self.draft.layout, self.draft.pool, receipt.draft_received

    def finish_push(self, request_id: str, epoch: int | None = None) -> None:
        seq = lookup(self.seqs, request_id)
        self._check_epoch(seq, epoch)
        receipt = seq.receipt
        num_evicted, num_rebased = receipt.eviction or (0, 0)
        kept = blocks_for_tokens(seq.num_prompt_tokens - num_evicted, self.pool.block_size)
        missing = receipt.num_missing(kept)
        if missing:
            raise InvalidArgument(f"push ended with {missing} pages missing", "data")
        if receipt.draft_received is not None:
            missing = receipt.num_draft_missing()
            if missing:
                raise InvalidArgument(f"push ended with {missing} draft pages missing",
                                      "is_draft")
            seq.draft_kv_tokens = seq.num_prompt_tokens
        if num_evicted:  # the kept pages lead the table; what the reservation held past
            # them (and the first token's slot) goes back
            seq.num_evicted, seq.num_rebased = num_evicted, num_rebased
            keep = blocks_for_tokens(seq.num_prompt_tokens - num_evicted + 1,
                                     self.pool.block_size)
            self.pool.allocator.free(seq.block_table[keep:])
            del seq.block_table[keep:]
        receipt.complete()
        self._on_complete(seq)

    def fail_push(self, request_id: str, epoch: int | None = None) -> None:
        """A push broke off: forget partial pages so the prompt can be pushed again (unless
        a newer push has taken over the reservation)."""
        seq = self.seqs.get(request_id)
        if (seq is not None and not seq.receipt.is_complete
                and epoch in (None, seq.receipt.epoch)):
            seq.receipt.reset(seq.num_cached_blocks)
