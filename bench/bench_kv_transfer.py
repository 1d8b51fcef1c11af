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
import multiprocessing
import statistics
import time
from pathlib import Path

import grpc
import torch

from deploy import client
from deploy.default_model import tiny_model
from deploy.launcher import Deployment
from deploy.worker_model import tune_malloc
from kvferry.cache.layout import KvLayout, blocks_for_tokens
from kvferry.cache.pool import KvPool
from kvferry.model.checkpoint import ModelSpec, make_model
from kvferry.rpc import grpc_util
from kvferry.transfer import wire
from kvferry.transfer.grpc_push import GrpcKvSender
from kvferry.transfer.sender import KvSender
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


async def push_gbps(sender: KvSender, address: str, pool: KvPool, layout: KvLayout,
                    num_tokens: int, reps: int) -> float:
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


def measure(deployment: Deployment, make_sender, sizes_mib: list[int], reps: int,
            pool: KvPool) -> list[float]:
    """GB/s of pushes of each size from this process into the deployment's decode worker."""
    address = deployment.addresses("decode")[0]
    with grpc_util_sync_stats(address) as fingerprint:
        layout = KvLayout.of_pool(pool, fingerprint)
    rates = []
    for size in sizes_mib:
        tokens = size * (1 << 20) // BYTES_PER_TOKEN
        rates.append(asyncio.run(push_gbps(make_sender(), address, pool, layout, tokens, reps)))
    return rates


