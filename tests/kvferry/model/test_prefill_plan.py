"""How the prefill batcher fills one forward (`PrefillBatcher._plan`): arrival order under
the token budget, prompts longer than the chunk size in chunks, and a long prompt's chunk
leaving room for the prompts waiting behind it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import Executor, Future

import pytest

from kvferry.faults import FAULTS_ENV, PER_REQUEST, tag
from kvferry.model.prefill_batch import NO_GATHERING, PrefillBatcher, PrefillJob
from kvferry.model.sampling import SamplingParams

Loop = asyncio.AbstractEventLoop


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _batcher(budget: int, chunk: int) -> PrefillBatcher:
    return PrefillBatcher(None, None, None, lambda: None, token_budget=budget,  # type: ignore[arg-type]
                          chunk_size=chunk)


def _job(loop: Loop, name: str, length: int, done: int = 0) -> PrefillJob:
    return PrefillJob(name, list(range(length)), SamplingParams(), [], loop.create_future(),
                      num_computed=done)


def _planned(batcher: PrefillBatcher) -> list[tuple[str, int, int]]:
    return [(it.job.request_id, it.start, it.end) for it in batcher._plan()]


def test_a_burst_of_short_prompts_goes_in_arrival_order_up_to_the_budget(loop: Loop) -> None:
    batcher = _batcher(512, 512)
    for i in range(31):
        batcher.submit(_job(loop, f"p{i}", 64))
    assert _planned(batcher) == [(f"p{i}", 0, 64) for i in range(8)]


def test_a_long_prompt_alone_takes_whole_chunks(loop: Loop) -> None:
    batcher = _batcher(512, 512)
    batcher.submit(_job(loop, "long", 3000, done=1024))
    assert _planned(batcher) == [("long", 1024, 1536)]


def test_a_long_prompts_chunk_leaves_room_for_the_short_prompts_behind_it(loop: Loop) -> None:
    """Without the room, the long prompt's 512-token chunk filled every forward and the short
    prompts waited for all of its chunks."""
    batcher = _batcher(512, 512)
    batcher.submit(_job(loop, "long", 3000, done=512))
    batcher.submit(_job(loop, "a", 32))
    batcher.submit(_job(loop, "b", 40))
    assert _planned(batcher) == [("long", 512, 952), ("a", 0, 32), ("b", 0, 40)]


def test_the_room_is_at_most_half_the_budget_and_a_chunk_leaves_room_too(loop: Loop) -> None:
    batcher = _batcher(512, 512)
    batcher.submit(_job(loop, "long", 3000))
    for i in range(6):
        batcher.submit(_job(loop, f"s{i}", 100))
    batcher.submit(_job(loop, "tiny", 12))
    # long: 256 (half kept back of the 612 wanted behind it); s0, s1 whole (56 left); s2-s4
    # would be chunks leaving no room for what waits behind them: skipped (first next
    # time); s5 a 44-token chunk, leaving 12 for tiny, whole.
    assert _planned(batcher) == [("long", 0, 256), ("s0", 0, 100), ("s1", 0, 100),
                                 ("s5", 0, 44), ("tiny", 0, 12)]


def test_the_first_job_always_progresses_even_with_a_budget_of_one(loop: Loop) -> None:
    batcher = _batcher(1, 512)
    batcher.submit(_job(loop, "long", 30))
    batcher.submit(_job(loop, "short", 3))
    assert _planned(batcher) == [("long", 0, 1)]


class _RecordingExecutor(Executor):
    """Runs the forward at once, on the caller's thread, and records each call."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.calls.append([it.job.request_id for it in args[0]])
        future: Future = Future()
        future.set_result([[7]] * len(args[0]))  # each job's first token
        return future


@pytest.mark.parametrize("tagged", [False, True])
def test_the_prefill_batch_delay_fault_holds_only_batches_with_a_tagged_request(
        loop: Loop, tagged: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fault tests use to keep a prompt pending (kvferry/faults.py): the batch waits before
    its forward with its jobs still queued, and a batch without a tagged job does not."""
    monkeypatch.setenv(FAULTS_ENV, PER_REQUEST)
    executor = _RecordingExecutor()
    batcher = PrefillBatcher(None, None, executor, lambda: None,  # type: ignore[arg-type]
                             token_budget=512, chunk_size=512, gathering=NO_GATHERING)
    name = "p" + (tag(prefill_batch_delay_s=0.2) if tagged else "")
    job = _job(loop, name, 64)
    batcher.submit(job)

    async def first_yield() -> tuple[bool, list[list[str]], int]:
        task = asyncio.ensure_future(batcher.run_once())
        await asyncio.sleep(0)  # run_once runs up to its first await
        seen = (job.is_in_batch, list(executor.calls), batcher.pending_tokens)
        assert await task
        return seen

    in_batch, calls, pending = loop.run_until_complete(first_yield())
    if tagged:
        assert (in_batch, calls, pending) == (True, [], 64)  # waiting, nothing run yet
    else:
        assert calls == [[name]]
    assert executor.calls == [[name]]
    assert job.first_token.result() == 7 and batcher.pending_tokens == 0
