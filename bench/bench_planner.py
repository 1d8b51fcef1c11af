"""Goodput of the live planner against every fixed prefill/decode split with the same
number of workers, on Ray, under a workload that shifts mid-run.

Each layout serves the same two phases back to back: phase A, short prompts with long
answers, then phase B, long prompts with short answers, each for --phase-s seconds of
seeded Poisson arrivals at its own rate. The fixed layouts are every split of --workers
workers (1P+(N-1)D ... (N-1)P+1D); the planner's run starts at the middle split and the live
planner (deploy/planner/loop.run_ray_planner, as `kvferry serve --planner-sla` runs it)
scales it from the profile, with at most --workers workers. Repetitions are interleaved
across the layouts (rep 0 of each, then rep 1, ...), all deployments up at once, each rep
starting one layout later than the last, so drift on a noisy machine, and whatever one run
leaves behind for the next, falls on every layout alike.

Goodput: the fraction of requests meeting the SLA (their TTFT, and their own ITL
percentile: deploy/planner/search.Sla.attainment), and those requests per second. The rates
are --utilization times the simulated capacity (deploy/planner/search.capacity) of the
split best for each phase; the default SLA is derived from the profile (printed).

Usage:

    .venv/bin/python bench/bench_planner.py --profile FILE [--model DIR] [--workers 3]
        [--reps 3] [--phase-s 45] [--sla ttft-p90=MS,itl-p90=MS] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from deploy.default_model import tiny_model
from deploy.loadgen.bench import BenchConfig, run_target
from deploy.loadgen.workload import RandomWorkload
from deploy.planner.live import Bounds, Planner
from deploy.planner.loop import PlannerMetrics, run_ray_planner
from deploy.planner.profile import CostModel, Profile
from deploy.planner.scalers import RayScaler
from deploy.planner.search import Sla, capacity
from deploy.planner.simulator import Layout, SimRequest

PHASES = {"A": RandomWorkload(input_len=32, output_len=96, range_ratio=0.25),
          "B": RandomWorkload(input_len=512, output_len=4, range_ratio=0.25)}


def _sample(workload: RandomWorkload) -> list[SimRequest]:
    return [SimRequest(0.0, r.prompt_len, r.output_len) for r in workload.build(200, 500, 0)]


def phase_rates(cost: CostModel, workers: int, utilization: float) -> dict[str, float]:
    """Each phase's rate: `utilization` of the best split's simulated capacity for it."""
    splits = [Layout(p, workers - p) for p in range(1, workers)]
    return {name: round(utilization * max(capacity(cost, s, _sample(w)) for s in splits), 2)
            for name, w in PHASES.items()}


def default_sla(cost: CostModel) -> Sla:
    """TTFT p90 at 4 prefills of phase B's prompt, ITL p90 at 3 steps of 4 sequences."""
    prompt = PHASES["B"].input_len
    ttft = 4 * cost.prefill_s(prompt, prompt * prompt)
    itl = 3 * cost.decode_s(4, 4 * PHASES["A"].input_len)
    return Sla.parse(f"ttft-p90={ttft * 1000:.0f},itl-p90={itl * 1000:.1f}")


def send_phases(client: ProcessPoolExecutor, address: str, rates: dict[str, float],
                phase_s: float, seed: int) -> list:
    """`run_phases` in the client's own process: a planner deciding in this one holds its
    interpreter for a while each interval, and must not hold up the client's stream reads
    (in `kvferry serve --planner-sla` the planner is in the driver, the client elsewhere)."""
    return client.submit(run_phases, address, rates, phase_s, seed).result()


def run_phases(address: str, rates: dict[str, float], phase_s: float, seed: int
               ) -> list:
    """Phase A then phase B against one router; every request's record."""
    from deploy.loadgen.bench import _model_info

    vocab = asyncio.run(_model_info(address))[0]
    records = []
    for index, (name, workload) in enumerate(PHASES.items()):
        count = max(1, round(rates[name] * phase_s))
        config = BenchConfig(num_requests=count, request_rates=(rates[name],),
                             seed=seed * 10 + index, num_warmups=0, vocab_size=vocab)
        requests = workload.build(count, vocab, seed * 10 + index)
        result = asyncio.run(run_target(name, address, requests, config))[0]
        records += [(name, r) for r in result.records]
    return records


