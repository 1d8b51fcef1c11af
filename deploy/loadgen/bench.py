"""The benchmark as a Python API: targets x request rates, one seeded workload for all.

    from deploy.loadgen import BenchConfig, RandomWorkload, run_benchmark
    result = run_benchmark(["disagg=launch:disagg", "colocated=launch:colocated"],
                           RandomWorkload(input_len=512, output_len=64),
                           BenchConfig(num_requests=50, request_rates=(1.0, 2.0, 4.0)))

Every target gets the same requests (same seed and vocabulary) at the same arrival times for
each rate, whatever its backend: kvferry's gRPC front, or any OpenAI-compatible HTTP server
(kvferry's HTTP front, vLLM, ...), timed with the same definitions, so their runs share one
table and one plot. Targets run one after another; a launched one is stopped before the next
starts.
A conversation workload (MultiTurnWorkload) is sent the same way, with conversations in place
of requests: num_requests and the rates count conversations, the records every turn.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deploy import client
from deploy.launcher import Deployment
from deploy.loadgen.arrivals import arrival_offsets_s
from deploy.loadgen.metrics import BenchmarkMetrics, RequestRecord, Slo, calculate_metrics
from deploy.loadgen.openai_client import Codec, check_workload, open_sender
from deploy.loadgen.runner import (
    GrpcSender,
    OnDone,
    RunOutcome,
    Sender,
    SendOptions,
    run_conversations,
    run_requests,
)
from deploy.loadgen.targets import Endpoint, Target, open_target, parse_target
from deploy.loadgen.workload import BenchRequest, Conversation, ConversationWorkload, Workload
from kvferry.rpc import security
from kvferry.rpc.security import PLAINTEXT, Credentials

if TYPE_CHECKING:
    from tqdm import tqdm


@dataclass(frozen=True)
class BenchConfig:
    """Load shape and reporting; the same for every target."""

    num_requests: int = 100  # conversations, for a conversation workload
    request_rates: tuple[float, ...] = (math.inf,)
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 0  # copies of the first request sent before each target's runs
    seed: int = 0
    slo: Slo = field(default_factory=Slo)
    percentiles: tuple[float, ...] = (90.0, 95.0, 99.0)
    send: SendOptions = field(default_factory=SendOptions)
    vocab_size: int | None = None  # None: ask the target (GetModelInfo; _target_vocab)
    show_progress: bool = False
    tokenizer: Path | None = None  # OpenAI backends: decodes chat prompts, counts answers
    served_model_name: str | None = None  # OpenAI `model`; None: the first of GET /models
    extra_body: dict[str, Any] = field(default_factory=dict)  # OpenAI: more body fields
    reuse_prompts: bool = False  # every rate sends the same prompts (default: fresh per rate,
    # seeded seed + rate index, so a later rate does not hit what an earlier one cached)
    credentials: Credentials = PLAINTEXT  # gRPC targets: TLS and the router's API key

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not self.request_rates:
            raise ValueError("request_rates: give at least one rate")


@dataclass(frozen=True)
class RunResult:
    """One target at one request rate."""

    target: str
    request_rate: float
    metrics: BenchmarkMetrics
    records: tuple[RequestRecord, ...]
    backend: str = "grpc"
    model: str = ""  # what the target serves: GetModelInfo's name, the OpenAI `model`
    placement: dict[str, str] = field(default_factory=dict)  # Endpoint.placement
    is_interrupted: bool = False  # cut short (Ctrl-C): figures of the requests that finished


@dataclass(frozen=True)
class BenchmarkResult:
    config: BenchConfig
    workload: str  # the workload's repr: what was sent
    runs: tuple[RunResult, ...]
    workload_params: dict[str, Any] = field(default_factory=dict)  # its fields, structured

    @property
    def models(self) -> list[str]:
        return list(dict.fromkeys(run.model for run in self.runs if run.model))


async def _model_info(address: str, creds: Credentials = PLAINTEXT) -> tuple[int, str]:
    """The gRPC front's vocabulary and model name: its first call, so an unreachable one (or
    one that wants a key) is said here, in one line (Unreachable)."""
    import grpc

    from deploy.client_errors import Unreachable, rpc_error_line

    async with security.channel(address, creds) as chan:
        try:
            info = await client.model_info(chan)
        except grpc.aio.AioRpcError as exc:
            raise Unreachable(rpc_error_line("bench", exc, address,
                                             creds.ca is not None)) from None
    if info.vocab_size < 1:
        raise ValueError(f"{address}: GetModelInfo reports vocab_size {info.vocab_size}")
    return info.vocab_size, info.model_name or info.architecture


def _progress(total: int, label: str, enabled: bool) -> tqdm | None:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=label, unit="req", leave=False)


async def _warm_up(stub: Sender, request: BenchRequest,
                   config: BenchConfig, name: str) -> None:
    outcome = await run_requests(stub, [request] * config.num_warmups,
                                 [0.0] * config.num_warmups, config.send,
                                 config.max_concurrency, id_prefix=f"warmup-{name}")
    failed = [r for r in outcome.records if not r.is_success]
    if failed:
        raise RuntimeError(f"{name}: warm-up request failed: {failed[0].status}: "
                           f"{failed[0].error}")


def _first_request(item: BenchRequest | Conversation) -> BenchRequest:
    if isinstance(item, BenchRequest):
        return item
    return BenchRequest(item.messages[0], item.output_len, len(item.messages[0]))


async def _run_rate(stub: Sender, items: Sequence[BenchRequest] | Sequence[Conversation],
                    offsets: Sequence[float], config: BenchConfig, on_done: OnDone | None,
                    id_prefix: str) -> RunOutcome:
    if items and isinstance(items[0], Conversation):
        return await run_conversations(stub, items, offsets, config.send,
                                       config.max_concurrency, on_done=on_done,
                                       id_prefix=id_prefix)
    return await run_requests(stub, items, offsets, config.send, config.max_concurrency,
                              on_done=on_done, id_prefix=id_prefix)


@asynccontextmanager
async def _open_sender(target: Target, endpoint: Endpoint, config: BenchConfig,
                       codec: Codec | None) -> AsyncIterator[Sender]:
    if target.backend == "grpc":
        async with security.channel(str(endpoint.grpc_address), config.credentials) as chan:
            yield GrpcSender(client.public_stub(chan))
        return
    async with open_sender(str(endpoint.base_url), target.backend, config.served_model_name,
                           codec, config.extra_body) as sender:
        yield sender


Items = Sequence[BenchRequest] | Sequence[Conversation]


async def run_target(name: str, address: str,
                     requests: Sequence[BenchRequest] | Sequence[Conversation],
                     config: BenchConfig) -> list[RunResult]:
    """Every configured rate against one running kvferry router, over gRPC (run_endpoint)."""
    return await run_endpoint(Target(name, address=address), Endpoint(address, None), requests,
                              config)


async def run_endpoint(target: Target, endpoint: Endpoint,
                       requests: Sequence[BenchRequest] | Sequence[Conversation],
                       config: BenchConfig, codec: Codec | None = None,
                       per_rate: Sequence[Items] | None = None,
                       model: str = "") -> list[RunResult]:
    """Every configured rate against one running server, over one gRPC channel or one HTTP
    client as target.backend says. `requests` may be conversations (each starting at its
    arrival time, its turns one after another); `per_rate`: the requests of each rate
    instead (fresh prompts per rate); `model`: the served model, for the results."""
    check_workload(target.backend, requests, codec)
    name, results = target.name, []
    total = sum(r.num_turns if isinstance(r, Conversation) else 1 for r in requests)
    async with _open_sender(target, endpoint, config, codec) as sender:
        model = model or getattr(sender, "model", "")
        if config.num_warmups:
            await _warm_up(sender, _first_request(requests[0]), config, name)
        for index, rate in enumerate(config.request_rates):
            requests = per_rate[index] if per_rate is not None else requests
            offsets = arrival_offsets_s(len(requests), rate, config.burstiness, config.seed)
            bar = _progress(total, f"{name} @ {rate:g} req/s", config.show_progress)
            on_done = None if bar is None else (lambda _, b=bar: b.update(1))
            try:
                outcome = await _run_rate(sender, requests, offsets, config, on_done,
                                          f"bench-{name}-{rate:g}")
            finally:
                if bar is not None:
                    bar.close()
            metrics = calculate_metrics(outcome.records, outcome.duration_s, config.slo,
                                        config.percentiles)
            results.append(RunResult(name, rate, metrics, outcome.records, target.backend,
                                     model, endpoint.placement or {}, outcome.is_interrupted))
            if outcome.is_interrupted:  # Ctrl-C: no further rate
                break
    return results


def _target_vocab(target: Target, endpoint: Endpoint, config: BenchConfig,
                  codec: Codec | None, built: Sequence[int]) -> tuple[int, str]:
    """The vocabulary random prompts are drawn from: the configured one, else the gRPC
    front's GetModelInfo, else (an OpenAI server, which does not say) the tokenizer's, else
    the one of the targets before it; and the model's name where the gRPC front says it."""
    if endpoint.grpc_address is not None:
        vocab, model = asyncio.run(_model_info(endpoint.grpc_address, config.credentials))
        return config.vocab_size or vocab, model
    if config.vocab_size:
        return config.vocab_size, ""
    if codec is not None:
        return codec.vocab_size, ""
    if len(built) == 1:
        return built[0], ""
    raise ValueError(f"{target.name}: an OpenAI server does not report its vocabulary: give "
                     "--vocab-size or --tokenizer, or compare it after a gRPC target")


