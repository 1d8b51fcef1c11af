"""Where an unloaded token's time goes with `kvferry serve`'s defaults (issue 62).

Starts `kvferry serve --model M` with its defaults (its own placement; tracing on,
kvferry/trace.py) --repeats times, each afresh, and sends --num-requests short requests one
at a time (concurrency 1, greedy, eos ignored; --warmups copies of the first one before).
From the traces, for every streamed token k >= 2 of the measured requests (token 0 comes from
prefill, token 1 joins the decode batch), its producing decode step and its path:

  cycle (consecutive tokens' steps; these two sum to the ITL, give or take the change in
  the path's latency from one token to the next):
    step          the decode step's wall time on the executor thread; split into its thread
                  CPU, the GIL wait (the process's other threads ran meanwhile) and the rest
                  (descheduled: another process had the core)
    between       end of the previous step -> start of this one (scheduling, Python)
    other_cpu     the decode process's CPU outside the step thread over the cycle (its event
                  loop and gRPC's threads, on the same core: what it takes from the step)
  path (the token's latency after its step; on the ITL only through what it takes from the
  decode worker's core or GIL while the next step runs):
    loop_hop      step end -> `deliver` on the worker's event loop
    to_write      deliver -> the DecodeStream update handed to gRPC (`write` t0)
    to_router     handed to gRPC -> the router read it (relay t_in)
    relay         router read -> router wrote it to the client (t_out, taken once the
                  write returned, so the write's own syscalls are here)
    to_client     router write -> the client's arrival (slightly negative when the client
                  read it before the router's write call returned)

Each stage is reported as median [p10-p90] over the tokens of a repetition, then median
[min-max] across repetitions. Also where each process ran: its Cpus_allowed_list, its CPU
seconds over the measured requests (and its busiest threads'), from /proc. Usage:

    .venv/bin/python bench/bench_itl_breakdown.py --model default --out bench/results/X.json
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "kernels"))
from deploy.default_model import BENCH_MODEL_HELP, bench_model  # noqa: E402
from deploy.loadgen import BenchConfig, RandomWorkload  # noqa: E402
from deploy.loadgen.attribution import step_parts  # noqa: E402
from deploy.loadgen.bench import run_target  # noqa: E402
from deploy.loadgen.trace_load import Traces, load  # noqa: E402
from kvferry import trace  # noqa: E402

CYCLE = ("step", "between")
STEP_PARTS = ("step_cpu", "step_gil", "step_desched")
PATH = ("loop_hop", "to_write", "to_router", "relay", "to_client")
STAGES = (*CYCLE, *STEP_PARTS, *PATH, "cycle", "itl", "latency", "other_cpu")
NAME = "itl"  # the bench target's name: measured requests are "bench-itl-inf-<i>"


class Write(NamedTuple):
    t0: float  # the update handed to gRPC (the stream generator yields it)
    t1: float  # the generator resumed


class TokenStages(NamedTuple):
    """One streamed token's stages, seconds (see the module docstring)."""

    request_id: str
    k: int  # token index in its request
    values: dict[str, float]  # STAGES -> seconds


def load_writes(folder: Path) -> dict[str, list[Write]]:
    """Decode workers' `write` events by downstream request id, by t0."""
    writes: dict[str, list[Write]] = defaultdict(list)
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(e, dict) and e.get("ev") == "write" and "t0" in e and "ids" in e:
                for request_id in e["ids"]:
                    writes[str(request_id)].append(Write(float(e["t0"]), float(e["t1"])))
    for by_id in writes.values():
        by_id.sort()
    return dict(writes)


