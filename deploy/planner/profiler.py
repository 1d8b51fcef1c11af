"""Measures a profile (deploy/planner/profile.py) against a running kvferry router with one
prefill and one decode worker behind it, through the public Generate API, as the load tester
sends (random token prompts, max_tokens with ignore_eos, greedy):

1. prefill: each prompt length alone, `repeats` times, two tokens each: the time to first
   token is a prefill of that length; the gap to the second token, less one decode step,
   is the K/V push and attach (the transfer points);
2. prefill batches: `k` prompts of `n` tokens sent together (k x n within the token budget,
   so one forward): the last first token is the batch's time;
3. decode: `batch` requests of `context` prompt tokens sent together, each long enough that
   all of them decode together for a while: the median gap between tokens while all are in
   the batch, against the context tokens they hold then, and the gaps' spread around it;
4. the CPU the router process and, apart, this client spent on each send of 1-3, less what
   each spends idle (measured first, over IDLE_S), whose different mixes of requests,
   decode steps and tokens give the router's CPU per request, per update (a step's tokens
   come in one) and per token, and the client's per request and per token; and the decode
   worker's CPU per request in 1, less its one step: receiving and attaching the K/V.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from deploy import client
from deploy.loadgen.metrics import RequestRecord
from deploy.loadgen.runner import GrpcSender, SendOptions, run_requests
from deploy.loadgen.workload import RandomWorkload
from deploy.planner.profile import (
    JITTER_QUANTILES,
    DecodePoint,
    PrefillPoint,
    TransferPoint,
    nonneg_lstsq,
)
from kvferry.rpc import grpc_util

MIN_STEADY_GAPS = 8  # a decode point needs this many gaps with the whole batch running
IDLE_S = 2.0  # measures the CPU the router and the client spend idle, taken off the phases


@dataclass(frozen=True)
class Sweep:
    """What to measure."""

    prompt_lens: tuple[int, ...] = (16, 64, 256, 512, 1024)
    batch_prompts: tuple[tuple[int, int], ...] = ((4, 64), (4, 128))  # (k prompts, n tokens)
    decode_batches: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 16, 32)
    decode_contexts: tuple[int, ...] = (64, 512)
    repeats: int = 3
    steady_tokens: int = 24  # tokens each decode request makes after the last one joins

    def __post_init__(self) -> None:
        for name in ("prompt_lens", "decode_batches", "decode_contexts"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise ValueError(f"{name}: give at least one value, each >= 1")
        if self.repeats < 1:
            raise ValueError(f"repeats: must be >= 1, got {self.repeats}")


@dataclass(frozen=True)
class Measured:
    prefill: tuple[PrefillPoint, ...]
    decode: tuple[DecodePoint, ...]
    second_gaps: tuple[tuple[int, float], ...]  # (prompt tokens, median gap to token 2)
    cpu: tuple[CpuPoint, ...] = ()  # what the router and this client spent, per send
    # (prompt tokens, the decode worker's CPU seconds per request of two tokens)
    decode_cpu: tuple[tuple[int, float], ...] = ()


class CpuPoint(NamedTuple):
    """One send of the sweep: requests, the updates the router read from the decode worker
    (a step's tokens come in one), tokens streamed, and the CPU seconds the router and this
    client spent on them (less what each spends idle)."""

    requests: int
    updates: int
    tokens: int
    router_s: float
    client_s: float


def _cpu_point(records: Sequence[RequestRecord], is_serial: bool,
               before: tuple[float, float, float], after: tuple[float, float, float],
               idle: tuple[float, float]) -> CpuPoint:
    tokens = sum(r.output_len for r in records)
    # one at a time, every token is an update of its own; sent together, the requests'
    # first tokens come one by one and their later ones a step at a time
    updates = tokens if is_serial else len(records) + max(r.output_len for r in records) - 1
    wall = after[2] - before[2]
    return CpuPoint(len(records), updates, tokens,
                    max(after[0] - before[0] - idle[0] * wall, 0.0),
                    max(after[1] - before[1] - idle[1] * wall, 0.0))


def cpu_costs(points: Sequence[CpuPoint]) -> tuple[tuple[float, float, float],
                                                   tuple[float, float]]:
    """The router's CPU per request, per update and per token, and the client's per request
    and per token (least squares over the sweep's sends, none below zero)."""
    if not points:
        return (0.0, 0.0, 0.0), (0.0, 0.0)
    router = nonneg_lstsq(np.array([[p.requests, p.updates, p.tokens] for p in points], float),
                          np.array([p.router_s for p in points]))
    client = nonneg_lstsq(np.array([[p.requests, p.tokens] for p in points], float),
                          np.array([p.client_s for p in points]))
    return ((float(router[0]), float(router[1]), float(router[2])),
            (float(client[0]), float(client[1])))


def _token_times(record: RequestRecord) -> list[float]:
    first = record.start_s + record.ttft_s
    return [first, *(first + t for t in itertools.accumulate(record.itls_s))]


def steady_gaps(records: Sequence[RequestRecord], context: int) -> tuple[list[float], int]:
    """The gaps between tokens while every request decodes (after the last one's second
    token, before the first one's last), and the context tokens the batch held on average
    over them."""
    times = [_token_times(r) for r in records]
    if any(len(t) < 3 for t in times):
        return [], 0
    start, end = max(t[1] for t in times), min(t[-1] for t in times)
    gaps, held = [], []
    for t in times:
        for k in range(1, len(t)):
            if start <= t[k - 1] and t[k] <= end:
                gaps.append(t[k] - t[k - 1])
                held.append(context + k)
    if not held:
        return [], 0
    return gaps, round(len(records) * statistics.fmean(held))


class Profiler:
    """Sends the sweep to `address`; `vocab_size` bounds the random prompt tokens."""

    def __init__(self, address: str, sweep: Sweep, vocab_size: int, max_model_len: int,
                 log: Callable[[str], None] = lambda _: None,
                 router_cpu_s: Callable[[], float] = lambda: 0.0,
                 decode_cpu_s: Callable[[], float] = lambda: 0.0) -> None:
        self.address, self.sweep, self.vocab_size = address, sweep, vocab_size
        self.max_model_len = max_model_len
        self.log = log
        self.router_cpu_s = router_cpu_s
        self.decode_cpu_s = decode_cpu_s
        self._decode_cpu: list[tuple[int, float]] = []
        self._seed = itertools.count(1)
        self._idle: tuple[float, float] | None = None  # router, client CPU per second idle
        self._cpu: list[CpuPoint] = []

    def _mark(self) -> tuple[float, float, float]:
        """The router's and this client's CPU, and the time."""
        return self.router_cpu_s(), time.process_time(), time.perf_counter()

    async def _send(self, sender: GrpcSender, count: int, prompt_len: int, output_len: int,
                    concurrency: int | None) -> list[RequestRecord]:
        requests = RandomWorkload(prompt_len, output_len).build(count, self.vocab_size,
                                                                next(self._seed))
        before = self._mark()
        outcome = await run_requests(sender, requests, [0.0] * count, SendOptions(),
                                     concurrency, id_prefix=f"profile-{prompt_len}")
        after = self._mark()
        failed = [r for r in outcome.records if not r.is_success]
        if failed:
            raise RuntimeError(f"profile: a request failed: {failed[0].status}: "
                               f"{failed[0].error}")
        if self._idle is not None:
            self._cpu.append(_cpu_point(outcome.records, concurrency == 1, before, after,
                                        self._idle))
        return list(outcome.records)

    async def run(self) -> Measured:
        async with grpc_util.channel(self.address) as chan:
            sender = GrpcSender(client.public_stub(chan))
            await self._send(sender, 2, 16, 4, 1)  # warm-up
            idle = self._mark()
            await asyncio.sleep(IDLE_S)  # the CPU both spend doing nothing: polls, health
            start = self._mark()
            self._idle = ((start[0] - idle[0]) / (start[2] - idle[2]),
                          (start[1] - idle[1]) / (start[2] - idle[2]))
            prefill, gaps = await self._prefill(sender)
            prefill += await self._batches(sender)
            decode = await self._decode(sender, prefill)
        return Measured(tuple(prefill), tuple(decode), tuple(gaps), tuple(self._cpu),
                        tuple(self._decode_cpu))

    async def _prefill(self, sender: GrpcSender
                       ) -> tuple[list[PrefillPoint], list[tuple[int, float]]]:
        points, gaps = [], []
        for n in self.sweep.prompt_lens:
            if n + 2 > self.max_model_len:
                continue
            cpu = self.decode_cpu_s()
            records = await self._send(sender, self.sweep.repeats, n, 2, 1)
            self._decode_cpu.append((n, (self.decode_cpu_s() - cpu) / self.sweep.repeats))
            ttft = statistics.median(r.ttft_s for r in records)
            points.append(PrefillPoint(n, n * n, ttft))
            gaps.append((n, statistics.median(r.itls_s[0] for r in records)))
            self.log(f"prefill {n} tokens: {ttft * 1000:.1f} ms")
        return points, gaps

    async def _batches(self, sender: GrpcSender) -> list[PrefillPoint]:
        points = []
        for k, n in self.sweep.batch_prompts:
            times = []
            for _ in range(self.sweep.repeats):
                records = await self._send(sender, k, n, 2, None)
                times.append(max(r.ttft_s for r in records))
            points.append(PrefillPoint(k * n, k * n * n, statistics.median(times)))
            self.log(f"prefill {k} x {n} tokens: {points[-1].seconds * 1000:.1f} ms")
        return points

    async def _decode(self, sender: GrpcSender,
                      prefill: Sequence[PrefillPoint]) -> list[DecodePoint]:
        points: list[DecodePoint] = []
        longest = max(prefill, key=lambda p: p.tokens)
        per_token = longest.seconds / longest.tokens
        for context in self.sweep.decode_contexts:
            step_s = None  # the last batch's step: a lower bound of this one's
            for batch in self.sweep.decode_batches:
                # tokens the first request makes while the others are still prefilled
                joining = 0 if step_s is None else math.ceil(1.5 * batch * context
                                                             * per_token / step_s)
                output = min(self.sweep.steady_tokens + joining,
                             self.max_model_len - context - 1)
                if output < 3:
                    continue
                records = await self._send(sender, batch, context, output, None)
                gaps, held = steady_gaps(records, context)
                if len(gaps) < MIN_STEADY_GAPS:
                    self.log(f"decode {batch} x {context}: too few steady gaps, skipped")
                    continue
                median = statistics.median(gaps)
                quantiles = np.quantile(gaps, (np.arange(JITTER_QUANTILES) + 0.5)
                                        / JITTER_QUANTILES) / median
                points.append(DecodePoint(batch, held, median,
                                          tuple(round(float(q), 4) for q in quantiles)))
                step_s = points[-1].seconds
                self.log(f"decode {batch} x {context}: {points[-1].seconds * 1000:.2f} ms")
        return points


def transfer_points(second_gaps: Sequence[tuple[int, float]],
                    step_s: Callable[[int], float]) -> tuple[TransferPoint, ...]:
    """The gap to the second token less one decode step of a batch of one at that context."""
    return tuple(TransferPoint(n, max(gap - step_s(n), 0.0)) for n, gap in second_gaps)


def process_cpu_s(pid: int) -> float:
    """A process's CPU seconds so far, user and system (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(address: str, sweep: Sweep, vocab_size: int, max_model_len: int,
            log: Callable[[str], None] = lambda _: None, router_pid: int | None = None,
            decode_pid: int | None = None) -> Measured:
    """Blocking: the sweep against a running router (the pids: whose CPU is counted)."""
    def cpu_of(pid: int | None) -> Callable[[], float]:
        return (lambda: process_cpu_s(pid)) if pid else (lambda: 0.0)

    profiler = Profiler(address, sweep, vocab_size, max_model_len, log, cpu_of(router_pid),
                        cpu_of(decode_pid))
    return asyncio.run(profiler.run())
