"""Router engine: validate, reserve decode blocks, prefill, relay tokens, clean up.

The token contract (docs/architecture.md): prefill computes K/V for the N prompt tokens and
samples token N+1, which the router streams at once. Decode is told that token, feeds it at
position N and streams tokens N+2 onwards. Every token is streamed exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import NamedTuple

import grpc

from kvferry import convert
from kvferry.capacity import blocks_needed
from kvferry.config import ModelConfig
from kvferry.errors import (
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    Remote,
    ResourceExhausted,
    Unavailable,
)
from kvferry.sampling import SamplingParams
from kvferry.types import FinishReason
from kvferry.v1 import generation_pb2, worker_pb2
from router import validation
from router.decode_mux import MuxItem, StreamBroken
from router.detok import IncrementalDetokenizer
from router.policy import HeadroomPolicy, Policy
from router.validation import GenerateInput
from router.workers import Worker, WorkerSet

log = logging.getLogger("kvferry.router")


class ChunkEvent(NamedTuple):
    token_ids: list[int]
    text: str


class Timing(NamedTuple):
    queue_s: float
    prefill_s: float
    kv_transfer_s: float
    first_decode_step_s: float
    time_to_first_token_s: float
    admission_wait_s: float = 0.0
    num_migrations: int = 0


class DoneEvent(NamedTuple):
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    timing: Timing


@dataclass(slots=True)
class RouterRequest:
    request_id: str
    is_aborted: bool = False
    is_push_deferred: bool = False  # prefilled before its decode reservation (see _run)
    prefill_worker: Worker | None = None
    prefill_call: grpc.aio.UnaryStreamCall | None = None
    decode_worker: Worker | None = None
    holds_decode: bool = False  # the decode worker still holds this request's blocks
    failed_prefill: set[str] = field(default_factory=set)  # prefill workers that failed it
    is_decoding: bool = False  # the Decode stream is open


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - time.monotonic(), 0.001)


async def _next_update(updates: asyncio.Queue[MuxItem], deadline: float | None
                       ) -> worker_pb2.DecodeUpdate:
    """The request's next decode update; its failure or a passed deadline raise."""
    if not updates.empty():  # the common case under load: no timer, no task
        item = updates.get_nowait()
    else:
        try:
            async with asyncio.timeout(_remaining(deadline)):
                item = await updates.get()
        except TimeoutError:
            raise DeadlineExceeded("deadline exceeded while decoding") from None
    if isinstance(item, Exception):
        raise item
    if item.error_code:
        raise Remote(f"decode worker: {item.error_message}", item.error_code)
    return item