def _summary(sla: Sla, records: list, duration_s: float) -> dict:
    plain = [r for _, r in records]
    failed = sum(1 for r in plain if not r.is_success)
    ok = [r for r in plain if r.is_success]
    attained = sla.attainment(ok) * len(ok) if ok else 0.0
    return {"requests": len(plain), "failed": failed,
            "attainment": attained / len(plain) if plain else 0.0,
            "goodput_rps": attained / duration_s,
            "by_phase": {name: sla.attainment([r for n, r in records if n == name
                                               and r.is_success])
                         for name in PHASES},
            "p90_ms": {name: _p90s([r for n, r in records if n == name and r.is_success])
                       for name in PHASES}}


def _p90s(records: list) -> dict[str, float]:
    import numpy as np

    ttft = [r.ttft_s for r in records] or [0.0]
    itl = [g for r in records for g in r.itls_s] or [0.0]
    return {"ttft": float(np.percentile(ttft, 90)) * 1000,
            "itl": float(np.percentile(itl, 90)) * 1000}


def run_planner_rep(client: ProcessPoolExecutor, deployment, cost: CostModel, sla: Sla,
                    workers: int, start: Layout, rates: dict[str, float],
                    args: argparse.Namespace, seed: int) -> dict:
    """One repetition with the live planner scaling `deployment` (put back to `start`
    first); the layouts it went through, with when."""
    RayScaler(deployment).scale(start.num_prefill, start.num_decode)
    planner = Planner(cost, sla, Bounds(1, workers - 1, 1, workers - 1, workers),
                      patience=2)
    from prometheus_client import CollectorRegistry

    began, layouts, stop = time.monotonic(), [], threading.Event()

    def planner_thread(*loop_args: object) -> None:
        # Ray starts its workers niced; a planner here would take the cores from them each
        # interval, where a real one runs on cores of its own (another node, another pod)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), args.planner_nice)
        run_ray_planner(*loop_args)

    thread = threading.Thread(target=planner_thread, args=(
        planner, deployment, args.interval_s, stop, PlannerMetrics(CollectorRegistry()),
        lambda d: layouts.append((round(time.monotonic() - began, 1), str(d.layout),
                                  d.reason, round(time.thread_time(), 2)))), daemon=True)
    thread.start()
    try:
        records = send_phases(client, deployment.router_address, rates, args.phase_s, seed)
    finally:
        stop.set()
        thread.join(600)
    out = _summary(sla, records, time.monotonic() - began)
    out["layouts"] = layouts  # (s into the run, layout, reason, the planner's CPU s so far)
    out["planner_cpu_s"] = layouts[-1][3] if layouts else 0.0
    out["duration_s"] = time.monotonic() - began
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", type=Path, required=True,
                   help="`kvferry profile` of --model on this machine")
    p.add_argument("--model", default=None, help="checkpoint (default: the tiny model)")
    p.add_argument("--workers", type=int, default=3, help="prefill + decode workers")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--phase-s", type=float, default=45.0, help="seconds of each phase")
    p.add_argument("--utilization", type=float, default=0.7,
                   help="each phase's rate: this fraction of its best split's capacity")
    p.add_argument("--sla", default=None, help="default: derived from the profile")
    p.add_argument("--rates", default=None, metavar="A,B",
                   help="each phase's requests/s (default: from --utilization)")
    p.add_argument("--interval-s", type=float, default=5.0, help="the planner's")
    p.add_argument("--planner-nice", type=int, default=19,
                   help="the planner thread's niceness (Ray starts its workers niced)")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = p.parse_args()
    if args.workers < 2 or args.reps < 1:
        print("bench_planner: --workers must be >= 2 and --reps >= 1", file=sys.stderr)
        return 2
    cost = CostModel(Profile.load(args.profile))
    sla = Sla.parse(args.sla) if args.sla else default_sla(cost)
    rates = phase_rates(cost, args.workers, args.utilization)
    if args.rates:
        rates = dict(zip(PHASES, (float(v) for v in args.rates.split(","))))
    print(f"SLA {sla}; rates {rates} requests/s; {args.phase_s:g} s a phase", file=sys.stderr)
    results = run(args, cost, sla, rates)
    _print(results)
    if args.out is not None:
        args.out.write_text(json.dumps({"sla": str(sla), "rates": rates,
                                        "args": {k: str(v) for k, v in vars(args).items()},
                                        "results": results}, indent=1) + "\n")
    return 0


