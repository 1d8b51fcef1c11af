"""The decode side of one request, composed by `router.engine.Router` (its prefill leg is
`router.prefill_leg.PrefillLeg`): fitting it to a pool, waiting for headroom and reserving on
the best decode worker (`reserve_leg`, once per leg), decoding there (`decode_leg`), forgetting a
decode worker lost under it (`lose_decode`), aborting and releasing. Each call is passed the
request's record (`Admitted`) and its state (`RouterRequest`).

The RPCs go through the client adapters (`router.workers.decode_client`); their failures arrive here
as `kvferry.errors`, whose classes decide what to try next.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from kvferry.cache.budget import KvBudget
from kvferry.cache.prefix import block_keys, cache_seed, max_shared_blocks
from kvferry.errors import (
    Cancelled,
    DeadlineExceeded,
    InvalidArgument,
    KvferryError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvferry.model.sampling import FinishReason
from router.detok import IncrementalDetokenizer
from router.events import ChunkEvent, Ending
from router.policies.routing import HeadroomPolicy, LocalPrefill, Policy
from router.records import DecodeStart
from router.request import Admitted, RouterRequest
from router.workers.client import remaining_s
from router.workers.decode_client import DecodeCall, StreamBroken
from router.workers.registry import WorkerSet
from router.workers.worker import Worker

log = logging.getLogger("kvferry.router")

# What the client side makes up when it gives up waiting: the worker may have reserved.
_UNANSWERED = (Cancelled, DeadlineExceeded)


class Downstream:
    """Which decode worker, when to wait for one, what to retry. The workers' health and
    load live in `workers`; each request's progress in the `RouterRequest` a call is given."""

    def __init__(self, workers: WorkerSet, policy: Policy, lease_s: float,
                 admission_timeout_s: float, kv_budget: KvBudget | None = None,
                 local_prefill: LocalPrefill | None = None, max_migrations: int = 2) -> None:
        self.workers = workers
        self.local_prefill = local_prefill or LocalPrefill()
        self.max_migrations = max_migrations  # decode workers lost under one request, at most
        # What a request holds at most: the decode workers' formula (kvferry/cache/budget.py).
        self.kv_budget = kv_budget or KvBudget()
        self.policy = policy
        self.lease_s = lease_s
        self.admission_timeout_s = admission_timeout_s
        # The clock admission waits by: monotonic, as request deadlines are (tests move one).
        self.clock: Callable[[], float] = time.monotonic

    async def reserve_leg(self, state: RouterRequest, job: Admitted, context: list[int],
                          remaining: int, is_first_leg: bool, may_defer: bool = True) -> float:
        """Reserve this leg's decode blocks before its prefill; seconds waited for headroom.
        The first leg is checked against the pools first (`check_fits`). Nothing is reserved
        when the first leg of a request that `may_defer` finds no decode worker with room now
        (it prefills anyway and streams its first token, its K/V waiting in the prefill
        worker's pool, `state.is_push_deferred`, until `reserve` after it), or when nothing is
        left to decode but the prefill worker's token."""
        if is_first_leg:
            await self.check_fits_fresh(len(job.prompt), job.params.max_tokens,
                                        state.num_samples, job.keeps_all_kv)
        self.key_prompt(state, context)
        state.is_push_deferred = (may_defer and is_first_leg and remaining > 1
                                  and not self.local_prefill.is_local(len(context))
                                  and self.admission_would_wait(len(context), remaining,
                                                                job.keeps_all_kv))
        if state.is_push_deferred or (remaining <= 1 and self.workers.has_prefill_workers()):
            return 0.0
        return await self.reserve(state, context, remaining, job.deadline, job.keeps_all_kv,
                                  job.shares_cache)

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

    def need(self, num_prompt: int, max_tokens: int, block_size: int, num_samples: int = 1,
             keeps_all: bool = False) -> int:
        """Blocks a request holds at most on a decode worker (`keeps_all`: it opted out of
        the deployment's K/V eviction)."""
        return self.kv_budget.blocks(num_prompt, max_tokens, block_size, num_samples, keeps_all)

    def check_fits(self, num_prompt: int, max_tokens: int, num_samples: int = 1,
                   keeps_all: bool = False) -> None:
        """Refuse a request that no healthy decode worker could hold at its longest even with
        its whole pool free (INVALID_ARGUMENT naming the field: RESOURCE_EXHAUSTED would be
        retried, and waiting cannot make it fit). One that fits but not now waits or gets
        RESOURCE_EXHAUSTED in `reserve`. Nothing is refused before a worker reports its pool.
        Under K/V eviction generation may pass the pool: a sequence holds the policy's
        budget at most."""
        pools = self._pools()
        if not pools or (max_tokens <= 1 and self.workers.has_prefill_workers()):
            return  # unknown yet, or no reservation (the prefill worker's token is the last)
        capacity = max(blocks * size for blocks, size in pools)  # a whole pool, in tokens
        if num_prompt + 1 > capacity:  # the prompt and the first decode slot (Reserve)
            raise InvalidArgument(
                f"input: a prompt of {num_prompt} tokens does not fit the largest decode "
                f"worker's K/V pool, which holds {capacity} tokens", "input")
        if all(self.need(num_prompt, max_tokens, size, 1, keeps_all) > blocks
               for blocks, size in pools):
            raise InvalidArgument(
                f"sampling.max_tokens: prompt {num_prompt} + max_tokens {max_tokens} is more "
                f"than the largest decode worker's K/V pool holds ({capacity} tokens); lower "
                f"max_tokens to at most {capacity - num_prompt}", "sampling.max_tokens")
        if num_samples > 1 and all(self.need(num_prompt, max_tokens, size, num_samples,
                                             keeps_all) > blocks for blocks, size in pools):
            raise InvalidArgument(
                f"sampling.n: {num_samples} samples of prompt {num_prompt} + max_tokens "
                f"{max_tokens} are more than the largest decode worker's K/V pool holds "
                f"({capacity} tokens); ask for fewer samples or tokens", "sampling.n")

    async def check_fits_fresh(self, num_prompt: int, max_tokens: int, num_samples: int = 1,
                               keeps_all: bool = False) -> None:
        """`check_fits`, confirmed on fresh stats before a refusal: a pool that grew since its
        worker last reported (restarted at its address with a larger --kv-pool-size) is not
        held against the request. Concurrent refusals share one round of stats calls."""
        try:
            self.check_fits(num_prompt, max_tokens, num_samples, keeps_all)
        except InvalidArgument:
            await self.workers.refresh_shared()
            if not self._pools():
                raise  # no worker answered: its last report stands
            self.check_fits(num_prompt, max_tokens, num_samples, keeps_all)

    def pool_capacity(self) -> int | None:
        """Tokens the largest healthy decode pool holds whole (None: none reported yet)."""
        pools = self._pools()
        return max(blocks * size for blocks, size in pools) if pools else None

    def _pools(self) -> list[tuple[int, int]]:
        """(blocks, block size) of every healthy decode pool that reported its size."""
        return [(w.total_blocks, w.layout.block_size)
                for w in self.workers.healthy("decode", "colocated")
                if w.layout is not None and w.total_blocks > 0]

    async def reserve(self, state: RouterRequest, prompt: list[int], max_tokens: int,
                      deadline: float | None, keeps_all: bool = False,
                      shares_cache: bool = True) -> float:
        """Reserve on the best decode worker; returns seconds spent waiting for headroom
        (`keeps_all`: the request opted out of K/V eviction; not `shares_cache`: its prompt
        is computed whole, no cached prefix shared). Nothing is reserved when the request was
        aborted before its turn."""
        need = self.need(len(prompt), max_tokens, self.workers.block_size(), state.num_samples,
                         keeps_all)
        candidates, waited = await self._admit(state, need, deadline)
        if state.is_aborted:
            # Aborted while it waited: a reservation now would only take blocks a running
            # request may need to grow (it would be swapped out for nothing).
            return waited
        last_error = ""
        for worker in candidates:
            worker.add_in_flight(state.request_id, need, 0, state.block_keys)
            state.unanswered_reserve = worker
            try:
                state.decode_cached_blocks = await worker.decode.reserve(
                    state.request_id, prompt, max_tokens, self.lease_s, remaining_s(deadline),
                    state.cache_salt, state.num_samples, shares_cache)
            except KvferryError as exc:
                if not isinstance(exc, _UNANSWERED):
                    state.unanswered_reserve = None  # the worker refused it: nothing held
                    worker.done(state.request_id)
                if isinstance(exc, (ResourceExhausted, Unavailable)):
                    last_error = f"{worker.address}: {exc}"
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
        start = self.clock()
        give_up = start + self.admission_timeout_s
        if deadline is not None:
            give_up = min(give_up, deadline)
        while candidates[0].headroom < need and need <= candidates[0].total_blocks:
            if self.clock() > give_up or state.is_aborted:
                break  # let the worker queue it: it may still fit by the time it runs
            await asyncio.sleep(0.02)
            await self.workers.refresh_shared()
            candidates = self.policy.order_decode(self.workers.decode_workers(), need,
                                                  state.block_keys)
        return candidates, self.clock() - start

    def admission_would_wait(self, num_prompt: int, max_tokens: int, keeps_all: bool = False
                             ) -> bool:
        """Headroom policy, prefill workers to prefill on, and no decode worker with room
        right now."""
        if not isinstance(self.policy, HeadroomPolicy) or not self.workers.has_prefill_workers():
            return False
        workers = self.workers.decode_workers()
        need = self.need(num_prompt, max_tokens, self.workers.block_size(), 1, keeps_all)
        return max(w.headroom for w in workers) < need

    async def decode_leg(self, state: RouterRequest, job: Admitted,
                         detok: IncrementalDetokenizer, generated: list[int], remaining: int,
                         ending: Ending) -> AsyncIterator[ChunkEvent]:
        """Stream one decode leg: its tokens' chunks, each token appended to `generated`;
        how it ended goes into `ending` (aborted unless told otherwise)."""
        start = DecodeStart(
            request_id=state.request_id, first_token_id=generated[-1], sampling=job.params,
            max_new_tokens=remaining - 1, stop_token_ids=list(job.stop_ids),
            num_generated=len(generated) - 1,
        )
        async with self.decoding(state, start, job.deadline) as call:
            while call is not None:
                update = await call.next()
                ids = update.token_ids
                state.last_token_s = update.received_s
                if ids:
                    generated.extend(ids)
                    step = detok.add(ids)
                    yield ChunkEvent(ids, step.text, logprobs=update.logprobs)
                    if step.is_stopped:
                        ending.reason, ending.is_stopped = FinishReason.STOP, True
                        break  # the decode worker still holds it: released in `release`
                if update.finished is not None:
                    state.holds_decode = False
                    ending.reason = update.finished.reason
                    ending.first_decode_step_s = update.finished.first_decode_step_s
                    ending.num_draft_tokens += update.finished.num_draft_tokens
                    ending.num_accepted_tokens += update.finished.num_accepted_tokens
                    break

    @asynccontextmanager
    async def decoding(self, state: RouterRequest, start: DecodeStart,
                       deadline: float | None) -> AsyncIterator[DecodeCall | None]:
        """The frame of a decode on the reserved worker (one sample or several): the call
        `start` begins there, or None when the request was aborted between the push and the
        decode (the reservation is released, nothing is started). On the way out the call's
        queue is dropped, and a request the worker still holds (a stop string, a cancel, a
        deadline) is aborted on the same stream, so the abort can never overtake its start."""
        worker = state.decode_worker
        client = worker.decode_client if worker is not None else None
        if client is None:
            raise Unavailable("decode reservation lost")
        if state.is_aborted:
            await self.abort_decode(state)
            state.holds_decode = False
            yield None
            return
        state.is_decoding = True
        call = client.start(start, deadline)
        try:
            yield call
        finally:
            call.close()
            if state.holds_decode:
                call.abort()
        state.is_decoding = False

    def lose_decode(self, state: RouterRequest, exc: StreamBroken, migrations: int) -> None:
        """Forget a decode worker that died under a request, before its `migrations`-th
        migration; past `max_migrations`, give up (UNAVAILABLE)."""
        if migrations > self.max_migrations:
            log.warning("request %s: decode failed %d times, last: %s", state.request_id,
                        migrations, exc)
            raise Unavailable(f"decode failed {migrations} times") from exc
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
        state.decode_cached_blocks = 0

    async def abort_decode(self, state: RouterRequest) -> None:
        worker = state.decode_worker
        if worker is None or not state.holds_decode:
            return
        await self._abort_on(worker, state)

    async def _abort_on(self, worker: Worker, state: RouterRequest) -> None:
        try:
            await worker.decode.abort(state.request_id, timeout_s=5.0)
        except NotFound:
            pass
        except KvferryError as exc:
            log.warning("request %s: decode abort failed: %s: %s", state.request_id,
                        type(exc).__name__, exc)

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

