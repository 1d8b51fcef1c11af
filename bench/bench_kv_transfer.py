"""K/V transfer throughput: gRPC and NIXL pushes into a decode worker process (and Ray, on
request) against an in-process memcpy of the same bytes, for 4, 64 and 256 MiB of K/V per
request, in one run.

The pushing side is this process (a pool filled with random pages, the project's
GrpcKvSender or NixlKvSender); the receiving side is a real decode worker process, started
with `--kv-transport nixl` for NIXL, which validates every group and writes (gRPC) or READs
(NIXL) it into its pool. Each size: one untimed push (connection, NIXL registration and
metadata exchange), then `--reps` timed ones, reported as median [min-max] GB/s and as a
ratio to the fastest memcpy of the size in the run (bench/kv_transfer_report.py).

Two ceiling rows go with the transports. "gRPC bare" (bench/kv_transfer_ceiling.py): the same
bytes in 1 MiB messages into a process that only reads them. "NIXL bare"
(bench/kv_transfer_nixl_bare.py): the data plane alone, what NIXL over UCX gives on this
machine without kvferry's checks: one READ per group of the same descriptors, cross-process,
no checksums, no finite checks, no gRPC control messages. The gap to the NIXL row is the price
of the checks and the control plane.

The run ends with the NIXL target: at or above 0.4x of memcpy for pushes of 64 MiB and more.
Uses a seeded checkpoint with 64 KiB of K/V per token (16 layers x 8 KV heads x 64 x fp32 x
2), so 256 MiB is 4096 tokens. Usage:

    .venv/bin/python bench/bench_kv_transfer.py [--sizes-mib 4 64 256] [--reps 3]
        [--transports grpc nixl ray] [--ttft-prompt-tokens 0] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script too
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "kernels"))
from bench.kv_transfer_ceiling import bare_grpc_gbps  # noqa: E402
from bench.kv_transfer_nixl_bare import bare_nixl_gbps  # noqa: E402
from bench.kv_transfer_ray import ray_stage_gbps  # noqa: E402
from bench.kv_transfer_report import (  # noqa: E402
    SizeFigures,
    format_table,
    ratio_summary,
    target_verdict,
)
from bench.kv_transfer_ttft import NIXL_WORKER_ARGS, print_ttft, ttft_rows  # noqa: E402
from deploy.launcher import Deployment  # noqa: E402
from deploy.worker_model import tune_malloc  # noqa: E402
from kvferry.cache.budget import blocks_for_tokens  # noqa: E402
from kvferry.cache.layout import KvLayout  # noqa: E402
from kvferry.cache.pool import KvPool  # noqa: E402
from kvferry.model.checkpoint import ModelSpec, make_model  # noqa: E402
from kvferry.rpc import grpc_util  # noqa: E402
from kvferry.transfer import wire
from kvferry.transfer.grpc.send import GrpcKvSender  # noqa: E402
from kvferry.transfer.nixl import pages as nixl_pages  # noqa: E402
from kvferry.transfer.nixl.send import NIXL_MIN_GROUP_BYTES, NixlKvSender  # noqa: E402
from kvferry.transfer.sender import KvSender  # noqa: E402
from kvferry.v1 import generation_pb2, worker_pb2, worker_pb2_grpc  # noqa: E402

SPEC = ModelSpec(vocab_size=512, hidden_size=512, intermediate_size=512, num_layers=16,
                 num_heads=8, num_kv_heads=8, head_dim=64, max_position_embeddings=4097,
                 seed=5)
BYTES_PER_TOKEN = 2 * 16 * 8 * 64 * 4
TRANSPORTS = ("grpc", "nixl", "ray")
MEMCPY_REPS = 5  # per size, before and after the transports


def memcpy_gbps(num_bytes: int, reps: int = MEMCPY_REPS) -> list[float]:
    """GB/s of `reps` in-process copies of `num_bytes`, after one untimed copy."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    return [num_bytes / _time(lambda: dst.copy_(src)) / 1e9 for _ in range(reps)]


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def tokens_of(size_mib: int) -> int:
    return size_mib * (1 << 20) // BYTES_PER_TOKEN


