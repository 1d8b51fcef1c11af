"""Several fronts of one deployment measured under one load, in the same time window.

A run's requests take the fronts in turn (request i goes to front i mod n, from a rotated
order), at one Poisson arrival process: every front sees the same load, the same neighbours
and the same moments of a noisy machine, which front-after-front runs cannot give (on the
2-core build machine, one front's median TTFT varied 2x between consecutive 10 s runs). Each
record is tagged with its front, and each front's metrics come from its own records.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, replace
from typing import Any

from deploy import client
from deploy.loadgen import BenchConfig, RequestRecord, calculate_metrics
from deploy.loadgen.arrivals import arrival_offsets_s
from deploy.loadgen.bench import RunResult
from deploy.loadgen.openai_client import Codec, open_sender
from deploy.loadgen.runner import Clock, GrpcSender, Sender, SendOptions, run_requests
from deploy.loadgen.workload import BenchRequest
from kvferry.rpc import grpc_util


@dataclass(frozen=True)
class Front:
    """One way into the deployment: gRPC at `address`, or an OpenAI backend at `base_url`."""

    name: str
    address: str | None = None
    base_url: str | None = None
    backend: str = "grpc"
    extra_body: dict[str, Any] | None = None
    codec: Codec | None = None  # openai-chat: decodes token-id prompts


@dataclass(frozen=True)
class Interleaved:
    """A Sender that sends request `index` through front `order[index % len(order)]` and tags
    its record with that front's name."""

    senders: dict[str, Sender]
    order: tuple[str, ...]

    async def send(self, request: BenchRequest, request_id: str, index: int,
                   options: SendOptions, clock: Clock, origin_s: float,
                   answer: list[int] | None = None) -> RequestRecord:
        front = self.order[index % len(self.order)]
        record = await self.senders[front].send(request, request_id, index, options, clock,
                                                origin_s, answer)
        return replace(record, tag=front)


async def _open(stack: AsyncExitStack, front: Front) -> Sender:
    if front.backend == "grpc":
        chan = await stack.enter_async_context(grpc_util.channel(str(front.address)))
        return GrpcSender(client.public_stub(chan))
    return await stack.enter_async_context(
        open_sender(str(front.base_url), front.backend, codec=front.codec,
                    extra_body=front.extra_body))


async def run_interleaved(fronts: Sequence[Front], order: Sequence[str],
                          requests: Sequence[BenchRequest], rate: float,
                          config: BenchConfig) -> dict[str, RunResult]:
    """Warm every front up (config.num_warmups copies of the first request each), then send
    `requests` at `rate` across the fronts in `order`; one RunResult per front."""
    async with AsyncExitStack() as stack:
        senders = {f.name: await _open(stack, f) for f in fronts}
        for name, sender in senders.items():
            warm = await run_requests(sender, [requests[0]] * config.num_warmups,
                                      [0.0] * config.num_warmups, config.send,
                                      id_prefix=f"warmup-{name}")
            failed = [r for r in warm.records if not r.is_success]
            if failed:
                raise RuntimeError(f"{name}: warm-up request failed: {failed[0].status}: "
                                   f"{failed[0].error}")
        offsets = arrival_offsets_s(len(requests), rate, config.burstiness, config.seed)
        outcome = await run_requests(Interleaved(senders, tuple(order)), requests, offsets,
                                     config.send, config.max_concurrency,
                                     id_prefix="bench-interleaved")
    backends = {f.name: f.backend for f in fronts}
    results = {}
    for name in order:
        records = tuple(r for r in outcome.records if r.tag == name)
        metrics = calculate_metrics(records, outcome.duration_s, config.slo, config.percentiles)
        results[name] = RunResult(name, rate, metrics, records, backends[name])
    return results


def run(fronts: Sequence[Front], order: Sequence[str], requests: Sequence[BenchRequest],
        rate: float, config: BenchConfig) -> dict[str, RunResult]:
    """run_interleaved, blocking."""
    return asyncio.run(run_interleaved(fronts, order, requests, rate, config))
