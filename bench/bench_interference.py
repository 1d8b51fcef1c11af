"""Headline scenario: long prompts arriving among steady short decodes, disaggregated
against colocated, on the same machine, in one run.

Deployments of `--model` (the tiny seeded model unless told; `--model default` is the real
default model), started one after the other: disaggregated (one prefill and one decode
worker, one torch thread each), once per K/V transport of --kv-transports (gRPC streams;
NIXL: the decode worker reads the pages from the prefill worker's pool), and colocated (one
worker serving both roles with two threads: the same cores). Each gets the same two seeded,
open-loop workloads through `kvferry bench`'s engine:
  unloaded: short requests only (--short-input / --short-output tokens) at --rate req/s;
  loaded:   the same stream with long prompts (--long-input tokens, --long-output tokens)
            mixed in as --long-fraction of the requests.
The set runs --repeats times (the deployments alternate, each started afresh). Reported for
the short requests, per deployment, median [min-max] over the repetitions: ITL p50/p99
unloaded and loaded, loaded TTFT p99, and the ratio loaded p99 ITL / unloaded p50 ITL; the
target is disaggregated <= 1.5x while colocated's is >= 3x. Writes a JSON (every repetition)
and a PNG (the first repetition's ITL percentiles and token gaps over time). Usage:

    .venv/bin/python bench/bench_interference.py [--model tiny|default|PATH] --out-dir bench/results

With --launch serve the deployments are started by `kvferry serve` with its defaults instead
(what a user who tries the headline sees): the placement and pool sizes are serve's
own, the colocated one is `serve --colocated --num-decode 1`, and this client floats.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.* helpers
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "kernels"))
from bench.interference_attribution import slow_gap_table  # noqa: E402
from deploy.default_model import BENCH_MODEL_HELP, bench_model
from deploy.launcher import Deployment, pin_threads
from deploy.loadgen import BenchConfig, MixedWorkload, RandomWorkload, calculate_metrics
from deploy.loadgen.bench import run_target
from deploy.loadgen.plots import _pyplot
from kvferry import trace


def _phase(address: str, name: str, requests, config: BenchConfig) -> dict[str, object]:
    run = asyncio.run(run_target(name, address, requests, config))[0]
    short = [r for r in run.records if r.tag == "short"]
    failed = [r for r in run.records if not r.is_success]
    m = calculate_metrics(short, run.metrics.duration_s, config.slo, (50.0, 99.0))
    gaps = [(r.start_s + t0, t1 - t0) for r in short
            for t0, t1 in zip(_times(r), _times(r)[1:])]
    return {"itl_p50_ms": m.itl.percentile_ms(50), "itl_p99_ms": m.itl.percentile_ms(99),
            "ttft_p50_ms": m.ttft.percentile_ms(50), "ttft_p99_ms": m.ttft.percentile_ms(99),
            "num_short": len(short), "num_long": len(run.records) - len(short),
            "num_failed": len(failed), "gaps": gaps}


@contextmanager
def _pinned(deployment: Deployment, pinning: dict[str, set[int]],
            transfer: dict[str, set[int]], client: set[int]) -> Iterator[str]:
    """A deployment started here, its processes pinned as asked; its router's address."""
    with deployment:
        for role, cpus in pinning.items():
            deployment.pin(role, cpus, transfer.get(role))
        pin_threads(os.getpid(), client)
        yield deployment.router_address


@contextmanager
def _served(model: str, name: str, env: dict[str, str],
            placements: dict[str, str]) -> Iterator[str]:
    """`kvferry serve` with its defaults for deployment `name`; its router's address. The
    placement line of its log goes to `placements[name]`."""
    extra = (["--colocated", "--num-decode", "1"] if name == "colocated"
             else ["--kv-transport", "nixl"] if name.endswith("nixl") else [])
    log = tempfile.TemporaryFile("w+")
    serve = subprocess.Popen([sys.executable, "-m", "deploy.cli", "serve", "--model", model,
                              "--port", "0", "--http-port", "off", *extra],
                             stdout=subprocess.PIPE, stderr=log, text=True,
                             env={**os.environ, **env})
    try:
        assert serve.stdout is not None
        line = serve.stdout.readline()
        log.seek(0)
        if "serving on " not in line:
            raise RuntimeError(f"kvferry serve did not start (exit code {serve.wait()}): "
                               f"{log.read()[-2000:]}")
        placements[name] = next((x.split("placement: ", 1)[1].strip() for x in log
                                 if "placement: " in x), "not logged")
        yield line.split("serving on ")[1].split()[0]
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(120)
        log.close()


def _times(record) -> list[float]:
    return [record.ttft_s + sum(record.itls_s[:i]) for i in range(len(record.itls_s) + 1)]


