"""The open-loop driver: send each request at its arrival offset, stream, time every chunk.

A Sender sends one request over one backend and times its stream: GrpcSender (kvferry's
GenerationService, here) or OpenAISender (any OpenAI-compatible HTTP server,
deploy/loadgen/openai_client.py); the schedule below is the same for every backend.

Requests go out on schedule whether or not earlier ones have finished (open loop); an
optional max_concurrency holds a request back until a slot frees, as vLLM's semaphore does.
Conversations start on the same schedule, and within one the turns are a closed loop: a turn
is sent when the previous one has finished (and its think time passed).
Timestamps come from an injectable clock, so tests can script them exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterable, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import grpc

from deploy.loadgen.metrics import ABANDONED, OK, RequestRecord
from deploy.loadgen.workload import BenchRequest, Conversation
from kvferry import trace
from kvferry.v1 import generation_pb2

T = TypeVar("T")
Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]
OnDone = Callable[[RequestRecord], None]


class GenerateStub(Protocol):
    """The part of GenerationServiceStub the runner uses (a fake in tests)."""

    def Generate(self, request: generation_pb2.GenerateRequest,  # noqa: N802 - gRPC name
                 timeout: float | None = None) -> AsyncIterable[generation_pb2.GenerateResponse]:
        ...


@dataclass(frozen=True)
class SendOptions:
    """Sampling and limits applied to every request."""

    temperature: float = 0.0
    ignore_eos: bool = True
    seed: int | None = None  # per-request sampling seed = seed + request index
    timeout_s: float | None = None


class Sender(Protocol):
    """Sends one request and times its stream. Every failure becomes a record carrying its
    status; `answer`, when given, receives the generated token ids (multi-turn)."""

    async def send(self, request: BenchRequest, request_id: str, index: int,
                   options: SendOptions, clock: Clock, origin_s: float,
                   answer: list[int] | None = None) -> RequestRecord: ...


@dataclass(frozen=True)
class RunOutcome:
    """Records in request order, and the run's duration (first send slot to last finish)."""

    records: tuple[RequestRecord, ...]
    duration_s: float
    is_interrupted: bool = False  # cut short (Ctrl-C): the records of what had finished


class Interrupted(Exception):
    """A run cut short (its task cancelled: Ctrl-C); `results` holds the requests (or
    conversations) that had finished, in request order, and `duration_s` the time so far."""

    def __init__(self, results: list, duration_s: float) -> None:
        super().__init__("interrupted")
        self.results, self.duration_s = results, duration_s


def to_proto(request: BenchRequest, request_id: str, options: SendOptions,
             index: int = 0) -> generation_pb2.GenerateRequest:
    sampling = generation_pb2.SamplingParams(
        temperature=options.temperature, max_tokens=request.output_len,
        ignore_eos=options.ignore_eos)
    if options.seed is not None:
        sampling.seed = options.seed + index
    proto = generation_pb2.GenerateRequest(request_id=request_id, sampling=sampling)
    if isinstance(request.prompt, str):
        proto.text = request.prompt
    else:
        proto.token_ids.ids.extend(request.prompt)
    return proto


async def send_one(stub: GenerateStub, request: BenchRequest, proto: generation_pb2.
                   GenerateRequest, options: SendOptions, clock: Clock, origin_s: float,
                   answer: list[int] | None = None) -> RequestRecord:
    """Stream one request; every failure becomes a record carrying its status code.
    `answer`, when given, receives the generated token ids."""
    start = clock()
    ttft, last, itls, num_tokens = 0.0, start, [], 0
    tracer, arrivals, sizes = trace.get(), [], []  # kvferry bench --trace
    prompt_len = request.prompt_len
    status, error = OK, ""
    usage = generation_pb2.Usage()
    try:
        finished = None
        async for msg in stub.Generate(proto, timeout=options.timeout_s):
            if msg.HasField("finished"):
                finished = msg.finished
            elif msg.chunk.token_ids:
                now = clock()
                if num_tokens == 0:
                    ttft = now - start
                else:
                    itls.append(now - last)
                last = now
                num_tokens += len(msg.chunk.token_ids)
                if tracer:
                    arrivals.append(time.monotonic())
                    sizes.append(len(msg.chunk.token_ids))
                if answer is not None:
                    answer.extend(msg.chunk.token_ids)
        if finished is None:
            status, error = "INCOMPLETE", "stream ended without a finished message"
        else:
            usage = finished.usage
            prompt_len = usage.prompt_tokens or prompt_len
    except grpc.aio.AioRpcError as exc:
        status, error = exc.code().name, exc.details() or ""
    if tracer:
        tracer.event("arrivals", id=proto.request_id, tag=request.tag,
                     phase=proto.request_id.rsplit("-", 1)[0], t=arrivals, n=sizes)
    return RequestRecord(
        prompt_len=prompt_len or 0, output_len=num_tokens, start_s=start - origin_s,
        ttft_s=ttft, itls_s=tuple(itls), latency_s=last - start, status=status, error=error,
        tag=request.tag, cached_prompt_tokens=usage.cached_prompt_tokens,
        kv_bytes_shipped=usage.kv_bytes_shipped,
        kv_bytes_not_shipped=usage.kv_bytes_not_shipped,
        cache_reported=usage.HasField("cached_prompt_tokens"))


