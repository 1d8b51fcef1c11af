"""Decode throughput (generated tokens/s) at several concurrencies, in one run.

Starts one deployment (router + 1 prefill + 1 decode worker, or one colocated worker with
--colocated) on the default model, then for each concurrency C runs C clients in a closed
loop, each sending `--requests-per-client` requests of `--prompt-tokens` prompt tokens and
exactly `--max-tokens` output tokens (ignore_eos). Reports tokens/s and the ratio to
concurrency 1. Usage:

    .venv/bin/python bench/bench_decode_throughput.py [--concurrency 1 8 32] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
from pathlib import Path

import torch

from kvferry import client
from kvferry.cli import _ensure_default_model
from kvferry.launcher import Deployment


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
    parser.add_argument("--model", default=None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--colocated", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = args.model or _ensure_default_model()
    results = []
    with Deployment(model=model, is_colocated=args.colocated) as deployment:
        # Warm-up: first-call costs (allocations, lazy imports) stay out of the figures.
        asyncio.run(measure(deployment.router_address, 2, args.prompt_tokens, 8, 1))
        for concurrency in args.concurrency:
            result = asyncio.run(measure(deployment.router_address, concurrency,
                                         args.prompt_tokens, args.max_tokens,
                                         args.requests_per_client))
            results.append(result)
    base = results[0]["tokens_per_s"]
    print(f"{'concurrency':>11} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'vs first':>8}")
    for r in results:
        r["ratio_to_first"] = r["tokens_per_s"] / base
        print(f"{r['concurrency']:>11} {r['generated_tokens']:>7} {r['seconds']:>8.2f} "
              f"{r['tokens_per_s']:>9.1f} {r['ratio_to_first']:>7.2f}x")
    report = {"machine": platform.machine(), "cpus": torch.get_num_threads(),
              "colocated": args.colocated, "prompt_tokens": args.prompt_tokens,
              "max_tokens": args.max_tokens, "results": results}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