def _disaggregated(transport: str) -> str:
    return "disaggregated" if transport == "grpc" else f"disaggregated-{transport}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help=BENCH_MODEL_HELP)
    parser.add_argument("--repeats", type=int, default=5,
                        help="repetitions of the pair of deployments (default 5)")
    parser.add_argument("--num-requests", type=int, default=80)
    parser.add_argument("--rate", type=float, default=4.0, help="requests/s, Poisson")
    parser.add_argument("--short-input", type=int, default=32)
    parser.add_argument("--short-output", type=int, default=64)
    parser.add_argument("--long-input", type=int, default=3000)
    parser.add_argument("--long-output", type=int, default=4)
    parser.add_argument("--long-fraction", type=float, default=0.15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-transports", nargs="+", default=["grpc", "nixl"],
                        choices=["grpc", "nixl"],
                        help="one disaggregated deployment per K/V transport")
    parser.add_argument("--pin-transfer-threads", action="store_true",
                        help="NIXL: pin the decode worker's transfer threads (kvferry-xfer) to "
                             "the prefill worker's core, off the decode core (not yet "
                             "measured over repetitions; a single trial looked worse)")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="do not pin prefill and decode workers to one core each")
    parser.add_argument("--isolate-decode-core", action="store_true",
                        help="disaggregated: the router and this client run on the prefill "
                             "worker's core too, so nothing but the decode worker uses its core")
    parser.add_argument("--launch", default="deployment", choices=["deployment", "serve"],
                        help="serve: each deployment started as a user starts it, `kvferry "
                             "serve` with its defaults (its own placement and pool sizing), "
                             "this client unpinned; deployment (default): started "
                             "here and pinned as the flags above say")
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--out-stem", default=None,
                        help="file names in --out-dir (default bench_interference[_MODEL])")
    parser.add_argument("--trace", type=Path, default=None, metavar="DIR",
                        help="trace every token (kvferry/trace.py) into DIR/<deployment>-<n> "
                             "and print where the slow gaps of the short requests went")
    args = parser.parse_args()
    model = bench_model(args.model)
    short = RandomWorkload(input_len=args.short_input, output_len=args.short_output,
                           range_ratio=0.0)
    long = RandomWorkload(input_len=args.long_input, output_len=args.long_output,
                          range_ratio=0.0)
    unloaded = MixedWorkload((("short", short, 1.0),))
    loaded = MixedWorkload((("short", short, 1.0 - args.long_fraction),
                            ("long", long, args.long_fraction)))
    config = BenchConfig(num_requests=args.num_requests, request_rates=(args.rate,),
                         num_warmups=2, seed=args.seed, vocab_size=512)
    setups = {_disaggregated(t): dict(model=model, torch_threads=1,
                                      worker_args=["--kv-transport", t])
              for t in args.kv_transports}
    setups["colocated"] = dict(model=model, torch_threads=2, is_colocated=True)
    cores = sorted(os.sched_getaffinity(0))
    pinning = {name: {"prefill": {cores[0]}, "decode": {cores[-1]}} for name in setups}
    pinning["colocated"] = {"colocated": set(cores[:2])}
    client_cpus = {name: set(cores) for name in setups}  # this process's threads
    if args.isolate_decode_core:  # the router and this client off the decode core
        for name in setups:
            if name != "colocated":
                pinning[name]["router"] = client_cpus[name] = {cores[0]}
    # --pin-transfer-threads: NIXL moves and checks K/V bytes on threads of their own; they
    # go to the prefill worker's core and the decode core only steps.
    transfer_pinning = {name: {"decode": {cores[0]}} for name in setups
                        if "nixl" in name and args.pin_transfer_threads}
    runs: dict[str, list[dict[str, dict[str, object]]]] = {name: [] for name in setups}
    served: dict[str, str] = {}  # --launch serve: each deployment's placement, as it logged
    for repeat in range(args.repeats):
        for name, kwargs in setups.items():
            folder = None if args.trace is None else args.trace / f"{name}-{repeat + 1}"
            traced = {} if folder is None else {"env": {trace.TRACE_ENV: str(folder)}}
            trace.switch("client", folder)
            if args.launch == "serve":
                started = _served(model, name, traced.get("env", {}), served)
            else:
                started = _pinned(Deployment(**kwargs, **traced),
                                  pinning[name] if args.pin else {},
                                  transfer_pinning.get(name, {}), client_cpus[name])
            with started as address:
                run = {phase: _phase(address, f"{name}-{phase}",
                                     workload.build(args.num_requests, 512, args.seed), config)
                       for phase, workload in (("unloaded", unloaded), ("loaded", loaded))}
            trace.switch("client", None)
            run["ratio_loaded_p99_to_unloaded_p50"] = (run["loaded"]["itl_p99_ms"]
                                                       / run["unloaded"]["itl_p50_ms"])
            runs[name].append(run)
            print(f"repetition {repeat + 1}/{args.repeats} {name}: loaded p99 / unloaded p50 "
                  f"{run['ratio_loaded_p99_to_unloaded_p50']:.2f}x", flush=True)
    summary = {name: _summarize(r) for name, r in runs.items()}
    placement = {  # which process ran on which core
        name: {**{role: sorted(cpus) for role, cpus in pinning[name].items()},
               "client": sorted(client_cpus[name])} if args.pin else "unpinned"
        for name in setups}
    if args.launch == "serve":
        placement = {name: f"serve: {line}; client unpinned" for name, line in served.items()}
    print(f"placement (cores): {placement}")
    print(f"model {model}; {args.repeats} repetitions, median [min-max]")
    print(f"{args.num_requests} requests at {args.rate:g}/s; short {args.short_input}->"
          f"{args.short_output} tokens; {args.long_fraction:.0%} long {args.long_input}->"
          f"{args.long_output}; ITL/TTFT of the short requests, ms")
    for name, stats in summary.items():
        print(name)
        for key, label in SUMMARY_COLUMNS:
            lo, mid, hi = stats[key]
            print(f"  {label:<32} {mid:>8.2f}  [{lo:.2f}-{hi:.2f}]")
        print(f"  {'failed requests (all runs)':<32} {stats['failed']:>8}")
    summary["placement"] = placement
    if args.trace is not None:
        summary["attribution"] = slow_gap_table(args.trace, list(setups), args.repeats,
                                                args.rate)
    if args.out_dir:
        _write(args, model, runs, summary)


