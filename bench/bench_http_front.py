"""The router's OpenAI HTTP front against its gRPC front, on one deployment.

One deployment (router with `--http-port`, 1 prefill + 1 decode worker, prefix caching off so
that every front computes every prompt) serves the same workload through each front: each
repetition sends `--num-prompts` random prompts of `--input-len` token ids, each generating
exactly `--output-len` tokens (greedy, ignore_eos), at `--request-rate` requests/s (Poisson,
seeded), through each of `--fronts`, with `kvferry bench`'s backends:

  grpc      the gRPC front (Generate);
  http      the HTTP front as any OpenAI client calls it (`--backend`: openai-completions by
            default, the same token ids as gRPC; openai-chat decodes them with the model's
            tokenizer). Every token step is a chunk, as over gRPC: a token whose text is held
            back (an incomplete UTF-8 character) comes with empty text;
  http-ids  the same with `return_token_ids: true`: each chunk also carries its token ids.

By default the fronts are interleaved (bench/front_interleave.py): one run per repetition
sends `--num-prompts` requests per front at `--request-rate` in all, request i through the
i-th front in turn (the order rotating each repetition), so every front is measured under the
same load in the same time window. `--sequential` runs the fronts one after another instead,
each with the same prompts and arrival times (the order rotating each repetition).

Reported per front: TTFT and ITL at p50 and p99, median [min-max] over repetitions; and each
HTTP front's figures over the gRPC front's, taken within each repetition (1.05 = 5% added).
Target: under 1.10 at p50, TTFT and ITL. Also reported, outside the target: p50 TPOT (which
does not depend on how tokens are grouped into chunks) and the content chunks per request
(ITLs + 1). Usage:

    .venv/bin/python bench/bench_http_front.py [--model tiny|default|PATH] [--repeats 5]
        [--num-prompts 40] [--request-rate 4] [--input-len 128] [--output-len 64]
        [--fronts grpc,http,http-ids] [--backend openai-completions|openai-chat]
        [--sequential] [--out bench/results/bench_http_front.json]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import shlex
import signal
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script too
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "kernels"))
from bench import front_interleave  # noqa: E402
from bench.bench_prefix_cache import Spread, spread  # noqa: E402
from deploy import client  # noqa: E402
from deploy.default_model import BENCH_MODEL_HELP, bench_model  # noqa: E402
from deploy.launcher import Deployment  # noqa: E402
from deploy.loadgen import (  # noqa: E402
    BenchConfig,
    RandomWorkload,
    RunResult,
    Target,
    run_benchmark,
)
from deploy.loadgen.openai_client import OPENAI_BACKENDS, Codec  # noqa: E402
from kvferry.rpc import grpc_util  # noqa: E402
from kvferry.settings import DEPLOYMENT_TORCH_THREADS  # noqa: E402

FRONTS = ("grpc", "http", "http-ids")
EXTRA_BODY = {"http": {}, "http-ids": {"return_token_ids": True}}  # what the HTTP fronts add
FIGURES = ("p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms", "p50_tpot_ms",
           "chunks_per_request")
TARGET_RATIO = 1.10  # the HTTP front's p50 TTFT and ITL over gRPC's, at most
TARGET_FIGURES = ("p50_ttft_ms", "p50_itl_ms")


class Figures(NamedTuple):
    """One front's run of one repetition."""

    p50_ttft_ms: float
    p99_ttft_ms: float
    p50_itl_ms: float
    p99_itl_ms: float
    p50_tpot_ms: float
    chunks_per_request: float  # content chunks (ITLs + 1): both fronts should stream alike
    completed: int
    failed: int
    output_tokens: int


def figures(run: RunResult) -> Figures:
    m = run.metrics
    done = [r for r in run.records if r.is_success]
    chunks = sum(len(r.itls_s) + 1 for r in done) / len(done) if done else 0.0
    return Figures(m.ttft.median_ms, m.ttft.percentile_ms(99), m.itl.median_ms,
                   m.itl.percentile_ms(99), m.tpot.median_ms, chunks, m.completed, m.failed,
                   m.total_output)


