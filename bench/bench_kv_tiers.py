"""K/V tiers below the pool, in one run: multi-turn chats whose
K/V is at least 4x the deployment's device pools, device-only against each tier.

Workload: --conversations chats of --num-turns turns. Turn 1 sends a --system-len-token system
prompt and a --message-len-token message; each later turn adds the answer (--output-len
tokens, greedy, EOS ignored) and a new message. Turns go round robin, by default one request
at a time: every chat comes back only after all the others had their turn, so its history has
long left the device pools (the script computes the histories' K/V against the pools' and
refuses to run below 4x: exit 2), and each TTFT is the prefill alone, not a queue. With
--concurrency N, N chats of a turn are in flight at once: requests queue on the workers, the
load a routing policy has to weigh against where a history is cached.

Runs (each a fresh deployment of --model, 1 prefill + 1 decode worker, --kv-pool-size each):
  device      no tier: a returning chat recomputes its history (the pools evicted it).
  host        --kv-host-cache-size: the history comes back from host memory (blocks written
              through as they are indexed).
  write-back  the same with --kv-host-write-policy write_back (blocks copied only when the
              pool runs low): which of the two is the default is decided on these figures.
  disk        host + --kv-disk-cache-dir; the whole deployment is stopped after turn
              --num-turns // 2 and started again on the same directory (host memory and
              pools empty): the turns after the restart hit on disk.
  store       host + --kv-store-url (a Valkey server this script starts).
  prefix-2p2d, priced-2p2d   host tiers on 2 prefill + 2 decode workers, the router's
              `prefix` policy against `priced` (router/policies/priced.py).
Figures per run: TTFT p50 and p99, prompt tokens computed (prompt minus cached, as the router
reports them), hit rate (cached / prompt tokens, turns 2 on), tokens served per tier (the
workers' TierStats), and for `disk` the hit rate before and after the restart. Each run is
repeated --repeats times (interleaved); reported: median [min-max] of each figure and of the
ratios taken within each repetition, against the targets: TTFT p50 device/host >= 2, tokens
computed device/host >= 3, disk hit rate after/before the restart >= 0.8, TTFT p50
prefix-2p2d/priced-2p2d >= 1 (priced not worse). Usage:

    .venv/bin/python bench/bench_kv_tiers.py [--model default|tiny|PATH] [--repeats 3]
        [--runs NAMES] [--out FILE] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script too
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "kernels"))
from bench.bench_prefix_cache import Spread, ratio, spread  # noqa: E402
from deploy import client  # noqa: E402
from deploy.default_model import BENCH_MODEL_HELP, bench_model  # noqa: E402
from deploy.launcher import Deployment  # noqa: E402
from deploy.store_server import StoreServer  # noqa: E402
from kvferry.cache.layout import KvShape  # noqa: E402
from kvferry.rpc import grpc_util  # noqa: E402
from kvferry.settings.sizes import parse_pool_size  # noqa: E402
from kvferry.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402

FULL = dict(repeats=3, conversations=16, num_turns=6, system_len=128, message_len=32,
            output_len=32, kv_pool_size="32MiB", host_cache_size="2GiB")
QUICK = dict(repeats=1, conversations=10, num_turns=4, system_len=40, message_len=8,
             output_len=8, kv_pool_size="448KiB", host_cache_size="64MiB")
RUNS = ("device", "host", "write-back", "disk", "store", "prefix-2p2d", "priced-2p2d")
TIERS = {worker_pb2.KV_TIER_HOST: "host", worker_pb2.KV_TIER_DISK: "disk",
         worker_pb2.KV_TIER_STORE: "store"}


class Turn(NamedTuple):
    turn: int  # from 1
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float


@dataclass
class Chat:
    messages: list[list[int]]  # turn 1's system prompt and message, then one per turn
    history: list[int] = field(default_factory=list)


def chats(args: argparse.Namespace, vocab: int) -> list[Chat]:
    rng = np.random.default_rng(args.seed)
    out = []
    for _ in range(args.conversations):
        first = rng.integers(1, vocab, args.system_len + args.message_len).tolist()
        later = [rng.integers(1, vocab, args.message_len).tolist()
                 for _ in range(args.num_turns - 1)]
        out.append(Chat([first, *later]))
    return out


def history_bytes(args: argparse.Namespace, shape: KvShape) -> int:
    """The chats' K/V once every turn is answered."""
    tokens = args.system_len + args.num_turns * (args.message_len + args.output_len)
    return args.conversations * tokens * shape.bytes_per_token


