"""The simulator (deploy/planner/simulator.py) against measurement on this machine.

For each model: profile it (`kvferry profile`'s measurement, or --profile FILE), then for
each configuration launch the deployment, send the load tester's seeded workload at a rate
set from the profile (half the layout's capacity by default: where latency targets are
met), `--reps` times with different seeds, and simulate the same requests
(the measured send times and lengths) through the same layout. Prints, per configuration,
the measured and predicted TTFT and ITL p50 and p90 (medians over the repetitions, with the
measured range) and the prediction's error. Configurations:

  disagg-short   1 prefill + 1 decode worker, short prompts
  disagg-mixed   the same with long prompts among them (1 in 5)
  colocated      2 colocated workers, the short prompts

Usage:

    .venv/bin/python bench/bench_simulator.py [--models tiny,default] [--reps 3]
        [--requests 60] [--utilization 0.5] [--out FILE]
    .venv/bin/python bench/bench_simulator.py --replay FILE [--profile P]  # no measuring
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

from deploy.default_model import ensure_default_model, tiny_model
from deploy.launcher import Deployment
from deploy.loadgen.bench import BenchConfig, run_endpoint
from deploy.loadgen.metrics import RequestRecord, calculate_metrics
from deploy.loadgen.targets import Target, make_deployment, open_target
from deploy.loadgen.workload import MixedWorkload, RandomWorkload
from deploy.planner.profile import CostModel, Profile
from deploy.planner.profiler import Sweep
from deploy.planner.search import capacity
from deploy.planner.simulator import Layout, SimRequest, simulate
from deploy.profile_args import PROFILE_POOL_SIZE
from deploy.profile_cmd import profile_deployment

METRICS = (("ttft", 50.0), ("ttft", 90.0), ("itl", 50.0), ("itl", 90.0))
SHORT = RandomWorkload(input_len=128, output_len=64, range_ratio=0.5)
LONG = RandomWorkload(input_len=1024, output_len=16, range_ratio=0.25)
CONFIGS = {
    "disagg-short": (Layout(1, 1), SHORT),
    "disagg-mixed": (Layout(1, 1), MixedWorkload((("short", SHORT, 4.0), ("long", LONG, 1.0)))),
    "colocated": (Layout(0, 2, is_colocated=True), SHORT),
}


def _percentiles(records: list[RequestRecord], duration_s: float) -> dict[str, float]:
    metrics = calculate_metrics(records, duration_s, percentiles=(50.0, 90.0))
    return {f"{name}_p{p:g}_ms": metrics.stats(name).percentile_ms(p) for name, p in METRICS}


def _sim_requests(records: tuple[RequestRecord, ...]) -> list[SimRequest]:
    return [SimRequest(r.start_s, r.prompt_len, r.output_len, r.tag) for r in records]


def run_config(name: str, cost: CostModel, template: Deployment, rate: float, reps: int,
               num_requests: int) -> dict:
    layout, workload = CONFIGS[name]
    kind = "colocated" if layout.is_colocated else "disagg"
    launch = dataclasses.replace(template, num_prefill=layout.num_prefill,
                                 num_decode=layout.num_decode)
    deployment = make_deployment(kind, launch)
    runs = []
    with open_target(Target(name, deployment=deployment)) as endpoint:
        vocab = _vocab(endpoint.grpc_address)
        for rep in range(reps):
            config = BenchConfig(num_requests=num_requests, request_rates=(rate,), seed=rep,
                                 num_warmups=2, percentiles=(50.0, 90.0))
            requests = workload.build(num_requests, vocab, rep)
            result = asyncio.run(run_endpoint(Target(name, address=endpoint.grpc_address),
                                              endpoint, requests, config))[0]
            failed = [r for r in result.records if not r.is_success]
            if failed:
                raise RuntimeError(f"{name}: {len(failed)} requests failed: {failed[0].error}")
            requests = _sim_requests(result.records)
            runs.append({"measured": _percentiles(list(result.records),
                                                  result.metrics.duration_s),
                         "predicted": _predict(cost, layout, requests),
                         "requests": [dataclasses.astuple(r) for r in requests]})
            print(f"  {name} rep {rep}: measured {runs[-1]['measured']}", file=sys.stderr)
            print(f"  {name} rep {rep}: predicted {runs[-1]['predicted']}", file=sys.stderr)
    return {"layout": str(layout), "workload": repr(workload), "rate": rate, "runs": runs,
            "summary": _summary(runs)}


def _predict(cost: CostModel, layout: Layout, requests: list[SimRequest]) -> dict[str, float]:
    predicted = simulate(cost, layout, requests)
    return _percentiles(predicted, max(r.start_s + r.latency_s for r in predicted))


def replay(path: Path, profile: Path | None) -> dict:
    """Simulate the requests a results file measured again (with `profile`, or the one it
    was measured with), and print the table: a change to the simulator or the profile,
    checked against the same measurements."""
    out = json.loads(path.read_text())
    for label, model in out.items():
        cost = CostModel(Profile.load(profile) if profile else Profile.from_dict(model["profile"]))
        for name, res in model["configs"].items():
            layout = CONFIGS[name][0]
            for run in res["runs"]:
                run["predicted"] = _predict(cost, layout,
                                            [SimRequest(*r) for r in run["requests"]])
            res["summary"] = _summary(res["runs"])
        _print_table(label, model["configs"])
    return out


def _vocab(address: str) -> int:
    from deploy.loadgen.bench import _model_info

    return asyncio.run(_model_info(address))[0]


def _summary(runs: list[dict]) -> dict:
    out = {}
    for name, p in METRICS:
        key = f"{name}_p{p:g}_ms"
        measured = [r["measured"][key] for r in runs]
        predicted = [r["predicted"][key] for r in runs]
        med_m, med_p = statistics.median(measured), statistics.median(predicted)
        out[key] = {"measured_median": med_m, "measured_min": min(measured),
                    "measured_max": max(measured), "predicted_median": med_p,
                    "predicted_min": min(predicted), "predicted_max": max(predicted),
                    "error": med_p / med_m - 1 if med_m > 0 else None}
    return out


def _print_table(model: str, results: dict) -> None:
    print(f"\n{model}: measured median [min-max] vs predicted median, error")
    print(f"{'config':<14} {'rate':>6}  " + "  ".join(f"{n} p{p:g}".ljust(34)
                                                   for n, p in METRICS))
    for name, res in results.items():
        cells = []
        for metric, p in METRICS:
            s = res["summary"][f"{metric}_p{p:g}_ms"]
            cells.append(f"{s['measured_median']:7.1f} [{s['measured_min']:.1f}-"
                         f"{s['measured_max']:.1f}] {s['predicted_median']:7.1f} "
                         f"{s['error']:+5.0%}".ljust(34))
        print(f"{name:<14} {res['rate']:6.2f}  " + "  ".join(cells))


def run_model(label: str, model: str, args: argparse.Namespace) -> dict:
    log_dir = args.log_dir / label
    log_dir.mkdir(parents=True, exist_ok=True)
    if args.profile is not None:
        profile = Profile.load(args.profile)
    else:
        profile = profile_deployment(model, Sweep(), "grpc", PROFILE_POOL_SIZE, 16,
                                     log_dir=log_dir / "profile",
                                     log=lambda line: print(line, file=sys.stderr))
    cost = CostModel(profile)
    print(f"{label} profile:\n{cost.describe()}", file=sys.stderr)
    template = Deployment(model=model, kv_pool_size=PROFILE_POOL_SIZE, torch_threads=0,
                          pin_cores=True, log_dir=log_dir)
    results = {}
    for name in args.configs:
        layout, workload = CONFIGS[name]
        sample = [SimRequest(0.0, r.prompt_len, r.output_len)
                  for r in workload.build(200, 1000, 0)]
        rate = args.utilization * capacity(cost, layout, sample)
        results[name] = run_config(name, cost, template, round(rate, 2), args.reps,
                                   args.requests)
    _print_table(label, results)
    return {"profile": dataclasses.asdict(profile), "configs": results}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,default", help="tiny, default, or both")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--requests", type=int, default=60, help="per repetition")
    p.add_argument("--utilization", type=float, default=0.5,
                   help="the rate: this fraction of the layout's capacity (its busier side's, "
                        "deploy/planner/search.py capacity)")
    p.add_argument("--profile", type=Path, default=None,
                   help="use this profile instead of measuring one (one model only)")
    p.add_argument("--log-dir", type=Path,
                   default=Path("/tmp") / time.strftime("bench-simulator-%Y%m%d-%H%M%S"))
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    p.add_argument("--replay", type=Path, default=None, metavar="RESULTS",
                   help="measure nothing: simulate a results file's requests again (with "
                        "--profile, or the profile it holds) and print the table")
    args = p.parse_args()
    if args.replay is not None:
        out = replay(args.replay, args.profile)
        if args.out is not None:
            args.out.write_text(json.dumps(out, indent=1) + "\n")
        return 0
    args.configs = args.configs.split(",")
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        print(f"bench_simulator: --configs: unknown {unknown}", file=sys.stderr)
        return 2
    paths = {"tiny": tiny_model, "default": ensure_default_model}
    out = {}
    for label in args.models.split(","):
        if label not in paths:
            print(f"bench_simulator: --models: unknown {label!r}", file=sys.stderr)
            return 2
        out[label] = run_model(label, paths[label](), args)
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
