"""Prefill engine: one prompt -> K/V in the local pool -> first token -> pages shipped.

The local blocks live only as long as the request: they are freed when the push is accepted,
fails, or the caller goes away, and never while a forward pass may still write into them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch

from kvferry import wire
from kvferry.errors import InvalidArgument, NotFound
from kvferry.executor import run_to_completion
from kvferry.kv_pool import KvPool, blocks_for_tokens
from kvferry.model import Transformer
from kvferry.sampling import SamplingParams, sample_tokens
from kvferry.transport import KvSender
from kvferry.types import PoolStats


class FirstTokenEvent(NamedTuple):
    token_id: int
    prefill_s: float


class PushedEvent(NamedTuple):
    kv_transfer_s: float
    kv_bytes: int


class PrefillEngine:
    def __init__(self, model: Transformer, pool: KvPool, layout: wire.KvLayout,
                 sender: KvSender) -> None:
        self.model = model
        self.pool = pool
        self.layout = layout
        self.sender = sender
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill")
        self._active: dict[str, asyncio.Task[object]] = {}
        self._pending_tokens = 0

    async def stop(self) -> None:
        for task in list(self._active.values()):
            task.cancel()
        self._executor.shutdown(wait=True)
        await self.sender.close()

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if not request_id:
            raise InvalidArgument("request_id must be non-empty", "request_id")
        if request_id in self._active:
            raise InvalidArgument(f"request_id {request_id!r} is already prefilling",
                                  "request_id")
        if not prompt:
            raise InvalidArgument("prompt_token_ids must be non-empty", "prompt_token_ids")
        vocab = self.model.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise InvalidArgument(f"prompt_token_ids must be in [0, {vocab})",
                                  "prompt_token_ids")
        if len(prompt) >= self.model.config.max_position_embeddings:
            raise InvalidArgument("prompt fills the model's context", "prompt_token_ids")
        params.validate(vocab)

    def _forward(self, prompt: list[int], blocks: list[int]) -> torch.Tensor:
        slots = self.pool.slots(blocks, 0, len(prompt)).to(self.model.device)
        ids = torch.tensor(prompt, device=self.model.device)
        return self.model.prefill(ids, [len(prompt)], slots, self.pool)  # [1, vocab]

    async def prefill(
        self, request_id: str, prompt: list[int], params: SamplingParams,
        decode_address: str, timeout_s: float | None,
    ) -> AsyncIterator[FirstTokenEvent | PushedEvent]:
        """Yield the first token as soon as it exists, then the push's completion."""
        self._validate(request_id, prompt, params)
        blocks = self.pool.allocator.alloc(blocks_for_tokens(len(prompt), self.pool.block_size))
        task = asyncio.current_task()
        if task is not None:
            self._active[request_id] = task
        self._pending_tokens += len(prompt)
        try:
            start = time.perf_counter()
            logits = await run_to_completion(self._executor, self._forward, prompt, blocks)
            token = sample_tokens(logits, [params], [0])[0]
            self._pending_tokens -= len(prompt)
            yield FirstTokenEvent(token, time.perf_counter() - start)
            if decode_address:
                pushed = await self.sender.push(
                    decode_address, request_id, self.layout, len(prompt), self.pool, blocks,
                    timeout_s,
                )
                yield PushedEvent(pushed.seconds, pushed.num_bytes)
        finally:
            self._active.pop(request_id, None)
            self.pool.allocator.free(blocks)

    def abort(self, request_id: str) -> None:
        task = self._active.get(request_id)
        if task is None:
            raise NotFound(f"request_id {request_id!r} is not prefilling here", "request_id")
        task.cancel()

    def stats(self) -> PoolStats:
        report = self.pool.allocator.check_integrity()
        return PoolStats(
            total_blocks=self.pool.num_blocks, free_blocks=self.pool.allocator.num_free,
            reserved_blocks=0, num_running=len(self._active), num_waiting=0,
            integrity_ok=report.ok, integrity_error=report.error,
        )
