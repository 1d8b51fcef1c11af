"""The prefill leg of one request, composed by `router.engine.Router`: which worker
prefills (a prefill worker, or the decode worker itself when little is left to compute),
reading the `Prefill` stream, failover to another prefill worker, prefilling again after a
push was lost, and shipping K/V whose push was deferred.

The per-request state is the `RouterRequest` each call is given; the workers' health and
load live in the `WorkerSet`. RPC failures arrive as `kvferry.errors`, translated by the
client adapters; their classes decide failover and migration (`StreamBroken` asks the
engine to migrate).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TypeVar

from kvferry.errors import KvferryError, NotFound, Unavailable
from kvferry.model.sampling import SamplingParams
from router.events import Timing
from router.policies.routing import LocalPrefill, Policy
from router.records import FirstToken, PrefillDone, PrefillStart
from router.request import Admitted, RouterRequest
from router.workers.client import remaining_s
from router.workers.decode_client import StreamBroken
from router.workers.prefill_client import PrefillCall
from router.workers.registry import WorkerSet
from router.workers.worker import Worker

log = logging.getLogger("kvferry.router")

_Msg = TypeVar("_Msg", FirstToken, PrefillDone)
# A push failed between workers that both still serve is prefilled again this many times.
MAX_PUSH_RETRIES = 1


def _cancelled_from_outside() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _lost(exc: KvferryError) -> bool:
    """A worker's call failed UNAVAILABLE: the worker, or its link, may be gone. Only a
    downstream answer counts (`StreamBroken` and this module's own errors are raised for
    other reasons)."""
    return isinstance(exc, Unavailable) and exc.downstream


def _expect(kind: type[_Msg], msg: FirstToken | PrefillDone | None) -> _Msg | None:
    """The Prefill stream sends a FirstToken, then a PrefillDone; anything else is broken."""
    if msg is None or isinstance(msg, kind):
        return msg
    raise Unavailable(f"prefill stream sent {type(msg).__name__} out of order")


class PrefillLeg:
    """Owns how one request's prompt is prefilled and its K/V reaches the decode
    reservation; `on_retry` is called each time a lost prefill worker is replaced or a lost
    push prefilled again (the router's metrics count them)."""

    def __init__(self, workers: WorkerSet, policy: Policy, local_prefill: LocalPrefill
                 ) -> None:
        self.workers = workers
        self.policy = policy
        self.local_prefill = local_prefill
        self.on_retry: Callable[[], None] = lambda: None

    async def ship(self, state: RouterRequest, deadline: float | None) -> None:
        """Tell the prefill worker holding a deferred prefill where to push its K/V."""
        if state.prefill_worker is None or state.decode_worker is None:
            raise Unavailable("deferred prefill lost")
        try:
            await state.prefill_worker.prefill.ship(
                state.request_id, state.decode_worker.address, state.decode_cached_blocks,
                remaining_s(deadline))
        except NotFound as exc:
            self._forget_parked(state, str(exc))
            return
        except KvferryError as exc:
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
            decode.role == "colocated" or self.local_prefill.is_local(uncached))
        if is_local and decode is not None:
            worker = decode
        else:
            worker = self._next_prefill(state, len(prompt))
        is_push = decode is not None and not is_local
        if num_generated and params.prompt_logprobs is not None:  # streamed on the first leg
            params = dataclasses.replace(params, prompt_logprobs=None)
        start = PrefillStart(
            request_id=state.request_id, prompt_token_ids=prompt, sampling=params,
            decode_address=decode.address if is_push and decode is not None else "",
            is_local_decode=is_local, num_generated=num_generated,
            defer_push=state.is_push_deferred, cache_salt=state.cache_salt,
            skip_blocks=state.decode_cached_blocks if is_push else 0,
            num_samples=state.num_samples,
        )
        if worker is not decode:
            worker.add_in_flight(state.request_id, 0, len(prompt), state.block_keys)
        state.prefill_worker = worker
        state.prefill_call = worker.prefill.prefill(start, remaining_s(deadline))
        return state.prefill_call

    async def first(self, state: RouterRequest, job: Admitted, context: list[int],
                    num_generated: int, timing: Timing) -> tuple[FirstToken | None, Timing]:
        """Prefill this leg (`context`: the prompt and every token streamed so far) up to its
        first token: the prefill's answer (None: aborted), and `timing` with the first leg's
        queue, prefill and TTFT."""
        if not num_generated:
            timing = timing._replace(queue_s=time.perf_counter() - job.received)
        first_msg = await self.first_token(state, context, job.params, job.deadline,
                                           num_generated)
        if first_msg is None:
            return None, timing
        state.last_token_s = time.monotonic()
        if not num_generated:
            timing = timing._replace(prefill_s=first_msg.prefill_s,
                                     time_to_first_token_s=time.perf_counter() - job.received)
            state.num_cached_tokens = first_msg.num_cached_tokens
            state.cached_by_tier = first_msg.cached_by_tier
        else:  # a migrated leg: Usage counts the first leg's cache; the log shows this one's
            log.info("request %s: migrated leg prefilled %d context tokens, %d from the "
                     "prefix cache", state.request_id, len(context),
                     first_msg.num_cached_tokens)
        return first_msg, timing

    async def first_token(self, state: RouterRequest, prompt: list[int],
                          params: SamplingParams, deadline: float | None, num_generated: int
                          ) -> FirstToken | None:
        """Prefill until the first token. A prefill worker that is unavailable before then is
        marked unhealthy and the prompt goes to another one, transparently."""
        while True:
            call = self._start_prefill(state, prompt, params, deadline, num_generated)
            try:
                return _expect(FirstToken, await self._prefill_read(state, call))
            except KvferryError as exc:
                if not (await self._lose_prefill(state, exc)
                        or await self._push_lost(state, exc)):
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
                except KvferryError as exc:
                    if await self._lose_prefill(state, exc):
                        pass  # prefill it again below
                    elif await self._decode_lost(state, exc):
                        raise StreamBroken(f"decode worker lost during the K/V push: "
                                           f"{exc}") from exc
                    elif not await self._push_lost(state, exc):
                        raise
                else:
                    if done is not None:  # the K/V is in the reservation: the prefill is over
                        state.kv_bytes_shipped += done.kv_bytes
                        if state.decode_worker is not None:
                            state.decode_worker.note_push(done.kv_bytes, done.kv_transfer_s)
                        self._count_skipped(state)
                        state.drop_prefill_worker()
                    return done
            state.is_push_deferred = False  # the reservation exists now: push straight to it
            if await self.first_token(state, prompt, params, deadline, num_generated) is None:
                return None

    @staticmethod
    def _count_skipped(state: RouterRequest) -> None:
        """The K/V is in place: what no push carried because the decode worker's cache held
        it (whether the rest was pushed or prefilled there; a colocated worker ships
        nothing in any case, so it is not counted there)."""
        decode = state.decode_worker
        if (decode is None or decode.layout is None or decode.role != "decode"
                or not state.decode_cached_blocks):
            return
        layout = decode.layout
        state.kv_bytes_not_shipped += (state.decode_cached_blocks * layout.num_layers
                                       * layout.bytes_per_layer_block)

    async def _lose_prefill(self, state: RouterRequest, exc: KvferryError) -> bool:
        """Forget a remote prefill worker that became unavailable under a request. False
        when the failure is of another kind, the prefill was local, or the worker still
        answers as serving (its push to the decode worker failed, say): the caller raises."""
        worker = state.prefill_worker
        if (not _lost(exc) or worker is None or worker is state.decode_worker):
            return False
        await self.workers.refresh(worker)
        if worker.is_healthy:
            return False
        log.warning("request %s: prefill worker %s unavailable (%s); retrying",
                    state.request_id, worker.address, exc)
        worker.is_healthy = False
        state.failed_prefill.add(worker.address)
        state.drop_prefill_worker()
        self.on_retry()
        return True

    async def _decode_lost(self, state: RouterRequest, exc: KvferryError) -> bool:
        """The push failed because the decode worker holding the reservation is gone (the
        prefill worker still answers): the caller migrates the request."""
        worker = state.decode_worker
        if (not _lost(exc) or worker is None or worker is state.prefill_worker):
            return False
        await self.workers.refresh(worker)
        return not worker.is_healthy

    async def _push_lost(self, state: RouterRequest, exc: KvferryError) -> bool:
        """The push failed UNAVAILABLE between two workers that both still serve (a link cut
        and healed: the prefill worker's connection to the decode worker died): the prompt
        is prefilled again, once, and pushed afresh (the reservation forgot the broken
        push's pages). False otherwise: the caller raises."""
        prefill, decode = state.prefill_worker, state.decode_worker
        if (not _lost(exc) or prefill is None or decode is None or prefill is decode
                or not str(exc).startswith("downstream:")
                or state.num_push_retries >= MAX_PUSH_RETRIES):
            return False
        await self.workers.refresh(decode)
        if not decode.is_healthy:
            return False
        log.warning("request %s: K/V push from %s to %s failed (%s); prefilling again",
                    state.request_id, prefill.address, decode.address, exc)
        state.num_push_retries += 1
        state.drop_prefill_worker()
        state.prefill_call = None
        self.on_retry()
        return True

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
