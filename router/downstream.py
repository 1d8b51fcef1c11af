"""The router's calls to its workers, for one request: decode admission and reservation,
prefill (with failover and re-prefill), shipping deferred K/V, abort and release.

`Downstream` is composed by `router.engine.Router`, which owns the request's flow; the
per-request state both share is `RouterRequest`. The RPCs themselves go through the client
adapters (`router.prefill_client`, `router.decode_client`); their failures arrive here as
`grpc.aio.AioRpcError`, whose status codes decide failover, migration and abort.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from kvferry.cache.layout import blocks_needed
from kvferry.cache.prefix import block_keys, cache_seed, max_shared_blocks
from kvferry.errors import ResourceExhausted, Unavailable
from kvferry.model.sampling import SamplingParams
from router.decode_client import StreamBroken
from router.policy import HeadroomPolicy, Policy
from router.prefill_client import PrefillCall
from router.records import FirstToken, PrefillDone, PrefillStart
from router.request import RouterRequest, remaining_s
from router.workers import Worker, WorkerSet

log = logging.getLogger("kvferry.router")

_Msg = TypeVar("_Msg", FirstToken, PrefillDone)


# Statuses the client side makes up when it gives up waiting: the worker may have reserved.
_UNANSWERED = (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)


def _cancelled_from_outside() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _expect(kind: type[_Msg], msg: FirstToken | PrefillDone | None) -> _Msg | None:
    """The Prefill stream sends a FirstToken, then a PrefillDone; anything else is broken."""
    if msg is None or isinstance(msg, kind):
        return msg
    raise Unavailable(f"prefill stream sent {type(msg).__name__} out of order")


class Downstream:
    """Owns how one request's calls reach the workers: which worker, when to wait, what to
    retry. The workers' health and load live in `workers`; the request's progress in the
    `RouterRequest` each call is given."""

    def __init__(self, workers: WorkerSet, policy: Policy, lease_s: float,
                 local_prefill_threshold: int, admission_timeout_s: float) -> None:
        self.workers = workers
        self.policy = policy
        self.lease_s = lease_s
        # Conditional disaggregation: prompts shorter than this are prefilled on the decode
        # worker itself (no K/V transfer); 0 turns it off.
        self.local_prefill_threshold = local_prefill_threshold
        self.admission_timeout_s = admission_timeout_s
        self.on_prefill_retry: Callable[[], None] = lambda: None  # metrics: count retries

    def key_prompt(self, state: RouterRequest, prompt: list[int]) -> None:
        """Compute the keys of the prompt's shareable blocks, as the workers' caches key them
        (`kvferry.cache.prefix`), when the policy routes on them; each leg, before routing."""
        state.block_keys = []
        layout = self.workers.layout()
        if not self.policy.uses_keys or layout is None:
            return
        seed = cache_seed(layout.model_fingerprint, layout.dtype, state.cache_salt)
        state.block_keys = block_keys(prompt, layout.block_size, seed,
                                      max_shared_blocks(len(prompt), layout.block_size))

    async def reserve(self, state: RouterRequest, prompt: list[int], max_tokens: int,
                      deadline: float | None) -> float:
        """Reserve on the best decode worker; returns seconds spent waiting for headroom."""
        need = blocks_needed(len(prompt), max_tokens, self.workers.block_size())
        candidates, waited = await self._admit(state, need, deadline)
        last_error = ""
        for worker in candidates:
            worker.add_in_flight(state.request_id, need, 0, state.block_keys)
            state.unanswered_reserve = worker
            try:
                state.decode_cached_blocks = await worker.decode.reserve(
                    state.request_id, prompt, max_tokens, self.lease_s, remaining_s(deadline),
                    state.cache_salt)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _UNANSWERED:
                    state.unanswered_reserve = None  # the worker refused it: nothing held
                    worker.done(state.request_id)
                if exc.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
                    last_error = f"{worker.address}: {exc.details()}"
                    continue
                raise
            state.unanswered_reserve = None
            worker.accepted(state.request_id)
            state.decode_worker = worker
            state.holds_decode = True
            return waited
        raise ResourceExhausted(f"no decode worker can hold the request ({last_error})")

    async def _admit(self, state: RouterRequest, need: int, deadline: float | None
                     ) -> tuple[list[Worker], float]:
        """Decode candidates in policy order, and seconds waited. A headroom policy (prefix
        included) waits (bounded) until a worker has room for the request at its longest, so
        that nothing gets preempted."""
        candidates = self.policy.order_decode(self.workers.decode_workers(), need,
                                              state.block_keys)
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
            candidates = self.policy.order_decode(self.workers.decode_workers(), need,
                                                  state.block_keys)
        return candidates, time.perf_counter() - start

    def admission_would_wait(self, num_prompt: int, max_tokens: int) -> bool:
        """Headroom policy, a remote prefill, and no decode worker with room right now."""
        if (not isinstance(self.policy, HeadroomPolicy) or not self.workers.has_prefill_workers()
                or num_prompt < self.local_prefill_threshold):
            return False
        workers = self.workers.decode_workers()
        need = blocks_needed(num_prompt, max_tokens, self.workers.block_size())
        return max(w.headroom for w in workers) < need

    async def ship(self, state: RouterRequest, deadline: float | None) -> None:
        """Tell the prefill worker holding a deferred prefill where to push its K/V."""
        if state.prefill_worker is None or state.decode_worker is None:
            raise Unavailable("deferred prefill lost")
        try:
            await state.prefill_worker.prefill.ship(
                state.request_id, state.decode_worker.address, state.decode_cached_blocks,
                remaining_s(deadline))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                self._forget_parked(state, exc.details())
                return
            # The worker holding the K/V is gone: prefill_done prefills it again elsewhere.
            if not await self._lose_prefill(state, exc):
                raise

    def _forget_parked(self, state: RouterRequest, why: str | None) -> None:
        """The prefill worker no longer holds the deferred K/V (it made room for a prefill
        with a decode reservation, or restarted): prefill_done prefills the prompt again,
        straight into the reservation now made."""
        worker = state.prefill_worker
        if worker is None:
            return
        log.info("request %s: deferred K/V gone from %s (%s); prefilling again",
                 state.request_id, worker.address, why)
        if state.prefill_call is not None:
            state.prefill_call.cancel()
        state.drop_prefill_worker()
        state.prefill_call = None

    def _start_prefill(self, state: RouterRequest, prompt: list[int], params: SamplingParams,
                       deadline: float | None, num_generated: int) -> PrefillCall:
        decode = state.decode_worker
        # Conditional disaggregation on what is left to compute: a new chat turn whose
        # history the decode worker holds prefills there, with no transfer.
        uncached = len(prompt)
        if decode is not None and decode.layout is not None:
            uncached -= state.decode_cached_blocks * decode.layout.block_size
        is_local = decode is not None and (
            decode.role == "colocated" or uncached < self.local_prefill_threshold)
        if is_local and decode is not None:
            worker = decode
        else:
            worker = self._next_prefill(state, len(prompt))
        is_push = decode is not None and not is_local
        start = PrefillStart(
            request_id=state.request_id, prompt_token_ids=prompt, sampling=params,
            decode_address=decode.address if is_push and decode is not None else "",
            is_local_decode=is_local, num_generated=num_generated,
            defer_push=state.is_push_deferred, cache_salt=state.cache_salt,
            skip_blocks=state.decode_cached_blocks if is_push else 0,
        )
        if worker is not decode:
            worker.add_in_flight(state.request_id, 0, len(prompt), state.block_keys)
        state.prefill_worker = worker
        state.prefill_call = worker.prefill.prefill(start, remaining_s(deadline))
        return state.prefill_call

    async def first_token(self, state: RouterRequest, prompt: list[int],
                          params: SamplingParams, deadline: float | None, num_generated: int
                          ) -> FirstToken | None:
        """Prefill until the first token. A prefill worker that is unavailable before then is
        marked unhealthy and the prompt goes to another one, transparently."""
        while True:
            call = self._start_prefill(state, prompt, params, deadline, num_generated)
            try:
                return _expect(FirstToken, await self._prefill_read(state, call))
            except grpc.aio.AioRpcError as exc:
                if not await self._lose_prefill(state, exc):
                    raise

    async def prefill_done(self, state: RouterRequest, prompt: list[int],
                           params: SamplingParams, deadline: float | None, num_generated: int
                           ) -> PrefillDone | None:
        """The end of the prefill stream: the K/V is in the decode reservation. A prefill
        worker lost after the first token (mid push) is replaced: the reservation still
        stands (the decode worker forgets a broken push's pages), so another worker prefills
        the prompt again and pushes to it. Its first token was streamed already: dropped."""
        while True:
            if state.prefill_worker is not None:  # None: lost while it held deferred K/V
                try:
                    done = _expect(PrefillDone, await self._prefill_read(state, None))
                except grpc.aio.AioRpcError as exc:
                    if await self._lose_prefill(state, exc):
                        pass  # prefill it again below
                    elif await self._decode_lost(state, exc):
                        raise StreamBroken(f"decode worker lost during the K/V push: "
                                           f"{exc.details()}") from exc
                    else:
                        raise
                else:
                    if done is not None:  # the K/V is in the reservation: the prefill is over
                        state.kv_bytes_shipped += done.kv_bytes
                        self._count_skipped(state)
                        state.drop_prefill_worker()
                    return done
            state.is_push_deferred = False  # the reservation exists now: push straight to it
            if await self.first_token(state, prompt, params, deadline, num_generated) is None:
                return None

    @staticmethod
    def _count_skipped(state: RouterRequest) -> None:
        """A push ended: what it did not carry because the decode cache held it."""
        decode = state.decode_worker
        if (decode is None or decode.layout is None or state.prefill_worker is decode
                or not state.decode_cached_blocks):
            return
        layout = decode.layout
        state.kv_bytes_not_shipped += (state.decode_cached_blocks * layout.num_layers
                                       * layout.bytes_per_layer_block)

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
        state.failed_prefill.add(worker.address)
        state.drop_prefill_worker()
        self.on_prefill_retry()
        return True

    async def _decode_lost(self, state: RouterRequest, exc: grpc.aio.AioRpcError) -> bool:
        """The push failed because the decode worker holding the reservation is gone (the
        prefill worker still answers): the caller migrates the request."""
        worker = state.decode_worker
        if (exc.code() != grpc.StatusCode.UNAVAILABLE or worker is None
                or worker is state.prefill_worker):
            return False
        await self.workers.refresh(worker)
        return not worker.is_healthy

    def _next_prefill(self, state: RouterRequest, num_prompt: int) -> Worker:
        """Best prefill worker by policy, skipping those that already failed this request."""
        tried = state.failed_prefill
        ordered = self.policy.order_prefill(self.workers.prefill_workers(), num_prompt,
                                            state.block_keys)
        fresh = [w for w in ordered if w.address not in tried]
        if not fresh:
            raise Unavailable(f"no healthy prefill worker left (tried {sorted(tried)})")
        return fresh[0]

    async def _prefill_read(self, state: RouterRequest, call: PrefillCall | None
                            ) -> FirstToken | PrefillDone | None:
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
        if msg is None:
            raise Unavailable("prefill stream ended early")
        return msg

    async def abort_decode(self, state: RouterRequest) -> None:
        worker = state.decode_worker
        if worker is None or not state.holds_decode:
            return
        await self._abort_on(worker, state)

    async def _abort_on(self, worker: Worker, state: RouterRequest) -> None:
        try:
            await worker.decode.abort(state.request_id, timeout_s=5.0)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                log.warning("request %s: decode abort failed: %s", state.request_id,
                            exc.code().name)

    async def release(self, state: RouterRequest) -> None:
        """However the request ended, leave nothing held downstream."""
        call = state.prefill_call
        if call is not None and not call.done():
            call.cancel()
        state.drop_prefill_worker()
        if state.decode_worker is not None:
            state.decode_worker.done(state.request_id)
            # Idempotent: NOT_FOUND (already released by the worker) is fine.
            await self.abort_decode(state)
        unanswered, state.unanswered_reserve = state.unanswered_reserve, None
        if unanswered is not None:
            # Cut off mid-Reserve. Sent on the same channel after the Reserve's cancellation,
            # so it reaches the worker after a reservation that landed; one the worker made
            # after seeing the cancellation it drops itself (decode server, Reserve).
            unanswered.done(state.request_id)
            await self._abort_on(unanswered, state)

