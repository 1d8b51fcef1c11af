"""Prefix caching, in one run: the cache on against off on a
shared-prefix workload, and prefix-aware against headroom routing on multi-turn chats.

Every deployment is a router and 2 prefill + 2 decode workers of `--model` (the tiny seeded
model unless told; `--model default` is the real default model), started afresh for each run
so that no cache carries over, warmed up with requests that share no token run with the
workload, then sent one seeded workload through `kvferry bench`'s engine (Poisson arrivals):
  shared-prefix: --num-prefixes prefixes of --prefix-len tokens, each request one of them and
                 a --suffix-len suffix; `cache-on` (headroom routing) against `cache-off`
                 (the same, workers with --no-prefix-caching). Target: median TTFT >= 3x
                 lower with the cache.
  multi-turn:    --conversations chats of --num-turns turns (turn 1: --input-len tokens;
                 each later turn adds the answer and --turn-len new tokens); the cache on,
                 the router's `--policy` the first of --policies against the second
                 (default prefix,headroom). Targets: K/V bytes shipped per request >= 5x
                 lower and TTFT p50 lower with the first. Why 16 turns: turn 1 ships all
                 its K/V whatever the routing, so a policy that keeps every later turn on
                 its history ships turn 1's 512 tokens / 16 a turn; at 8 turns that floor
                 is 64 tokens a turn, and a baseline that keeps three quarters of its
                 histories by accident (below) ships only 2.6x that.
                 Why --kv-pool-size 64MiB: each worker's cache then holds what the 16
                 conversations end with (16 x ~1,500 tokens x 4 KiB = 94 MiB) only across
                 both decode workers, not in one: the regime prefix-aware routing exists
                 for (a cluster's cache is the sum of its workers' only when conversations
                 are partitioned among them; a policy that sends a chat everywhere keeps it
                 everywhere and evicts). The workers' default, 256 MiB, holds 64k tokens of
                 the tiny model, 4x the real default model's 5.7k at 46 KiB a token.
                 Both policies run with the router's --local-prefill-threshold (default
                 128): a turn whose uncached suffix on its decode worker is shorter
                 prefills there and ships nothing, which is what keeping a conversation's
                 history on one decode worker buys in disaggregated serving. 16
                 conversations start at 4/s and each user thinks --think-time-s (2 s)
                 before the next turn. Headroom routing breaks ties (idle workers) on the
                 first address and sends a finished turn's successor back to the worker it
                 just freed, so it keeps most histories together by accident; the table's
                 "not shipped" column shows how much.
A fifth run, BASELINE-no-cache, is the multi-turn workload on workers without a prefix cache
(kvferry before it had one), for the same ratios against the candidate. A policy this tree's
router does not know is skipped, with a note; `--runs` picks some of the runs. Each run is
repeated --repeats times (interleaved); reported: median [min-max] of each figure and of the
ratios taken within each repetition.
SIGTERM unwinds like Ctrl-C:
deployments always stop. `--quick` shrinks everything (one repetition) for tests. Usage:

    .venv/bin/python bench/bench_prefix_cache.py [--model tiny|default|PATH] [--repeats 3]
        [--policies prefix,headroom] [--runs NAMES] [--out FILE] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import signal
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script too
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "kernels"))
from deploy import client  # noqa: E402
from deploy.default_model import BENCH_MODEL_HELP, bench_model  # noqa: E402
from deploy.launcher import Deployment  # noqa: E402
from deploy.loadgen import (  # noqa: E402
    BenchConfig,
    MultiTurnWorkload,
    RandomWorkload,
    SharedPrefixWorkload,
    calculate_metrics,
)
from deploy.loadgen.bench import run_target  # noqa: E402
from deploy.loadgen.runner import run_requests  # noqa: E402
from kvferry.rpc import grpc_util  # noqa: E402
from kvferry.settings import POLICIES  # noqa: E402

# Flag defaults: the full benchmark, and --quick (a smoke run for tests).
FULL = dict(repeats=3, kv_pool_size="64MiB", num_prefixes=4, prefix_len=1000, suffix_len=32,
            sp_output_len=16, sp_requests=48, sp_rate=2.0, conversations=16, num_turns=16,
            input_len=512, turn_len=32, mt_output_len=32, mt_rate=4.0, think_time_s=2.0)
QUICK = dict(repeats=1, kv_pool_size=None, num_prefixes=2, prefix_len=128, suffix_len=16,
             sp_output_len=4, sp_requests=6, sp_rate=20.0, conversations=2, num_turns=2,
             input_len=64, turn_len=16, mt_output_len=4, mt_rate=20.0, think_time_s=0.0)
NUM_WARMUPS = 4


class Setup(NamedTuple):
    """One deployment and the workload it is sent."""

    name: str
    workload: str  # "shared-prefix" or "multi-turn"
    worker_args: tuple[str, ...]
    router_args: tuple[str, ...]


class Figures(NamedTuple):
    """One run's figures (TTFT in ms, K/V in bytes per completed request)."""

    ttft_p50_ms: float
    ttft_p99_ms: float
    hit_rate: float
    kv_bytes_shipped: float
    kv_bytes_not_shipped: float
    num_completed: int
    num_failed: int


