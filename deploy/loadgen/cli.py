"""`kvferry bench`: arguments and the command (deploy/cli.py delegates here)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from deploy.client_errors import EXIT_UNREACHABLE, Unreachable
from deploy.default_model import bench_model
from deploy.launcher import Deployment
from deploy.loadgen.bench import BenchConfig, BenchmarkResult, run_benchmark
from deploy.loadgen.metrics import Slo
from deploy.loadgen.openai_client import BACKENDS
from deploy.loadgen.runner import SendOptions
from deploy.loadgen.targets import Target, parse_target
from deploy.loadgen.workload import (
    ConversationWorkload,
    JsonlWorkload,
    MultiTurnWorkload,
    RandomWorkload,
    SharedPrefixWorkload,
    ShareGptWorkload,
    TokenCounter,
    Workload,
)
from deploy.security_args import client_tls_args, public_client_credentials
from deploy.serve_args import placement_args
from kvferry import trace
from kvferry.settings import (
    COMPILE_MODES,
    DEFAULT_COMPILE_BATCH_SIZES,
    DEFAULT_COMPILE_MODE,
    DEFAULT_KV_POOL_SIZE,
    KVFERRY_HOME,
    LOAD_FORMATS,
)

DATASETS = ("random", "shared-prefix", "multi-turn", "jsonl", "sharegpt")
DEFAULT_ADDRESS = "127.0.0.1:50051"


def add_arguments(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("targets")
    t.add_argument("--backend", default=BACKENDS[0], choices=BACKENDS,
                   help="grpc: kvferry's router; openai-chat / openai-completions: any "
                        "OpenAI-compatible server (--base-url), streamed as vLLM's bench does")
    t.add_argument("--address", default=None,
                   help=f"router HOST:PORT (default {DEFAULT_ADDRESS}), or launch:disagg / "
                        "launch:colocated (with an OpenAI backend: its HTTP front)")
    t.add_argument("--base-url", default=None,
                   help="OpenAI backends: the server's API root, e.g. http://HOST:PORT/v1")
    t.add_argument("--served-model-name", default=None,
                   help="OpenAI backends: the model requests name (default: GET /v1/models)")
    t.add_argument("--api-key", default=None, metavar="KEY",
                   help="grpc: the router's API key, sent as `authorization: Bearer KEY` "
                        "(default: $KVFERRY_API_KEY; OpenAI backends send $OPENAI_API_KEY)")
    client_tls_args(t)
    t.add_argument("--extra-body", default=None, metavar="JSON",
                   help="OpenAI backends: a JSON object merged into every request's body, "
                        "e.g. '{\"return_token_ids\": true}'")
    t.add_argument("--compare", nargs="+", default=None, metavar="TARGET",
                   help="several targets, same workload and seed: [NAME=][BACKEND:]WHERE, "
                        "WHERE a HOST:PORT, an http(s):// base URL or launch:disagg|colocated;"
                        " BACKEND defaults to --backend")
    t.add_argument("--model", default="default",
                   help="launch: 'default' (the real default model, as serve), 'tiny' (the "
                        "seeded tiny model, for quick checks) or a checkpoint / .gguf file")
    t.add_argument("--load-format", default=LOAD_FORMATS[0], choices=LOAD_FORMATS,
                   help="launch: auto: the checkpoint's weights; dummy: seeded random weights "
                        "of its shapes (see `kvferry make-model --shape`)")
    t.add_argument("--num-prefill", type=int, default=1, help="launch: prefill workers")
    t.add_argument("--num-decode", type=int, default=1, help="launch: decode/colocated workers")
    t.add_argument("--kv-pool-size", default=DEFAULT_KV_POOL_SIZE, help="launch: per worker")
    placement_args(t, "launch: ", " (this client runs on the router's cores; the placement "
                                  "is in the JSON)")
    t.add_argument("--compile", default=DEFAULT_COMPILE_MODE, choices=COMPILE_MODES,
                   help="launch: workers compile their forwards (as `serve --compile`)")
    t.add_argument("--compile-batch-sizes", default=DEFAULT_COMPILE_BATCH_SIZES,
                   help="launch: --compile batch-size buckets")
    t.add_argument("--launch-log-dir", type=Path, default=None,
                   help="where launched deployments' processes log (default: a new folder "
                        "under KVFERRY_HOME/logs, named on the terminal)")

    w = p.add_argument_group("workload")
    w.add_argument("--dataset-name", default="random", choices=DATASETS,
                   help="where prompts come from: random token ids, or --dataset-path")
    w.add_argument("--dataset-path", type=Path, default=None, help="jsonl / sharegpt file")
    w.add_argument("--num-prompts", type=int, default=100,
                   help="requests per run; multi-turn: conversations per run")
    w.add_argument("--input-len", type=int, default=128,
                   help="random: prompt tokens; multi-turn: turn 1's prompt tokens")
    w.add_argument("--output-len", type=int, default=None,
                   help="tokens to generate (max_tokens, ignore_eos); default 32, "
                        "sharegpt: the reply's length")
    w.add_argument("--range-ratio", type=float, default=0.0,
                   help="random: lengths uniform in len x [1 - r, 1 + r]")
    w.add_argument("--prefix-len", type=int, default=None,
                   help="random: shared prefix tokens (default 0); shared-prefix: "
                        "tokens per prefix (default 256)")
    w.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix")
    w.add_argument("--suffix-len", type=int, default=32, help="shared-prefix")
    w.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per conversation")
    w.add_argument("--turn-len", type=int, default=32,
                   help="multi-turn: tokens of each later turn's new user message")
    w.add_argument("--think-time-s", type=float, default=0.0,
                   help="multi-turn: pause between an answer and the next turn")
    w.add_argument("--tokenizer", type=Path, default=None,
                   help="tokenizer.json or its directory: counts text prompt lengths; "
                        "OpenAI backends: decodes token prompts for chat, tokenizes answers")
    w.add_argument("--vocab-size", type=int, default=None,
                   help="default: GetModelInfo; OpenAI servers: the tokenizer's")

    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, nargs="+", default=[float("inf")],
                   help="requests/s (multi-turn: conversations/s); several values sweep "
                        "(inf: all at once)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape: 1 Poisson, <1 burstier, >1 more even")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in flight at most (default: no limit, open loop)")
    g.add_argument("--num-warmups", type=int, default=0,
                   help="requests sent and not measured before the run")
    g.add_argument("--seed", type=int, default=None,
                   help="seeds the prompts and the arrivals (default: 0)")
    g.add_argument("--temperature", type=float, default=0.0, help="every request's (0: greedy)")
    g.add_argument("--timeout-s", type=float, default=None, help="per request deadline")

    r = p.add_argument_group("results")
    r.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS",
                   help="SLOs, e.g. ttft:500 tpot:50 (names: ttft, tpot, e2el)")
    r.add_argument("--metric-percentiles", default="90,95,99", help="comma-separated")
    r.add_argument("--result-file", type=Path, default=None, help="write the JSON here")
    r.add_argument("--plot-dir", type=Path, default=None, help="write PNG plots here")
    r.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    r.add_argument("--reuse-prompts", action="store_true",
                   help="every rate sends the same prompts (default: fresh ones per rate, so "
                        "a later rate does not hit the prefix cache an earlier one filled)")
    r.add_argument("--trace", type=Path, default=None, metavar="DIR",
                   help="trace every token in this process and in launched deployments "
                        "(KVFERRY_TRACE_DIR) into DIR, then print where slow gaps went")


def _token_counter(path: Path | None) -> TokenCounter | None:
    if path is None:
        return None
    from tokenizers import Tokenizer

    file = path / "tokenizer.json" if path.is_dir() else path
    tokenizer = Tokenizer.from_file(str(file))
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


def make_workload(args: argparse.Namespace) -> Workload | ConversationWorkload:
    output_len = args.output_len or 32
    if args.dataset_name == "random":
        return RandomWorkload(args.input_len, output_len, args.range_ratio,
                              args.prefix_len or 0)
    if args.dataset_name == "shared-prefix":
        return SharedPrefixWorkload(args.num_prefixes, args.prefix_len or 256,
                                    args.suffix_len, output_len)
    if args.dataset_name == "multi-turn":
        return MultiTurnWorkload(args.num_turns, args.input_len, args.turn_len, output_len,
                                 args.think_time_s)
    if args.dataset_path is None:
        raise ValueError(f"--dataset-path is required for {args.dataset_name}")
    counter = _token_counter(args.tokenizer)
    if args.dataset_name == "jsonl":
        return JsonlWorkload(args.dataset_path, output_len, counter)
    return ShareGptWorkload(args.dataset_path, args.output_len, counter)


def make_config(args: argparse.Namespace) -> BenchConfig:
    percentiles = tuple(float(x) for x in args.metric_percentiles.split(",") if x.strip())
    return BenchConfig(
        num_requests=args.num_prompts, request_rates=tuple(args.request_rate),
        burstiness=args.burstiness, max_concurrency=args.max_concurrency,
        num_warmups=args.num_warmups, seed=args.seed, slo=Slo.parse(args.goodput),
        percentiles=percentiles,
        send=SendOptions(temperature=args.temperature, seed=args.seed,
                         timeout_s=args.timeout_s),
        vocab_size=args.vocab_size, show_progress=not args.disable_tqdm,
        tokenizer=args.tokenizer, served_model_name=args.served_model_name,
        extra_body=_extra_body(args.extra_body), reuse_prompts=args.reuse_prompts,
        credentials=public_client_credentials(args),
    )


def _extra_body(text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--extra-body: not JSON ({exc})") from exc
    if not isinstance(body, dict):
        raise ValueError(f"--extra-body: expected a JSON object, got {text!r}")
    return body


def make_targets(args: argparse.Namespace) -> list[Target]:
    """--compare's targets, or the one given by --address / --base-url and --backend."""
    if args.compare:
        if args.address or args.base_url:
            raise ValueError("--compare names every target: drop --address / --base-url")
        return [parse_target(text, args.backend) for text in args.compare]
    if args.backend == "grpc":
        if args.base_url:
            raise ValueError("--base-url needs --backend openai-chat|openai-completions")
        return [parse_target(args.address or DEFAULT_ADDRESS)]
    if args.base_url and args.address:
        raise ValueError("give --base-url or --address, not both")
    if args.base_url:
        return [Target(args.base_url, base_url=args.base_url, backend=args.backend)]
    if args.address:
        return [parse_target(args.address, args.backend)]
    raise ValueError(f"--backend {args.backend} needs --base-url (or --address launch:KIND)")