def ratios(repetitions: Sequence[dict[str, Figures]], front: str) -> dict[str, list[float]]:
    """`front` over gRPC, figure by figure, within each repetition."""
    return {name: [getattr(rep[front], name) / getattr(rep["grpc"], name)
                   for rep in repetitions] for name in FIGURES}


def _fronts(repetitions: Sequence[dict[str, Figures]]) -> list[str]:
    return [front for front in FRONTS if front in repetitions[0]]


def summarize(repetitions: Sequence[dict[str, Figures]]) -> dict[str, Any]:
    """Per front and figure: median, min, max; per HTTP front, its ratios to gRPC (with the
    values) and the verdict on the target."""
    out: dict[str, Any] = {"fronts": {}, "ratios": {}, "target": {}}
    for front in _fronts(repetitions):
        out["fronts"][front] = {name: spread([getattr(rep[front], name)
                                              for rep in repetitions])._asdict()
                                for name in FIGURES}
        if front == "grpc":
            continue
        out["ratios"][front] = {name: {**spread(values)._asdict(), "values": values}
                                for name, values in ratios(repetitions, front).items()}
        verdicts = {name: out["ratios"][front][name]["median"] < TARGET_RATIO
                    for name in TARGET_FIGURES}
        out["target"][front] = {"ratio_below": TARGET_RATIO, "figures": verdicts,
                                "is_met": all(verdicts.values())}
    return out


def format_report(repetitions: Sequence[dict[str, Figures]]) -> str:
    summary = summarize(repetitions)
    fronts = _fronts(repetitions)
    http = [front for front in fronts if front != "grpc"]
    lines = ["| figure | " + " | ".join(fronts) + " | "
             + " | ".join(f"{front} / grpc" for front in http) + " |",
             "|---" + "|---:" * (len(fronts) + len(http)) + "|"]
    for name in FIGURES:
        cells = [Spread(**summary["fronts"][front][name]).text() for front in fronts]
        for front in http:
            r = summary["ratios"][front][name]
            cells.append(Spread(r["median"], r["low"], r["high"]).text(3))
        label = name.replace("_ms", " (ms)").replace("_", " ")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for front in http:
        verdict = "met" if summary["target"][front]["is_met"] else "NOT met"
        lines.append(f"target ({front} / grpc < {TARGET_RATIO} at p50, TTFT and ITL): "
                     f"{verdict}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help=BENCH_MODEL_HELP)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--num-prompts", type=int, default=40, help="requests per front and run")
    p.add_argument("--request-rate", type=float, default=4.0, help="requests/s (Poisson)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-warmups", type=int, default=4, help="per front and run")
    p.add_argument("--fronts", default=",".join(FRONTS),
                   help=f"comma-separated, grpc first, from {', '.join(FRONTS)}")
    p.add_argument("--backend", default=OPENAI_BACKENDS[1], choices=OPENAI_BACKENDS,
                   help="how the HTTP fronts are driven")
    p.add_argument("--sequential", action="store_true",
                   help="one front after another, not interleaved in one run")
    p.add_argument("--torch-threads", type=int, default=DEPLOYMENT_TORCH_THREADS)
    p.add_argument("--seed", type=int, default=0, help="repetition r uses seed + r")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here")
    p.add_argument("--log-dir", type=Path, default=None)
    args = p.parse_args(argv)
    if args.repeats < 1 or args.num_prompts < 1:
        p.error("--repeats and --num-prompts must be >= 1")
    args.fronts = args.fronts.split(",")
    if args.fronts[0] != "grpc" or len(args.fronts) < 2 or any(
            f not in FRONTS for f in args.fronts) or len(set(args.fronts)) != len(args.fronts):
        p.error(f"--fronts: grpc, then one or more of {', '.join(FRONTS[1:])}")
    return args


async def _vocab_size(address: str) -> int:
    async with grpc_util.channel(address) as chan:
        return int((await client.model_info(chan)).vocab_size)


