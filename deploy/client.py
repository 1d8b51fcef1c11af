"""A small client for the public Generate stream, with client-side TTFT and ITL."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from kvferry.rpc import grpc_util
from kvferry.v1 import generation_pb2, generation_pb2_grpc


@dataclass
class Completion:
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: generation_pb2.Finished | None = None
    ttft_s: float = 0.0
    token_times_s: list[float] = field(default_factory=list)  # arrival of each chunk
    # sampling.logprobs / prompt_logprobs: one per token id; one per prompt token after the first
    logprobs: list[generation_pb2.TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[generation_pb2.TokenLogprob] = field(default_factory=list)

    @property
    def mean_itl_s(self) -> float:
        gaps = [b - a for a, b in zip(self.token_times_s, self.token_times_s[1:])]
        return sum(gaps) / len(gaps) if gaps else 0.0


def make_request(prompt: str | list[int] | None = None, request_id: str = "", *,
                 messages: Sequence[tuple[str, str]] | None = None,
                 **sampling: object) -> generation_pb2.GenerateRequest:
    """A Generate request for text, token ids, or chat `messages` as (role, content) pairs
    (give either a prompt or messages)."""
    if (prompt is None) == (messages is None):
        raise ValueError("make_request: give exactly one of prompt and messages")
    request = generation_pb2.GenerateRequest(
        request_id=request_id, sampling=generation_pb2.SamplingParams(**sampling)
    )
    if messages is not None:
        request.messages.SetInParent()  # set the oneof even for an empty conversation
        request.messages.messages.extend(
            generation_pb2.ChatMessage(role=role, content=content) for role, content in messages)
    elif isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return request


def public_stub(chan: grpc.aio.Channel) -> generation_pb2_grpc.GenerationServiceStub:
    """The public GenerationService on an open channel."""
    return generation_pb2_grpc.GenerationServiceStub(chan)


async def model_info(chan: grpc.aio.Channel, timeout_s: float | None = 30.0
                     ) -> generation_pb2.ModelInfo:
    return await public_stub(chan).GetModelInfo(generation_pb2.GetModelInfoRequest(),
                                                timeout=timeout_s)


def finish_reason_name(finished: generation_pb2.Finished | None) -> str:
    """STOP, LENGTH, ABORT; "none" for a stream that ended without its final message."""
    return generation_pb2.FinishReason.Name(finished.reason) if finished else "none"


async def stream(stub: generation_pb2_grpc.GenerationServiceStub,
                 request: generation_pb2.GenerateRequest, timeout_s: float | None = None
                 ) -> AsyncIterator[tuple[generation_pb2.GenerateResponse, Completion]]:
    """Yield each response together with the completion accumulated so far."""
    completion = Completion()
    start = time.perf_counter()
    async for msg in stub.Generate(request, timeout=timeout_s):
        add_response(completion, msg, time.perf_counter() - start)
        yield msg, completion


def add_response(completion: Completion, msg: generation_pb2.GenerateResponse, now: float) -> None:
    """One response into its completion; `now`: seconds since the request was sent."""
    completion.request_id = msg.request_id
    if msg.HasField("chunk"):
        if msg.chunk.token_ids:
            if not completion.token_ids:
                completion.ttft_s = now
            completion.token_times_s.append(now)
        completion.token_ids.extend(msg.chunk.token_ids)
        completion.text += msg.chunk.text
        completion.logprobs.extend(msg.chunk.logprobs)
        completion.prompt_logprobs.extend(msg.chunk.prompt_logprobs)
    else:
        completion.finished = msg.finished


async def collect(stub: generation_pb2_grpc.GenerationServiceStub,
                  request: generation_pb2.GenerateRequest,
                  timeout_s: float | None = None) -> Completion:
    """The whole stream of one request on an open channel, as one completion."""
    completion = Completion()
    async for _, latest in stream(stub, request, timeout_s):
        completion = latest
    return completion


async def generate(address: str, request: generation_pb2.GenerateRequest,
                   timeout_s: float | None = None) -> Completion:
    async with grpc_util.channel(address) as chan:
        return await collect(generation_pb2_grpc.GenerationServiceStub(chan), request,
                             timeout_s)


async def generate_samples(address: str, request: generation_pb2.GenerateRequest,
                           timeout_s: float | None = None) -> list[Completion]:
    """A request of sampling.n samples: one completion per sample, in sample order."""
    n = request.sampling.n if request.sampling.HasField("n") and request.sampling.n else 1
    samples = [Completion() for _ in range(n)]
    start = time.perf_counter()
    async with grpc_util.channel(address) as chan:
        async for msg in public_stub(chan).Generate(request, timeout=timeout_s):
            add_response(samples[msg.sample_index], msg, time.perf_counter() - start)
    return samples


async def generate_many(address: str, requests: list[generation_pb2.GenerateRequest],
                        timeout_s: float | None = None) -> list[Completion]:
    """All requests at once, each on its own stream; completions in request order."""
    return await asyncio.gather(*(generate(address, r, timeout_s) for r in requests))


__all__ = ["Completion", "add_response", "collect", "finish_reason_name", "generate",
           "generate_many", "generate_samples", "make_request", "model_info", "public_stub",
           "stream"]