SUMMARY_COLUMNS = (("unloaded.itl_p50_ms", "unloaded ITL p50"),
                   ("unloaded.itl_p99_ms", "unloaded ITL p99"),
                   ("loaded.itl_p50_ms", "loaded ITL p50"),
                   ("loaded.itl_p99_ms", "loaded ITL p99"),
                   ("loaded.ttft_p50_ms", "loaded TTFT p50"),
                   ("loaded.ttft_p99_ms", "loaded TTFT p99"),
                   ("ratio_loaded_p99_to_unloaded_p50", "loaded p99 ITL / unloaded p50"))


def _summarize(runs: list[dict[str, object]]) -> dict[str, object]:
    """(min, median, max) of each SUMMARY_COLUMNS value over the repetitions."""
    def value(run: dict[str, object], key: str) -> float:
        phase, _, field = key.partition(".")
        return run[phase][field] if field else run[phase]
    out: dict[str, object] = {}
    for key, _ in SUMMARY_COLUMNS:
        values = sorted(value(r, key) for r in runs)
        out[key] = (values[0], statistics.median(values), values[-1])
    out["failed"] = sum(r[p]["num_failed"] for r in runs for p in ("unloaded", "loaded"))
    return out


def _write(args: argparse.Namespace, model: str, runs: dict[str, list[dict[str, object]]],
           summary: dict[str, object]) -> None:
    results = {name: r[0] for name, r in runs.items()}  # the picture: the first repetition
    plt = _pyplot()
    fig, (bars, timeline) = plt.subplots(1, 2, figsize=(13, 4.5))
    names = list(results)
    labels = ["unloaded p50", "unloaded p99", "loaded p50", "loaded p99"]
    for i, name in enumerate(names):
        r = results[name]
        values = [r["unloaded"]["itl_p50_ms"], r["unloaded"]["itl_p99_ms"],
                  r["loaded"]["itl_p50_ms"], r["loaded"]["itl_p99_ms"]]
        bars.bar([x + i * 0.4 for x in range(4)], values, width=0.4, label=name)
    bars.set_xticks([x + 0.2 for x in range(4)], labels)
    bars.set_yscale("log")
    bars.set_ylabel("ITL of short requests (ms)")
    bars.legend()
    for name in names:
        gaps = results[name]["loaded"]["gaps"]
        timeline.plot([g[0] for g in gaps], [g[1] * 1e3 for g in gaps], ".", markersize=3,
                      label=name)
    timeline.set_yscale("log")
    timeline.set_xlabel("time into the loaded run (s)")
    timeline.set_ylabel("token gap (ms)")
    timeline.set_title("short requests' token gaps, long prompts arriving")
    timeline.legend()
    fig.tight_layout()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_stem or ("bench_interference"
                             + ("" if args.model == "tiny" else f"_{Path(args.model).stem}"))
    fig.savefig(args.out_dir / f"{stem}.png", dpi=110)
    for name_runs in runs.values():
        for r in name_runs:
            for phase in ("unloaded", "loaded"):
                r[phase].pop("gaps")
    payload = {"args": {k: str(v) for k, v in vars(args).items()}, "model": Path(model).name,
               "machine": platform.platform(), "summary": summary, "runs": runs}
    (args.out_dir / f"{stem}.json").write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
