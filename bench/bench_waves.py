"""A closed loop's waves on serve's placement, with and without idle cores lent (issue 62).

Starts the deployment `kvferry serve` starts (one prefill and one decode worker, each on
cores of its own, compiled, traced: kvferry/trace.py), `--lend-cores` on and off in turn,
`--repeats` times each, and runs a closed loop of `--concurrency` clients, each sending
`--requests` requests of `--input-len` random token ids for `--output-len` tokens (greedy, eos
ignored) after one warm-up request each. From the prefill worker's trace: each prefill
forward's tokens (a whole wave is concurrency x input-len tokens) and how many decode steps
ran during it (the decode worker busy: no core to lend); from the client: TTFT p50 and output
tok/s. Figures are median [min-max] over repetitions. Usage:

    .venv/bin/python bench/bench_waves.py --model default [--concurrency 8] [--requests 3]
        [--repeats 3] [--out bench/results/bench_waves_smollm2.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "kernels"))
from bench.bench_compile_dynamic import span  # noqa: E402
from deploy import client  # noqa: E402
from deploy.default_model import BENCH_MODEL_HELP, bench_model  # noqa: E402
from deploy.launcher import Deployment  # noqa: E402
from kvferry.trace import TRACE_ENV  # noqa: E402

ARMS = ("on", "off")


async def closed_loop(address: str, args: argparse.Namespace, seed: int
                      ) -> tuple[float, list[float], int]:
    """Warm-up, then the loop: (its start on the monotonic clock, every TTFT, tokens)."""
    rng = random.Random(seed)

    def request() -> object:
        prompt = [rng.randrange(100, 30000) for _ in range(args.input_len)]
        return client.make_request(prompt, temperature=0.0, max_tokens=args.output_len,
                                   ignore_eos=True)

    async def one_client(count: int) -> list[client.Completion]:
        return [await client.generate(address, request(), 600) for _ in range(count)]

    await asyncio.gather(*(one_client(1) for _ in range(args.concurrency)))
    start = time.monotonic()
    done = await asyncio.gather(*(one_client(args.requests) for _ in range(args.concurrency)))
    completions = [c for per_client in done for c in per_client]
    return start, [c.ttft_s for c in completions], sum(len(c.token_ids) for c in completions)


def read_events(folder: Path) -> list[dict]:
    """Every event every process of the run wrote (kvferry/trace.py's JSON lines)."""
    return [json.loads(line) for path in sorted(folder.glob("*.jsonl"))
            for line in path.read_text().splitlines() if line.strip()]


def waves(events: list[dict], since: float) -> tuple[list[int], list[int]]:
    """Each prefill forward's tokens after `since`, and the decode steps overlapping it."""
    forwards = sorted((e for e in events if e.get("ev") == "prefill" and e["t0"] >= since),
                      key=lambda e: e["t0"])
    steps = [e for e in events if e.get("ev") == "step" and e["t0"] >= since]
    overlaps = [sum(1 for s in steps if s["t1"] > f["t0"] and s["t0"] < f["t1"])
                for f in forwards]
    return [int(f["tokens"]) for f in forwards], overlaps


def run_arm(model: str, arm: str, args: argparse.Namespace, seed: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvferry-waves-") as tmp:
        traces, logs = Path(tmp) / "trace", Path(tmp) / "logs"
        traces.mkdir()
        logs.mkdir()
        deployment = Deployment(model=model, pin_cores=True, lend_cores=arm == "on",
                                torch_threads=0, kv_pool_size="auto", log_dir=logs,
                                env={TRACE_ENV: str(traces)})
        with deployment:
            started = time.monotonic()
            start, ttfts, tokens = asyncio.run(closed_loop(deployment.router_address, args,
                                                           seed))
            elapsed = time.monotonic() - start
        sizes, overlaps = waves(read_events(traces), start)
    whole = args.concurrency * args.input_len
    return {"arm": arm, "ttft_p50_ms": statistics.median(ttfts) * 1000,
            "output_tok_s": tokens / elapsed, "forwards": sizes, "overlapping_steps": overlaps,
            "whole_waves": sum(1 for n in sizes if n == whole), "start_s": start - started}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help=BENCH_MODEL_HELP)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=3, help="per client, after one warm-up")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS,
                   help="--lend-cores auto (on) and off")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    model = bench_model(args.model)
    runs = []
    for repeat in range(args.repeats):
        for arm in (args.arms if repeat % 2 == 0 else list(reversed(args.arms))):
            run = run_arm(model, arm, args, seed=repeat)
            print(f"repetition {repeat + 1} lending {arm}: TTFT p50 {run['ttft_p50_ms']:.0f} "
                  f"ms, {run['output_tok_s']:.1f} tok/s, forwards {run['forwards']}, decode "
                  f"steps during each {run['overlapping_steps']}", flush=True)
            runs.append(run)
    summary = {arm: {key: span([r[key] for r in runs if r["arm"] == arm])
                     for key in ("ttft_p50_ms", "output_tok_s", "whole_waves")}
               for arm in args.arms}
    for arm, figures in summary.items():
        print(f"lending {arm}: " + ", ".join(f"{k} {v}" for k, v in figures.items()))
    if args.out is not None:
        args.out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items()
                                                 if k != "out"},
                                        "runs": runs, "summary": summary}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
