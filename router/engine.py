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

from kvferry import trace
from kvferry.cache.budget import KvBudget
from kvferry.errors import NotFound, Unavailable
from kvferry.model.config import ModelConfig
from kvferry.model.sampling import FinishReason
from kvferry.settings import DEFAULT_LEASE_S
from kvferry.settings.limits import PublicLimits
from router.admission import Admission
from router.detok import IncrementalDetokenizer
from router.downstream import Downstream
from router.events import ChunkEvent, DoneEvent, Ending, Timing
from router.identity import ANONYMOUS, Caller
from router.policies.routing import HeadroomPolicy, Policy
from router.prefill_leg import PrefillLeg
from router.records import DecodeStart, FirstToken
from router.request import Admitted, OpenRequests, RouterRequest, remaining_s
from router.sample_group import SampleGroup
from router.validation import GenerateInput
from router.workers.decode_client import StreamBroken, next_update
from router.workers.registry import WorkerSet

log = logging.getLogger("kvferry.router")


class Router:
    """One router instance. A request keeps the id its client chose (or a random one) in
    public, within its caller's scope (router/identity.py); downstream it is
    `<id>@<instance_id>` (`.<n>` added while another scope runs the same id), so two routers
    or two scopes sharing workers never collide on an id. `open` is the table of open
    requests (one cap for both fronts); cached prompt tokens are reported only with
    `is_prompt_tokens_details` (they reveal others' prompts)."""

    def __init__(self, config: ModelConfig, tokenizer: object, workers: WorkerSet,
                 lease_s: float = DEFAULT_LEASE_S, policy: Policy | None = None,
                 local_prefill_threshold: int = 0, admission_timeout_s: float = 30.0,
                 max_migrations: int = 2, limits: PublicLimits | None = None,
                 is_prompt_tokens_details: bool = False,
                 kv_budget: KvBudget | None = None) -> None:
        self.config = config
        # What a request holds at most on a decode worker, under its --kv-eviction: with a
        # policy generation may pass the pool and the model's context.
        self.kv_budget = kv_budget or KvBudget()
        self.tokenizer = tokenizer
        self.limits = limits or PublicLimits()
        self.admission = Admission(config, tokenizer, self.limits, self.kv_budget)
        self.is_prompt_tokens_details = is_prompt_tokens_details
        self.instance_id = uuid.uuid4().hex[:12]
        self.open = OpenRequests(self.limits.max_streams)
        self.workers = workers
        policy = policy or HeadroomPolicy()
        self.downstream = Downstream(workers, policy, lease_s, admission_timeout_s,
                                     self.kv_budget)
        self.prefill = PrefillLeg(workers, policy, local_prefill_threshold)
        self.max_migrations = max_migrations

    # ---- the request ---------------------------------------------------------------------
    async def generate(self, inp: GenerateInput, timeout_s: float | None,
                       caller: Caller = ANONYMOUS
                       ) -> AsyncIterator[ChunkEvent | DoneEvent | str]:
        """Yields the request id first, then chunks, then exactly one DoneEvent per sample
        (one sample unless sampling.n asks for more: router/sample_group.py)."""
        job = await self.admission.admit(inp, timeout_s, caller)
        request_id = job.public_id or uuid.uuid4().hex
        state = RouterRequest(self.open.downstream_id(request_id, self.instance_id),
                              cache_salt=job.cache_salt)
        self.open.add(caller.scope, request_id, state)
        yield request_id
        try:
            await self.workers.revive()
            run = (self.run_one(state, job) if job.params.n == 1
                   else SampleGroup(self, state, job).run())
            async for event in run:
                if isinstance(event, DoneEvent) and self.is_prompt_tokens_details:
                    event = event._replace(cached_prompt_tokens=state.num_cached_tokens,
                                           cached_by_tier=state.cached_by_tier,
                                           kv_bytes_not_shipped=state.kv_bytes_not_shipped,
                                           kv_bytes_shipped=state.kv_bytes_shipped)
                yield event
                if (tracer := trace.get()) and isinstance(event, ChunkEvent) and event.token_ids:
                    tracer.event("relay", id=request_id, down=state.request_id,
                                 n=len(event.token_ids), t_in=state.last_token_s,
                                 t_out=time.monotonic())
        finally:
            self.open.remove(caller.scope, request_id)
            # Shielded: a second cancellation (client gone, deadline) must not cut the
            # release short and leave blocks held downstream.
            release = asyncio.ensure_future(self.downstream.release(state))
            try:
                await asyncio.shield(release)
            except asyncio.CancelledError:
                pass  # the release goes on by itself

    async def run_one(self, state: RouterRequest, job: Admitted, generated: list[int] | None = None,
                      detok: IncrementalDetokenizer | None = None
                      ) -> AsyncIterator[ChunkEvent | DoneEvent]:
        """Legs of reserve -> prefill -> first token -> decode (from `generated`, with
        `detok`: a sample going on alone, sample_group.py). When a decode worker dies the
        request migrates: a new leg prefills prompt + every token streamed so far on another
        pair. However the request ends (aborted, a finish on the first token, the decode's
        finish), it leaves the loop with its `Ending`; its last chunk and DoneEvent follow."""
        prompt, params, deadline = job.prompt, job.params, job.deadline
        self.downstream.check_fits(len(prompt), params.max_tokens,  # before any work
                                   keeps_all=job.keeps_all_kv)
        detok = detok or IncrementalDetokenizer(self.tokenizer, params.stop)
        generated = [] if generated is None else generated  # every token streamed so far
        timing = Timing(0.0, 0.0, 0.0, 0.0, 0.0)  # num_migrations counts the legs after the first
        ending = Ending()  # aborted, unless the loop finds otherwise
        while True:
            context = prompt + generated
            remaining = params.max_tokens - len(generated)
            timing = await self.reserve_first(state, job, context, remaining, not generated,
                                              timing)
            if state.is_aborted:
                break
            first_msg, timing = await self.first_token(state, job, context, len(generated),
                                                        timing)
            if first_msg is None:
                break
            first = first_msg.token_id
            generated.append(first)
            step = detok.add([first])
            is_stop = step.is_stopped or first in job.stop_ids
            if is_stop or remaining == 1:
                ending = Ending(FinishReason.STOP if is_stop else FinishReason.LENGTH, [first],
                                step.text, step.is_stopped)
                break
            yield ChunkEvent([first], step.text)
            if state.is_push_deferred:
                timing = await self._reserve(state, job, context, remaining, timing)
                if state.is_aborted:
                    break
                await self.prefill.ship(state, deadline)
            try:  # a decode worker lost during the push or the decode: migrate
                done_msg = await self.prefill.prefill_done(state, context, params, deadline,
                                                           len(generated) - 1)
                if done_msg is None:
                    break
                if not timing.num_migrations:
                    timing = timing._replace(kv_transfer_s=done_msg.kv_transfer_s)
                decoded = Ending(always_chunk=False)
                async for event in self._decode(state, job, detok, generated, remaining,
                                                decoded):
                    yield event
                ending = decoded
                break
            except StreamBroken as exc:
                timing = timing._replace(num_migrations=timing.num_migrations + 1)
                self.lose_decode(state, exc, timing.num_migrations)
        text = ending.text + ("" if ending.is_stopped else detok.finish())
        if ending.token_ids or text or ending.always_chunk:
            yield ChunkEvent(ending.token_ids, text)
        yield ending.done(len(prompt), len(generated), timing)

    async def reserve_first(self, state: RouterRequest, job: Admitted, context: list[int],
                            remaining: int, is_first_leg: bool, timing: Timing) -> Timing:
        """Reserve this leg's decode blocks before its prefill, unless the first leg finds no
        decode worker with room now (then it prefills anyway and streams its first token, its
        K/V waiting in the prefill worker's pool until `_reserve` after it) or nothing is
        left to decode but the prefill's token."""
        self.downstream.key_prompt(state, context)
        state.is_push_deferred = (is_first_leg and remaining > 1
                                  and len(context) >= self.prefill.local_prefill_threshold
                                  and self.downstream.admission_would_wait(
                                      len(context), remaining, job.keeps_all_kv))
        if not state.is_push_deferred and (remaining > 1
                                           or not self.workers.has_prefill_workers()):
            timing = await self._reserve(state, job, context, remaining, timing)
        return timing

    async def _reserve(self, state: RouterRequest, job: Admitted, context: list[int],
                       remaining: int, timing: Timing) -> Timing:
        """Reserve decode blocks for this leg; `timing` with the wait for headroom added."""
        waited = await self.downstream.reserve(state, context, remaining, job.deadline,
                                               job.keeps_all_kv)
        return timing._replace(admission_wait_s=timing.admission_wait_s + waited)

    async def first_token(self, state: RouterRequest, job: Admitted, context: list[int],
                          num_generated: int, timing: Timing
                          ) -> tuple[FirstToken | None, Timing]:
        """Prefill this leg (`context`: the prompt and every token streamed so far) up to its
        first token: the prefill's answer (None: aborted), and `timing` with the first leg's
        queue, prefill and TTFT."""
        if not num_generated:
            timing = timing._replace(queue_s=time.perf_counter() - job.received)
        first_msg = await self.prefill.first_token(state, context, job.params, job.deadline,
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

    async def _decode(self, state: RouterRequest, job: Admitted,
                      detok: IncrementalDetokenizer, generated: list[int], remaining: int,
                      ending: Ending) -> AsyncIterator[ChunkEvent]:
        """Stream one decode leg: its tokens' chunks, each token appended to `generated`;
        how it ended goes into `ending` (aborted unless told otherwise)."""
        worker = state.decode_worker
        client = worker.decode_client if worker is not None else None
        if client is None:
            raise Unavailable("decode reservation lost")
        start = DecodeStart(
            request_id=state.request_id, first_token_id=generated[-1], sampling=job.params,
            max_new_tokens=remaining - 1, stop_token_ids=list(job.stop_ids),
            num_generated=len(generated) - 1,
        )
        if state.is_aborted:  # aborted between the push and the decode: never start it
            await self.downstream.abort_decode(state)
            state.holds_decode = False
            return
        state.is_decoding = True
        updates = client.start(start)
        try:
            while True:
                update = await next_update(updates, remaining_s(job.deadline))
                ids = update.token_ids
                state.last_token_s = update.received_s
                if ids:
                    generated.extend(ids)
                    step = detok.add(ids)
                    yield ChunkEvent(ids, step.text)
                    if step.is_stopped:
                        ending.reason, ending.is_stopped = FinishReason.STOP, True
                        break  # the decode worker still holds it: released in _release
                if update.finished is not None:
                    state.holds_decode = False
                    ending.reason = update.finished.reason
                    ending.first_decode_step_s = update.finished.first_decode_step_s
                    ending.num_draft_tokens += update.finished.num_draft_tokens
                    ending.num_accepted_tokens += update.finished.num_accepted_tokens
                    break
        finally:
            client.forget(state.request_id)
            if state.holds_decode:
                # Ended early (stop string, cancel, deadline): abort on the same stream, so
                # the abort can never overtake the start it answers.
                client.abort_on_stream(state.request_id)
        state.is_decoding = False

    def abort(self, request_id: str, caller: Caller = ANONYMOUS
              ) -> asyncio.Future[None] | None:
        """Abort a running request of `caller`'s scope (another scope's is not found); its
        stream ends with finish reason ABORT."""
        found = self.open.find(caller.scope, request_id)
        if found is None:
            raise NotFound(f"no running request with request_id {request_id!r}", "request_id")
        for state in [found, *found.sub_requests]:  # its samples gone on by themselves too
            state.is_aborted = True
            worker = state.decode_worker
            if state.is_decoding and worker is not None and worker.decode_client is not None:
                # On the DecodeStream that carried the start: the abort cannot overtake it.
                worker.decode_client.abort_on_stream(state.request_id)
            elif state.prefill_call is not None:
                state.prefill_call.cancel()
        return None