def run(args: argparse.Namespace, cost: CostModel, sla: Sla, rates: dict[str, float]
        ) -> dict[str, list[dict]]:
    import ray

    from deploy.ray_launcher import RayDeployment, start_local_ray
    from kvferry.transfer.ray.send import NAMESPACE

    start_local_ray(namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    n = args.workers
    fixed = {f"{p}P+{n - p}D": Layout(p, n - p) for p in range(1, n)}
    start = Layout(n // 2, n - n // 2)
    layouts = {**fixed, "planner": start}
    deployments = {}
    client = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    try:
        for name, layout in layouts.items():
            deployments[name] = RayDeployment(
                model=args.model or tiny_model(), num_prefill=layout.num_prefill,
                num_decode=layout.num_decode, router_args=["--metrics-port", "0"],
                torch_threads=1).start()
        results: dict[str, list[dict]] = {name: [] for name in layouts}
        names = list(deployments)
        for rep in range(args.reps):
            # each rep starts one layout later, so each runs first, second, ... in turn
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                deployment = deployments[name]
                began = time.monotonic()
                if name == "planner":
                    out = run_planner_rep(client, deployment, cost, sla, n, start, rates,
                                          args, rep)
                else:
                    records = send_phases(client, deployment.router_address, rates,
                                          args.phase_s, rep)
                    out = _summary(sla, records, time.monotonic() - began)
                results[name].append(out)
                print(f"  rep {rep} {name}: attainment {out['attainment']:.1%} "
                      f"(A {out['by_phase']['A']:.1%}, B {out['by_phase']['B']:.1%}), "
                      f"{out['failed']} failed; p90 {out['p90_ms']}; "
                      f"planner CPU {out.get('planner_cpu_s', 0.0)} s; "
                      f"{[x[:2] for x in out.get('layouts', [])]}", file=sys.stderr)
        return results
    finally:
        client.shutdown()
        for deployment in deployments.values():
            deployment.stop()
        ray.shutdown()


def _print(results: dict[str, list[dict]]) -> None:
    def cell(values: list[float], fmt: str) -> str:
        return (f"{format(statistics.median(values), fmt)} "
                f"[{format(min(values), fmt)}-{format(max(values), fmt)}]")

    best = max((n for n in results if n != "planner"),
               key=lambda n: statistics.median(r["attainment"] for r in results[n]))
    print(f"{'layout':<10} {'attainment':>24} {'goodput req/s':>22} {'A':>8} {'B':>8} failed")
    for name, runs in results.items():
        print(f"{name:<10} {cell([r['attainment'] for r in runs], '.1%'):>24} "
              f"{cell([r['goodput_rps'] for r in runs], '.2f'):>22} "
              f"{statistics.median(r['by_phase']['A'] for r in runs):>8.1%} "
              f"{statistics.median(r['by_phase']['B'] for r in runs):>8.1%} "
              f"{sum(r['failed'] for r in runs)}")
    planner = statistics.median(r["attainment"] for r in results["planner"])
    fixed = statistics.median(r["attainment"] for r in results[best])
    print(f"planner / best fixed split ({best}): attainment {planner / fixed:.2f}x"
          if fixed else f"best fixed split ({best}) met no request")


if __name__ == "__main__":
    sys.exit(main())
