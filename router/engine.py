"""Router engine: the table of open requests and each request's run, from its record
(`Admitted`, made by the fronts through `admission`) to its last event: reserve decode
blocks, prefill, relay tokens, migrate, clean up. Each leg's decode side is
`router.downstream.Downstream`, its prefill `router.prefill_leg.PrefillLeg`; a request of
several samples is a `router.sample_group.SampleGroup`.

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
from contextlib import aclosing

from kvferry import trace
from kvferry.cache.budget import KvBudget
from kvferry.errors import NotFound
from kvferry.model.config import ModelConfig
from kvferry.model.sampling import FinishReason
from kvferry.settings import DEFAULT_LEASE_S
from kvferry.settings.limits import PublicLimits
from router.admission import Admission
from router.detok import IncrementalDetokenizer
from router.downstream import Downstream
from router.events import ChunkEvent, DoneEvent, Ending, Timing
from router.identity import ANONYMOUS, Caller
from router.policies.routing import HeadroomPolicy, LocalPrefill, Policy
from router.prefill_leg import PrefillLeg
from router.request import Admitted, GenerateInput, OpenRequests, RouterRequest
from router.sample_group import SampleGroup
from router.workers.decode_client import StreamBroken
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
        self.admission = Admission(config, tokenizer, self.limits, self.kv_budget,
                                   self.max_model_len)
        self.is_prompt_tokens_details = is_prompt_tokens_details
        self.instance_id = uuid.uuid4().hex[:12]
        self.open = OpenRequests(self.limits.max_streams)
        self.workers = workers
        policy = policy or HeadroomPolicy()
        local_prefill = LocalPrefill(local_prefill_threshold)
        self.downstream = Downstream(workers, policy, lease_s, admission_timeout_s,
                                     self.kv_budget, local_prefill, max_migrations)
        self.prefill = PrefillLeg(workers, policy, local_prefill)

    def max_model_len(self) -> int:
        """The longest prompt + completion a request may have now: the model's context, or
        less where the largest decode worker's K/V pool holds less (without K/V eviction):
        what /v1/models and GetModelInfo report, and an unset max_tokens is clamped to."""
        context = self.config.max_position_embeddings
        if self.kv_budget.is_bounded:
            return context
        capacity = self.downstream.pool_capacity()
        return context if capacity is None else min(context, capacity)

    # ---- the request ---------------------------------------------------------------------
    async def generate(self, inp: GenerateInput, timeout_s: float | None,
                       caller: Caller = ANONYMOUS
                       ) -> AsyncIterator[ChunkEvent | DoneEvent | str]:
        """`relay` of the record `admission` makes of `inp` (in-process callers; the fronts
        admit first themselves)."""
        job = await self.admission.admit(inp, timeout_s, caller)
        async with aclosing(self.relay(job, caller)) as events:
            async for event in events:
                yield event

    async def relay(self, job: Admitted, caller: Caller = ANONYMOUS
                  ) -> AsyncIterator[ChunkEvent | DoneEvent | str]:
        """Yields the request id first, then chunks, then exactly one DoneEvent per sample
        (one sample unless sampling.n asks for more: router/sample_group.py)."""
        request_id = job.public_id or uuid.uuid4().hex
        state = RouterRequest(self.open.downstream_id(request_id, self.instance_id),
                              cache_salt=job.cache_salt)
        self.open.add(caller.scope, request_id, state)
        yield request_id
        try:
            await self.workers.revive()
            run = (self.run_one(state, job) if job.params.n == 1
                   else SampleGroup(self.downstream, self.prefill, self.tokenizer, self.run_one,
                                    state, job).run())
            async for event in run:
                if isinstance(event, DoneEvent) and self.is_prompt_tokens_details:
                    event = event._replace(cached_prompt_tokens=state.num_cached_tokens,
                                           cached_by_tier=state.cached_by_tier,
                                           kv_bytes_not_shipped=state.kv_bytes_not_shipped,
                                           kv_bytes_shipped=state.kv_bytes_shipped,
                                           details=True)
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
        `detok`: a sample going on alone); a lost decode worker migrates the request to a new
        leg, which prefills prompt + every token streamed so far. However it ends, the loop
        leaves with its `Ending`; its last chunk and DoneEvent follow."""
        prompt, params, deadline = job.prompt, job.params, job.deadline
        generated = [] if generated is None else generated  # every token streamed so far
        timing = Timing(0.0, 0.0, 0.0, 0.0, 0.0)  # num_migrations counts the legs after the first
        ending = Ending()  # aborted, unless the loop finds otherwise
        while True:
            ctx = prompt + generated
            remaining = params.max_tokens - len(generated)
            waited = await self.downstream.reserve_leg(state, job, ctx, remaining, not generated)
            detok = detok or IncrementalDetokenizer(self.tokenizer, params.stop)
            if state.is_aborted:
                break
            timing = timing._replace(admission_wait_s=timing.admission_wait_s + waited)
            first_msg, timing = await self.prefill.first(state, job, ctx, len(generated), timing)
            if first_msg is None:
                break
            first = first_msg.token_id
            generated.append(first)
            step = detok.add([first])
            is_stop = step.is_stopped or first in job.stop_ids
            logprobs, prompt_logprobs = first_msg.logprobs[:1], first_msg.prompt_logprobs
            if is_stop or remaining == 1:  # a stop, or the last token asked for
                ending = Ending(FinishReason.STOP if is_stop else FinishReason.LENGTH, [first],
                                step.text, step.is_stopped, logprobs=logprobs,
                                prompt_logprobs=prompt_logprobs)
                break
            yield ChunkEvent([first], step.text, 0, logprobs, prompt_logprobs)
            if state.is_push_deferred:
                waited = await self.downstream.reserve(state, ctx, remaining, deadline,
                                                       job.keeps_all_kv, job.shares_cache)
                timing = timing._replace(admission_wait_s=timing.admission_wait_s + waited)
                if state.is_aborted:
                    break
                await self.prefill.ship(state, deadline)
            try:  # a decode worker lost during the push or the decode: migrate
                done_msg = await self.prefill.prefill_done(state, ctx, params, deadline,
                                                           len(generated) - 1)
                if done_msg is None:
                    break
                if not timing.num_migrations:
                    timing = timing._replace(kv_transfer_s=done_msg.kv_transfer_s)
                decoded = Ending(always_chunk=False)
                async for event in self.downstream.decode_leg(state, job, detok, generated,
                                                          remaining, decoded):
                    yield event
                ending = decoded
                break
            except StreamBroken as exc:
                timing = timing._replace(num_migrations=timing.num_migrations + 1)
                self.downstream.lose_decode(state, exc, timing.num_migrations)
        text = ending.text + ("" if ending.is_stopped or detok is None else detok.finish())
        if ending.token_ids or text or ending.always_chunk:
            yield ChunkEvent(ending.token_ids, text, 0, ending.logprobs, ending.prompt_logprobs)
        yield ending.done(len(prompt), len(generated), timing)

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