async def _push_once(decode: worker_pb2_grpc.DecodeServiceStub, sender: KvSender,
                     address: str, request_id: str, layout: KvLayout, num_tokens: int,
                     pool: KvPool) -> float:
    """GB/s of one push into a fresh reservation (released after)."""
    table = list(range(blocks_for_tokens(num_tokens, pool.block_size)))
    await decode.Reserve(worker_pb2.ReserveRequest(
        request_id=request_id, num_prompt_tokens=num_tokens, max_tokens=1, lease_s=120),
        timeout=60)
    start = time.perf_counter()
    result = await sender.push(address, request_id, layout, num_tokens, pool, table, 600)
    seconds = time.perf_counter() - start
    await decode.Abort(generation_pb2.AbortRequest(request_id=request_id), timeout=60)
    return result.num_bytes / seconds / 1e9


async def push_gbps(sender: KvSender, address: str, pool: KvPool, layout: KvLayout,
                    sizes_mib: list[int], reps: int) -> list[list[float]]:
    """Per size, GB/s of `reps` timed pushes after one untimed one, all with one sender."""
    samples = []
    async with grpc_util.channel(address) as chan:
        decode = worker_pb2_grpc.DecodeServiceStub(chan)
        for size in sizes_mib:
            rates = [await _push_once(decode, sender, address, f"bench-{size}-{rep}", layout,
                                      tokens_of(size), pool) for rep in range(reps + 1)]
            samples.append(rates[1:])
    await sender.close()
    return samples


def measure(deployment: Deployment, sender: KvSender, sizes_mib: list[int], reps: int,
            pool: KvPool) -> list[list[float]]:
    """GB/s samples of pushes of each size from this process into the deployment's decode
    worker."""
    address = deployment.addresses("decode")[0]
    with grpc_util_sync_stats(address) as fingerprint:
        layout = KvLayout.of_pool(pool, fingerprint)
    return asyncio.run(push_gbps(sender, address, pool, layout, sizes_mib, reps))


def nixl_descriptors(pool: KvPool, num_tokens: int, chunk_bytes: int) -> int:
    """NIXL descriptors one push of `num_tokens` names (one per layer, K/V and run of blocks
    consecutive on both sides), counting the decode worker's blocks as consecutive, as a
    fresh pool hands them out."""
    layout = KvLayout.of_pool(pool, "bench")
    table = list(range(blocks_for_tokens(num_tokens, pool.block_size)))
    memory, page = nixl_pages.PoolMemory.of(pool), nixl_pages.page_bytes(pool)
    spans = wire.plan_chunks(layout, num_tokens, chunk_bytes, NIXL_MIN_GROUP_BYTES)
    return sum(len(nixl_pages.descriptors(memory, ids, memory, ids, span, page)[0])
               for span in spans for ids in [nixl_pages.span_ids(table, span)])


def run_ray(options: dict[str, str], sizes_mib: list[int], reps: int, pool: KvPool,
            pool_bytes: int) -> tuple[list[list[float]], dict[str, float]]:
    """Ray pushes into a decode worker running as a Ray actor, then each stage alone. Ray
    stays up (the TTFT part may need it); the caller shuts it down."""
    import ray

    from deploy.ray_launcher import RayDeployment
    from kvferry.transfer.ray.send import NAMESPACE, RAY_CHUNK_TARGET_BYTES, RayKvSender

    ray.init(namespace=NAMESPACE, include_dashboard=False, log_to_driver=False,
             object_store_memory=max(3 * pool_bytes, 256 << 20))
    with RayDeployment(**options) as deployment:
        samples = measure(deployment, RayKvSender(), sizes_mib, reps, pool)
    return samples, ray_stage_gbps(pool, tokens_of(max(sizes_mib)), RAY_CHUNK_TARGET_BYTES)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[4, 64, 256])
    parser.add_argument("--reps", type=int, default=3, help="timed pushes per size")
    parser.add_argument("--transports", nargs="+", default=["grpc", "nixl"],
                        choices=TRANSPORTS)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/kvferry-bench-transfer"))
    parser.add_argument("--ttft-prompt-tokens", type=int, default=4000,
                        help="long prompt for the TTFT comparison (0: skip it)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps: at least 1")
    if min(args.sizes_mib) < 1:
        parser.error("--sizes-mib: each at least 1")
    return args


