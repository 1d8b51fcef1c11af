"""Headline scenario (issue 7): long prompts arriving among steady short decodes, disaggregated
against colocated, on the same machine, in one run.

Two deployments of the tiny model, started one after the other: disaggregated (one
prefill and one decode worker, one torch thread each) and colocated (one worker serving both
roles with two threads: the same cores). Each gets the same two seeded, open-loop workloads
through `kvferry bench`'s engine:
  unloaded: short requests only (--short-input / --short-output tokens) at --rate req/s;
  loaded:   the same stream with long prompts (--long-input tokens, --long-output tokens)
            mixed in as --long-fraction of the requests.
Reported for the short requests: ITL p50/p99 unloaded and loaded, TTFT; the target is
disaggregated loaded p99 ITL <= 1.5x its unloaded p50 while colocated's is >= 3x. Writes a
JSON and a PNG (ITL percentiles, and every short request's token gaps over time). Usage:

    .venv/bin/python bench/bench_interference.py --out-dir docs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
from pathlib import Path

from deploy.default_model import tiny_model
from deploy.launcher import Deployment
from deploy.loadgen import BenchConfig, MixedWorkload, RandomWorkload, calculate_metrics
from deploy.loadgen.bench import run_target
from deploy.loadgen.plots import _pyplot


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


def _times(record) -> list[float]:
    return [record.ttft_s + sum(record.itls_s[:i]) for i in range(len(record.itls_s) + 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=80)
    parser.add_argument("--rate", type=float, default=4.0, help="requests/s, Poisson")
    parser.add_argument("--short-input", type=int, default=32)
    parser.add_argument("--short-output", type=int, default=64)
    parser.add_argument("--long-input", type=int, default=3000)
    parser.add_argument("--long-output", type=int, default=4)
    parser.add_argument("--long-fraction", type=float, default=0.15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="do not pin prefill and decode workers to one core each")
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    model = tiny_model()
    short = RandomWorkload(input_len=args.short_input, output_len=args.short_output,
                           range_ratio=0.0)
    long = RandomWorkload(input_len=args.long_input, output_len=args.long_output,
                          range_ratio=0.0)
    unloaded = MixedWorkload((("short", short, 1.0),))
    loaded = MixedWorkload((("short", short, 1.0 - args.long_fraction),
                            ("long", long, args.long_fraction)))
    config = BenchConfig(num_requests=args.num_requests, request_rates=(args.rate,),
                         num_warmups=2, seed=args.seed, vocab_size=512)
    setups = {
        "disaggregated": Deployment(model=model, torch_threads=1),
        "colocated": Deployment(model=model, torch_threads=2, is_colocated=True),
    }
    results: dict[str, dict[str, dict[str, object]]] = {}
    cores = sorted(os.sched_getaffinity(0))
    pinning = {"disaggregated": {"prefill": {cores[0]}, "decode": {cores[-1]}},
               "colocated": {"colocated": set(cores[:2])}}
    for name, deployment in setups.items():
        with deployment:
            if args.pin:
                for role, cpus in pinning[name].items():
                    deployment.pin(role, cpus)
            results[name] = {
                phase: _phase(deployment.router_address, f"{name}-{phase}",
                              workload.build(args.num_requests, 512, args.seed), config)
                for phase, workload in (("unloaded", unloaded), ("loaded", loaded))
            }
    print(f"{args.num_requests} requests at {args.rate:g}/s; short {args.short_input}->"
          f"{args.short_output} tokens; {args.long_fraction:.0%} long {args.long_input}->"
          f"{args.long_output}; ITL/TTFT of the short requests, ms")
    print(f"{'deployment':<15} {'unloaded ITL p50':>17} {'p99':>7} {'loaded ITL p50':>15} "
          f"{'p99':>7} {'p99 / unloaded p50':>19} {'loaded TTFT p99':>16} {'failed':>7}")
    for name, r in results.items():
        u, lo = r["unloaded"], r["loaded"]
        r["ratio_loaded_p99_to_unloaded_p50"] = lo["itl_p99_ms"] / u["itl_p50_ms"]
        print(f"{name:<15} {u['itl_p50_ms']:>17.1f} {u['itl_p99_ms']:>7.1f} "
              f"{lo['itl_p50_ms']:>15.1f} {lo['itl_p99_ms']:>7.1f} "
              f"{r['ratio_loaded_p99_to_unloaded_p50']:>18.2f}x {lo['ttft_p99_ms']:>16.1f} "
              f"{u['num_failed'] + lo['num_failed']:>7}")
    if args.out_dir:
        _write(args, results)


def _write(args: argparse.Namespace, results: dict[str, dict[str, dict[str, object]]]) -> None:
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
    fig.savefig(args.out_dir / "bench_interference.png", dpi=110)
    for r in results.values():
        for phase in ("unloaded", "loaded"):
            r[phase].pop("gaps")
    payload = {"args": {k: str(v) for k, v in vars(args).items()},
               "machine": platform.platform(), "results": results}
    (args.out_dir / "bench_interference.json").write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