async def _turns(address: str, conversations: list[Chat], turns: range, output_len: int,
                 salt: str, concurrency: int = 1) -> list[Turn]:
    """Every chat's `turns`, turn by turn; within a turn, `concurrency` chats in flight."""
    records: list[Turn] = []
    gate = asyncio.Semaphore(concurrency)
    async with grpc_util.channel(address) as chan:
        stub = client.public_stub(chan)

        async def one(turn: int, chat: Chat) -> None:
            async with gate:
                prompt = chat.history + chat.messages[turn - 1]
                request = client.make_request(prompt, temperature=0.0, max_tokens=output_len,
                                              ignore_eos=True)
                request.cache_salt = salt
                done = await client.collect(stub, request, timeout_s=600)
            if len(done.token_ids) != output_len:
                raise RuntimeError(f"turn {turn}: {len(done.token_ids)} tokens, "
                                   f"{client.finish_reason_name(done.finished)}")
            chat.history = prompt + done.token_ids
            records.append(Turn(turn, len(prompt), done.finished.usage.cached_prompt_tokens,
                                done.ttft_s))

        for turn in turns:
            await asyncio.gather(*(one(turn, chat) for chat in conversations))
    return records


async def worker_stats(deployment: Deployment) -> list[worker_pb2.WorkerStats]:
    """GetStats of every prefill and decode worker of `deployment`."""
    found = []
    for role in ("prefill", "decode"):
        for address in deployment.addresses(role):
            async with grpc_util.channel(address) as chan:
                stub = (worker_pb2_grpc.PrefillServiceStub(chan) if role == "prefill"
                        else worker_pb2_grpc.DecodeServiceStub(chan))
                found.append(await stub.GetStats(worker_pb2.GetStatsRequest(), timeout=30))
    return found


async def _tier_tokens(deployment: Deployment) -> dict[str, int]:
    """Prompt tokens each tier served, summed over the workers."""
    served: dict[str, int] = {}
    for stats in await worker_stats(deployment):
        for tier in stats.tiers:
            name = TIERS[tier.tier]
            served[name] = served.get(name, 0) + tier.hit_tokens
    return served


class Figures(NamedTuple):
    ttft_p50_ms: float
    ttft_p99_ms: float
    tokens_computed: int
    hit_rate: float  # turns 2 on
    tier_tokens: dict[str, int]
    hit_rate_before: float  # disk: turns 2 .. the restart; others: as hit_rate
    hit_rate_after: float  # disk: after the restart; others: as hit_rate


def _hit_rate(turns: Sequence[Turn]) -> float:
    prompt = sum(t.prompt_tokens for t in turns)
    return sum(t.cached_tokens for t in turns) / prompt if prompt else 0.0


def figures(turns: list[Turn], tier_tokens: dict[str, int], restart_after: int) -> Figures:
    ttfts = sorted(t.ttft_s * 1e3 for t in turns)
    later = [t for t in turns if t.turn >= 2]
    before = [t for t in later if t.turn <= restart_after] or later
    after = [t for t in later if t.turn > restart_after] or later
    return Figures(float(np.percentile(ttfts, 50)), float(np.percentile(ttfts, 99)),
                   sum(t.prompt_tokens - t.cached_tokens for t in turns), _hit_rate(later),
                   tier_tokens, _hit_rate(before), _hit_rate(after))


def _deployment(run: str, model: str, args: argparse.Namespace, log_dir: Path,
                store_url: str | None) -> Deployment:
    workers = ["--kv-pool-size", args.kv_pool_size]
    if run != "device":
        workers += ["--kv-host-cache-size", args.host_cache_size]
    if run == "write-back":
        workers += ["--kv-host-write-policy", "write_back"]
    if run == "disk":
        workers += ["--kv-disk-cache-dir", str(log_dir / "kv-disk")]
    if run == "store":
        assert store_url is not None
        workers += ["--kv-store-url", store_url]
    size = 2 if run.endswith("2p2d") else 1
    router = ["--enable-prompt-tokens-details"]
    if run.endswith("2p2d"):
        router += ["--policy", run.split("-")[0]]
    return Deployment(model=model, num_prefill=size, num_decode=size,
                      torch_threads=args.torch_threads, worker_args=workers,
                      router_args=router, log_dir=log_dir)


