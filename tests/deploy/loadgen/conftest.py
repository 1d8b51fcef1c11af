"""A scripted GenerationService over real gRPC, a fake stub with a virtual clock for exact
timing tests, a clock a real server and its client share for the same exactness over a real
transport, and the same script from an OpenAI-compatible server (fake_openai.py)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import pytest

from kvferry.v1 import generation_pb2, generation_pb2_grpc

if TYPE_CHECKING:
    from tests.deploy.loadgen.fake_openai import FakeOpenAI

FAIL_TOKEN = 999_999  # a prompt starting with this id is refused: RESOURCE_EXHAUSTED
VOCAB_SIZE = 1000
KV_BYTES_PER_TOKEN = 10  # what the scripted usage reports per prompt token


@dataclass(frozen=True)
class Step:
    """Wait delay_s (real or virtual), then send a chunk of num_tokens tokens."""

    delay_s: float
    num_tokens: int


# 4 chunks, 5 tokens: first chunk after 40 ms, then gaps of 50, 30 and 70 ms.
SCRIPT = (Step(0.040, 1), Step(0.050, 1), Step(0.030, 2), Step(0.070, 1))


def responses(request: generation_pb2.GenerateRequest, script: tuple[Step, ...]
              ) -> Iterator[tuple[float, generation_pb2.GenerateResponse]]:
    """(delay before sending, message) for a scripted stream, finished last."""
    for step in script:
        chunk = generation_pb2.TokenChunk(token_ids=[7] * step.num_tokens, text="x")
        yield step.delay_s, generation_pb2.GenerateResponse(request_id=request.request_id,
                                                            chunk=chunk)
    num_prompt = len(request.token_ids.ids)
    num_cached = num_prompt // 2  # a scripted prefix cache: half of every prompt hits
    usage = generation_pb2.Usage(prompt_tokens=num_prompt,
                                 completion_tokens=sum(s.num_tokens for s in script),
                                 cached_prompt_tokens=num_cached,
                                 kv_bytes_shipped=KV_BYTES_PER_TOKEN * (num_prompt - num_cached),
                                 kv_bytes_not_shipped=KV_BYTES_PER_TOKEN * num_cached)
    finished = generation_pb2.Finished(reason=generation_pb2.FINISH_REASON_LENGTH, usage=usage)
    yield 0.0, generation_pb2.GenerateResponse(request_id=request.request_id, finished=finished)


class LockstepClock:
    """Virtual time shared by a real server (on its own threads) and a client that runs one
    stream at a time: the server moves it on by each chunk's scripted delay just before
    sending the chunk, once the client has read it since the last move (the arrival of the
    chunk before). Records over a real transport are then as exact as FakeStub's."""

    def __init__(self, deadline_s: float = 60.0) -> None:
        self.now = 0.0
        self.deadline_s = deadline_s  # only a hang reaches it
        self._is_read = True
        self._changed = threading.Condition()

    def __call__(self) -> float:
        with self._changed:
            self._is_read = True
            self._changed.notify_all()
            return self.now

    def advance(self, delay_s: float) -> None:
        """Move time on by delay_s, once the client has read the last move (blocks)."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._is_read, self.deadline_s):
                raise TimeoutError("the client never read the clock after the last chunk")
            self.now += delay_s
            self._is_read = False


class ScriptedServicer(generation_pb2_grpc.GenerationServiceServicer):
    """Synchronous (thread-pool) servicer: it works whatever event loops the client runs.
    Its chunks come after their scripted delays in real time, or on a LockstepClock."""

    def __init__(self, script: tuple[Step, ...] = SCRIPT,
                 clock: LockstepClock | None = None) -> None:
        self.script = script
        self.clock = clock
        self.requests: list[generation_pb2.GenerateRequest] = []
        self.keys: list[str | None] = []  # each call's `authorization` metadata

    def Generate(self, request: generation_pb2.GenerateRequest,  # noqa: N802
                 context: grpc.ServicerContext) -> Iterator[generation_pb2.GenerateResponse]:
        self.requests.append(request)
        self.keys.append(dict(context.invocation_metadata()).get("authorization"))
        if request.token_ids.ids and request.token_ids.ids[0] == FAIL_TOKEN:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "scripted refusal")
        for delay_s, msg in responses(request, self.script):
            if self.clock is None:
                time.sleep(delay_s)  # paces: the scripted gaps, for clients on real time
            elif msg.HasField("chunk"):
                self.clock.advance(delay_s)
            yield msg

    def GetModelInfo(self, request: generation_pb2.GetModelInfoRequest,  # noqa: N802
                     context: grpc.ServicerContext) -> generation_pb2.ModelInfo:
        self.keys.append(dict(context.invocation_metadata()).get("authorization"))
        return generation_pb2.ModelInfo(architecture="Scripted", vocab_size=VOCAB_SIZE,
                                        max_context_tokens=4096, model_name="scripted-model")


@dataclass
class FakeServer:
    address: str
    servicer: ScriptedServicer


@contextlib.contextmanager
def serve_scripted(clock: LockstepClock | None = None) -> Iterator[FakeServer]:
    """A real gRPC server on a free port, one thread per stream."""
    servicer = ScriptedServicer(clock=clock)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield FakeServer(f"127.0.0.1:{port}", servicer)
    finally:
        server.stop(0).wait(10)


@pytest.fixture
def fake_server() -> Iterator[FakeServer]:
    """The scripted server on real time."""
    with serve_scripted() as served:
        yield served


class VirtualClock:
    """Time that moves only when told: by the fake stub's chunks and by sleep()."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, delay_s: float) -> None:
        target = self.now + delay_s
        await asyncio.sleep(0)  # paces: one loop turn, so that started requests run first
        self.now = max(self.now, target)


class FakeStub:
    """Generate without gRPC: each scripted step advances the virtual clock, then yields."""

    def __init__(self, clock: VirtualClock, script: tuple[Step, ...] = SCRIPT) -> None:
        self.clock = clock
        self.script = script

    async def _stream(self, request: generation_pb2.GenerateRequest
                      ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        if request.token_ids.ids and request.token_ids.ids[0] == FAIL_TOKEN:
            raise grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                       grpc.aio.Metadata(), grpc.aio.Metadata(), "refused")
        for delay_s, msg in responses(request, self.script):
            self.clock.now += delay_s
            yield msg

    def Generate(self, request: generation_pb2.GenerateRequest,  # noqa: N802
                 timeout: float | None = None) -> AsyncIterator[generation_pb2.GenerateResponse]:
        return self._stream(request)


@pytest.fixture
def openai_server() -> Iterator[FakeOpenAI]:
    """The scripted OpenAI-compatible server (fake_openai.py) under uvicorn on a free port."""
    from tests.deploy.loadgen.fake_openai import serve, stop

    served = serve()
    yield served.record
    stop(served)