def token_stages(traces: Traces, writes: dict[str, list[Write]],
                 phase: str | None = None) -> list[TokenStages]:
    """Every update k >= 2 of the client's requests in `phase` (None: all) whose path is
    traced whole: updates k-1 and k carry one token each (a merged update is skipped), the
    relays match the arrivals one for one, and the request's steps c-2 and c-1 (c: tokens
    through update k) produced them, ending before the router read them."""
    out = []
    for a in traces.arrivals:
        if phase is not None and a.phase != phase:
            continue
        relays = [r for r in traces.relays.get(a.id, []) if r.n > 0]
        if len(relays) != len(a.t):
            continue
        num_tokens = list(itertools.accumulate(r.n for r in relays))
        for k in range(2, len(a.t)):
            relay, c = relays[k], num_tokens[k]
            steps = traces.steps.get(relay.down, [])
            if relay.n != 1 or relays[k - 1].n != 1 or len(steps) < c - 1:
                continue
            prev, step = steps[c - 3], steps[c - 2]
            if step.t1 > relay.t_in or prev.t1 > relays[k - 1].t_in:
                continue
            deliver = traces.delivers.get((step.worker, step.s))
            by_id = writes.get(relay.down, [])
            i = bisect.bisect_left(by_id, (deliver,)) if deliver is not None else len(by_id)
            if i == len(by_id) or by_id[i].t0 > relay.t_in:
                continue
            write = by_id[i]
            cpu, gil, desched = step_parts(step)
            # The decode process's CPU outside the step thread, from the end of the previous
            # step to the end of this one: its event loop, gRPC's threads (same core).
            other = step.pcpu_s - step.cpu_s + (step.p0 - prev.p1 if step.p0 is not None
                                                 and prev.p1 is not None else 0.0)
            values = {
                "step": step.t1 - step.t0, "between": step.t0 - prev.t1,
                "step_cpu": cpu, "step_gil": gil, "step_desched": desched,
                "loop_hop": deliver - step.t1, "to_write": write.t0 - deliver,
                "to_router": relay.t_in - write.t0, "relay": relay.t_out - relay.t_in,
                "to_client": a.t[k] - relay.t_out,
                "cycle": step.t1 - prev.t1, "itl": a.t[k] - a.t[k - 1],
                "latency": a.t[k] - step.t1, "other_cpu": other}
            out.append(TokenStages(a.id, k, values))
    return out


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, linear between order statistics."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(tokens: Sequence[TokenStages]) -> dict[str, tuple[float, float, float]]:
    """Stage -> (p10, median, p90) in ms over the tokens."""
    return {stage: tuple(1e3 * quantile([t.values[stage] for t in tokens], q)
                         for q in (0.1, 0.5, 0.9))
            for stage in STAGES if stage in tokens[0].values} if tokens else {}


def across(runs: Sequence[dict[str, tuple[float, float, float]]]
           ) -> dict[str, tuple[float, float, float]]:
    """Stage -> (min, median, max) over the repetitions of each repetition's median."""
    out = {}
    for stage in STAGES:
        medians = sorted(r[stage][1] for r in runs if stage in r)
        if medians:
            out[stage] = (medians[0], statistics.median(medians), medians[-1])
    return out


LABELS = {"step": "decode step (wall)", "step_cpu": "  its thread CPU",
          "step_gil": "  GIL wait", "step_desched": "  descheduled",
          "other_cpu": "decode process, other threads' CPU",
          "between": "step end -> next step start", "cycle": "cycle (step + between)",
          "loop_hop": "step end -> deliver (loop)", "to_write": "deliver -> gRPC write",
          "to_router": "gRPC write -> router read", "relay": "router read -> write",
          "to_client": "router write -> client", "latency": "step end -> client (path)",
          "itl": "client ITL"}


def format_table(runs: Sequence[dict[str, tuple[float, float, float]]]) -> str:
    """Per stage: median [p10-p90] of each repetition, then the median [min-max] of the
    repetitions' medians; the step's share of the ITL and the cycle's sum against it."""
    lines = [f"{'stage, ms':<36} " + "  ".join(f"{'rep ' + str(i + 1):>20}"
                                                for i in range(len(runs)))
             + f"  {'across reps':>22}"]
    agg = across(runs)
    for stage in ("itl", "cycle", "step", "step_cpu", "step_gil", "step_desched", "between",
                  "other_cpu", "latency", *PATH):
        if stage not in agg:  # untraced: the client's ITL only
            continue
        cells = [f"{r[stage][1]:7.2f} [{r[stage][0]:6.2f}-{r[stage][2]:6.2f}]"
                 if stage in r else f"{'-':>20}" for r in runs]
        lo, mid, hi = agg.get(stage, (float("nan"),) * 3)
        lines.append(f"{LABELS[stage]:<36} " + "  ".join(cells)
                     + f"  {mid:7.2f} [{lo:6.2f}-{hi:6.2f}]")
    if "itl" in agg and "step" in agg:
        itl = agg["itl"][1]
        lines.append(f"step / ITL {agg['step'][1] / itl:.2f}; step thread CPU / ITL "
                     f"{agg['step_cpu'][1] / itl:.2f}; (step + between) / ITL "
                     f"{(agg['step'][1] + agg['between'][1]) / itl:.2f}")
    return "\n".join(lines)


