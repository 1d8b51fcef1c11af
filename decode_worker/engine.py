"""Decode engine: reservations, K/V reception and the batched step loop.

Lifecycle of a request here: Reserve (blocks allocated, lease starts) -> K/V chunks arrive and
are validated -> push complete -> Decode attached (first token, sampling) -> joins the running
batch at the next step boundary -> one token per step -> finished, aborted or lease expired:
its blocks go back to the free list exactly once. Aborts of a running request take effect at
the next step boundary, never while a step still writes into its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

import numpy as np
import torch

from kvferry import wire
from kvferry.errors import Aborted, InvalidArgument, NotFound
from kvferry.executor import run_to_completion
from kvferry.kv_pool import KvPool, blocks_for_tokens
from kvferry.model import Transformer
from kvferry.sampling import SamplingParams, sample_tokens
from kvferry.types import FinishReason, PoolStats

log = logging.getLogger("kvferry.decode")


class Phase(Enum):
    RESERVED = "reserved"  # blocks held, waiting for K/V and/or Decode
    RUNNING = "running"  # in the step loop
    DONE = "done"  # blocks released


class TokensEvent(NamedTuple):
    token_ids: list[int]


class FinishedEvent(NamedTuple):
    reason: FinishReason
    first_step_s: float


class ErrorEvent(NamedTuple):
    error: Exception


DecodeEvent = TokensEvent | FinishedEvent | ErrorEvent


@dataclass(slots=True)
class DecodeSeq:
    request_id: str
    num_prompt_tokens: int
    block_table: list[int]
    lease_deadline: float
    received: np.ndarray  # [layers, prompt blocks] pages delivered so far
    is_kv_complete: bool = False
    params: SamplingParams | None = None
    max_new_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    tokens: list[int] = field(default_factory=list)  # first token (from prefill) + generated
    events: asyncio.Queue[DecodeEvent] | None = None
    phase: Phase = Phase.RESERVED
    is_aborted: bool = False
    first_step_s: float = 0.0

    @property
    def capacity(self) -> int:
        return len(self.block_table)


class DecodeEngine:
    """Owns the pool, the reservations and the step loop. Not thread-safe: call from the
    event loop; only the forward pass runs on the executor thread."""

    def __init__(self, model: Transformer, pool: KvPool, layout: wire.KvLayout) -> None:
        self.model = model
        self.pool = pool
        self.layout = layout
        self._seqs: dict[str, DecodeSeq] = {}
        self._running: list[DecodeSeq] = []
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode-step")
        self._tasks: list[asyncio.Task[None]] = []

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._step_loop()), asyncio.create_task(self._leases())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for seq in list(self._seqs.values()):
            self._finish(seq, ErrorEvent(Aborted("decode worker stopped")))
        self._executor.shutdown(wait=True)

    # ---- reservations and K/V ----------------------------------------------------------------
    def reserve(self, request_id: str, num_prompt_tokens: int, max_tokens: int,
                lease_s: float) -> int:
        if not request_id:
            raise InvalidArgument("request_id must be non-empty", "request_id")
        if request_id in self._seqs:
            raise InvalidArgument(f"request_id {request_id!r} already reserved", "request_id")
        if num_prompt_tokens < 1:
            raise InvalidArgument("num_prompt_tokens must be >= 1", "num_prompt_tokens")
        if max_tokens < 1:
            raise InvalidArgument("max_tokens must be >= 1", "max_tokens")
        context = self.model.config.max_position_embeddings
        if num_prompt_tokens + max_tokens > context:
            raise InvalidArgument(
                f"prompt {num_prompt_tokens} + max_tokens {max_tokens} exceeds the "
                f"context of {context}", "max_tokens",
            )
        if lease_s <= 0:
            raise InvalidArgument("lease_s must be > 0", "lease_s")
        blocks = self.pool.allocator.alloc(
            blocks_for_tokens(num_prompt_tokens + max_tokens, self.pool.block_size)
        )
        self._seqs[request_id] = DecodeSeq(
            request_id=request_id, num_prompt_tokens=num_prompt_tokens, block_table=blocks,
            lease_deadline=time.monotonic() + lease_s,
            received=wire.coverage(self.layout, num_prompt_tokens),
        )
        return len(blocks)

    def _get(self, request_id: str) -> DecodeSeq:
        seq = self._seqs.get(request_id)
        if seq is None:
            raise NotFound(f"no reservation for request_id {request_id!r}", "request_id")
        return seq

    def receive_chunk(self, request_id: str, layout: wire.KvLayout, num_tokens: int,
                      span: wire.ChunkSpan, data: bytes, crc32: int) -> int:
        """Validate one chunk against layout and reservation, then write it. Returns bytes."""
        seq = self._get(request_id)
        if seq.is_kv_complete or seq.phase is not Phase.RESERVED:
            raise InvalidArgument(f"K/V for {request_id!r} is already complete", "request_id")
        problem = self.layout.mismatch(layout)
        if problem:
            raise InvalidArgument(problem, "layout")
        if num_tokens != seq.num_prompt_tokens:
            raise InvalidArgument(
                f"num_tokens {num_tokens} != reserved prompt length {seq.num_prompt_tokens}",
                "num_tokens",
            )
        wire.check_span(self.layout, num_tokens, span, len(data))
        if wire.crc32(data) != crc32:
            raise InvalidArgument("chunk checksum mismatch: corrupted in flight", "crc32")
        rows = slice(span.layer_start, span.layer_end)
        cols = slice(span.block_start, span.block_start + span.num_blocks)
        if seq.received[rows, cols].any():
            raise InvalidArgument("chunk overlaps pages already received", "block_start")
        wire.unpack_into(self.pool, seq.block_table, span, data)
        seq.received[rows, cols] = True
        return len(data)

    def finish_push(self, request_id: str) -> None:
        seq = self._get(request_id)
        missing = int((~seq.received).sum())
        if missing:
            raise InvalidArgument(f"push ended with {missing} pages missing", "data")
        seq.is_kv_complete = True
        self._wake.set()

    def fail_push(self, request_id: str) -> None:
        """A push broke off: forget partial pages so the prompt can be pushed again."""
        seq = self._seqs.get(request_id)
        if seq is not None and not seq.is_kv_complete:
            seq.received[:] = False

    # ---- decoding ----------------------------------------------------------------------------
    def attach(self, request_id: str, first_token_id: int, params: SamplingParams,
               max_new_tokens: int, stop_token_ids: list[int]) -> asyncio.Queue[DecodeEvent]:
        """Register the Decode stream of a reserved request; tokens flow once K/V is in."""
        seq = self._get(request_id)
        if seq.events is not None:
            raise InvalidArgument(f"request_id {request_id!r} is already decoding", "request_id")
        vocab = self.model.config.vocab_size
        if not 0 <= first_token_id < vocab:
            raise InvalidArgument(f"first_token_id outside [0, {vocab})", "first_token_id")
        if max_new_tokens < 1 or seq.num_prompt_tokens + max_new_tokens > seq.capacity * (
            self.pool.block_size
        ):
            raise InvalidArgument(
                f"max_new_tokens {max_new_tokens} does not fit the reservation", "max_new_tokens"
            )
        seq.params = params
        seq.max_new_tokens = max_new_tokens
        seq.stop_token_ids = frozenset(stop_token_ids)
        seq.tokens = [first_token_id]
        seq.events = asyncio.Queue()
        self._wake.set()
        return seq.events

    def abort(self, request_id: str) -> None:
        seq = self._get(request_id)
        if seq.phase is Phase.RUNNING:
            seq.is_aborted = True  # released at the next step boundary
            self._wake.set()
        else:
            self._finish(seq, FinishedEvent(FinishReason.ABORT, 0.0))

    def _finish(self, seq: DecodeSeq, event: DecodeEvent) -> None:
        """Release the request's blocks exactly once and tell its stream how it ended."""
        if seq.phase is Phase.DONE:
            return
        seq.phase = Phase.DONE
        self.pool.allocator.free(seq.block_table)
        self._seqs.pop(seq.request_id, None)
        if seq.events is not None:
            seq.events.put_nowait(event)

    async def _leases(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            for seq in list(self._seqs.values()):
                if seq.phase is Phase.RESERVED and now > seq.lease_deadline:
                    log.warning("request %s: lease expired before decoding began", seq.request_id)
                    self._finish(seq, ErrorEvent(Aborted("lease expired before K/V arrived")))

    def _admit_and_reap(self) -> None:
        for seq in self._running:
            if seq.is_aborted:
                self._finish(seq, FinishedEvent(FinishReason.ABORT, seq.first_step_s))
        self._running = [s for s in self._running if s.phase is Phase.RUNNING]
        for seq in self._seqs.values():
            if seq.phase is Phase.RESERVED and seq.is_kv_complete and seq.events is not None:
                seq.phase = Phase.RUNNING
                self._running.append(seq)

    async def _step_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._admit_and_reap()
            while self._running:
                batch = list(self._running)
                start = time.perf_counter()
                tokens = await run_to_completion(self._executor, self._step, batch)
                elapsed = time.perf_counter() - start
                self._emit(batch, tokens, elapsed)
                self._admit_and_reap()

    def _step(self, batch: list[DecodeSeq]) -> list[int]:
        """One forward for the whole ragged batch (executor thread)."""
        bs = self.pool.block_size
        positions = [s.num_prompt_tokens + len(s.tokens) - 1 for s in batch]
        max_blocks = max(s.capacity for s in batch)
        table = torch.zeros(len(batch), max_blocks, dtype=torch.int32)
        for i, seq in enumerate(batch):
            table[i, : seq.capacity] = torch.tensor(seq.block_table, dtype=torch.int32)
        slots = [seq.block_table[p // bs] * bs + p % bs for seq, p in zip(batch, positions)]
        logits = self.model.decode(
            torch.tensor([s.tokens[-1] for s in batch]),
            torch.tensor(positions),
            torch.tensor(slots, dtype=torch.int64),
            table.to(self.model.device),
            self.pool,
        )
        params = [s.params or SamplingParams() for s in batch]  # attached: never None
        return sample_tokens(logits, params, [len(s.tokens) for s in batch])

    def _emit(self, batch: list[DecodeSeq], tokens: list[int], elapsed: float) -> None:
        for seq, token in zip(batch, tokens):
            if seq.phase is not Phase.RUNNING or seq.is_aborted or seq.events is None:
                continue
            if len(seq.tokens) == 1:
                seq.first_step_s = elapsed
            seq.tokens.append(token)
            seq.events.put_nowait(TokensEvent([token]))
            if token in seq.stop_token_ids:
                self._finish(seq, FinishedEvent(FinishReason.STOP, seq.first_step_s))
            elif len(seq.tokens) - 1 >= seq.max_new_tokens:
                self._finish(seq, FinishedEvent(FinishReason.LENGTH, seq.first_step_s))

    # ---- stats -------------------------------------------------------------------------------
    def stats(self) -> PoolStats:
        waiting = [s for s in self._seqs.values() if s.phase is Phase.RESERVED]
        report = self.pool.allocator.check_integrity()
        return PoolStats(
            total_blocks=self.pool.num_blocks,
            free_blocks=self.pool.allocator.num_free,
            reserved_blocks=sum(s.capacity for s in waiting),
            num_running=len(self._running),
            num_waiting=len(waiting),
            integrity_ok=report.ok,
            integrity_error=report.error,
        )
