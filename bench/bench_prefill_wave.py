"""A wave of prompts arriving at the prefill batcher the way a closed loop of clients sends
them (issue 62): time to first token with the batcher's gathering window off and on.

In process, no serving around it: `--prompts` prompts of `--prompt-tokens` random tokens are
submitted to a PrefillBatcher (its own loop, one executor thread, `--model`, one torch thread
unless told) staggered by seeded random gaps of 0 to `--max-gap-ms`; each one's TTFT is its
submission to its first token. Each repetition runs the same wave with gathering off (a
forward as soon as one job waits) and on (`--gap-ms`, `--window-ms`; the batcher's default
unless told), in alternating order, then a lone prompt each way (what the window costs a
request nobody joins); `--budget N` adds two arms, off and on with N prompt tokens per
forward instead of the device's budget. Prints the median [min-max] over repetitions of TTFT p50 and
mean, the off/arm ratios, and the forwards each wave took; JSON to --out. Usage:

    .venv/bin/python bench/bench_prefill_wave.py [--model default|tiny|PATH] [--reps 3]
        [--prompts 8] [--prompt-tokens 64] [--max-gap-ms 5] [--gap-ms G] [--window-ms W]
        [--budget N] [--threads 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import torch

from deploy.default_model import BENCH_MODEL_HELP, bench_model
from deploy.worker_model import tune_malloc
from kvferry.cache.pool import KvPool
from kvferry.model.config import load_model_config
from kvferry.model.prefill_batch import (
    DEFAULT_GATHERING,
    NO_GATHERING,
    Gathering,
    PrefillBatcher,
    PrefillJob,
    token_budget_for,
)
from kvferry.model.sampling import SamplingParams
from kvferry.model.transformer import Transformer
from kvferry.settings import KERNEL_CACHE_DIR
from kvferry_kernels.dispatch import get_attention_backend

BLOCK_SIZE = 16


class Wave:
    """What one wave measured: each prompt's TTFT (submission order) and the forwards' sizes
    in prompts (the jobs sharing a start time shared a forward)."""

    def __init__(self, ttft_s: list[float], forwards: list[int]) -> None:
        self.ttft_s, self.forwards = ttft_s, forwards

    @property
    def p50_s(self) -> float:
        return statistics.median(self.ttft_s)

    @property
    def mean_s(self) -> float:
        return statistics.fmean(self.ttft_s)


class Arm(NamedTuple):
    gathering: Gathering
    token_budget: int


async def run_wave(model: Transformer, pool: KvPool, executor: ThreadPoolExecutor, arm: Arm,
                   prompts: list[list[int]], gaps_s: list[float]) -> Wave:
    """Submit `prompts[i]` `gaps_s[i]` after the one before it to a fresh batcher."""
    wake = asyncio.Event()
    batcher = PrefillBatcher(model, pool, executor, wake.set, arm.token_budget,
                             gathering=arm.gathering)
    serving = asyncio.create_task(batcher.loop(wake))
    per_prompt = -(-len(prompts[0]) // BLOCK_SIZE)
    loop = asyncio.get_running_loop()
    jobs: list[PrefillJob] = []
    done_at: dict[str, float] = {}
    for i, (prompt, gap_s) in enumerate(zip(prompts, gaps_s)):
        if gap_s:
            await asyncio.sleep(gap_s)
        table = list(range(i * per_prompt, (i + 1) * per_prompt))
        job = PrefillJob(f"p{i}", prompt, SamplingParams(), table, loop.create_future())
        job.first_token.add_done_callback(
            lambda _f, name=job.request_id: done_at.setdefault(name, time.perf_counter()))
        jobs.append(job)
        batcher.submit(job)
    await asyncio.gather(*(j.first_token for j in jobs))
    serving.cancel()
    starts = sorted({j.started_at for j in jobs})
    forwards = [sum(j.started_at == s for j in jobs) for s in starts]
    return Wave([done_at[j.request_id] - j.submitted_at for j in jobs], forwards)


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def fmt(s: dict[str, float], scale: float = 1e3, unit: str = " ms") -> str:
    return (f"{s['median'] * scale:.0f}{unit} [{s['min'] * scale:.0f}-{s['max'] * scale:.0f}]"
            if unit else f"{s['median']:.2f}x [{s['min']:.2f}-{s['max']:.2f}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help=BENCH_MODEL_HELP)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-gap-ms", type=float, default=5.0)
    parser.add_argument("--gap-ms", type=float, default=DEFAULT_GATHERING.gap_s * 1e3)
    parser.add_argument("--window-ms", type=float, default=DEFAULT_GATHERING.window_s * 1e3)
    parser.add_argument("--budget", type=int, default=None,
                        help="two more arms, off and on, this many prompt tokens per forward")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    tune_malloc()
    torch.set_num_threads(args.threads)
    config = load_model_config(bench_model(args.model))
    model = Transformer(config, get_attention_backend("torch", KERNEL_CACHE_DIR),
                        torch.float32, torch.device("cpu"))
    per_prompt = -(-args.prompt_tokens // BLOCK_SIZE)
    pool = KvPool(config.num_layers, config.num_kv_heads, config.head_dim, BLOCK_SIZE,
                  args.prompts * per_prompt + 1, torch.float32, torch.device("cpu"),
                  prefix_caching=False)
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill")
    on = Gathering(gap_s=args.gap_ms / 1e3, window_s=args.window_ms / 1e3)
    budget = token_budget_for(model.device)
    arms = {"off": Arm(NO_GATHERING, budget), "on": Arm(on, budget)}
    if args.budget is not None:
        arms[f"off@{args.budget}"] = Arm(NO_GATHERING, args.budget)
        arms[f"on@{args.budget}"] = Arm(on, args.budget)
    rng = random.Random(args.seed)

    def prompts() -> list[list[int]]:
        return [[rng.randrange(1, config.vocab_size) for _ in range(args.prompt_tokens)]
                for _ in range(args.prompts)]

    # warm up: a lone prompt and a full wave, each way
    for arm in arms.values():
        asyncio.run(run_wave(model, pool, executor, arm, prompts(), [0.0] * args.prompts))
        asyncio.run(run_wave(model, pool, executor, arm, prompts()[:1], [0.0]))
    load_start = os.getloadavg()[0]  # the machine's, shared: timings scale with it
    waves: dict[str, list[Wave]] = {arm: [] for arm in arms}
    lone: dict[str, list[float]] = {arm: [] for arm in arms}
    for rep in range(args.reps):
        wave_prompts = prompts()
        gaps_s = [0.0] + [rng.uniform(0, args.max_gap_ms / 1e3) for _ in wave_prompts[1:]]
        order = list(arms)[rep % len(arms):] + list(arms)[:rep % len(arms)]  # rotated
        for arm in order:
            wave = asyncio.run(run_wave(model, pool, executor, arms[arm], wave_prompts,
                                        gaps_s))
            waves[arm].append(wave)
            print(f"rep {rep} {arm:>6}: TTFT p50 {wave.p50_s * 1e3:6.0f} ms, mean "
                  f"{wave.mean_s * 1e3:6.0f} ms, forwards of {wave.forwards} prompts "
                  f"(arrivals over {sum(gaps_s) * 1e3:.1f} ms)", flush=True)
        for arm in order:
            single = asyncio.run(run_wave(model, pool, executor, arms[arm], prompts()[:1], [0.0]))
            lone[arm].append(single.ttft_s[0])
    result: dict[str, object] = {
        "model": args.model, "threads": args.threads, "reps": args.reps,
        "prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
        "max_gap_ms": args.max_gap_ms, "gap_ms": args.gap_ms, "window_ms": args.window_ms,
        "token_budget": budget, "budget_arm": args.budget, "seed": args.seed,
        "load_average_1m": [load_start, os.getloadavg()[0]]}
    print(f"\n{args.prompts} prompts of {args.prompt_tokens} tokens, gaps 0-{args.max_gap_ms} ms,"
          f" gathering gap {args.gap_ms} ms window {args.window_ms} ms, {args.reps} reps")
    for arm in arms:
        p50 = summary([w.p50_s for w in waves[arm]])
        mean = summary([w.mean_s for w in waves[arm]])
        single = summary(lone[arm])
        result[arm] = {"ttft_p50_s": p50, "ttft_mean_s": mean, "lone_ttft_s": single,
                       "forwards": [w.forwards for w in waves[arm]],
                       "ttft_s": [w.ttft_s for w in waves[arm]]}
        print(f"{arm:>6}: TTFT p50 {fmt(p50)}, mean {fmt(mean)}, lone prompt {fmt(single)}")
    ratios: dict[str, dict[str, float]] = {}
    for arm in list(arms)[1:]:
        for name, get in (("ttft_p50", lambda w: w.p50_s), ("ttft_mean", lambda w: w.mean_s)):
            key = f"off/{arm} {name}"
            ratios[key] = summary([get(a) / get(b) for a, b in zip(waves["off"], waves[arm])])
            print(f"{key}: {fmt(ratios[key], unit='')}")
        key = f"{arm}/off lone prompt TTFT"
        ratios[key] = summary([b / a for a, b in zip(lone["off"], lone[arm])])
        print(f"{key}: {fmt(ratios[key], unit='')}")
    result["ratios"] = ratios
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
