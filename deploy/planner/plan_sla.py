"""`kvferry plan --sla ... --workload ...`: reads the profile and the workload, searches the
layouts (deploy/planner/search.py) and prints every candidate's goodput and predicted
percentiles, the recommendation first. Bad input: one line, exit status 2."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from deploy.eviction_args import eviction_config
from deploy.parser import comma_ints
from deploy.planner.profile import PROFILES_DIR, CostModel, Profile
from deploy.planner.search import Outcome, Sla, layouts, search
from deploy.planner.workloads import load_workload
from kvferry.cache.budget import KvBudget


def _profile_path(given: Path | None) -> Path:
    if given is not None:
        return given
    found = sorted(PROFILES_DIR.glob("*.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise ValueError(f"profile: none under {PROFILES_DIR}: run `kvferry profile` first, "
                         "or give --profile FILE")
    return found[-1]


def _thresholds(text: str) -> tuple[int, ...]:
    try:
        return comma_ints(text, 0)
    except ValueError as exc:
        raise ValueError(f"local_prefill_thresholds: {exc}") from None


def _row(o: Outcome) -> str:
    p = o.percentiles_ms
    return (f"{str(o.layout):<32} {o.layout.num_workers:>7} {o.goodput:>9.2f} "
            f"{o.goodput_per_worker:>10.2f} {o.rate:>7.2f} {p['ttft_p50_ms']:>9.1f} "
            f"{p['ttft_p90_ms']:>9.1f} {p['itl_p50_ms']:>8.2f} {p['itl_p90_ms']:>8.2f} "
            f"{o.attainment:>6.0%}")


def run_sla_plan(args: argparse.Namespace) -> int:
    try:
        if args.sla is None or args.workload is None:
            raise ValueError("sla: give --sla and --workload together")
        sla = Sla.parse(args.sla)
        if args.max_workers < 1:
            raise ValueError(f"max_workers: must be >= 1, got {args.max_workers}")
        if args.request_rate is not None and not args.request_rate > 0:
            raise ValueError(f"request_rate: must be > 0, got {args.request_rate}")
        thresholds = _thresholds(args.local_prefill_thresholds)
        path = _profile_path(args.profile)
        profile = Profile.load(path)
        cost = CostModel(profile, kv_budget=KvBudget(eviction_config(args)))
        requests, trace_rate = load_workload(args.workload, args.num_requests)
    except (ValueError, OSError) as exc:
        print(f"kvferry: plan: {exc}", file=sys.stderr)
        return 2
    print(f"profile: {path} ({profile.model}, {profile.dtype} on {profile.device}, "
          f"{profile.torch_threads} thread(s) per worker, K/V over {profile.kv_transport})")
    print(f"workload: {args.workload}, {len(requests)} requests"
          + (f" (its own rate: {trace_rate:.2f}/s)" if trace_rate else ""))
    outcomes = search(cost, requests, sla, layouts(args.max_workers, thresholds),
                      args.request_rate)
    print(f"SLA {sla}: goodput = the highest rate (requests/s) meeting it; predictions at "
          + (f"{args.request_rate:g}/s" if args.request_rate else "each layout's goodput"))
    print(f"{'layout':<32} {'workers':>7} {'goodput':>9} {'per worker':>10} {'rate':>7} "
          f"{'TTFT p50':>9} {'TTFT p90':>9} {'ITL p50':>8} {'ITL p90':>8} {'attain':>6}")
    for outcome in outcomes:
        print(_row(outcome))
    best = outcomes[0]
    if best.goodput == 0 or (args.request_rate and best.goodput < args.request_rate):
        print("recommendation: none of these layouts meets the SLA"
              + (f" at {args.request_rate:g}/s" if args.request_rate else "")
              + f" within {args.max_workers} workers")
        return 1
    print(f"recommendation: {best.layout} ({best.layout.num_workers} workers): "
          f"{best.goodput:.2f} requests/s within the SLA, {best.goodput_per_worker:.2f} per "
          "worker")
    return 0