def _bare_sink(conn) -> None:
    """A gRPC server whose one method reads a stream of bytes messages and does nothing else."""

    async def sink(messages, context) -> bytes:
        async for _ in messages:
            pass
        return b""

    async def serve() -> None:
        server = grpc_util.make_server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "bench.Sink", {"Push": grpc.stream_unary_rpc_method_handler(sink)}),))
        conn.send(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


async def _bare_push_gbps(address: str, num_bytes: int, reps: int) -> float:
    best = float("inf")
    message = bytes(wire.CHUNK_TARGET_BYTES)

    async def messages():
        for _ in range(num_bytes // len(message)):
            yield message

    async with grpc_util.channel(address) as chan:
        push = chan.stream_unary("/bench.Sink/Push")
        await push(messages(), timeout=600)  # warm-up
        for _ in range(reps):
            start = time.perf_counter()
            await push(messages(), timeout=600)
            best = min(best, time.perf_counter() - start)
    return num_bytes / best / 1e9


def bare_grpc_gbps(sizes_mib: list[int], reps: int) -> list[float]:
    """The ceiling of any byte stream over Python gRPC here: the same bytes in 1 MiB messages
    over the same channel options into a server that only reads them. No packing, checksum,
    parsing or writing on either side."""
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    server = ctx.Process(target=_bare_sink, args=(theirs,), daemon=True)
    server.start()
    try:
        port = ours.recv()
        return [asyncio.run(_bare_push_gbps(f"127.0.0.1:{port}", size << 20, reps))
                for size in sizes_mib]
    finally:
        server.kill()


async def _first_two_tokens(address: str, prompt: list[int]) -> tuple[float, float]:
    """Client-side seconds to the first and to the second token of one request."""
    request = client.make_request(prompt, temperature=0.0, max_tokens=2, ignore_eos=True)
    got = await client.generate(address, request, timeout_s=600)
    return got.token_times_s[0], got.token_times_s[-1]


def ttft_rows(prompt_tokens: int, reps: int, transports: list[str]) -> list[dict[str, object]]:
    """Median TTFT and time to the 2nd token of one long prompt on the tiny model: a
    colocated worker (prefill compute alone, no transfer) against disaggregated deployments
    whose K/V push is pipelined with the prefill. The 2nd token needs the K/V to have landed
    on the decode worker, so it shows what the transfer adds to the critical path."""
    model = tiny_model()
    prompt = torch.randint(1, 500, (prompt_tokens,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    setups = [("colocated (compute alone)", Deployment(model=model, is_colocated=True))]
    if "grpc" in transports:
        setups.append(("disaggregated, gRPC", Deployment(model=model)))
    if "ray" in transports:
        from deploy.ray_launcher import RayDeployment

        setups.append(("disaggregated, Ray", RayDeployment(model=model)))
    rows = []
    for name, deployment in setups:
        with deployment:
            asyncio.run(_first_two_tokens(deployment.router_address, prompt))  # warm-up
            times = [asyncio.run(_first_two_tokens(deployment.router_address, prompt))
                     for _ in range(reps)]
        rows.append({"setup": name, "ttft_s": statistics.median(t[0] for t in times),
                     "second_token_s": statistics.median(t[1] for t in times)})
    for row in rows:
        row["ttft_ratio"] = row["ttft_s"] / rows[0]["ttft_s"]
        row["second_token_ratio"] = row["second_token_s"] / rows[0]["second_token_s"]
    return rows


def ray_stage_gbps(pool: KvPool, size_mib: int, chunk_bytes: int) -> dict[str, float]:
    """Each stage of a Ray push on its own, in this process, over `size_mib` of pages in the
    Ray transport's chunks: gather out of the pool, checksum, `ray.put`, `ray.get` (a
    zero-copy map on one node), and the write into a second pool. GB/s of each."""
    import ray

    layout = KvLayout.of_pool(pool, "bench")
    tokens = size_mib * (1 << 20) // BYTES_PER_TOKEN
    table = list(range(blocks_for_tokens(tokens, pool.block_size)))
    spans = wire.plan_chunks(layout, tokens, chunk_bytes)
    target = KvPool(pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.block_size,
                    len(table), pool.dtype)
    seconds = dict.fromkeys(("gather", "checksum", "ray.put", "ray.get", "write"), 0.0)
    for _ in range(2):  # the second pass counts: first-touch page faults stay out
        seconds = dict.fromkeys(seconds, 0.0)
        for span in spans:
            marks = [time.perf_counter()]
            data = wire.pack_array(pool, table, span)
            marks.append(time.perf_counter())
            wire.crc32(data)
            marks.append(time.perf_counter())
            ref = ray.put(data)
            marks.append(time.perf_counter())
            got = ray.get(ref)
            marks.append(time.perf_counter())
            wire.unpack_into(target, table, span, got)
            marks.append(time.perf_counter())
            for name, start, end in zip(seconds, marks, marks[1:]):
                seconds[name] += end - start
            del ref, got
    return {name: tokens * BYTES_PER_TOKEN / t / 1e9 for name, t in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[4, 64, 256])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--transports", nargs="+", default=["grpc", "ray"],
                        choices=["grpc", "ray"])
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/kvferry-bench-transfer"))
    parser.add_argument("--ttft-prompt-tokens", type=int, default=4000,
                        help="long prompt for the TTFT comparison (0: skip it)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    # This process stands in for a prefill worker: tuned malloc and one torch thread, as
    # `kvferry up` and the Deployment launcher run workers on a small machine (a second
    # thread here spins in OpenMP and takes the receiver's core).
    tune_malloc()
    torch.set_num_threads(1)
    if not (args.model_dir / "config.json").exists():
        make_model(args.model_dir, SPEC)
    max_tokens = max(args.sizes_mib) * (1 << 20) // BYTES_PER_TOKEN
    pool_bytes = (max_tokens + 64) * BYTES_PER_TOKEN
    pool = KvPool(16, 8, 64, 16, blocks_for_tokens(max_tokens, 16), torch.float32)
    pool.cache.uniform_()
    options = dict(model=str(args.model_dir), kv_pool_size=f"{pool_bytes}B")
    copy_before = [memcpy_gbps(size << 20) for size in args.sizes_mib]
    rates: dict[str, list[float]] = {}
    if "grpc" in args.transports:
        with Deployment(**options) as deployment:
            rates["grpc"] = measure(deployment, GrpcKvSender, args.sizes_mib, args.reps, pool)
        rates["grpc_bare"] = bare_grpc_gbps(args.sizes_mib, args.reps)
    ray_up = False
    ray_stages: dict[str, float] = {}
    if "ray" in args.transports:
        import ray

        from deploy.ray_launcher import RayDeployment
        from kvferry.transfer.ray_push import NAMESPACE, RayKvSender

        ray.init(namespace=NAMESPACE, include_dashboard=False, log_to_driver=False,
                 object_store_memory=max(3 * pool_bytes, 256 << 20))
        with RayDeployment(**options) as deployment:
            rates["ray"] = measure(deployment, RayKvSender, args.sizes_mib, args.reps, pool)
        ray_up = True
        from kvferry.transfer.ray_push import RAY_CHUNK_TARGET_BYTES

        ray_stages = ray_stage_gbps(pool, max(args.sizes_mib), RAY_CHUNK_TARGET_BYTES)
    # memcpy before and after the transports, the faster of the two: on a shared VM memory
    # bandwidth drifts by 2x within minutes, and the ratios should not flatter the transports.
    copy = [max(before, memcpy_gbps(size << 20))
            for before, size in zip(copy_before, args.sizes_mib)]
    rows = [{"mib": size, "memcpy_gbps": copy[i],
             **{f"{t}_gbps": rates[t][i] for t in rates},
             **{f"{t}_ratio": rates[t][i] / copy[i] for t in rates}}
            for i, size in enumerate(args.sizes_mib)]
    names = list(rates)
    print(f"{'MiB':>5} {'memcpy GB/s':>12}" + "".join(f" {t + ' GB/s':>10} {t + '/memcpy':>12}"
                                                   for t in names))
    for r in rows:
        print(f"{r['mib']:>5} {r['memcpy_gbps']:>12.3f}" + "".join(
            f" {r[t + '_gbps']:>10.3f} {r[t + '_ratio']:>12.1%}" for t in names))
    if ray_stages:
        print(f"\nRay push stages alone, {max(args.sizes_mib)} MiB in "
              f"{RAY_CHUNK_TARGET_BYTES >> 20} MiB chunks (GB/s; memcpy {copy[-1]:.2f}):")
        print("  " + "  ".join(f"{name} {gbps:.2f}" for name, gbps in ray_stages.items()))
    ttft = ttft_rows(args.ttft_prompt_tokens, args.reps, args.transports) \
        if args.ttft_prompt_tokens else []
    if ray_up:
        ray.shutdown()
    if ttft:
        print(f"\n{args.ttft_prompt_tokens}-token prompt, tiny model (median of {args.reps})")
        print(f"{'setup':<28} {'TTFT ms':>8} {'x':>6} {'2nd token ms':>13} {'x':>6}")
        for r in ttft:
            print(f"{r['setup']:<28} {r['ttft_s'] * 1e3:>8.1f} {r['ttft_ratio']:>6.2f} "
                  f"{r['second_token_s'] * 1e3:>13.1f} {r['second_token_ratio']:>6.2f}")
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "ray_stages_gbps": ray_stages,
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
