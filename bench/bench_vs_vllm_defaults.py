"""kvferry against vLLM's CPU build, each started as a user starts it, with its defaults, in
one run (issue 62): start-up time cold and warm, resident memory, the interference scenario
and closed-loop throughput, all through one client.

  vllm:    `vllm serve DIR --dtype float32 --max-model-len 2048` with the env of
           bench/vllm_peer.py (VLLM_CPU_KVCACHE_SPACE=2), 127.0.0.1 and a free port;
  kvferry: `kvferry serve --model DIR` (one prefill and one decode worker and a router, its
           pool sizes, placement and compile mode its own), a free gRPC and HTTP port.

The client is kvferry's load generator, openai-completions backend (deploy/loadgen), for both
engines: the same token-id prompts at the same seeded arrival times, timed with the same
definitions (TTFT: send to first content chunk; ITL: every gap between content chunks).

Per repetition, for each engine in turn (the order rotates each repetition):
  cold start: fresh cache directories (kvferry: KVFERRY_HOME, KVFERRY_COMPILE_CACHE; vLLM:
              VLLM_CACHE_ROOT; both: TORCHINDUCTOR_CACHE_DIR), launch to the first completed
              request, stopped; the model's files stay in the OS page cache either way;
  warm start: the same caches again, launch to the first completed request; then, on that
              server: resident memory (RSS summed over the engine's whole process tree, from
              /proc), then
  unloaded:   --num-requests short requests (--short-input -> --short-output tokens), Poisson
              arrivals at --rate req/s; short requests' ITL and TTFT p50/p99;
  loaded:     the same stream with long prompts (--long-input -> --long-output) as
              --long-fraction of the requests; the short requests' ITL and TTFT p50/p99 and
              the long ones' TTFT p50/p99;
  C=...:      closed loop of C clients for each --concurrency, max(8, 4 x C) short requests
              after C warm-ups: output tok/s, TTFT p50, TPOT p50;
  and the RSS again after the load.
vLLM 0.32.0 (CPU) with torch 2.13 fails to load its own AOT compile cache on the warm start
("Compiling model again due to a load failure ... 'function' object has no attribute
'finalize_loading'", in its log) and compiles again, helped by inductor's cache: that is its
default warm start here, and what the warm figure measures.
Reported per figure, median [min-max] over repetitions, and kvferry / vLLM taken within each
repetition (for every figure here but throughput, lower is better). Usage:

    .venv/bin/python bench/bench_vs_vllm_defaults.py [--model default|tiny|PATH]
        [--engines vllm,kvferry] [--repeats 3] [--num-requests 40] [--rate 1]
        [--concurrency 8 32] [--kvferry-args FLAGS] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script too
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "kernels"))
from bench.bench_vs_vllm import Spread, checkpoint_dir, spread  # noqa: E402
from bench.vllm_peer import (  # noqa: E402
    DEFAULT_VLLM_VENV,
    REPO,
    SERVER_START_TIMEOUT_S,
    VLLM_ENV,
    VLLM_SERVE_ARGS,
    VLLM_VERSION,
    ScriptParser,
    ensure_vllm,
    stop_group,
    tail,
)
from deploy.default_model import BENCH_MODEL_HELP  # noqa: E402
from deploy.loadgen import BenchConfig, MixedWorkload, RandomWorkload  # noqa: E402
from deploy.loadgen.bench import run_endpoint  # noqa: E402
from deploy.loadgen.metrics import RequestRecord, Stats  # noqa: E402
from deploy.loadgen.openai_client import Codec  # noqa: E402
from deploy.loadgen.targets import Endpoint, Target  # noqa: E402
from kvferry.rpc.grpc_util import free_port  # noqa: E402
from kvferry.settings import KVFERRY_HOME  # noqa: E402

ENGINES = ("vllm", "kvferry")
VLLM_MAX_MODEL_LEN = int(VLLM_SERVE_ARGS[VLLM_SERVE_ARGS.index("--max-model-len") + 1])
PROBE_PROMPT = [1, 2, 3, 4]  # token ids of the start-up probe, one token asked
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# ---- figures (pure) -------------------------------------------------------------------------

class PhaseFigures(NamedTuple):
    """One open-loop phase: short requests' latencies, long ones' TTFT (None: none sent)."""

    short_itl_p50_ms: float
    short_itl_p99_ms: float
    short_ttft_p50_ms: float
    short_ttft_p99_ms: float
    long_ttft_p50_ms: float | None
    long_ttft_p99_ms: float | None
    num_failed: int


class LoopFigures(NamedTuple):
    """One closed-loop run at concurrency C."""

    output_tok_s: float
    ttft_p50_ms: float
    tpot_p50_ms: float
    num_failed: int


def _pcts(values_s: Sequence[float]) -> tuple[float, float] | None:
    """(p50, p99) in ms, numpy's linear percentiles (the load generator's), or None."""
    if not values_s:
        return None
    stats = Stats.of(values_s, (50.0, 99.0))
    return stats.percentile_ms(50.0), stats.percentile_ms(99.0)


def phase_figures(records: Sequence[RequestRecord]) -> PhaseFigures:
    """The figures of one phase's records, by tag: "long" ones, and every other (short)."""
    done = [r for r in records if r.is_success]
    short = [r for r in done if r.tag != "long"]
    itl = _pcts([gap for r in short for gap in r.itls_s]) or (math.nan, math.nan)
    ttft = _pcts([r.ttft_s for r in short]) or (math.nan, math.nan)
    long = _pcts([r.ttft_s for r in done if r.tag == "long"]) or (None, None)
    return PhaseFigures(*itl, *ttft, *long, len(records) - len(done))