def run_once(run: str, model: str, args: argparse.Namespace, log_dir: Path) -> Figures:
    """One fresh deployment sent every turn of every chat (the disk run restarted midway)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    store = StoreServer(log_dir / "store", 4 << 30).start() if run == "store" else None
    restart_after = args.num_turns // 2 if run == "disk" else args.num_turns
    salt = f"{run}-{log_dir.name}"
    try:
        deployment = _deployment(run, model, args, log_dir, store.url if store else None)
        with deployment:
            vocab = asyncio.run(_vocab(deployment.router_address))
            conversations = chats(args, vocab)
            turns = asyncio.run(_turns(deployment.router_address, conversations,
                                       range(1, restart_after + 1), args.output_len, salt,
                                       args.concurrency))
            served = asyncio.run(_tier_tokens(deployment))
        if restart_after < args.num_turns:
            again = _deployment(run, model, args, log_dir, None)
            with again:
                turns += asyncio.run(_turns(again.router_address, conversations,
                                            range(restart_after + 1, args.num_turns + 1),
                                            args.output_len, salt, args.concurrency))
                for tier, tokens in asyncio.run(_tier_tokens(again)).items():
                    served[tier] = served.get(tier, 0) + tokens
    finally:
        if store is not None:
            store.stop()
    return figures(turns, served, restart_after)


async def _vocab(address: str) -> int:
    async with grpc_util.channel(address) as chan:
        return (await client.model_info(chan)).vocab_size


class Ratio(NamedTuple):
    label: str
    numerator: str  # run names (the same for a within-run ratio)
    denominator: str
    figure: str  # a Figures field
    target: float
    over: str = ""  # a second Figures field of the same run: numerator figure / this one

    def values(self, runs: dict[str, list[Figures]]) -> list[float]:
        if self.over:
            return [ratio(getattr(f, self.figure), getattr(f, self.over))
                    for f in runs.get(self.numerator, [])]
        pairs = zip(runs.get(self.numerator, []), runs.get(self.denominator, []))
        return [ratio(getattr(n, self.figure), getattr(d, self.figure)) for n, d in pairs]


RATIOS = (Ratio("TTFT p50, device / host", "device", "host", "ttft_p50_ms", 2.0),
          Ratio("prompt tokens computed, device / host", "device", "host", "tokens_computed",
                3.0),
          Ratio("disk: hit rate after / before the restart", "disk", "disk", "hit_rate_after",
                0.8, over="hit_rate_before"),
          Ratio("TTFT p50, prefix / priced (2p2d, host tiers)", "prefix-2p2d", "priced-2p2d",
                "ttft_p50_ms", 1.0))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help=BENCH_MODEL_HELP)
    p.add_argument("--quick", action="store_true", help="small everything, for tests")
    p.add_argument("--repeats", type=int, help="default 3")
    p.add_argument("--runs", default=",".join(RUNS), help=f"some of {', '.join(RUNS)}")
    for name in ("conversations", "num_turns", "system_len", "message_len", "output_len"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"default {FULL[name]}")
    p.add_argument("--kv-pool-size", help="every worker's pool (default 32MiB)")
    p.add_argument("--host-cache-size", help="every worker's host tier (default 2GiB)")
    p.add_argument("--concurrency", type=int, default=1,
                   help="chats in flight at once within a turn (default 1: each TTFT is the "
                        "prefill alone; more: requests queue, which the priced policy weighs)")
    p.add_argument("--torch-threads", type=int, default=2, help="per worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", type=Path, default=None, help="default: a new temporary one")
    p.add_argument("--out", type=Path, default=None, help="write every run as JSON here")
    args = p.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.runs = [x.strip() for x in args.runs.split(",") if x.strip()]
    if not args.runs or any(run not in RUNS for run in args.runs):
        p.error(f"--runs: expected names among {', '.join(RUNS)}, got {args.runs}")
    if args.repeats < 1 or args.num_turns < 2 or args.conversations < 1:
        p.error("--repeats and --conversations must be >= 1, --num-turns >= 2")
    if not 1 <= args.concurrency <= args.conversations:
        p.error(f"--concurrency: expected 1 to --conversations ({args.conversations}), "
                f"got {args.concurrency}")
    return args


def _in_flight(concurrency: int) -> str:
    return "one at a time" if concurrency == 1 else f"{concurrency} in flight"


def format_report(args: argparse.Namespace, runs: dict[str, list[Figures]],
                  scale: float) -> str:
    lines = [f"{args.repeats} repetition(s), median [min-max]; {args.conversations} chats x "
             f"{args.num_turns} turns ({args.system_len} + {args.message_len} tokens, then "
             f"{args.message_len} a turn, {args.output_len} out), round robin, "
             f"{_in_flight(args.concurrency)}; "
             f"histories' K/V = {scale:.1f}x the device pools", "",
             f"{'run':<13}{'TTFT p50 ms':>24}{'TTFT p99 ms':>24}{'tokens computed':>26}"
             f"{'hit rate %':>20}  tokens by tier"]
    for name, figs in runs.items():
        cells = [spread([f.ttft_p50_ms for f in figs]).text(1).rjust(24),
                 spread([f.ttft_p99_ms for f in figs]).text(1).rjust(24),
                 spread([f.tokens_computed for f in figs]).text(0).rjust(26),
                 spread([100 * f.hit_rate for f in figs]).text(1).rjust(20)]
        tiers = {t: statistics.median(f.tier_tokens.get(t, 0) for f in figs)
                 for t in ("host", "disk", "store")}
        lines.append(f"{name:<13}{''.join(cells)}  "
                     + ", ".join(f"{t} {v:,.0f}" for t, v in tiers.items() if v))
    lines.append("")
    for r in RATIOS:
        values = r.values(runs)
        if not values:
            lines.append(f"{r.label}: not measured")
            continue
        s: Spread = spread(values)
        verdict = "met" if s.median >= r.target else "NOT met"
        lines.append(f"{r.label}: {s.text()}  target >= {r.target:g}  {verdict}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    model = bench_model(args.model)
    shape = KvShape.from_config(model, "float32")
    pools = 2 * parse_pool_size(args.kv_pool_size, 0)  # prefill + decode
    scale = history_bytes(args, shape) / pools
    if scale < 4:
        print(f"bench_kv_tiers: the chats' K/V is {scale:.2f}x the device pools; the "
              "benchmark needs >= 4x (more --conversations or a smaller --kv-pool-size)",
              file=sys.stderr)
        return 2
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench_kv_tiers-"))
    print(f"model {args.model} ({Path(model).name}); histories {scale:.1f}x the pools; "
          f"logs {log_dir}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: deployments stop
    runs: dict[str, list[Figures]] = {}
    started = time.monotonic()
    try:
        for repeat in range(args.repeats):
            for run in args.runs:
                got = run_once(run, model, args, log_dir / f"r{repeat}" / run)
                runs.setdefault(run, []).append(got)
                print(f"repetition {repeat + 1}/{args.repeats} {run}: TTFT p50 "
                      f"{got.ttft_p50_ms:.1f} ms, {got.tokens_computed} tokens computed, "
                      f"hit rate {got.hit_rate:.1%} ({got.hit_rate_before:.1%} / "
                      f"{got.hit_rate_after:.1%}), tiers {got.tier_tokens}", flush=True)
    except (RuntimeError, ValueError) as exc:
        print(f"bench_kv_tiers: {exc} (logs: {log_dir})", file=sys.stderr)
        return 1
    print(format_report(args, runs, scale))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload: dict[str, Any] = {
            "model": Path(model).name, "machine": platform.platform(),
            "args": {k: v for k, v in vars(args).items() if k not in ("out", "log_dir")},
            "history_over_pools": scale, "duration_s": time.monotonic() - started,
            "ratios": {r.label: {"target": r.target, "values": r.values(runs)}
                       for r in RATIOS},
            "runs": {name: [f._asdict() for f in figs] for name, figs in runs.items()}}
        args.out.write_text(json.dumps(payload, indent=1) + "\n")
        print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