class Spread(NamedTuple):
    median: float
    low: float
    high: float

    def text(self, digits: int = 2) -> str:
        return f"{self.median:.{digits}f} [{self.low:.{digits}f}-{self.high:.{digits}f}]"


def spread(values: Sequence[float]) -> Spread:
    if not values:
        raise ValueError("spread: no values")
    return Spread(statistics.median(values), min(values), max(values))


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator; inf when only the denominator is 0, nan when both are."""
    if denominator == 0:
        return math.nan if numerator == 0 else math.inf
    return numerator / denominator


def setups(policies: Sequence[str], local_prefill_threshold: int = 0) -> list[Setup]:
    headroom = ("--policy", "headroom")
    out = [Setup("cache-on", "shared-prefix", (), headroom),
           Setup("cache-off", "shared-prefix", ("--no-prefix-caching",), headroom)]
    # The policy's name stays last (run_all checks it).
    local = ("--local-prefill-threshold", str(local_prefill_threshold))
    out += [Setup(f"{p}-routing", "multi-turn", (), (*local, "--policy", p)) for p in policies]
    # The baseline policy with no cache at all: kvferry before prefix caching.
    out.append(Setup(f"{policies[1]}-no-cache", "multi-turn", ("--no-prefix-caching",),
                     (*local, "--policy", policies[1])))
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help=BENCH_MODEL_HELP)
    p.add_argument("--quick", action="store_true", help="small everything, for tests")
    p.add_argument("--repeats", type=int, help="repetitions of the runs (default 3)")
    p.add_argument("--policies", default="prefix,headroom",
                   help="multi-turn: CANDIDATE,BASELINE router policies")
    p.add_argument("--runs", default=None,
                   help="a comma-separated subset of cache-on, cache-off, CANDIDATE-routing, "
                        "BASELINE-routing, BASELINE-no-cache (default: all five)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-threads", type=int, default=1, help="per worker")
    for name in ("num_prefixes", "prefix_len", "suffix_len", "sp_output_len", "sp_requests",
                 "conversations", "num_turns", "input_len", "turn_len", "mt_output_len"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"default {FULL[name]}")
    p.add_argument("--sp-rate", type=float, help="shared-prefix requests/s (default 2)")
    p.add_argument("--mt-rate", type=float, help="multi-turn conversations/s (default 4)")
    p.add_argument("--think-time-s", type=float, default=None,
                   help="multi-turn: pause between an answer and the next turn (default "
                        f"{FULL['think_time_s']:g} s; --quick: 0)")
    p.add_argument("--prefix-weight", type=float, default=None,
                   help="the prefix policy's --prefix-weight in every run (default: the "
                        "router's)")
    p.add_argument("--local-prefill-threshold", type=int, default=128,
                   help="multi-turn, both policies: the router's conditional disaggregation "
                        "(a turn whose uncached suffix on the chosen decode worker is shorter "
                        "prefills there, with no transfer); 0: always a prefill worker")
    p.add_argument("--kv-pool-size", default=None,
                   help="every worker's --kv-pool-size (default 64MiB; --quick: the "
                        "workers' own): how much K/V each worker's cache holds, so whether "
                        "a workload's histories fit once per worker or only over all")
    p.add_argument("--log-dir", type=Path, default=None, help="default: a new temporary one")
    p.add_argument("--out", type=Path, default=None, help="write every run as JSON here")
    args = p.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    names = [x.strip() for x in args.policies.split(",")]
    if len(names) != 2 or len(set(names)) != 2 or not all(names):
        p.error(f"--policies: expected CANDIDATE,BASELINE, got {args.policies!r}")
    args.policies = names
    args.router_args = ([] if args.prefix_weight is None
                        else ["--prefix-weight", str(args.prefix_weight)])
    args.worker_args = ([] if args.kv_pool_size is None
                        else ["--kv-pool-size", str(args.kv_pool_size)])
    known = [setup.name for setup in setups(names)]
    args.runs = known if args.runs is None else [x.strip() for x in args.runs.split(",")]
    if not args.runs or any(name not in known for name in args.runs):
        p.error(f"--runs: expected names among {', '.join(known)}, got {','.join(args.runs)}")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def workloads(args: argparse.Namespace) -> dict[str, tuple[Any, BenchConfig]]:
    """Workload name -> (recipe, load): the same for every deployment."""
    shared = SharedPrefixWorkload(args.num_prefixes, args.prefix_len, args.suffix_len,
                                  args.sp_output_len)
    chats = MultiTurnWorkload(args.num_turns, args.input_len, args.turn_len,
                              args.mt_output_len, args.think_time_s)
    load = dict(seed=args.seed, percentiles=(50.0, 99.0))
    return {"shared-prefix": (shared, BenchConfig(num_requests=args.sp_requests,
                                                  request_rates=(args.sp_rate,), **load)),
            "multi-turn": (chats, BenchConfig(num_requests=args.conversations,
                                              request_rates=(args.mt_rate,), **load))}


async def _vocab_and_warm_up(address: str, seed: int) -> int:
    """The served vocabulary; NUM_WARMUPS short random requests, at once, sharing no run of
    tokens with the workload (another seed), so no cache is seeded."""
    async with grpc_util.channel(address) as chan:
        vocab = (await client.model_info(chan)).vocab_size
        warmups = RandomWorkload(input_len=48, output_len=4).build(NUM_WARMUPS, vocab,
                                                                   seed + 10_000)
        outcome = await run_requests(client.public_stub(chan), warmups, [0.0] * NUM_WARMUPS,
                                     id_prefix="warmup")
    failed = [r for r in outcome.records if not r.is_success]
    if failed:
        raise RuntimeError(f"warm-up failed: {failed[0].status}: {failed[0].error}")
    return vocab


def run_once(setup: Setup, model: str, args: argparse.Namespace, log_dir: Path) -> Figures:
    """One fresh deployment, warmed up, sent its workload; stopped however this ends."""
    workload, config = workloads(args)[setup.workload]
    run_log_dir = log_dir / setup.name
    run_log_dir.mkdir(parents=True, exist_ok=True)
    deployment = Deployment(model=model, num_prefill=2, num_decode=2,
                            torch_threads=args.torch_threads,
                            worker_args=[*args.worker_args, *setup.worker_args],
                            router_args=[*args.router_args, *setup.router_args,
                                         "--enable-prompt-tokens-details"],
                            log_dir=run_log_dir)
    with deployment:
        address = deployment.router_address
        vocab = asyncio.run(_vocab_and_warm_up(address, args.seed))
        items = workload.build(config.num_requests, vocab, config.seed)
        run = asyncio.run(run_target(setup.name, address, items, config))[0]
    m = calculate_metrics(run.records, run.metrics.duration_s, percentiles=(50.0, 99.0))
    return Figures(m.ttft.percentile_ms(50), m.ttft.percentile_ms(99), m.prefix_cache_hit_rate,
                   m.mean_kv_bytes_shipped, m.mean_kv_bytes_not_shipped, m.completed, m.failed)


def run_all(args: argparse.Namespace, model: str, log_dir: Path) -> dict[str, list[Figures]]:
    runs: dict[str, list[Figures]] = {}
    chosen = [setup for setup in setups(args.policies, args.local_prefill_threshold)
              if setup.name in args.runs and setup.router_args[-1] in POLICIES]
    for repeat in range(args.repeats):
        for setup in chosen:
            figures = run_once(setup, model, args, log_dir / f"r{repeat}")
            runs.setdefault(setup.name, []).append(figures)
            print(f"repetition {repeat + 1}/{args.repeats} {setup.name}: TTFT p50 "
                  f"{figures.ttft_p50_ms:.1f} ms, hit rate {figures.hit_rate:.1%}, "
                  f"K/V shipped {figures.kv_bytes_shipped / 1024:.1f} KiB/request, "
                  f"{figures.num_failed} failed", flush=True)
    return runs


class Ratio(NamedTuple):
    """A ratio taken within each repetition: numerator run's figure / denominator run's."""

    label: str
    numerator: str  # setup names
    denominator: str
    figure: str  # a Figures field
    target: float  # met when the median ratio is >= target (> target when is_strict)
    is_strict: bool = False

    def values(self, runs: dict[str, list[Figures]]) -> list[float]:
        pairs = zip(runs.get(self.numerator, []), runs.get(self.denominator, []))
        return [ratio(getattr(n, self.figure), getattr(d, self.figure)) for n, d in pairs]

    def target_text(self) -> str:
        return "> 1 (lower)" if self.is_strict else f">= {self.target:g}x"

    def is_met(self, median: float) -> bool:
        return median > self.target if self.is_strict else median >= self.target


def ratios(policies: Sequence[str]) -> list[Ratio]:
    candidate, baseline = (f"{p}-routing" for p in policies)
    no_cache = f"{policies[1]}-no-cache"
    return [Ratio("median TTFT, cache off / on", "cache-off", "cache-on", "ttft_p50_ms", 3.0),
            Ratio(f"K/V bytes shipped per request, {baseline} / {candidate}", baseline,
                  candidate, "kv_bytes_shipped", 5.0),
            Ratio(f"TTFT p50, {baseline} / {candidate}", baseline, candidate, "ttft_p50_ms",
                  1.0, is_strict=True),
            Ratio(f"K/V bytes shipped per request, {no_cache} / {candidate}", no_cache,
                  candidate, "kv_bytes_shipped", 5.0),
            Ratio(f"TTFT p50, {no_cache} / {candidate}", no_cache, candidate, "ttft_p50_ms",
                  1.0, is_strict=True)]


COLUMNS = (("ttft_p50_ms", "TTFT p50 ms", 1.0), ("ttft_p99_ms", "TTFT p99 ms", 1.0),
           ("hit_rate", "hit rate %", 100.0), ("kv_bytes_shipped", "K/V KiB shipped/req",
                                                  1 / 1024),
           ("kv_bytes_not_shipped", "K/V KiB not shipped/req", 1 / 1024))


def format_report(args: argparse.Namespace, runs: dict[str, list[Figures]]) -> str:
    lines = [f"{args.repeats} repetition(s), median [min-max]; 2 prefill + 2 decode workers",
             f"shared-prefix: {args.sp_requests} requests at {args.sp_rate:g}/s, "
             f"{args.num_prefixes} prefixes x {args.prefix_len} + {args.suffix_len} tokens, "
             f"{args.sp_output_len} out",
             f"multi-turn: {args.conversations} conversations at {args.mt_rate:g}/s, "
             f"{args.num_turns} turns, {args.input_len} + {args.turn_len} tokens a turn, "
             f"{args.mt_output_len} out", ""]
    header = f"{'run':<20}" + "".join(f"{label:>25}" for _, label, _ in COLUMNS) + "  failed"
    lines.append(header)
    for name, figures in runs.items():
        cells = [spread([getattr(f, field) * scale for f in figures]).text(1).rjust(25)
                 for field, _, scale in COLUMNS]
        lines.append(f"{name:<20}" + "".join(cells) + f"  {sum(f.num_failed for f in figures)}")
    lines.append("")
    width = max(len(r.label) for r in ratios(args.policies))
    for r in ratios(args.policies):
        values = r.values(runs)
        if not values:
            lines.append(f"{r.label:<{width}}  not measured ({r.numerator} or "
                         f"{r.denominator} did not run)")
            continue
        s = spread(values)
        verdict = "met" if r.is_met(s.median) else "NOT met"
        lines.append(f"{r.label:<{width}}  {s.text():>22}  target {r.target_text():<12} "
                     f"{verdict}")
    return "\n".join(lines)


def _finite(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)  # JSON has no inf / nan


def payload(args: argparse.Namespace, model: str, runs: dict[str, list[Figures]],
            notes: list[str]) -> dict[str, Any]:
    summary = {}
    for r in ratios(args.policies):
        values = r.values(runs)
        s = spread(values) if values else None
        summary[r.label] = {"target": r.target_text(), "values": [_finite(v) for v in values],
                            "median": _finite(s.median) if s else None,
                            "is_met": r.is_met(s.median) if s else None}
    skipped = {"model", "out", "log_dir"}
    return {"model": args.model if args.model in ("tiny", "default") else Path(model).name,
            "checkpoint": Path(model).name, "machine": platform.platform(),
            "args": {k: v for k, v in vars(args).items() if k not in skipped},
            "notes": notes, "ratios": summary,
            "runs": {name: [f._asdict() for f in figures] for name, figures in runs.items()}}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    notes = [f"policy {p!r} is not one this router accepts ({', '.join(POLICIES)}): its "
             "multi-turn run is skipped" for p in args.policies if p not in POLICIES]
    for note in notes:
        print(f"bench_prefix_cache: {note}", file=sys.stderr)
    model = bench_model(args.model)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench_prefix_cache-"))
    print(f"model {args.model} ({Path(model).name}); logs {log_dir}", flush=True)
    # SIGTERM unwinds like Ctrl-C, so that every deployment is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        runs = run_all(args, model, log_dir)
    except (RuntimeError, ValueError) as exc:
        print(f"bench_prefix_cache: {exc} (logs: {log_dir})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench_prefix_cache: interrupted; deployments stopped", file=sys.stderr)
        return 130
    print(format_report(args, runs))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload(args, model, runs, notes), indent=1) + "\n")
        print(f"results: {args.out}")
    failed = sum(f.num_failed for figures in runs.values() for f in figures)
    if failed:
        print(f"bench_prefix_cache: {failed} requests failed (see {log_dir})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
