"""Parallel sampling at the router: a request of n samples (sampling.n > 1), run by
`router.engine.Router` (its n = 1 path is `Router.run_one`) on the same legs.

One reservation holds the prompt's K/V once for every sample (a decode worker forks the
samples from it, decode_worker/samples.py); one prefill draws the n first tokens (sample i
with seed + i) and one push ships the prompt; one Decode start decodes them all. From there
each sample has its own detokenizer, stop strings and ending: a stop string ends that sample
alone (AbortSample on the Decode stream); the request ends with its last sample. Every event
carries its sample's index; each sample ends with a DoneEvent of its own (its completion
tokens; the prompt's tokens in each).

Migration: when the decode worker is lost, each unfinished sample goes on as a request of its
own (`<id>#<i>`, seed + i, its tokens so far in its context, as any migrated request), all of
them at once; seeding keeps every sample's tokens what they would have been.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from kvferry.errors import Unavailable
from kvferry.model.logprobs import TokenLogprob
from kvferry.model.sampling import FinishReason
from router.detok import IncrementalDetokenizer
from router.downstream import Downstream
from router.events import ChunkEvent, DoneEvent, Ending, Timing
from router.prefill_leg import PrefillLeg
from router.records import DecodeFinished, DecodeStart
from router.request import Admitted, RouterRequest
from router.workers.decode_client import StreamBroken

Event = ChunkEvent | DoneEvent


RunOne = Callable[[RouterRequest, Admitted, list[int], IncrementalDetokenizer],
                 AsyncIterator[Event]]


@dataclass
class _Sample:
    index: int
    detok: IncrementalDetokenizer
    generated: list[int] = field(default_factory=list)  # every token streamed for it
    is_done: bool = False


class SampleGroup:
    """One request of `params.n` samples, from its reservation to its last DoneEvent: its
    legs' decode side in `downstream`, its prefill in `prefill`; after a migration each
    unfinished sample goes on alone through `run_one` (the engine's one-sample run)."""

    def __init__(self, downstream: Downstream, prefill: PrefillLeg, tokenizer: object,
                 run_one: RunOne, state: RouterRequest, job: Admitted) -> None:
        self.downstream, self.prefill, self.run_one = downstream, prefill, run_one
        self.state, self.job = state, job
        self.prompt, self.params, self.deadline = job.prompt, job.params, job.deadline
        state.num_samples = job.params.n
        self.stop_ids = job.stop_ids
        self.samples = [_Sample(i, IncrementalDetokenizer(tokenizer, job.params.stop))
                        for i in range(job.params.n)]
        self.timing = Timing(0.0, 0.0, 0.0, 0.0, 0.0)

    async def run(self) -> AsyncIterator[Event]:
        try:
            async for event in self._one_leg():
                yield event
        except StreamBroken as exc:
            self.timing = self.timing._replace(num_migrations=1)
            self.downstream.lose_decode(self.state, exc, 1)
            async for event in self._migrate():
                yield event
        for sample in self.samples:  # aborted before it ended
            if not sample.is_done:
                for event in self._end(sample, Ending(FinishReason.ABORT)):
                    yield event

    def _end(self, sample: _Sample, ending: Ending) -> list[Event]:
        """The sample's last chunk (its detokenizer's tail, unless a stop string ended it)
        and its DoneEvent."""
        sample.is_done = True
        text = ending.text + ("" if ending.is_stopped else sample.detok.finish())
        events: list[Event] = []
        if ending.token_ids or text:
            events.append(ChunkEvent(ending.token_ids, text, sample.index, ending.logprobs,
                                     ending.prompt_logprobs))
        done = ending.done(len(self.prompt), len(sample.generated), self.timing)
        events.append(done._replace(sample_index=sample.index))
        return events

    async def _one_leg(self) -> AsyncIterator[Event]:
        """Reserve, prefill once (n first tokens), push once, decode every sample."""
        state, params = self.state, self.params
        waited = await self.downstream.reserve_leg(state, self.job, self.prompt,
                                                   params.max_tokens, True, may_defer=False)
        self.timing = self.timing._replace(admission_wait_s=waited)
        if state.is_aborted:
            return
        first_msg, self.timing = await self.prefill.first(state, self.job, self.prompt, 0,
                                                          self.timing)
        if first_msg is None:
            return
        firsts = [first_msg.token_id, *first_msg.sample_token_ids]
        if len(firsts) != params.n:
            raise Unavailable(f"the prefill worker drew {len(firsts)} first tokens for "
                              f"{params.n} samples")
        logprobs = first_msg.logprobs or (None,) * len(firsts)
        for sample, token, logprob in zip(self.samples, firsts, logprobs):
            for event in self._first(sample, token, logprob, first_msg.prompt_logprobs):
                yield event
        if all(s.is_done for s in self.samples):
            return
        done_msg = await self.prefill.prefill_done(state, self.prompt, params,
                                                   self.deadline, 0)
        if done_msg is None:
            return
        self.timing = self.timing._replace(kv_transfer_s=done_msg.kv_transfer_s)
        async for event in self._decode(firsts):
            yield event

    def _first(self, sample: _Sample, token: int, logprob: TokenLogprob | None,
               prompt_logprobs: tuple[TokenLogprob, ...]) -> list[Event]:
        """Its first token (with its log probability and the prompt's, where asked)."""
        sample.generated.append(token)
        step = sample.detok.add([token])
        logprobs = () if logprob is None else (logprob,)
        if step.is_stopped or token in self.stop_ids or self.params.max_tokens == 1:
            reason = FinishReason.LENGTH
            if step.is_stopped or token in self.stop_ids:
                reason = FinishReason.STOP
            return self._end(sample, Ending(reason, token_ids=[token], text=step.text,
                                            is_stopped=step.is_stopped, logprobs=logprobs,
                                            prompt_logprobs=prompt_logprobs))
        return [ChunkEvent([token], step.text, sample.index, logprobs, prompt_logprobs)]

    async def _decode(self, firsts: list[int]) -> AsyncIterator[Event]:
        """One Decode start for every sample; each sample's updates to its own stream."""
        state = self.state
        start = DecodeStart(state.request_id, firsts[0], self.params,
                            self.params.max_tokens - 1, list(self.stop_ids), 0,
                            tuple(firsts[1:]))
        async with self.downstream.decoding(state, start, self.deadline) as call:
            if call is None:
                return
            for sample in self.samples:
                if sample.is_done:  # ended at its first token: the worker need not decode it
                    call.abort_sample(sample.index)
            while not all(s.is_done for s in self.samples):
                update = await call.next()
                if not 0 <= update.sample_index < len(self.samples):
                    raise Unavailable(f"decode worker sent sample {update.sample_index}")
                sample = self.samples[update.sample_index]
                state.last_token_s = update.received_s
                if not sample.is_done:
                    for event in self._update(sample, update.token_ids, update.finished,
                                              update.logprobs):
                        yield event
                    if sample.is_done and update.finished is None:  # a stop string ended it
                        call.abort_sample(sample.index)
            state.holds_decode = False  # every sample finished there or was told to stop

    def _update(self, sample: _Sample, ids: list[int], finished: DecodeFinished | None,
                logprobs: tuple[TokenLogprob, ...] = ()) -> list[Event]:
        events: list[Event] = []
        if ids:
            sample.generated.extend(ids)
            step = sample.detok.add(ids)
            events.append(ChunkEvent(ids, step.text, sample.index, logprobs))
            if step.is_stopped:
                return events + self._end(sample, Ending(
                    FinishReason.STOP, is_stopped=True, always_chunk=False))
        if finished is not None:
            events += self._end(sample, Ending(
                finished.reason, always_chunk=False,
                first_decode_step_s=finished.first_decode_step_s,
                num_draft_tokens=finished.num_draft_tokens,
                num_accepted_tokens=finished.num_accepted_tokens))
        return events

    async def _migrate(self) -> AsyncIterator[Event]:
        """Every unfinished sample as a request of its own, all at once; their events
        merged as they come."""
        legs = [self._leg(s) for s in self.samples if not s.is_done]
        async for event in merge(legs):
            yield event

    async def _leg(self, sample: _Sample) -> AsyncIterator[Event]:
        parent = self.state
        state = RouterRequest(f"{parent.request_id}#{sample.index}",
                              cache_salt=parent.cache_salt, is_aborted=parent.is_aborted)
        parent.sub_requests.append(state)
        try:
            async for event in self.run_one(state, self.job.sample(sample.index),
                                            sample.generated, sample.detok):
                if isinstance(event, DoneEvent):
                    sample.is_done = True
                    timing = event.timing._replace(
                        num_migrations=event.timing.num_migrations + 1)
                    event = event._replace(timing=timing)
                yield event._replace(sample_index=sample.index)
        finally:
            release = asyncio.ensure_future(self.downstream.release(state))
            await asyncio.shield(release)


async def merge(streams: list[AsyncIterator[Event]]) -> AsyncIterator[Event]:
    """The events of every stream as they come; the first error raised is raised here."""
    queue: asyncio.Queue[Event | BaseException | None] = asyncio.Queue()

    async def pump(stream: AsyncIterator[Event]) -> None:
        try:
            async for event in stream:
                await queue.put(event)
        except Exception as exc:  # handed to the consumer
            await queue.put(exc)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
