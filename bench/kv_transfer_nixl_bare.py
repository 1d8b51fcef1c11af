"""The ceiling of NIXL over UCX on this machine, for bench/bench_kv_transfer.py: the data
plane of a NIXL push alone. A source process registers a pool of the benchmark's geometry
(random pages) with a NIXL agent and only waits; this process registers a pool of its own and
READs from it the pages a real push of each size names: the same descriptors (block ids
0..n-1 on both sides), one READ per group, the groups one after the other, as the decode
worker's puller reads them. No checksums, no finite checks, no gRPC control messages.

Timed per push: for each group, `initialize_xfer`, `transfer`, polling `check_xfer_state`
(at the puller's interval) until DONE, `release_xfer_handle`. The descriptor lists are built
before the clock starts."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from kvferry.cache.budget import blocks_for_tokens
from kvferry.cache.layout import KvLayout
from kvferry.cache.pool import KvPool
from kvferry.transfer import wire
from kvferry.transfer.nixl import pages as nixl_pages
from kvferry.transfer.nixl.send import NIXL_MIN_GROUP_BYTES

READ_TIMEOUT_S = 60.0
START_TIMEOUT_S = 120.0  # the source process: spawn, imports, the NIXL agent


class PoolShape(NamedTuple):
    """A KvPool's geometry, sent to the source process."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    dtype: torch.dtype
    device: str = "cpu"  # "cuda:N": the pool lies in GPU memory (NIXL VRAM)

    @classmethod
    def of(cls, pool: KvPool) -> PoolShape:
        return cls(pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.block_size,
                   pool.num_blocks, pool.dtype, str(pool.cache.device))

    def make(self) -> KvPool:
        return KvPool(*self[:6], device=self.device)

    def seeded(self, seed: int) -> torch.Tensor:
        """Pages of uniform noise from `seed`, made on the CPU: the same in every process."""
        shape = self.make_shape()
        gen = torch.Generator().manual_seed(seed)
        return torch.rand(shape, generator=gen, dtype=torch.float32).to(self.dtype)

    def make_shape(self) -> tuple[int, ...]:
        # [layers, 2, blocks, block_size, kv_heads, head_dim], as KvPool lays it out
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads,
                self.head_dim)


class SourceReady(NamedTuple):
    """What the source process sends back once its pool is registered."""

    agent_metadata: bytes
    memory: nixl_pages.PoolMemory


def _bare_source(conn: Any, shape: PoolShape, seed: int | None = None) -> None:
    """A NIXL agent with a registered pool of random pages (`shape.seeded(seed)` when a
    seed is given), kept until told to exit."""
    pool = shape.make()
    if seed is None:
        pool.cache.uniform_()
    else:
        pool.cache.copy_(shape.seeded(seed))
    agent = nixl_pages.make_agent("bench-bare-source")
    agent.register_memory(pool.cache)
    conn.send(SourceReady(agent.get_agent_metadata(), nixl_pages.PoolMemory.of(pool)))
    conn.recv()  # anything: exit


def read_groups(local: nixl_pages.PoolMemory, remote: nixl_pages.PoolMemory, pool: KvPool,
                num_tokens: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per group of a push of `num_tokens`, the (local, remote) [N, 3] descriptor arrays a
    real push names, with blocks 0..n-1 on both sides."""
    layout = KvLayout.of_pool(pool, "bench")
    ids = list(range(blocks_for_tokens(num_tokens, pool.block_size)))
    page = nixl_pages.page_bytes(pool)
    spans = wire.plan_chunks(layout, num_tokens, 1 << 62, NIXL_MIN_GROUP_BYTES)
    return [nixl_pages.descriptors(local, span_ids, remote, span_ids, span, page)
            for span in spans for span_ids in [nixl_pages.span_ids(ids, span)]]


def _read(agent: Any, local: Any, remote: Any, peer: str) -> None:
    """One READ, polled until it ends (as the puller polls); released either way."""
    state = nixl_pages.read(agent, local, remote, peer, READ_TIMEOUT_S)
    if state != "DONE":
        raise RuntimeError(f"NIXL bare READ from {peer} ended {state}"
                           + (" (timed out)" if state not in ("DONE", "ERR") else ""))


def _push_reads_gbps(agent: Any, peer: str, groups: list[tuple[Any, Any]], num_bytes: int,
                     reps: int) -> list[float]:
    """GB/s of `reps` sets of READs (one per group, in order), after one untimed set."""
    rates = []
    for rep in range(reps + 1):
        start = time.perf_counter()
        for local, remote in groups:
            _read(agent, local, remote, peer)
        if rep:
            rates.append(num_bytes / (time.perf_counter() - start) / 1e9)
    return rates


def _wait_ready(conn: Any, source: Any) -> SourceReady:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not conn.poll(0.5):
        if not source.is_alive():
            raise RuntimeError(f"NIXL bare source process exited {source.exitcode} "
                               "before registering its pool")
        if time.monotonic() > deadline:
            raise RuntimeError(f"NIXL bare source process not ready after {START_TIMEOUT_S} s")
    return conn.recv()


def bare_nixl_gbps(pool: KvPool, tokens_per_size: list[int], reps: int,
                   seed: int | None = None,
                   after: Callable[[KvPool, int], None] | None = None) -> list[list[float]]:
    """Per push size (in tokens), GB/s of `reps` bare READ sets from a source process whose
    pool has `pool`'s geometry (and device) into a pool of this process. With `seed`, the
    source's pages are `PoolShape.seeded(seed)`; `after(sink, num_tokens)` is called after
    each size's READs (to check what landed)."""
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    shape = PoolShape.of(pool)
    source = ctx.Process(target=_bare_source, args=(theirs, shape, seed), daemon=True)
    source.start()
    try:
        ready = _wait_ready(ours, source)
        sink = shape.make()  # [layers, 2, blocks, block_size, kv_heads, head_dim]
        agent = nixl_pages.make_agent("bench-bare-sink")
        registered = agent.register_memory(sink.cache)
        local = nixl_pages.PoolMemory.of(sink)
        peer = nixl_pages.add_peer(agent, ready.agent_metadata)
        samples = []
        for num_tokens in tokens_per_size:
            arrays = read_groups(local, ready.memory, sink, num_tokens)
            num_bytes = sum(int(lo[:, 1].sum()) for lo, _ in arrays)
            groups = [(agent.get_xfer_descs(lo, local.memory_type),
                       agent.get_xfer_descs(re, ready.memory.memory_type)) for lo, re in arrays]
            samples.append(_push_reads_gbps(agent, peer, groups, num_bytes, reps))
            if after is not None:
                after(sink, num_tokens)
        agent.remove_remote_agent(peer)
        agent.deregister_memory(registered)
        return samples
    finally:
        if source.is_alive():
            ours.send(None)
            source.join(10)
        if source.is_alive():
            source.kill()