def _write_outputs(result: BenchmarkResult, args: argparse.Namespace) -> None:
    from deploy.loadgen.report import format_result, write_json

    print(format_result(result))
    # the results are always kept: in KVFERRY_HOME/bench/ unless --result-file says where
    result_file = args.result_file or KVFERRY_HOME / "bench" / time.strftime(
        "bench-%Y%m%d-%H%M%S.json")
    print(f"results: {write_json(result, result_file)}"
          + ("" if args.plot_dir is not None else " (--plot-dir DIR for plots)"),
          file=sys.stderr)
    if args.is_default_seed:
        print(f"bench: prompts from --seed {args.seed} (the default): a rerun sends the same "
              "prompts, which the server's prefix cache may still hold; --seed N for fresh "
              "ones", file=sys.stderr)
    if args.plot_dir is not None:
        from deploy.loadgen.plots import write_plots

        for path in write_plots(result, args.plot_dir):
            print(f"plot: {path}", file=sys.stderr)


def _print_attribution(folder: Path) -> None:
    """Per run (target and rate), where the slow token gaps went (--trace)."""
    from deploy.loadgen.attribution import attribute
    from deploy.loadgen.causes import format_table
    from deploy.loadgen.trace_load import TraceError, load

    try:
        traces = load(folder)
    except TraceError as exc:
        print(f"bench: --trace: {exc}", file=sys.stderr)
        return
    for phase in sorted({a.phase for a in traces.arrivals}):
        print(f"\nslow token gaps of {phase} (trace: {folder})")
        print(format_table(attribute(traces, phase=phase, tag=None)))