class EngineRun(NamedTuple):
    """One engine in one repetition: figure name -> value (names: FIGURE_LABELS' keys)."""

    engine: str
    repeat: int
    figures: dict[str, float]
    num_failed: int


def run_figures(cold_s: float | None, warm_s: float, rss_bytes: int, rss_after_bytes: int,
                phases: dict[str, PhaseFigures], loops: dict[int, LoopFigures]
                ) -> dict[str, float]:
    """The flat figures of one engine's repetition, in the order the table prints them."""
    out: dict[str, float] = {}
    if cold_s is not None:
        out["cold_start_s"] = cold_s
    out["warm_start_s"] = warm_s
    out["rss_mib"] = rss_bytes / 2**20
    for phase, figures in phases.items():
        for name, value in figures._asdict().items():
            if name != "num_failed" and value is not None:
                out[f"{phase}.{name}"] = value
    for concurrency, loop in loops.items():
        for name, value in loop._asdict().items():
            if name != "num_failed":
                out[f"c{concurrency}.{name}"] = value
    out["rss_after_load_mib"] = rss_after_bytes / 2**20
    return out


class SummaryRow(NamedTuple):
    """One figure: each engine's median [min-max]; kvferry / vLLM paired by repetition."""

    figure: str
    by_engine: dict[str, Spread]
    kvferry_over_vllm: Spread | None

    def as_json(self) -> dict[str, Any]:
        ratio = self.kvferry_over_vllm
        return {"figure": self.figure,
                **{e: s.as_json() for e, s in self.by_engine.items()},
                "kvferry_over_vllm": ratio.as_json() if ratio else None}


def summarize(runs: Sequence[EngineRun]) -> list[SummaryRow]:
    """A row per figure any run has, in the order the runs list them."""
    names = list(dict.fromkeys(name for run in runs for name in run.figures))
    rows = []
    for name in names:
        values = {e: {r.repeat: r.figures[name] for r in runs
                      if r.engine == e and name in r.figures
                      and not math.isnan(r.figures[name])} for e in ENGINES}
        by_engine = {e: spread(list(v.values())) for e, v in values.items() if v}
        paired = [rep for rep in values["kvferry"]
                  if rep in values["vllm"] and values["vllm"][rep] > 0]
        ratios = [values["kvferry"][rep] / values["vllm"][rep] for rep in paired]
        rows.append(SummaryRow(name, by_engine, spread(ratios) if ratios else None))
    return rows