class Pushed(NamedTuple):
    """Every transport's samples, per transport then per size."""

    gbps: dict[str, list[list[float]]]
    nixl_descriptors: list[int | None]  # per size; None where NIXL did not run
    ray_stages_gbps: dict[str, float]


def run_transports(args: argparse.Namespace, pool: KvPool, pool_bytes: int) -> Pushed:
    sizes, reps = args.sizes_mib, args.reps
    options = dict(model=str(args.model_dir), kv_pool_size=f"{pool_bytes}B")
    pushed = Pushed({}, [None] * len(sizes), {})
    if "grpc" in args.transports:
        with Deployment(**options) as deployment:
            pushed.gbps["grpc"] = measure(deployment, GrpcKvSender(), sizes, reps, pool)
        pushed.gbps["grpc_bare"] = bare_grpc_gbps(sizes, reps)
    if "nixl" in args.transports:
        sender = NixlKvSender()
        with Deployment(**options, worker_args=NIXL_WORKER_ARGS) as deployment:
            pushed.gbps["nixl"] = measure(deployment, sender, sizes, reps, pool)
        pushed.nixl_descriptors[:] = [nixl_descriptors(pool, tokens_of(s), sender.chunk_bytes)
                                      for s in sizes]
        pushed.gbps["nixl_bare"] = bare_nixl_gbps(pool, [tokens_of(s) for s in sizes], reps)
    if "ray" in args.transports:
        pushed.gbps["ray"], stages = run_ray(options, sizes, reps, pool, pool_bytes)
        pushed.ray_stages_gbps.update(stages)
    return pushed


def main() -> None:
    args = parse_args()
    # This process stands in for a prefill worker: tuned malloc and one torch thread, as
    # `kvferry up` and the Deployment launcher run workers on a small machine (a second
    # thread here spins in OpenMP and takes the receiver's core).
    tune_malloc()
    torch.set_num_threads(1)
    if not (args.model_dir / "config.json").exists():
        make_model(args.model_dir, SPEC)
    sizes = args.sizes_mib
    max_tokens = tokens_of(max(sizes))
    pool = KvPool(16, 8, 64, 16, blocks_for_tokens(max_tokens, 16), torch.float32)
    pool.cache.uniform_()
    copies = [memcpy_gbps(size << 20) for size in sizes]
    pushed = run_transports(args, pool, (max_tokens + 64) * BYTES_PER_TOKEN)
    # memcpy before and after the transports; ratios are over the fastest sample.
    copies = [before + memcpy_gbps(size << 20) for before, size in zip(copies, sizes)]
    figures = [SizeFigures(size, tuple(copies[i]), {t: tuple(r[i]) for t, r in pushed.gbps.items()},
                           pushed.nixl_descriptors[i]) for i, size in enumerate(sizes)]
    verdict = target_verdict(figures)
    print(format_table(figures, args.reps) + "\n\n" + ratio_summary(figures) + "\n\n"
          + verdict.text)
    if pushed.ray_stages_gbps:
        print(f"\nRay push stages alone, {max(sizes)} MiB (GB/s; memcpy "
              f"{figures[-1].memcpy_ref_gbps:.2f}):")
        print("  " + "  ".join(f"{n} {gbps:.2f}" for n, gbps in pushed.ray_stages_gbps.items()))
    ttft = ttft_rows(args.ttft_prompt_tokens, args.reps, args.transports) \
        if args.ttft_prompt_tokens else []
    if "ray" in args.transports:
        import ray

        ray.shutdown()
    if ttft:
        print_ttft(ttft, args.ttft_prompt_tokens, args.reps)
    if args.out:
        args.out.write_text(json.dumps({
            "reps": args.reps, "rows": [f.to_json() for f in figures],
            "target": verdict.to_json(), "ray_stages_gbps": pushed.ray_stages_gbps,
            "ttft": ttft}, indent=2))


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
