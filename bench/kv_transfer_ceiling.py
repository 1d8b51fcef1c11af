"""The ceiling of any byte stream over Python gRPC on this machine, for
bench/bench_kv_transfer.py: the same bytes as a K/V push, in 1 MiB messages over the same
channel options, into a server process that only reads them. No packing, checksum, parsing
or writing on either side."""

from __future__ import annotations

import asyncio
import multiprocessing
import time

import grpc

from kvferry.rpc import grpc_util
from kvferry.transfer import wire


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


async def _bare_push_gbps(address: str, num_bytes: int, reps: int) -> list[float]:
    """GB/s of `reps` streams of `num_bytes`, after one untimed stream."""
    message = bytes(wire.CHUNK_TARGET_BYTES)

    async def messages():
        for _ in range(num_bytes // len(message)):
            yield message

    rates = []
    async with grpc_util.channel(address) as chan:
        push = chan.stream_unary("/bench.Sink/Push")
        await push(messages(), timeout=600)  # warm-up
        for _ in range(reps):
            start = time.perf_counter()
            await push(messages(), timeout=600)
            rates.append(num_bytes / (time.perf_counter() - start) / 1e9)
    return rates


def bare_grpc_gbps(sizes_mib: list[int], reps: int) -> list[list[float]]:
    """Per size, GB/s of `reps` bare streams into a sink process."""
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