def _cancelled_from_outside() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class Router:
    def __init__(self, config: ModelConfig, tokenizer: object, workers: WorkerSet,
                 lease_s: float = 30.0, policy: Policy | None = None,
                 local_prefill_threshold: int = 0, admission_timeout_s: float = 30.0,
                 max_migrations: int = 2) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.workers = workers
        self.lease_s = lease_s
        self.policy = policy or HeadroomPolicy()
        # Conditional disaggregation: prompts shorter than this are prefilled on the decode
        # worker itself (no K/V transfer); 0 turns it off.
        self.local_prefill_threshold = local_prefill_threshold
        self.admission_timeout_s = admission_timeout_s
        self.max_migrations = max_migrations
        self._running: dict[str, RouterRequest] = {}

    # ---- the request ---------------------------------------------------------------------
    async def generate(self, inp: GenerateInput, timeout_s: float | None
                       ) -> AsyncIterator[ChunkEvent | DoneEvent | str]:
        """Yields the request id first, then chunks, then exactly one DoneEvent."""
        received = time.perf_counter()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        prompt = validation.prompt_ids(inp, self.config, self.tokenizer)
        params = validation.resolve_sampling(inp, self.config, len(prompt))
        request_id = inp.request_id or uuid.uuid4().hex
        if request_id in self._running:
            raise InvalidArgument(f"request_id {request_id!r} is already running", "request_id")
        state = RouterRequest(request_id)
        self._running[request_id] = state
        yield request_id
        try:
            async for event in self._run(state, prompt, params, received, deadline):
                yield event
        finally:
            self._running.pop(request_id, None)
            # Shielded: a second cancellation (client gone, deadline) must not cut the
            # release short and leave blocks held downstream.
            release = asyncio.ensure_future(self._release(state))
            try:
                await asyncio.shield(release)
            except asyncio.CancelledError:
                pass  # the release goes on by itself

    async def _run(self, state: RouterRequest, prompt: list[int], params: SamplingParams,
                   received: float, deadline: float | None
                   ) -> AsyncIterator[ChunkEvent | DoneEvent]:
        """Legs of reserve -> prefill -> first token -> decode. When a decode worker dies
        mid-stream the request migrates: a new leg prefills prompt + every token streamed so
        far on another pair, and its first token is the stream's next one."""
        detok = IncrementalDetokenizer(self.tokenizer, params.stop)
        stop_ids = validation.stop_ids(params, self.config)
        generated: list[int] = []  # every token streamed to the client
        timing = Timing(0.0, 0.0, 0.0, 0.0, 0.0)
        migrations = 0
        while True:
            context = prompt + generated
            remaining = params.max_tokens - len(generated)
            # No decode worker has room for it now: prefill anyway and stream the first token;
            # the K/V waits in the prefill worker's pool until a reservation is made.
            state.is_push_deferred = (not generated and remaining > 1
                                      and self._admission_would_wait(len(context), remaining))
            if not state.is_push_deferred and (remaining > 1
                                               or not self.workers.has_prefill_workers()):
                waited = await self._reserve(state, len(context), remaining, deadline)
                timing = timing._replace(admission_wait_s=timing.admission_wait_s + waited)
            if not generated:
                timing = timing._replace(queue_s=time.perf_counter() - received)
            first_msg = await self._first_token(state, context, params, deadline,
                                                len(generated))
            if first_msg is None:
                yield ChunkEvent([], detok.finish())
                yield DoneEvent(FinishReason.ABORT, len(prompt), len(generated), timing)
                return
            first = first_msg.first_token.token_id
            if not generated:
                timing = timing._replace(prefill_s=first_msg.first_token.prefill_s,
                                         time_to_first_token_s=time.perf_counter() - received)
            generated.append(first)
            step = detok.add([first])
            reason: FinishReason | None = None
            if step.is_stopped or first in stop_ids:
                reason = FinishReason.STOP
            elif remaining == 1:
                reason = FinishReason.LENGTH
            if reason is not None:
                yield ChunkEvent([first], step.text + ("" if step.is_stopped else detok.finish()))
                yield DoneEvent(reason, len(prompt), len(generated), timing)
                return
            yield ChunkEvent([first], step.text)
            if state.is_push_deferred:
                waited = await self._reserve(state, len(context), remaining, deadline)
                timing = timing._replace(admission_wait_s=timing.admission_wait_s + waited)
                if state.is_aborted:
                    yield ChunkEvent([], detok.finish())
                    yield DoneEvent(FinishReason.ABORT, len(prompt), len(generated), timing)
                    return
                await self._ship(state, deadline)
            done_msg = await self._prefill_done(state, context, params, deadline,
                                                len(generated) - 1)
            if done_msg is None:
                yield ChunkEvent([], detok.finish())
                yield DoneEvent(FinishReason.ABORT, len(prompt), len(generated), timing)
                return
            if migrations == 0:
                timing = timing._replace(kv_transfer_s=done_msg.done.kv_transfer_s)
            try:
                async for event in self._decode(state, params, stop_ids, detok, deadline,
                                                len(prompt), timing, generated, remaining):
                    yield event
                return
            except StreamBroken as exc:
                migrations += 1
                if migrations > self.max_migrations:
                    raise Unavailable(f"decode failed {migrations} times: {exc}") from exc
                self._lose_decode(state, exc)
                timing = timing._replace(num_migrations=migrations)

    def _lose_decode(self, state: RouterRequest, exc: Exception) -> None:
        """Forget a decode worker that died under a request, before migrating it."""
        lost = state.decode_worker
        if lost is not None:
            log.warning("request %s: decode worker %s lost (%s); migrating", state.request_id,
                        lost.address, exc)
            lost.is_healthy = False
            lost.done(state.request_id)
        if state.prefill_worker is not None and state.prefill_worker is not lost:
            state.prefill_worker.done(state.request_id)
        state.decode_worker = state.prefill_worker = state.prefill_call = None
        state.holds_decode = state.is_decoding = False

    async def _decode(self, state: RouterRequest, params: SamplingParams,
                      stop_ids: list[int], detok: IncrementalDetokenizer,
                      deadline: float | None, num_prompt: int, timing: Timing,
                      generated: list[int], remaining: int
                      ) -> AsyncIterator[ChunkEvent | DoneEvent]:
        """Stream one decode leg; appends every token to `generated`."""
        worker = state.decode_worker
        if worker is None or worker.mux is None:
            raise Unavailable("decode reservation lost")
        request = worker_pb2.DecodeRequest(
            request_id=state.request_id, first_token_id=generated[-1],
            sampling=convert.sampling_to_proto(params), max_new_tokens=remaining - 1,
            stop_token_ids=stop_ids, num_generated=len(generated) - 1,
        )
        reason = FinishReason.ABORT
        first_step_s = 0.0
        is_stopped = False
        state.is_decoding = True
        if state.is_aborted:  # aborted between prefill and decode
            await self._abort_decode(state)
        updates = worker.mux.start(request)
        try:
            while True:
                update = await _next_update(updates, deadline)
                ids = list(update.token_ids)
                if ids:
                    generated.extend(ids)
                    step = detok.add(ids)
                    yield ChunkEvent(ids, step.text)
                    if step.is_stopped:
                        reason, is_stopped = FinishReason.STOP, True
                        break  # the decode worker still holds it: released in _release
                if update.HasField("finished"):
                    state.holds_decode = False
                    reason = FinishReason(update.finished.reason)
                    first_step_s = update.finished.first_decode_step_s
                    break
        finally:
            worker.mux.forget(state.request_id)
            if state.holds_decode:
                # Ended early (stop string, cancel, deadline): abort on the same stream, so
                # the abort can never overtake the start it answers.
                worker.mux.abort(state.request_id)
        state.is_decoding = False
        tail = "" if is_stopped else detok.finish()
        if tail:
            yield ChunkEvent([], tail)
        yield DoneEvent(reason, num_prompt, len(generated), timing._replace(
            first_decode_step_s=first_step_s))

    # ---- downstream calls ----------------------------------------------------------------
    async def _reserve(self, state: RouterRequest, num_prompt: int, max_tokens: int,
                       deadline: float | None) -> float:
        """Reserve on the best decode worker; returns seconds spent waiting for headroom."""
        block_size = next((w.layout.block_size for w in self.workers.workers if w.layout), 16)
        need = blocks_needed(num_prompt, max_tokens, block_size)
        candidates, waited = await self._admit(state, need, deadline)
        last_error = ""
        for worker in candidates:
            request = worker_pb2.ReserveRequest(
                request_id=state.request_id, num_prompt_tokens=num_prompt,
                max_tokens=max_tokens, lease_s=self.lease_s,
            )
            worker.add_in_flight(state.request_id, need, 0)
            try:
                await worker.decode.Reserve(request, timeout=_remaining(deadline))
            except grpc.aio.AioRpcError as exc:
                worker.done(state.request_id)
                if exc.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
                    last_error = f"{worker.address}: {exc.details()}"
                    continue
                raise
            worker.accepted(state.request_id)
            state.decode_worker = worker
            state.holds_decode = True
            return waited
        raise ResourceExhausted(f"no decode worker can hold the request ({last_error})")

    async def _admit(self, state: RouterRequest, need: int, deadline: float | None
                     ) -> tuple[list[Worker], float]:
        """Decode candidates in policy order, and seconds waited. The headroom policy waits
        (bounded) until a worker has room for the request at its longest, so that nothing
        gets preempted."""
        candidates = self.policy.order_decode(self.workers.decode_workers(), need)
        if not isinstance(self.policy, HeadroomPolicy):
            return candidates, 0.0
        start = time.perf_counter()
        give_up = time.monotonic() + self.admission_timeout_s
        if deadline is not None:
            give_up = min(give_up, deadline)
        while candidates[0].headroom < need and need <= candidates[0].total_blocks:
            if time.monotonic() > give_up or state.is_aborted:
                break  # let the worker queue it: it may still fit by the time it runs
            await asyncio.sleep(0.02)
            await self.workers.refresh_shared()
            candidates = self.policy.order_decode(self.workers.decode_workers(), need)
        return candidates, time.perf_counter() - start

    def _admission_would_wait(self, num_prompt: int, max_tokens: int) -> bool:
        """Headroom policy, a remote prefill, and no decode worker with room right now."""
        if (not isinstance(self.policy, HeadroomPolicy) or not self.workers.has_prefill_workers()
                or num_prompt < self.local_prefill_threshold):
            return False
        workers = self.workers.decode_workers()
        block_size = next((w.layout.block_size for w in workers if w.layout), 16)
        need = blocks_needed(num_prompt, max_tokens, block_size)
        return max(w.headroom for w in workers) < need

    async def _ship(self, state: RouterRequest, deadline: float | None) -> None:
        """Tell the prefill worker holding a deferred prefill where to push its K/V."""
        if state.prefill_worker is None or state.decode_worker is None:
            raise Unavailable("deferred prefill lost")
        await state.prefill_worker.prefill.Ship(
            worker_pb2.ShipRequest(request_id=state.request_id,
                                   decode_address=state.decode_worker.address),
            timeout=_remaining(deadline))

    def _start_prefill(self, state: RouterRequest, prompt: list[int], params: SamplingParams,
                       deadline: float | None, num_generated: int
                       ) -> grpc.aio.UnaryStreamCall:
        decode = state.decode_worker
        is_local = decode is not None and (
            decode.role == "colocated" or len(prompt) < self.local_prefill_threshold)
        if is_local and decode is not None:
            worker = decode
        else:
            worker = self._next_prefill(state, len(prompt))
        request = worker_pb2.PrefillRequest(
            request_id=state.request_id, prompt_token_ids=prompt,
            sampling=convert.sampling_to_proto(params),
            decode_address=decode.address if decode is not None and not is_local else "",
            is_local_decode=is_local, num_generated=num_generated,
            defer_push=state.is_push_deferred,
        )
        if worker is not decode:
            worker.add_in_flight(state.request_id, 0, len(prompt))
        state.prefill_worker = worker
        state.prefill_call = worker.prefill.Prefill(request, timeout=_remaining(deadline))
        return state.prefill_call

    async def _first_token(self, state: RouterRequest, prompt: list[int],
                           params: SamplingParams, deadline: float | None, num_generated: int
                           ) -> worker_pb2.PrefillResponse | None:
        """Prefill until the first token. A prefill worker that is unavailable before then is
        marked unhealthy and the prompt goes to another one, transparently."""
        while True:
            call = self._start_prefill(state, prompt, params, deadline, num_generated)
            try:
                return await self._prefill_read(state, call)
            except grpc.aio.AioRpcError as exc:
                if not await self._lose_prefill(state, exc):
                    raise

    async def _prefill_done(self, state: RouterRequest, prompt: list[int],
                            params: SamplingParams, deadline: float | None, num_generated: int
                            ) -> worker_pb2.PrefillResponse | None:
        """The end of the prefill stream: the K/V is in the decode reservation. A prefill
        worker lost after the first token (mid push) is replaced: the reservation still
        stands (the decode worker forgets a broken push's pages), so another worker prefills
        the prompt again and pushes to it. Its first token was streamed already: dropped."""
        while True:
            try:
                return await self._prefill_read(state, None)
            except grpc.aio.AioRpcError as exc:
                if not await self._lose_prefill(state, exc):
                    raise
            state.is_push_deferred = False  # the reservation exists now: push straight to it
            if await self._first_token(state, prompt, params, deadline, num_generated) is None:
                return None

    async def _lose_prefill(self, state: RouterRequest, exc: grpc.aio.AioRpcError) -> bool:
        """Forget a remote prefill worker that became unavailable under a request. False
        when the failure is of another kind, the prefill was local, or the worker still
        answers as serving (its push to the decode worker failed, say): the caller raises."""
        worker = state.prefill_worker
        if (exc.code() != grpc.StatusCode.UNAVAILABLE or worker is None
                or worker is state.decode_worker):
            return False
        await self.workers.refresh(worker)
        if worker.is_healthy:
            return False
        log.warning("request %s: prefill worker %s unavailable (%s); retrying",
                    state.request_id, worker.address, exc.details())
        worker.is_healthy = False
        worker.done(state.request_id)
        state.failed_prefill.add(worker.address)
        state.prefill_worker = None
        return True

    def _next_prefill(self, state: RouterRequest, num_prompt: int) -> Worker:
        """Best prefill worker by policy, skipping those that already failed this request."""
        tried = state.failed_prefill
        ordered = self.policy.order_prefill(self.workers.prefill_workers(), num_prompt)
        fresh = [w for w in ordered if w.address not in tried]
        if not fresh:
            raise Unavailable(f"no healthy prefill worker left (tried {sorted(tried)})")
        return fresh[0]

    async def _prefill_read(self, state: RouterRequest, call: grpc.aio.UnaryStreamCall | None
                            ) -> worker_pb2.PrefillResponse | None:
        """Next message of the Prefill stream; None when the request was aborted."""
        call = call or state.prefill_call
        if call is None or state.is_aborted:
            return None
        try:
            msg = await call.read()
        except asyncio.CancelledError:
            if state.is_aborted and not _cancelled_from_outside():
                return None
            raise
        if msg is grpc.aio.EOF:
            raise Unavailable("prefill stream ended early")
        return msg

    async def _abort_decode(self, state: RouterRequest) -> None:
        worker = state.decode_worker
        if worker is None or not state.holds_decode:
            return
        try:
            await worker.decode.Abort(generation_pb2.AbortRequest(request_id=state.request_id),
                                      timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                log.warning("request %s: decode abort failed: %s", state.request_id,
                            exc.code().name)

    async def _release(self, state: RouterRequest) -> None:
        """However the request ended, leave nothing held downstream."""
        call = state.prefill_call
        if call is not None and not call.done():
            call.cancel()
        if state.prefill_worker is not None and state.prefill_worker is not state.decode_worker:
            state.prefill_worker.done(state.request_id)
        if state.decode_worker is not None:
            state.decode_worker.done(state.request_id)
            # Idempotent: NOT_FOUND (already released by the worker) is fine.
            await self._abort_decode(state)

    def abort(self, request_id: str) -> asyncio.Future[None] | None:
        """Abort a running request; its stream ends with finish reason ABORT."""
        state = self._running.get(request_id)
        if state is None:
            raise NotFound(f"no running request with request_id {request_id!r}", "request_id")
        state.is_aborted = True
        if state.is_decoding:
            return asyncio.ensure_future(self._abort_decode(state))
        if state.prefill_call is not None:
            state.prefill_call.cancel()
        return None