# ---- processes: where each ran and what it spent -------------------------------------------
def _cpus_allowed(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    return "?"


def _ticks(path: Path) -> float:
    """utime + stime seconds of a /proc/.../stat file."""
    fields = path.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _thread_cpu(pid: int) -> dict[str, float]:
    """Thread -> CPU seconds: "main" (the event loop), "python-<tid>" for each other Python
    thread (a decode worker's step thread among them), other names summed (gRPC's
    event_engine pool)."""
    out: dict[str, float] = defaultdict(float)
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            name = ("main" if task.name == str(pid)
                    else f"{comm}-{task.name}" if comm == "python" else comm)
            out[name] += _ticks(task / "stat")
        except OSError:  # the thread ended
            continue
    return dict(out)


ROLES = {"router": "router", "prefill-worker": "prefill", "decode-worker": "decode",
         "colocated-worker": "colocated"}  # deploy.cli command -> role


def _roles(serve_pid: int) -> dict[str, int]:
    """Role -> pid of serve's processes (a second of a role: "<role>-<pid>"), from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text()
                                               .rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):  # ended meanwhile
                continue
    tree, grown = {serve_pid}, True
    while grown:
        found = {pid for pid, parent in parents.items() if parent in tree}
        grown = not found <= tree
        tree |= found
    roles = {}
    for pid in sorted(tree - {serve_pid}):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
        except OSError:
            continue
        role = next((ROLES[a] for a in argv if a in ROLES), None)
        if role is not None:
            roles[role if role not in roles else f"{role}-{pid}"] = pid
    return roles


def snapshot(roles: dict[str, int]) -> dict[str, dict[str, object]]:
    """Per role: pid, allowed CPUs, CPU seconds so far, per-thread CPU seconds."""
    out = {}
    for role, pid in roles.items():
        out[role] = {"pid": pid, "cpus": _cpus_allowed(pid),
                     "cpu_s": _ticks(Path(f"/proc/{pid}/stat")), "threads": _thread_cpu(pid)}
    return out


def spent(before: dict[str, dict], after: dict[str, dict], wall_s: float
          ) -> dict[str, dict[str, object]]:
    """Per role: allowed CPUs, CPU seconds between the snapshots, that as a share of the wall
    time, and the threads that spent more than 1% of it."""
    out = {}
    for role, a in after.items():
        b = before.get(role, {"cpu_s": 0.0, "threads": {}})
        threads = {name: round(s - b["threads"].get(name, 0.0), 2)
                   for name, s in a["threads"].items()}
        out[role] = {"pid": a["pid"], "cpus": a["cpus"],
                     "cpu_s": round(a["cpu_s"] - b["cpu_s"], 2),
                     "cpu_share": round((a["cpu_s"] - b["cpu_s"]) / wall_s, 3),
                     "threads": {n: s for n, s in sorted(threads.items(), key=lambda x: -x[1])
                                 if s > 0.01 * wall_s}}
    return out


def format_processes(runs: Sequence[dict[str, object]], num_tokens: int) -> str:
    """Per process: where it may run, its CPU seconds over the measured requests (median
    [min-max] over the repetitions), per streamed token, and its busiest threads' share."""
    lines = [f"{'process':<10} {'cpus':<6} {'CPU s over the run':>22} {'ms/token':>9}  "
             "threads (first repetition, CPU s)"]
    for role, first in runs[0]["processes"].items():
        if role == "serve":
            continue
        values = sorted(r["processes"][role]["cpu_s"] for r in runs if role in r["processes"])
        mid = statistics.median(values)
        threads = ", ".join(f"{n} {v}" for n, v in list(first["threads"].items())[:4])
        lines.append(f"{role:<10} {first['cpus']:<6} {mid:>8.2f} [{values[0]:.2f}-"
                     f"{values[-1]:.2f}] {1e3 * mid / num_tokens:>9.2f}  {threads}")
    return "\n".join(lines)


# ---- one repetition ------------------------------------------------------------------------
@contextmanager
def served(model: str, folder: Path | None) -> Iterator[tuple[str, int, str]]:
    """`kvferry serve --model M` with its defaults, traced into `folder` (None: untraced):
    (router address, serve's pid, its placement log line)."""
    log = tempfile.TemporaryFile("w+")
    serve = subprocess.Popen([sys.executable, "-m", "deploy.cli", "serve", "--model", model,
                              "--port", "0", "--http-port", "off"],
                             stdout=subprocess.PIPE, stderr=log, text=True,
                             env={**os.environ, **({} if folder is None
                                                   else {trace.TRACE_ENV: str(folder)})})
    try:
        assert serve.stdout is not None  # noqa: S101 - PIPE
        line = serve.stdout.readline()
        log.seek(0)
        if "serving on " not in line:
            raise RuntimeError(f"kvferry serve did not start (exit code {serve.wait()}): "
                               f"{log.read()[-2000:]}")
        placement = next((x.split("placement: ", 1)[1].strip() for x in log
                          if "placement: " in x), "not logged")
        yield line.split("serving on ")[1].split()[0], serve.pid, placement
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(120)
        log.close()


def repetition(args: argparse.Namespace, model: str, folder: Path | None
               ) -> dict[str, object]:
    """One fresh serve: warm-ups, then the measured requests one at a time; their stages
    (traced), or only the client's ITLs of tokens k >= 2 (`folder` None: untraced)."""
    workload = RandomWorkload(input_len=args.input_len, output_len=args.output_len,
                              range_ratio=0.0)
    config = BenchConfig(num_requests=args.num_requests, request_rates=(float("inf"),),
                         max_concurrency=1, seed=args.seed, vocab_size=512)
    requests = workload.build(args.num_requests, 512, args.seed)
    trace.switch("client", folder)
    try:
        with served(model, folder) as (address, serve_pid, placement):
            warm = BenchConfig(num_requests=1, request_rates=(float("inf"),),
                               max_concurrency=1, num_warmups=args.warmups - 1,
                               seed=args.seed, vocab_size=512)
            asyncio.run(run_target("warmup", address, requests[:1], warm))
            roles = {**_roles(serve_pid), "client": os.getpid()}
            load_before = os.getloadavg()[0]
            before, t0 = snapshot(roles), time.monotonic()
            run = asyncio.run(run_target(NAME, address, requests, config))[0]
            wall_s = time.monotonic() - t0
            processes = spent(before, snapshot(roles), wall_s)
    finally:
        trace.switch("client", None)
    failed = [r for r in run.records if not r.is_success]
    if folder is None:
        tokens = [TokenStages("", k + 1, {"itl": itl}) for r in run.records
                  for k, itl in enumerate(r.itls_s) if k >= 1]
    else:
        tokens = token_stages(load(folder), load_writes(folder), f"bench-{NAME}-inf")
    return {"placement": placement, "processes": processes, "wall_s": round(wall_s, 2),
            "load_avg_1min": (load_before, os.getloadavg()[0]),
            "num_failed": len(failed), "num_tokens": len(tokens),
            "stages_ms": summarize(tokens)}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help=BENCH_MODEL_HELP)
    parser.add_argument("--repeats", type=int, default=3, help="fresh serve each (default 3)")
    parser.add_argument("--num-requests", type=int, default=6, help="measured, one at a time")
    parser.add_argument("--warmups", type=int, default=3, help="requests before (>= 1)")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace-dir", type=Path, default=None,
                        help="keep the traces here (DIR/rep-<n>; default: a temporary folder)")
    parser.add_argument("--untraced", action="store_true",
                        help="tracing off: the client's ITL and the processes' CPU only (what "
                             "tracing costs: every traced process also wakes every 5 ms to "
                             "probe its event loop's lag)")
    parser.add_argument("--out", type=Path, default=None, help="JSON results")
    args = parser.parse_args(argv)
    if args.warmups < 1:
        parser.error("--warmups: at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop serve on the way out
    model = bench_model(args.model)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        root = args.trace_dir or Path(tmp)
        for i in range(args.repeats):
            run = repetition(args, model, None if args.untraced else root / f"rep-{i + 1}")
            runs.append(run)
            print(f"repetition {i + 1}/{args.repeats}: {run['num_tokens']} tokens, "
                  f"ITL median {run['stages_ms'].get('itl', (0, float('nan')))[1]:.2f} ms; "
                  f"machine load {run['load_avg_1min'][0]:.1f}->{run['load_avg_1min'][1]:.1f}; "
                  f"processes: " + ", ".join(f"{role} on {p['cpus']} {p['cpu_s']} s"
                                             for role, p in run["processes"].items()),
                  flush=True)
    table = format_table([r["stages_ms"] for r in runs])
    print(f"model {model}; serve defaults, placement: {runs[0]['placement']}")
    print(f"{args.num_requests} requests one at a time, {args.input_len} -> {args.output_len}"
          f" tokens, {args.repeats} repetitions; per repetition median [p10-p90], across "
          f"repetitions median [min-max] of the medians")
    print(table)
    processes = format_processes(runs, args.num_requests * args.output_len)
    print(processes)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"args": {k: str(v) for k, v in vars(args).items()},
                   "model": Path(model).name, "machine": platform.platform(),
                   "num_cpus": os.cpu_count(), "table": table, "processes": processes,
                   "across_ms": across([r["stages_ms"] for r in runs]), "runs": runs}
        args.out.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
