"""The open-loop driver: send each request at its arrival offset, stream, time every chunk.

Requests go out on schedule whether or not earlier ones have finished (open loop); an
optional max_concurrency holds a request back until a slot frees, as vLLM's semaphore does.
Timestamps come from an injectable clock, so tests can script them exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterable, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc

from deploy.loadgen.metrics import OK, RequestRecord
from deploy.loadgen.workload import BenchRequest
from kvferry.v1 import generation_pb2

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


@dataclass(frozen=True)
class RunOutcome:
    """Records in request order, and the run's duration (first send slot to last finish)."""

    records: tuple[RequestRecord, ...]
    duration_s: float


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
                   GenerateRequest, options: SendOptions, clock: Clock, origin_s: float
                   ) -> RequestRecord:
    """Stream one request; every failure becomes a record carrying its status code."""
    start = clock()
    ttft, last, itls, num_tokens = 0.0, start, [], 0
    prompt_len = request.prompt_len
    status, error = OK, ""
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
        if finished is None:
            status, error = "INCOMPLETE", "stream ended without a finished message"
        elif finished.usage.prompt_tokens:
            prompt_len = finished.usage.prompt_tokens
    except grpc.aio.AioRpcError as exc:
        status, error = exc.code().name, exc.details() or ""
    return RequestRecord(
        prompt_len=prompt_len or 0, output_len=num_tokens, start_s=start - origin_s,
        ttft_s=ttft, itls_s=tuple(itls), latency_s=last - start, status=status, error=error,
        tag=request.tag)


async def run_requests(stub: GenerateStub, requests: Sequence[BenchRequest],
                       offsets_s: Sequence[float], options: SendOptions = SendOptions(),
                       max_concurrency: int | None = None, clock: Clock = time.perf_counter,
                       sleep: Sleep = asyncio.sleep, on_done: OnDone | None = None,
                       id_prefix: str = "bench") -> RunOutcome:
    """Send requests[i] at offsets_s[i] after the start; wait for all; time the run."""
    if len(offsets_s) != len(requests):
        raise ValueError("offsets_s: one offset per request is needed")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    limit = (asyncio.Semaphore(max_concurrency) if max_concurrency
             else contextlib.nullcontext())

    async def limited(index: int) -> RequestRecord:
        request = requests[index]
        proto = to_proto(request, f"{id_prefix}-{index}", options, index)
        async with limit:
            record = await send_one(stub, request, proto, options, clock, origin)
        if on_done is not None:
            on_done(record)
        return record

    origin = clock()
    tasks = []
    for index, offset in enumerate(offsets_s):
        delay = origin + offset - clock()
        if delay > 0:
            await sleep(delay)
        tasks.append(asyncio.create_task(limited(index)))
    records = await asyncio.gather(*tasks)
    return RunOutcome(tuple(records), clock() - origin)
