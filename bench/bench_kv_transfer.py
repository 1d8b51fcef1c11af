"""K/V transfer throughput: gRPC push into a decode worker against an in-process memcpy of the
same bytes, for 4, 64 and 256 MiB of K/V per request, in one run.

The pushing side is this process (a pool filled with random pages, the project's
GrpcKvSender); the receiving side is a real decode worker process validating every chunk and
writing it into its pool. Uses a seeded checkpoint with 64 KiB of K/V per token (16 layers x
8 KV heads x 64 x fp32 x 2), so 256 MiB is 4096 tokens. Usage:

    .venv/bin/python bench/bench_kv_transfer.py [--sizes-mib 4 64 256] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import torch

from kvferry import grpc_util, wire
from kvferry.checkpoint import ModelSpec, make_model
from kvferry.kv_pool import KvPool, blocks_for_tokens
from kvferry.launcher import Deployment
from kvferry.transport import GrpcKvSender
from kvferry.v1 import generation_pb2, worker_pb2, worker_pb2_grpc

SPEC = ModelSpec(vocab_size=512, hidden_size=512, intermediate_size=512, num_layers=16,
                 num_heads=8, num_kv_heads=8, head_dim=64, max_position_embeddings=4097,
                 seed=5)
BYTES_PER_TOKEN = 2 * 16 * 8 * 64 * 4


def memcpy_gbps(num_bytes: int, reps: int = 5) -> float:
    src = torch.empty(num_bytes // 4, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_time(lambda: dst.copy_(src)) for _ in range(reps))
    return num_bytes / best / 1e9


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


async def push_gbps(address: str, pool: KvPool, layout: wire.KvLayout, num_tokens: int,
                    reps: int) -> float:
    sender = GrpcKvSender()
    table = list(range(blocks_for_tokens(num_tokens, pool.block_size)))
    best = float("inf")
    async with grpc_util.channel(address) as chan:
        decode = worker_pb2_grpc.DecodeServiceStub(chan)
        for rep in range(reps):
            request_id = f"bench-{num_tokens}-{rep}"
            await decode.Reserve(worker_pb2.ReserveRequest(
                request_id=request_id, num_prompt_tokens=num_tokens, max_tokens=1,
                lease_s=120), timeout=60)
            start = time.perf_counter()
            result = await sender.push(address, request_id, layout, num_tokens, pool, table, 600)
            best = min(best, time.perf_counter() - start)
            await decode.Abort(generation_pb2.AbortRequest(request_id=request_id), timeout=60)
    await sender.close()
    return result.num_bytes / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[4, 64, 256])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/kvferry-bench-transfer"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not (args.model_dir / "config.json").exists():
        make_model(args.model_dir, SPEC)
    max_tokens = max(args.sizes_mib) * (1 << 20) // BYTES_PER_TOKEN
    pool_bytes = (max_tokens + 64) * BYTES_PER_TOKEN
    rows = []
    with Deployment(model=str(args.model_dir), kv_pool_size=f"{pool_bytes}B") as deployment:
        address = deployment.addresses("decode")[0]
        pool = KvPool(16, 8, 64, 16, blocks_for_tokens(max_tokens, 16), torch.float32)
        pool.cache.uniform_()
        with grpc_util_sync_stats(address) as fingerprint:
            layout = wire.KvLayout.of_pool(pool, fingerprint)
        for size in args.sizes_mib:
            tokens = size * (1 << 20) // BYTES_PER_TOKEN
            grpc_rate = asyncio.run(push_gbps(address, pool, layout, tokens, args.reps))
            copy_rate = memcpy_gbps(size << 20)
            rows.append({"mib": size, "grpc_gbps": grpc_rate, "memcpy_gbps": copy_rate,
                         "ratio": grpc_rate / copy_rate})
    print(f"{'MiB':>5} {'gRPC GB/s':>10} {'memcpy GB/s':>12} {'gRPC/memcpy':>12}")
    for r in rows:
        print(f"{r['mib']:>5} {r['grpc_gbps']:>10.3f} {r['memcpy_gbps']:>12.3f} "
              f"{r['ratio']:>11.1%}")
    if args.out:
        args.out.write_text(json.dumps({"rows": rows}, indent=2))


class grpc_util_sync_stats:  # noqa: N801 - a tiny context manager
    """The decode worker's model fingerprint, read through its stats."""

    def __init__(self, address: str) -> None:
        import grpc

        self._chan = grpc.insecure_channel(address)
        stub = worker_pb2_grpc.DecodeServiceStub(self._chan)
        self.fingerprint = stub.GetStats(worker_pb2.GetStatsRequest(), timeout=30).layout \
            .model_fingerprint

    def __enter__(self) -> str:
        return self.fingerprint

    def __exit__(self, *exc: object) -> None:
        self._chan.close()


if __name__ == "__main__":
    main()