def load_format_argv(args: argparse.Namespace) -> list[str]:
    """A launched deployment's --load-format, for the router and every worker alike."""
    return [] if args.load_format == "auto" else ["--load-format", args.load_format]


EXIT_INTERRUPTED = 130  # as a shell reports a command ended by SIGINT


def run(args: argparse.Namespace) -> int:
    """Run `kvferry bench`; exit code 1 when any request failed, 2 on bad arguments."""
    args.is_default_seed = args.seed is None
    args.seed = 0 if args.seed is None else args.seed
    try:
        workload, config, targets = make_workload(args), make_config(args), make_targets(args)
    except ValueError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    launches = any(t.launch is not None for t in targets)
    is_openai = any(t.backend != "grpc" for t in targets)
    # the checkpoint, resolved (converted, verified) once and only where it is needed
    model = bench_model(args.model) if launches or is_openai else None
    if (is_openai and config.tokenizer is None and model is not None
            and (launches or all(t.backend != "grpc" for t in targets))):
        # as vLLM's bench: the tokenizer defaults to the model's (a launched one, or --model,
        # the default model included: what `kvferry serve` serves without --model); beside a
        # running gRPC target, that target's GetModelInfo gives the vocabulary instead
        config = dataclasses.replace(config, tokenizer=Path(model))
        print(f"bench: counting tokens with {args.model}'s tokenizer ({model}); --tokenizer "
              "for another", file=sys.stderr)
    log_dir = args.launch_log_dir
    if launches and log_dir is None:  # the servers' logs in a file, not on the terminal
        log_dir = KVFERRY_HOME / "logs" / time.strftime("bench-%Y%m%d-%H%M%S")
    if launches:
        print(f"bench: launched deployments log to {log_dir}", file=sys.stderr)
    launch = Deployment(model=model if launches else None,
                        num_prefill=args.num_prefill,
                        num_decode=args.num_decode, kv_pool_size=args.kv_pool_size,
                        torch_threads=args.torch_threads, log_dir=log_dir,
                        pin_cores=args.pin_cores == "auto", lend_cores=args.lend_cores == "auto",
                        compile=args.compile, compile_batch_sizes=args.compile_batch_sizes,
                        worker_args=load_format_argv(args),
                        router_args=["--enable-prompt-tokens-details",  # cache hit rates
                                     *load_format_argv(args)])
    if args.trace is not None:  # launched workers inherit the variable
        os.environ[trace.TRACE_ENV] = str(args.trace)
        trace.switch("client", args.trace)
    try:
        result = run_benchmark(targets, workload, config, launch)
    except ValueError as exc:  # a target's vocabulary, model or workload: said before sending
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    except Unreachable as exc:
        print(exc, file=sys.stderr)
        return EXIT_UNREACHABLE
    finally:
        if args.trace is not None:
            os.environ.pop(trace.TRACE_ENV, None)
            trace.switch("client", None)
    _write_outputs(result, args)
    if args.trace is not None:
        _print_attribution(args.trace)
    if result.runs and result.runs[-1].is_interrupted:
        last = result.runs[-1]
        print(f"bench: interrupted (Ctrl-C) during {last.target} @ {last.request_rate:g} "
              f"req/s: its figures count the {len(last.records)} requests that had finished",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    return 1 if any(run.metrics.failed for run in result.runs) else 0
