"""How the prefill batcher gathers a wave of arrivals into one forward (`Gathering`, issue 62):
submissions arriving less than the gap apart join the forward, a lone prompt waits the gap,
a wave at most the window, a full budget not at all; cancelled jobs leave the queue while it
waits; a caller that may not wait (a colocated worker with sequences decoding) is told to
come back instead. The forward is a recording stand-in: only the batcher's policy is tested."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from kvferry.model.prefill_batch import (
    DEFAULT_GATHERING,
    NO_GATHERING,
    Gathering,
    PrefillBatcher,
    PrefillJob,
)
from kvferry.model.sampling import SamplingParams
from tests.kvferry.model.test_prefill_plan import _RecordingExecutor

Loop = asyncio.AbstractEventLoop


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _batcher(gathering: Gathering, budget: int = 512, on_submit=lambda: None
             ) -> tuple[PrefillBatcher, _RecordingExecutor]:
    executor = _RecordingExecutor()
    batcher = PrefillBatcher(None, None, executor, on_submit,  # type: ignore[arg-type]
                             token_budget=budget, chunk_size=512, gathering=gathering)
    return batcher, executor


def _job(loop: Loop, name: str, length: int = 64) -> PrefillJob:
    return PrefillJob(name, list(range(length)), SamplingParams(), [], loop.create_future())


def test_the_default_waits_a_few_milliseconds_at_most() -> None:
    assert 0 < DEFAULT_GATHERING.gap_s <= DEFAULT_GATHERING.window_s <= 0.1
    with pytest.raises(ValueError, match="gap_s"):
        Gathering(gap_s=-1.0, window_s=0.0)


def test_a_lone_job_waits_the_gap_and_a_wave_at_most_the_window(loop: Loop) -> None:
    batcher, _ = _batcher(Gathering(gap_s=0.01, window_s=0.05))
    first = _job(loop, "a")
    batcher.submit(first)
    t0 = first.submitted_at
    assert batcher.gather_left_s(t0) == pytest.approx(0.01)
    assert batcher.gather_left_s(t0 + 0.01) == 0.0  # nobody came within the gap: start
    for i in range(1, 6):  # a submission every few ms keeps the window open...
        job = _job(loop, f"p{i}")
        batcher.submit(job)
        assert batcher.gather_left_s(job.submitted_at) > 0
    # ...but never past the window after the oldest waiting job's arrival
    assert batcher.gather_left_s(t0 + 0.05) == 0.0


def test_a_full_budget_starts_at_once(loop: Loop) -> None:
    batcher, executor = _batcher(Gathering(gap_s=10.0, window_s=10.0), budget=128)
    batcher.submit(_job(loop, "a"))
    assert batcher.gather_left_s(time.perf_counter()) > 0
    batcher.submit(_job(loop, "b"))
    assert batcher.gather_left_s(time.perf_counter()) == 0.0

    async def first_yield() -> list[list[str]]:
        task = asyncio.ensure_future(batcher.run_once())
        await asyncio.sleep(0)
        seen = list(executor.calls)
        assert await task
        return seen

    assert loop.run_until_complete(first_yield()) == [["a", "b"]]


def test_a_submission_filling_the_budget_cuts_the_wait_short(loop: Loop) -> None:
    batcher, executor = _batcher(Gathering(gap_s=10.0, window_s=10.0), budget=128)

    async def scenario() -> float:
        batcher.submit(_job(loop, "a"))
        task = asyncio.ensure_future(batcher.run_once())
        await asyncio.sleep(0.01)
        assert executor.calls == []  # gathering
        started = time.perf_counter()
        batcher.submit(_job(loop, "b"))
        assert await asyncio.wait_for(task, 5.0)
        return time.perf_counter() - started

    assert loop.run_until_complete(scenario()) < 5.0
    assert executor.calls == [["a", "b"]]


def test_submissions_within_the_gap_run_in_one_forward(loop: Loop) -> None:
    batcher, executor = _batcher(Gathering(gap_s=0.5, window_s=5.0))
    jobs = [_job(loop, f"p{i}") for i in range(6)]

    async def wave() -> None:
        batcher.submit(jobs[0])
        task = asyncio.ensure_future(batcher.run_once())
        for job in jobs[1:]:
            await asyncio.sleep(0.005)
            batcher.submit(job)
        assert await task

    loop.run_until_complete(wave())
    assert executor.calls == [[f"p{i}" for i in range(6)]]
    assert all(job.first_token.result() == 7 for job in jobs)


def test_without_gathering_the_first_arrival_runs_alone(loop: Loop) -> None:
    """Window 0: the behaviour before issue 62, a forward as soon as one job waits."""
    batcher, executor = _batcher(NO_GATHERING)
    jobs = [_job(loop, f"p{i}") for i in range(3)]

    async def wave() -> list[list[str]]:
        batcher.submit(jobs[0])
        task = asyncio.ensure_future(batcher.run_once())
        await asyncio.sleep(0)
        seen = list(executor.calls)
        for job in jobs[1:]:
            batcher.submit(job)
        assert await task
        assert await batcher.run_once()
        return seen

    assert loop.run_until_complete(wave()) == [["p0"]]
    assert executor.calls == [["p0"], ["p1", "p2"]]


def test_a_lone_job_starts_once_the_gap_passes(loop: Loop) -> None:
    batcher, executor = _batcher(Gathering(gap_s=0.02, window_s=0.1))
    job = _job(loop, "a")

    async def lone() -> float:
        batcher.submit(job)
        assert await batcher.run_once()
        return time.perf_counter() - job.submitted_at

    waited_s = loop.run_until_complete(lone())
    assert executor.calls == [["a"]] and job.first_token.result() == 7
    assert 0.02 <= waited_s < 2.0  # the gap, then the forward; generous under load


def test_a_job_cancelled_while_gathering_leaves_the_wave(loop: Loop) -> None:
    batcher, executor = _batcher(Gathering(gap_s=0.05, window_s=0.2))
    a, b = _job(loop, "a"), _job(loop, "b")

    async def scenario() -> bool:
        batcher.submit(a)
        batcher.submit(b)
        task = asyncio.ensure_future(batcher.run_once())
        await asyncio.sleep(0)
        await batcher.release(a)  # as a cancelled request's cleanup does
        return await task

    assert loop.run_until_complete(scenario())
    assert executor.calls == [["b"]]
    assert a.first_token.cancelled() and b.first_token.result() == 7


def test_a_wave_cancelled_whole_while_gathering_runs_nothing(loop: Loop) -> None:
    batcher, executor = _batcher(Gathering(gap_s=0.05, window_s=0.2))
    a = _job(loop, "a")

    async def scenario() -> bool:
        batcher.submit(a)
        task = asyncio.ensure_future(batcher.run_once())
        await asyncio.sleep(0)
        await batcher.release(a)
        return await task

    assert not loop.run_until_complete(scenario())
    assert executor.calls == [] and batcher.num_pending == 0


def test_a_caller_that_may_not_wait_is_woken_when_the_window_closes(loop: Loop) -> None:
    """The colocated step loop with sequences decoding: it steps them instead of waiting,
    and `on_submit` brings it back once the wave has arrived."""
    wakes: list[float] = []
    batcher, executor = _batcher(Gathering(gap_s=0.03, window_s=0.1),
                                 on_submit=lambda: wakes.append(time.perf_counter()))
    job = _job(loop, "a")

    async def scenario() -> None:
        batcher.submit(job)  # wake 1
        assert not await batcher.run_once(may_wait=False)  # deferred, not run
        assert executor.calls == [] and batcher.num_pending == 1
        while len(wakes) < 2:  # the window's wake
            await asyncio.sleep(0.005)
        assert await batcher.run_once(may_wait=False)

    loop.run_until_complete(asyncio.wait_for(scenario(), 5.0))
    assert wakes[1] - job.submitted_at >= 0.03
    assert executor.calls == [["a"]]