def run_repetition(deployment: Deployment, args: argparse.Namespace, model: str,
                   repetition: int, vocab: int) -> dict[str, Figures]:
    """Every front, in this repetition's order, on the same requests and arrival times."""
    workload = RandomWorkload(input_len=args.input_len, output_len=args.output_len)
    config = BenchConfig(num_requests=args.num_prompts, request_rates=(args.request_rate,),
                         num_warmups=args.num_warmups, seed=args.seed + repetition,
                         percentiles=(50.0, 99.0), vocab_size=vocab,
                         tokenizer=Path(model) if args.backend == "openai-chat" else None)
    base_url = f"http://{deployment.http_address}/v1"
    shift = repetition % len(args.fronts)
    order = args.fronts[shift:] + args.fronts[:shift]
    if not args.sequential:
        return _interleaved(deployment, args, config, workload, order, base_url, vocab)
    out = {}
    for front in order:
        if front == "grpc":
            target = Target(front, address=deployment.router_address)
        else:
            target = Target(front, base_url=base_url, backend=args.backend)
            config = replace(config, extra_body=EXTRA_BODY[front])
        (run,) = run_benchmark([target], workload, config).runs
        out[front] = _report(repetition, front, figures(run))
    return out


def _interleaved(deployment: Deployment, args: argparse.Namespace, config: BenchConfig,
                 workload: RandomWorkload, order: list[str], base_url: str, vocab: int
                 ) -> dict[str, Figures]:
    codec = Codec.load(config.tokenizer) if config.tokenizer is not None else None
    fronts = [front_interleave.Front("grpc", address=deployment.router_address)] + [
        front_interleave.Front(name, base_url=base_url, backend=args.backend,
                               extra_body=EXTRA_BODY[name], codec=codec)
        for name in args.fronts[1:]]
    requests = workload.build(args.num_prompts * len(order), vocab, config.seed)
    runs = front_interleave.run(fronts, order, requests, args.request_rate, config)
    return {front: _report(config.seed - args.seed, front, figures(runs[front]))
            for front in order}


def _report(repetition: int, front: str, f: Figures) -> Figures:
    print(f"  repetition {repetition + 1} {front}: TTFT p50 {f.p50_ttft_ms:.2f} p99 "
          f"{f.p99_ttft_ms:.2f}, ITL p50 {f.p50_itl_ms:.2f} p99 {f.p99_itl_ms:.2f}, TPOT "
          f"p50 {f.p50_tpot_ms:.2f} ms; {f.completed} done, {f.failed} failed, "
          f"{f.chunks_per_request:.1f} chunks/req", flush=True)
    return f


def run_all(args: argparse.Namespace, model: str, log_dir: Path) -> list[dict[str, Figures]]:
    deployment = Deployment(model=model, num_prefill=1, num_decode=1, http_port=0,
                            torch_threads=args.torch_threads, log_dir=log_dir,
                            worker_args=["--no-prefix-caching"])
    with deployment:
        vocab = asyncio.run(_vocab_size(deployment.router_address))
        return [run_repetition(deployment, args, model, r, vocab) for r in range(args.repeats)]


def payload(args: argparse.Namespace, model: str, argv: Sequence[str],
            repetitions: list[dict[str, Figures]]) -> dict[str, Any]:
    skipped = {"out", "log_dir"}
    return {"date": datetime.date.today().isoformat(),
            "command": shlex.join([".venv/bin/python", "bench/bench_http_front.py", *argv]),
            "checkpoint": Path(model).name, "machine": platform.platform(),
            "args": {k: v for k, v in vars(args).items() if k not in skipped},
            "deployment": "router (--http-port 0) + 1 prefill + 1 decode, --no-prefix-caching",
            "summary": summarize(repetitions),
            "repetitions": [{front: figures._asdict() for front, figures in rep.items()}
                            for rep in repetitions]}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    model = bench_model(args.model)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench_http_front-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"model {args.model} ({Path(model).name}); HTTP front via {args.backend}; "
          f"logs {log_dir}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: the deployment stops
    try:
        repetitions = run_all(args, model, log_dir)
    except (RuntimeError, ValueError) as exc:
        print(f"bench_http_front: {exc} (logs: {log_dir})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench_http_front: interrupted; deployment stopped", file=sys.stderr)
        return 130
    print(format_report(repetitions))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload(args, model, argv, repetitions), indent=1) + "\n")
        print(f"results: {args.out}")
    failed = sum(f.failed for rep in repetitions for f in rep.values())
    if failed:
        print(f"bench_http_front: {failed} requests failed (see {log_dir})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