def format_table(rows: Sequence[SummaryRow], engines: Sequence[str]) -> str:
    """Figures down, engines across, then kvferry / vLLM; median [min-max]."""
    width = 26
    ordered = [e for e in ENGINES if e in engines]
    lines = [f"{'figure':<28}" + "".join(f"{e:>{width}}" for e in ordered)
             + f"{'kvferry / vLLM':>{width}}"]
    for row in rows:
        cells = [row.by_engine[e].text(1) if e in row.by_engine else "-" for e in ordered]
        ratio = row.kvferry_over_vllm.text(2) if row.kvferry_over_vllm else "-"
        lines.append(f"{row.figure:<28}" + "".join(f"{c:>{width}}" for c in cells)
                     + f"{ratio:>{width}}")
    return "\n".join(lines)


# ---- processes ------------------------------------------------------------------------------

def tree_pids(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """`pid` and every live descendant (by parent pid, whatever their session)."""
    children: dict[int, list[int]] = {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # exited while listed
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        ppid = int(text.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += children.get(current, [])
    return found


def tree_rss_bytes(pid: int, proc: Path = Path("/proc")) -> int:
    """Resident memory of `pid` and its descendants: the sum of their VmRSS (shared pages
    count once per process, as `ps` adds them up)."""
    total = 0
    for member in tree_pids(pid, proc):
        try:
            status = (proc / str(member) / "status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


def kvferry_command(model: str, grpc_port: int, http_port: int) -> list[str]:
    """`kvferry serve` with nothing but the model and where to listen."""
    script = Path(sys.executable).with_name("kvferry")
    base = [str(script)] if script.is_file() else [sys.executable, "-m", "deploy.cli"]
    return [*base, "serve", "--model", model, "--port", str(grpc_port),
            "--http-port", str(http_port)]


def vllm_command(vllm: Path, model: str, http_port: int) -> list[str]:
    return [str(vllm), "serve", model, "--host", "127.0.0.1", "--port", str(http_port),
            *VLLM_SERVE_ARGS]


def cache_env(engine: str, cache_dir: Path) -> dict[str, str]:
    """The environment that points an engine's compile caches at `cache_dir` (empty: cold)."""
    inductor = {"TORCHINDUCTOR_CACHE_DIR": str(cache_dir / "inductor")}
    if engine == "vllm":
        return {**VLLM_ENV, "VLLM_CACHE_ROOT": str(cache_dir / "vllm"), **inductor}
    home = cache_dir / "kvferry"
    return {"KVFERRY_HOME": str(home), "KVFERRY_COMPILE_CACHE": str(home / "compile-cache"),
            **inductor}


def _probe(url: str) -> str | None:
    """The served model's name once a one-token completion succeeded; None: not yet."""
    try:
        with NO_PROXY.open(f"{url}/v1/models", timeout=10) as response:
            model = str(json.loads(response.read())["data"][0]["id"])
        body = json.dumps({"model": model, "prompt": PROBE_PROMPT, "max_tokens": 1,
                           "temperature": 0}).encode()
        request = urllib.request.Request(f"{url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with NO_PROXY.open(request, timeout=120) as response:
            return model if response.status == 200 else None
    except (OSError, ValueError, KeyError, IndexError):  # not listening, not ready yet
        return None


class Server(NamedTuple):
    url: str  # http://127.0.0.1:PORT
    startup_s: float  # launch to the first completed request
    pid: int


@contextmanager
def started(cmd: list[str], env: dict[str, str], url: str, log: Path,
            timeout_s: float) -> Iterator[Server]:
    """`cmd` in a session of its own, until the block ends; yields once a completion at
    `url` succeeded. Stopped with SIGTERM to its group (kvferry serve stops its workers, vLLM
    its engine core), then SIGKILL to whatever of its process tree is left."""
    with open(log, "ab") as out:
        out.write(f"$ {' '.join(cmd)}\n".encode())
        out.flush()
        launched = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, **env}, start_new_session=True)
    members = [proc.pid]
    try:
        while _probe(url) is None:
            if proc.poll() is not None:
                raise RuntimeError(f"{Path(cmd[0]).name} exited {proc.returncode}: {tail(log)}")
            if time.monotonic() - launched > timeout_s:
                raise RuntimeError(f"{url}: no completion {timeout_s:.0f} s after launch: "
                                   f"{tail(log)}")
            time.sleep(0.5)
        startup_s = time.monotonic() - launched
        members = tree_pids(proc.pid)
        yield Server(url, startup_s, proc.pid)
    finally:
        members = list(dict.fromkeys(members + tree_pids(proc.pid)))
        stop_group(proc, signal.SIGTERM, grace_s=60.0)
        for pid in members[1:]:  # workers in sessions of their own, if any outlived it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# ---- one engine, one repetition -------------------------------------------------------------

class Workloads(NamedTuple):
    """Every request list, built once: both engines get the very same ones."""

    phases: dict[str, list]  # "unloaded" / "loaded" -> BenchRequests
    loops: dict[int, list]  # concurrency -> BenchRequests
    vocab_size: int


def build_workloads(args: argparse.Namespace, vocab_size: int) -> Workloads:
    short = RandomWorkload(input_len=args.short_input, output_len=args.short_output)
    long = RandomWorkload(input_len=args.long_input, output_len=args.long_output)
    unloaded = MixedWorkload((("short", short, 1.0),))
    loaded = MixedWorkload((("short", short, 1.0 - args.long_fraction),
                            ("long", long, args.long_fraction)))
    # Prompts differ between phases and loops (seeds apart), so that none of them finds
    # another's in a prefix cache; arrival times are seeded by args.seed in both phases.
    phases = {name: w.build(args.num_requests, vocab_size, args.seed + offset)
              for name, w, offset in (("unloaded", unloaded, 0), ("loaded", loaded, 1000))}
    loops = {c: short.build(num_prompts_at(args, c), vocab_size, args.seed + 2000 + c)
             for c in args.concurrency}
    return Workloads(phases, loops, vocab_size)


def num_prompts_at(args: argparse.Namespace, concurrency: int) -> int:
    return args.num_prompts or max(8, 4 * concurrency)


def _send(name: str, url: str, requests: list, config: BenchConfig):
    target = Target(name, base_url=f"{url}/v1", backend="openai-completions")
    return asyncio.run(run_endpoint(target, Endpoint(None, f"{url}/v1"), requests, config))[0]


def measure_on(server: Server, engine: str, args: argparse.Namespace,
               work: Workloads) -> tuple[dict[str, PhaseFigures], dict[int, LoopFigures]]:
    """The open-loop phases, then the closed loops, against a running server."""
    phases = {}
    for phase, requests in work.phases.items():
        config = BenchConfig(num_requests=len(requests), request_rates=(args.rate,),
                             num_warmups=2, seed=args.seed, vocab_size=work.vocab_size,
                             percentiles=(50.0, 99.0))
        phases[phase] = phase_figures(_send(f"{engine}-{phase}", server.url, requests,
                                            config).records)
        print(f"  {engine} {phase}: {_phase_line(phases[phase])}", flush=True)
    loops = {}
    for concurrency, requests in work.loops.items():
        config = BenchConfig(num_requests=len(requests), request_rates=(math.inf,),
                             max_concurrency=concurrency, num_warmups=concurrency,
                             seed=args.seed, vocab_size=work.vocab_size,
                             percentiles=(50.0, 99.0))
        m = _send(f"{engine}-c{concurrency}", server.url, requests, config).metrics
        loops[concurrency] = LoopFigures(m.output_throughput, m.ttft.median_ms,
                                         m.tpot.median_ms, m.failed)
        print(f"  {engine} C={concurrency}: {m.output_throughput:.1f} tok/s, TTFT p50 "
              f"{m.ttft.median_ms:.0f} ms, TPOT p50 {m.tpot.median_ms:.1f} ms, "
              f"{m.failed} failed", flush=True)
    return phases, loops


def _phase_line(f: PhaseFigures) -> str:
    long = ("" if f.long_ttft_p50_ms is None else
            f"; long TTFT p50/p99 {f.long_ttft_p50_ms:.0f}/{f.long_ttft_p99_ms:.0f}")
    return (f"short ITL p50/p99 {f.short_itl_p50_ms:.1f}/{f.short_itl_p99_ms:.1f} ms, "
            f"TTFT p50/p99 {f.short_ttft_p50_ms:.0f}/{f.short_ttft_p99_ms:.0f}{long} ms, "
            f"{f.num_failed} failed")


def run_engine(engine: str, repeat: int, args: argparse.Namespace, model: str,
               vllm: Path | None, work: Workloads, log_dir: Path) -> EngineRun:
    """Cold start (unless --no-cold), warm start, memory and the workloads of one engine."""
    caches = log_dir / "caches" / f"{engine}-r{repeat}"
    shutil.rmtree(caches, ignore_errors=True)
    caches.mkdir(parents=True)
    env = cache_env(engine, caches)
    log = log_dir / f"{engine}-r{repeat}.log"

    def launch() -> AbstractContextManager[Server]:
        port = free_port()
        cmd = (vllm_command(vllm, model, port) if engine == "vllm"
               else kvferry_command(model, free_port(), port) + shlex.split(args.kvferry_args))
        return started(cmd, env, f"http://127.0.0.1:{port}", log, args.start_timeout_s)

    cold_s = None
    if args.cold:
        with launch() as server:
            cold_s = server.startup_s
        print(f"  {engine} cold start {cold_s:.1f} s", flush=True)
    with launch() as server:
        rss = tree_rss_bytes(server.pid)
        print(f"  {engine} warm start {server.startup_s:.1f} s, RSS {rss / 2**20:.0f} MiB",
              flush=True)
        phases, loops = measure_on(server, engine, args, work)
        rss_after = tree_rss_bytes(server.pid)
    shutil.rmtree(caches, ignore_errors=True)
    failed = sum(p.num_failed for p in phases.values()) + sum(x.num_failed
                                                              for x in loops.values())
    return EngineRun(engine, repeat,
                     run_figures(cold_s, server.startup_s, rss, rss_after, phases, loops), failed)


def run_all(args: argparse.Namespace, model: str, vllm: Path | None, work: Workloads,
            log_dir: Path) -> list[EngineRun]:
    runs = []
    for repeat in range(args.repeats):
        shift = repeat % len(args.engines)
        for engine in args.engines[shift:] + args.engines[:shift]:
            print(f"repetition {repeat + 1}/{args.repeats}: {engine}", flush=True)
            runs.append(run_engine(engine, repeat, args, model, vllm, work, log_dir))
    return runs


# ---- command line ---------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parsed and checked arguments; bad input: one line on stderr naming the flag, exit 2."""
    p = ScriptParser(prog="bench_vs_vllm_defaults", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help=BENCH_MODEL_HELP)
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated: vllm,kvferry")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=40, help="requests per open-loop phase")
    p.add_argument("--rate", type=float, default=1.0, help="open loop: requests/s, Poisson")
    p.add_argument("--short-input", type=int, default=64)
    p.add_argument("--short-output", type=int, default=128)
    p.add_argument("--long-input", type=int, default=2000)
    p.add_argument("--long-output", type=int, default=8)
    p.add_argument("--long-fraction", type=float, default=0.15,
                   help="loaded phase: the share of long prompts")
    p.add_argument("--concurrency", type=int, nargs="*", default=[8, 32],
                   help="closed loops after the open-loop phases (none: skip them)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests per closed loop (default: max(8, 4 x concurrency))")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kvferry-args", default="",
                   help="flags after kvferry serve's (an ablation, e.g. '--lend-cores off'; "
                        "default none: its defaults)")
    p.add_argument("--no-cold", dest="cold", action="store_false",
                   help="skip the cold start (warm start only)")
    p.add_argument("--start-timeout-s", type=float, default=SERVER_START_TIMEOUT_S)
    p.add_argument("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV)
    p.add_argument("--log-dir", type=Path, default=None,
                   help="servers' logs and the cold caches (default: "
                        "KVFERRY_HOME/logs/bench_vs_vllm_defaults-TIME)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON (default bench/results/bench_vs_vllm_defaults_<model>.json)")
    args = p.parse_args(argv)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if (not args.engines or any(e not in ENGINES for e in args.engines)
            or len(set(args.engines)) != len(args.engines)):
        p.error(f"--engines: expected a subset of {','.join(ENGINES)}, got {args.engines}")
    for name in ("repeats", "num_requests", "short_input", "short_output", "long_input",
                 "long_output"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(c < 1 for c in args.concurrency):
        p.error(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.num_prompts is not None and args.num_prompts < 1:
        p.error(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if not (args.rate > 0 and math.isfinite(args.rate)):
        p.error(f"--rate must be a positive number of requests/s, got {args.rate}")
    if not 0.0 <= args.long_fraction < 1.0:
        p.error(f"--long-fraction must be in [0, 1), got {args.long_fraction}")
    if not args.start_timeout_s > 0:
        p.error(f"--start-timeout-s must be > 0, got {args.start_timeout_s}")
    if "vllm" in args.engines:
        for kind in ("long", "short"):
            total = getattr(args, f"{kind}_input") + getattr(args, f"{kind}_output")
            if total > VLLM_MAX_MODEL_LEN:
                p.error(f"--{kind}-input: {kind} prompt + output is {total} tokens, past "
                        f"vLLM's --max-model-len {VLLM_MAX_MODEL_LEN}")
    args.model_name = args.model if args.model in ("tiny", "default") else Path(args.model).stem
    args.out = args.out or (REPO / "bench" / "results"
                            / f"bench_vs_vllm_defaults_{args.model_name}.json")
    return args


def report(args: argparse.Namespace, model: str, runs: Sequence[EngineRun]) -> dict[str, Any]:
    rows = summarize(runs)
    print(f"model {args.model_name}; {args.repeats} repetition(s), median [min-max]; open "
          f"loop: {args.num_requests} requests at {args.rate:g}/s, short {args.short_input}->"
          f"{args.short_output}, loaded with {args.long_fraction:.0%} long {args.long_input}->"
          f"{args.long_output}; times in ms unless _s, memory in MiB")
    print(format_table(rows, args.engines))
    return {
        "model": args.model_name, "checkpoint": Path(model).name,
        "machine": platform.platform(), "cpus": os.cpu_count(),
        "engines": args.engines, "repeats": args.repeats, "is_cold_measured": args.cold,
        "commands": {"vllm": shlex.join(vllm_command(Path("vllm"), "DIR", 0)),
                     "vllm_env": VLLM_ENV,
                     "kvferry": " ".join(["kvferry serve --model DIR --port FREE --http-port "
                                          "FREE", args.kvferry_args]).strip()},
        "vllm_version": VLLM_VERSION,
        "workload": {k: getattr(args, k) for k in (
            "num_requests", "rate", "short_input", "short_output", "long_input",
            "long_output", "long_fraction", "concurrency", "seed")}
        | {"num_prompts": {str(c): num_prompts_at(args, c) for c in args.concurrency},
           "client": "kvferry bench engine, openai-completions, token-id prompts, greedy, "
                     "ignore_eos"},
        "summary": [row.as_json() for row in rows],
        "runs": [r._asdict() for r in runs],
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    model = checkpoint_dir(args.model)
    log_dir = args.log_dir or KVFERRY_HOME / "logs" / time.strftime(
        "bench_vs_vllm_defaults-%Y%m%d-%H%M%S")
    log_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: servers stopped
    try:
        vllm = ensure_vllm(args.vllm_venv) if "vllm" in args.engines else None
        work = build_workloads(args, Codec.load(Path(model)).vocab_size)
        print(f"model {args.model_name} ({model}); logs {log_dir}", flush=True)
        runs = run_all(args, model, vllm, work, log_dir)
    except (RuntimeError, ValueError, subprocess.CalledProcessError) as exc:
        print(f"bench_vs_vllm_defaults: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench_vs_vllm_defaults: interrupted; servers stopped", file=sys.stderr)
        return 130
    payload = report(args, model, runs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"results: {args.out}")
    failed = sum(r.num_failed for r in runs)
    if failed:
        print(f"bench_vs_vllm_defaults: {failed} requests failed (see {log_dir})",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