@dataclass(frozen=True)
class GrpcSender:
    """The gRPC backend: GenerateRequest protos on a GenerationService stub."""

    stub: GenerateStub

    async def send(self, request: BenchRequest, request_id: str, index: int,
                   options: SendOptions, clock: Clock, origin_s: float,
                   answer: list[int] | None = None) -> RequestRecord:
        proto = to_proto(request, request_id, options, index)
        return await send_one(self.stub, request, proto, options, clock, origin_s, answer)


def as_sender(client: GenerateStub | Sender) -> Sender:
    """A Sender as is; a bare Generate stub (the gRPC backend) wrapped in a GrpcSender."""
    return client if hasattr(client, "send") else GrpcSender(client)  # type: ignore[arg-type]


def _check_load(num_items: int, offsets_s: Sequence[float], max_concurrency: int | None
                ) -> asyncio.Semaphore | contextlib.nullcontext[None]:
    """The concurrency limit every request is sent under."""
    if len(offsets_s) != num_items:
        raise ValueError("offsets_s: one offset per request is needed")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    return asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()


async def _on_schedule(offsets_s: Sequence[float], start: Callable[[int, float], Awaitable[T]],
                       clock: Clock, sleep: Sleep) -> tuple[list[T], float]:
    """Call start(i, origin) at offsets_s[i] after origin; every result, and the duration.
    Cancelled (Ctrl-C), it cancels what is still running and raises Interrupted with the
    results of what had finished."""
    origin = clock()
    tasks: list[asyncio.Task[T]] = []
    try:
        for index, offset in enumerate(offsets_s):
            delay = origin + offset - clock()
            if delay > 0:
                await sleep(delay)
            tasks.append(asyncio.create_task(start(index, origin)))
        results = await asyncio.gather(*tasks)
    except asyncio.CancelledError:
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        finished = [t.result() for t in tasks if not t.cancelled() and t.exception() is None]
        raise Interrupted(finished, clock() - origin) from None
    return list(results), clock() - origin


async def run_requests(client: GenerateStub | Sender, requests: Sequence[BenchRequest],
                       offsets_s: Sequence[float], options: SendOptions = SendOptions(),
                       max_concurrency: int | None = None, clock: Clock = time.perf_counter,
                       sleep: Sleep = asyncio.sleep, on_done: OnDone | None = None,
                       id_prefix: str = "bench") -> RunOutcome:
    """Send requests[i] at offsets_s[i] after the start; wait for all; time the run."""
    limit = _check_load(len(requests), offsets_s, max_concurrency)
    sender = as_sender(client)

    async def limited(index: int, origin: float) -> RequestRecord:
        async with limit:
            record = await sender.send(requests[index], f"{id_prefix}-{index}", index,
                                       options, clock, origin)
        if on_done is not None:
            on_done(record)
        return record

    try:
        records, duration_s = await _on_schedule(offsets_s, limited, clock, sleep)
    except Interrupted as cut:
        return RunOutcome(tuple(cut.results), cut.duration_s, is_interrupted=True)
    return RunOutcome(tuple(records), duration_s)


def _abandoned(turn: int, start_s: float) -> RequestRecord:
    """The record of a turn never sent because an earlier turn of its conversation failed."""
    return RequestRecord(prompt_len=0, output_len=0, start_s=start_s, status=ABANDONED,
                         error="an earlier turn of the conversation failed",
                         tag=f"turn-{turn + 1}")


async def run_conversations(client: GenerateStub | Sender, conversations: Sequence[Conversation],
                            offsets_s: Sequence[float], options: SendOptions = SendOptions(),
                            max_concurrency: int | None = None,
                            clock: Clock = time.perf_counter, sleep: Sleep = asyncio.sleep,
                            on_done: OnDone | None = None, id_prefix: str = "bench"
                            ) -> RunOutcome:
    """Start conversations[i] at offsets_s[i]; its turns go one after another, each tagged
    "turn-K". Records: conversation by conversation, turn by turn. A failed turn ends its
    conversation: the turns after it are recorded as ABANDONED. max_concurrency counts
    requests in flight, not conversations."""
    limit = _check_load(len(conversations), offsets_s, max_concurrency)
    sender = as_sender(client)
    first_index = [0]
    for conversation in conversations:
        first_index.append(first_index[-1] + conversation.num_turns)

    async def converse(index: int, origin: float) -> list[RequestRecord]:
        conversation, records = conversations[index], []
        prompt: tuple[int, ...] = ()
        answer: list[int] = []
        for turn in range(conversation.num_turns):
            if records and not records[-1].is_success:
                record = _abandoned(turn, clock() - origin)
            else:
                if turn and conversation.think_time_s > 0:
                    await sleep(conversation.think_time_s)
                prompt = conversation.next_prompt(prompt, answer, turn)
                answer = []
                request = BenchRequest(prompt, conversation.output_len, len(prompt),
                                       tag=f"turn-{turn + 1}")
                async with limit:
                    record = await sender.send(request, f"{id_prefix}-{index}-{turn + 1}",
                                               first_index[index] + turn, options, clock,
                                               origin, answer)
            if on_done is not None:
                on_done(record)
            records.append(record)
        return records

    try:
        per_conversation, duration_s = await _on_schedule(offsets_s, converse, clock, sleep)
    except Interrupted as cut:  # the conversations that had finished
        return RunOutcome(tuple(r for records in cut.results for r in records), cut.duration_s,
                          is_interrupted=True)
    return RunOutcome(tuple(r for records in per_conversation for r in records), duration_s)
