"""Decode throughput (generated tokens/s) at several concurrencies, in one run.

Starts one deployment (router + 1 prefill + 1 decode worker, or one colocated worker with
--colocated) on `--model` (the tiny seeded model unless told; `--model default` is the real
default model), then for each concurrency C runs C clients in a closed
loop, each sending enough requests of `--prompt-tokens` prompt tokens and exactly
`--max-tokens` output tokens (ignore_eos) for at least `--min-requests` requests in all (and
2 per client). The levels run interleaved for `--rounds` rounds; reported per level: the
median tokens/s and the median over rounds of its ratio to the first level in the same round
(machines here are noisy). Usage:

    .venv/bin/python bench/bench_decode_throughput.py [--model tiny|default|PATH]
        [--concurrency 1 8 32] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from deploy import client
from deploy.default_model import BENCH_MODEL_HELP, bench_model
from deploy.launcher import Deployment


async def _client(address: str, prompt: list[int], max_tokens: int, count: int) -> int:
    generated = 0
    for _ in range(count):
        request = client.make_request(prompt, temperature=0.0, max_tokens=max_tokens,
                                      ignore_eos=True)
        result = await client.generate(address, request, timeout_s=600)
        generated += len(result.token_ids)
    return generated


async def measure(address: str, concurrency: int, prompt_tokens: int, max_tokens: int,
                  per_client: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(concurrency)
    prompts = [torch.randint(1, 500, (prompt_tokens,), generator=gen).tolist()
               for _ in range(concurrency)]
    start = time.perf_counter()
    counts = await asyncio.gather(*(_client(address, p, max_tokens, per_client)
                                    for p in prompts))
    elapsed = time.perf_counter() - start
    total = sum(counts)
    return {"concurrency": concurrency, "generated_tokens": total, "seconds": elapsed,
            "tokens_per_s": total / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help=BENCH_MODEL_HELP)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--colocated", action="store_true")
    parser.add_argument("--torch-threads", type=int, default=1, help="per worker process")
    parser.add_argument("--decode-stage-mib", type=int, default=None,
                        help="the decode worker's --decode-stage-mib (0: gather pages every "
                             "step; default: the worker's default)")
    parser.add_argument("--pin-decode", action="store_true",
                        help="pin the decode worker to the last core, the rest elsewhere")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = bench_model(args.model)
    results = []
    worker_args = ([] if args.decode_stage_mib is None
                   else ["--decode-stage-mib", str(args.decode_stage_mib)])
    with Deployment(model=model, is_colocated=args.colocated, torch_threads=args.torch_threads,
                    worker_args=worker_args) as deployment:
        if args.pin_decode:
            cores = sorted(os.sched_getaffinity(0))
            deployment.pin("decode", {cores[-1]})
            deployment.pin("prefill", set(cores[:-1]))
            deployment.pin("router", set(cores[:-1]))
            os.sched_setaffinity(0, set(cores[:-1]))  # this client too
        # Warm-up: first-call costs (allocations, lazy imports) stay out of the figures.
        asyncio.run(measure(deployment.router_address, 2, args.prompt_tokens, 8, 1))
        runs: dict[int, list[dict[str, float]]] = {c: [] for c in args.concurrency}
        for _ in range(args.rounds):
            for concurrency in args.concurrency:
                per_client = max(2, -(-args.min_requests // concurrency))
                runs[concurrency].append(asyncio.run(measure(
                    deployment.router_address, concurrency, args.prompt_tokens,
                    args.max_tokens, per_client)))
    first = runs[args.concurrency[0]]
    for concurrency, measured in runs.items():
        rates = sorted(r["tokens_per_s"] for r in measured)
        # Each round's levels ran back to back, so a ratio within a round cancels most of
        # the machine's slow drifts; the median over rounds is the figure.
        ratios = sorted(m["tokens_per_s"] / f["tokens_per_s"] for m, f in zip(measured, first))
        results.append({"concurrency": concurrency, "runs": measured,
                        "median_tokens_per_s": statistics.median(rates),
                        "min_tokens_per_s": rates[0], "max_tokens_per_s": rates[-1],
                        "round_ratios": ratios, "ratio_to_first": statistics.median(ratios)})
    print(f"{'concurrency':>11} {'median tok/s':>12} {'min':>8} {'max':>8} "
          f"{'vs first (median of rounds)':>28} {'round ratios':>20}")
    for r in results:
        spread = " ".join(f"{x:.1f}" for x in r["round_ratios"])
        print(f"{r['concurrency']:>11} {r['median_tokens_per_s']:>12.1f} "
              f"{r['min_tokens_per_s']:>8.1f} {r['max_tokens_per_s']:>8.1f} "
              f"{r['ratio_to_first']:>27.2f}x {spread:>20}")
    report = {"machine": platform.machine(), "cpus": torch.get_num_threads(),
              "model": Path(model).name,
              "colocated": args.colocated, "decode_stage_mib": args.decode_stage_mib,
              "prompt_tokens": args.prompt_tokens,
              "max_tokens": args.max_tokens, "results": results}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