def run_benchmark(targets: Sequence[Target | str], workload: Workload | ConversationWorkload,
                  config: BenchConfig | None = None,
                  launch: Deployment | None = None) -> BenchmarkResult:
    """Run the workload against every target at every rate; blocking (starts its own loop).

    Targets are Target objects or strings such as "HOST:PORT", "disagg=launch:disagg",
    "vllm=openai-completions:http://HOST:PORT/v1"; `launch` is the (not started) template of
    `launch:` targets."""
    config = config or BenchConfig()
    parsed = [t if isinstance(t, Target) else parse_target(t) for t in targets]
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise ValueError(f"targets: names must differ, got {names}")
    codec = Codec.load(config.tokenizer) if config.tokenizer is not None else None
    for target in parsed:  # before anything is launched: a sample of the requests
        check_workload(target.backend, workload.build(1, config.vocab_size or 2, config.seed),
                       codec)
    built: dict[int, list[Items]] = {}  # per vocabulary, the requests of each rate
    runs: list[RunResult] = []
    seeds = [config.seed + (0 if config.reuse_prompts else i)
             for i in range(len(config.request_rates))]
    for target in parsed:
        with open_target(target, launch) as endpoint:
            vocab, model = _target_vocab(target, endpoint, config, codec, list(built))
            if built and vocab not in built:
                raise ValueError(f"{target.name} serves a vocabulary of {vocab}, the targets "
                                 f"before it {sorted(built)}: the workloads would differ")
            if vocab not in built:
                built[vocab] = [workload.build(config.num_requests, vocab, seed)
                                for seed in seeds]
            runs += asyncio.run(run_endpoint(target, endpoint, built[vocab][0], config, codec,
                                             built[vocab], model))
        if runs and runs[-1].is_interrupted:  # Ctrl-C: no further target
            break
    params = dataclasses.asdict(workload) if dataclasses.is_dataclass(workload) else {}
    return BenchmarkResult(config, repr(workload), tuple(runs),
                           {"kind": type(workload).__name__, **params})
