"""TTFT with a slow K/V store against no store, side by side in one run.

Three deployments of --model (1 prefill + 1 decode worker each, a host tier each) run at
once: `none` has no store; `slow` points every worker at a Valkey server behind a proxy that
delays each command by --delay-ms (bench/store_proxy.py), far past the store's lookup
deadline (--deadline-ms); `waiting` is the same store with a deadline of --waiting-deadline-ms
(past the delay: every lookup waits for the store's answer, as every one did before issue
61, and the store is never disabled for it). Every request is a fresh prompt (a miss in every
tier, so the store workers ask the store each time it is enabled). Repetitions are
interleaved (none, slow, waiting, none, ...), the deployments staying up; reported: TTFT p50
and p99 of each, the ratios slow / none and waiting / none within each repetition, median
[min-max], and the store tier's state on the `slow` workers at the end. Usage:

    .venv/bin/python bench/bench_kv_store_slow.py [--model tiny|default|PATH] [--repeats 3]
        [--requests 24] [--delay-ms 300] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script too
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "kernels"))
from bench.bench_kv_tiers import worker_stats  # noqa: E402
from bench.bench_prefix_cache import Spread, ratio, spread  # noqa: E402
from bench.store_proxy import StoreProxy  # noqa: E402
from deploy import client  # noqa: E402
from deploy.default_model import BENCH_MODEL_HELP, bench_model  # noqa: E402
from deploy.launcher import Deployment  # noqa: E402
from deploy.store_server import StoreServer  # noqa: E402
from kvferry.rpc import grpc_util  # noqa: E402
from kvferry.v1 import worker_pb2  # noqa: E402

RUNS = ("none", "slow", "waiting")
STATES = {0: "enabled", 1: "read-only", 2: "disabled"}


class Figures(NamedTuple):
    ttft_p50_ms: float
    ttft_p99_ms: float


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", help=BENCH_MODEL_HELP)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--requests", type=int, default=24, help="requests per run and repetition")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--delay-ms", type=float, default=300.0,
                   help="the slow store's delay per command")
    p.add_argument("--deadline-ms", type=float, default=50.0,
                   help="the workers' --kv-store-deadline-ms")
    p.add_argument("--waiting-deadline-ms", type=float, default=5000.0,
                   help="the `waiting` run's deadline (past --delay-ms)")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    return p.parse_args(argv)


def figures(ttfts_s: Sequence[float]) -> Figures:
    ms = np.array(ttfts_s) * 1e3
    return Figures(float(np.percentile(ms, 50)), float(np.percentile(ms, 99)))


def _deployment(model: str, args: argparse.Namespace, log_dir: Path,
                store_url: str | None, deadline_ms: float = 0.0) -> Deployment:
    log_dir.mkdir(parents=True, exist_ok=True)
    workers = ["--kv-pool-size", "16MiB", "--kv-host-cache-size", "64MiB"]
    if store_url is not None:
        workers += ["--kv-store-url", store_url, "--kv-store-deadline-ms", f"{deadline_ms:g}"]
    return Deployment(model=model, num_prefill=1, num_decode=1,
                      torch_threads=args.torch_threads, worker_args=workers,
                      router_args=["--enable-prompt-tokens-details"], log_dir=log_dir)


async def _ttfts(address: str, args: argparse.Namespace, seed: int) -> list[float]:
    """TTFT of --requests fresh prompts, one at a time."""
    rng = np.random.default_rng(seed)
    out = []
    async with grpc_util.channel(address) as chan:
        vocab = (await client.model_info(chan)).vocab_size
        stub = client.public_stub(chan)
        for i in range(args.requests):
            prompt = rng.integers(1, vocab, args.prompt_len).tolist()
            request = client.make_request(prompt, temperature=0.0, max_tokens=args.output_len,
                                          ignore_eos=True)
            request.cache_salt = f"bench-kv-store-slow-{seed}-{i}"
            done = await client.collect(stub, request, timeout_s=300)
            if len(done.token_ids) != args.output_len:
                raise RuntimeError(f"request {i}: {len(done.token_ids)} tokens")
            out.append(done.ttft_s)
    return out


async def _store_states(deployment: Deployment) -> list[str]:
    return [STATES.get(t.state, str(t.state)) for stats in await worker_stats(deployment)
            for t in stats.tiers if t.tier == worker_pb2.KV_TIER_STORE]


def format_report(runs: dict[str, list[Figures]], args: argparse.Namespace,
                  states: list[str]) -> str:
    lines = [f"{args.requests} fresh {args.prompt_len}-token prompts per run, "
             f"{args.repeats} repetitions; slow store: {args.delay_ms:g} ms per command, "
             f"deadline {args.deadline_ms:g} ms (waiting: {args.waiting_deadline_ms:g} ms)"]
    for name in RUNS:
        p50 = spread([f.ttft_p50_ms for f in runs[name]])
        p99 = spread([f.ttft_p99_ms for f in runs[name]])
        lines.append(f"  {name:7s} TTFT p50 {p50.text(1)} ms   p99 {p99.text(1)} ms")
    for name in RUNS[1:]:
        for field in Figures._fields:
            values = [ratio(getattr(s, field), getattr(n, field))
                      for s, n in zip(runs[name], runs["none"])]
            lines.append(f"  {field} {name} / none: {spread(values).text()}")
    lines.append(f"  store tier on the slow workers at the end: {', '.join(states)}")
    return "\n".join(lines)


def summary(runs: dict[str, list[Figures]]) -> dict[str, dict[str, Spread]]:
    out: dict[str, dict[str, Spread]] = {}
    for name in RUNS:
        out[name] = {f: spread([getattr(x, f) for x in runs[name]]) for f in Figures._fields}
    for name in RUNS[1:]:
        out[f"{name}/none"] = {f: spread([ratio(getattr(s, f), getattr(n, f))
                                          for s, n in zip(runs[name], runs["none"])])
                               for f in Figures._fields}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    model = bench_model(args.model)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-kv-store-slow-") as tmp:
        root = Path(tmp)
        store = StoreServer(root / "store", 256 << 20).start()
        proxy = StoreProxy(store.socket, delay_s=args.delay_ms / 1e3)
        try:
            with (_deployment(model, args, root / "none", None) as none,
                  _deployment(model, args, root / "slow", proxy.url, args.deadline_ms) as slow,
                  _deployment(model, args, root / "waiting", proxy.url,
                              args.waiting_deadline_ms) as waiting):
                runs: dict[str, list[Figures]] = {name: [] for name in RUNS}
                for rep in range(args.repeats):
                    for name, deployment in zip(RUNS, (none, slow, waiting)):
                        ttfts = asyncio.run(_ttfts(deployment.router_address, args,
                                                   seed=1000 * rep + RUNS.index(name)))
                        runs[name].append(figures(ttfts))
                states = asyncio.run(_store_states(slow))
        finally:
            proxy.close()
            store.stop()
    print(format_report(runs, args, states))
    print(f"({time.monotonic() - started:.0f} s)")
    if args.out is not None:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "runs": {k: [f._asdict() for f in v]
                                                 for k, v in runs.items()},
                                        "summary": {k: {f: s._asdict() for f, s in v.items()}
                                                    for k, v in summary(runs).items()},
                                        "store_states": states}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
