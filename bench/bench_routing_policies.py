"""Routing policies under a skewed workload, in one run: headroom vs round_robin vs
least_requests.

For each policy, one deployment (1 prefill + 2 decode workers with small K/V pools) gets the
same seeded workload: mostly short requests with long ones among them, Poisson arrivals.
Reports admission waits (requests held at the router for headroom), preemptions (decode
workers swapping a running request out), rejections (RESOURCE_EXHAUSTED), and p50/p99 TTFT
and ITL measured at the client. Usage:

    .venv/bin/python bench/bench_routing_policies.py [--requests 60] [--rate 6] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import grpc

from deploy import client
from deploy.default_model import tiny_model
from deploy.launcher import Deployment
from kvferry.rpc import grpc_util
from kvferry.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc

POLICIES = ["headroom", "round_robin", "least_requests"]


def workload(count: int, seed: int) -> list[tuple[float, list[int], int]]:
    """(arrival offset s, prompt, max_tokens): 70% short, 30% long, Poisson arrivals."""
    rng = random.Random(seed)
    items, t = [], 0.0
    for _ in range(count):
        if rng.random() < 0.3:
            prompt_len, output = rng.randint(150, 300), rng.randint(100, 200)
        else:
            prompt_len, output = rng.randint(8, 48), rng.randint(8, 48)
        items.append((t, [rng.randint(1, 500) for _ in range(prompt_len)], output))
        t += rng.expovariate(RATE[0])
    return items


RATE = [6.0]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def run_one(address: str, items: list[tuple[float, list[int], int]]) -> dict[str, object]:
    async with grpc_util.channel(address) as chan:
        stub = generation_pb2_grpc.GenerationServiceStub(chan)
        start = time.perf_counter()

        async def one(offset: float, prompt: list[int], max_tokens: int):
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            request = client.make_request(prompt, temperature=0.0, max_tokens=max_tokens,
                                          ignore_eos=True)
            completion = client.Completion()
            try:
                async for _, latest in client.stream(stub, request, timeout_s=300):
                    completion = latest
            except grpc.aio.AioRpcError as exc:
                return exc.code().name, completion
            return "OK", completion

        results = await asyncio.gather(*(one(*item) for item in items))
    ok = [c for status, c in results if status == "OK"]
    ttft = [c.ttft_s * 1000 for c in ok]
    itl = [(b - a) * 1000 for c in ok for a, b in zip(c.token_times_s, c.token_times_s[1:])]
    waits = [c.finished.timing.admission_wait_s for c in ok if c.finished]
    return {
        "completed": len(ok),
        "rejected": sum(1 for s, _ in results if s == "RESOURCE_EXHAUSTED"),
        "other_errors": sum(1 for s, _ in results if s not in ("OK", "RESOURCE_EXHAUSTED")),
        "admission_waits": sum(1 for w in waits if w > 0.005),
        "p50_ttft_ms": percentile(ttft, 50), "p99_ttft_ms": percentile(ttft, 99),
        "p50_itl_ms": percentile(itl, 50), "p99_itl_ms": percentile(itl, 99),
        "mean_ttft_ms": statistics.fmean(ttft) if ttft else float("nan"),
    }


def preemptions(deployment: Deployment) -> int:
    total = 0
    for address in deployment.addresses("decode"):
        with grpc.insecure_channel(address) as chan:
            stats = worker_pb2_grpc.DecodeServiceStub(chan).GetStats(
                worker_pb2.GetStatsRequest(), timeout=10)
        total += stats.num_preemptions
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--rate", type=float, default=6.0, help="requests per second")
    parser.add_argument("--pool-blocks", type=int, default=40,
                        help="K/V blocks per decode worker")
    parser.add_argument("--max-waiting", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    RATE[0] = args.rate
    model = args.model or tiny_model()
    from kvferry.cache.layout import KvShape

    shape = KvShape.from_config(model, "float32")
    pool_bytes = args.pool_blocks * shape.bytes_per_token * 16
    items = workload(args.requests, args.seed)
    report = {"requests": args.requests, "rate": args.rate, "pool_blocks": args.pool_blocks,
              "policies": {}}
    for policy in POLICIES:
        # Small pools on the decode workers only: the prefill worker's pool is a staging area
        # (with `headroom` it also holds prefilled K/V until a decode worker has room).
        decode_args = ["--kv-pool-size", f"{pool_bytes}B", "--max-waiting", str(args.max_waiting)]
        with Deployment(model=model, num_decode=2, role_args={"decode": decode_args},
                        router_args=["--policy", policy]) as deployment:
            result = asyncio.run(run_one(deployment.router_address, items))
            result["preemptions"] = preemptions(deployment)
        report["policies"][policy] = result
    header = (f"{'policy':<15}{'done':>6}{'reject':>8}{'waits':>7}{'preempt':>9}"
              f"{'p50 TTFT':>10}{'p99 TTFT':>10}{'p50 ITL':>9}{'p99 ITL':>9}")
    print(header)
    for policy, r in report["policies"].items():
        print(f"{policy:<15}{r['completed']:>6}{r['rejected']:>8}{r['admission_waits']:>7}"
              f"{r['preemptions']:>9}{r['p50_ttft_ms']:>10.1f}{r['p99_ttft_ms']:>10.1f}"
              f"{r['p50_itl_ms']:>9.2f}{r['p99_itl_ms']:>9.2f}")
    base = report["policies"]["headroom"]["p99_ttft_ms"]
    for policy in POLICIES[1:]:
        other = report["policies"][policy]["p99_ttft_ms"]
        print(f"p99 TTFT {policy} / headroom: {other / base:.2f}x")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
