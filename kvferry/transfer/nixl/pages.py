"""What both ends of the NIXL K/V transport share: the agent, and where pages lie in a pool.

A pool is one C-order tensor [layers, 2 (K, V), blocks, block_size, kv_heads, head_dim], so
the page of (layer, K or V, block) starts at `base + ((layer * 2 + kv) * blocks + block) *
page_bytes`, and consecutive block ids of one (layer, K or V) are one contiguous region.
A transfer names one descriptor per run of logical blocks that is consecutive on both sides
(block-sized descriptors fragment transfers: vLLM #50913), for every layer and K/V of a
group. Each side checksums its own pages in wire order (`kvferry.transfer.wire`: layer, K
then V, block), chaining CRC-32C over its own contiguous runs: the result equals the CRC of
the packed chunk a gRPC push would carry, without packing anything.

`nixl` (PyPI; `nixl-cu12` carries the library and UCX) is imported only here and only when a
worker runs with `--kv-transport nixl`.
"""

from __future__ import annotations

import importlib
import os
import socket
import threading
import time
import uuid
from typing import Any, NamedTuple

import crc32c
import numpy as np
import torch

from kvferry.cache.pool import KvPool
from kvferry.settings import TRANSFER_THREAD
from kvferry.transfer.nixl import agent as nixl_agent
from kvferry.transfer.wire import ChunkSpan

NIXL_INSTALL = "pip install nixl-cu12==1.5.1 (or nixl==1.5.1, which picks the CUDA build)"


class NixlMissing(RuntimeError):
    """The nixl package is not installed."""


# NIXL's Python wrapper creates every agent with a progress-thread delay of 0: a busy spin
# that took a whole core per worker here (0.98 CPU while idle), starving the decode steps and
# the prefill forward of a 2-core machine. With a delay the thread sleeps in poll() until UCX
# has work: 0.02 CPU idle, and cross-process READs as fast as with the spin (2.7-3.3 GB/s
# against 1.7-2.1 for 64 MiB, same machine, same minute).
PROGRESS_DELAY_US = 100
_agent_lock = threading.Lock()


def _nixl_api() -> Any:
    # The meta-package picks the build for the node's CUDA; else a build installed directly.
    nixl_agent.prepare_ucx()  # before UCX loads: see nixl_agent
    for module in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            return importlib.import_module(module)
        except ImportError:
            continue
    raise NixlMissing(f"--kv-transport nixl needs NIXL: {NIXL_INSTALL}")


def thread_ids() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def name_transfer_threads(tids: set[int]) -> None:
    """Name these threads of this process TRANSFER_THREAD: they move or check K/V bytes
    (NIXL's, UCX's, the puller's), and a deployment can keep them off the core that steps
    decoding (deploy.launcher.Deployment.pin). Linux; a thread gone meanwhile is skipped."""
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm", "w") as comm:
                comm.write(TRANSFER_THREAD)
        except OSError:
            pass


def name_this_thread() -> None:
    name_transfer_threads({threading.get_native_id()})


def make_agent(role: str) -> Any:
    """A NIXL agent with the UCX backend, a progress thread that sleeps when idle, and no
    listener of its own (metadata travels on the authenticated gRPC control plane). Its name
    is unique per process start, so a restarted peer is never confused with its
    predecessor. Closed by `nixl_agent.close` (its owner's stop path) or at exit."""
    api = _nixl_api()
    name = f"kvferry-{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    config = api.nixl_agent_config(enable_listen_thread=False, backends=["UCX"])
    bind = api.nixlBind
    plain = bind.nixlAgentConfig

    class Config(plain):  # type: ignore[misc, valid-type]
        """The wrapper's agent config, but for the progress thread's delay (see above)."""

        def __setattr__(self, field: str, value: Any) -> None:
            super().__setattr__(field, PROGRESS_DELAY_US if field == "pthrDelay" else value)

    before = thread_ids()
    with _agent_lock:  # the wrapper reads the class from its bindings module
        bind.nixlAgentConfig = Config
        try:
            agent = api.nixl_agent(name, config)
        finally:
            bind.nixlAgentConfig = plain
    name_transfer_threads(thread_ids() - before)  # NIXL's progress thread, UCX's async one
    nixl_agent.opened(agent)
    return agent


class PoolMemory(NamedTuple):
    """Where a pool lies, as NIXL names memory."""

    address: int
    num_blocks: int
    memory_type: str  # DRAM or VRAM
    device_id: int

    @classmethod
    def of(cls, pool: KvPool) -> PoolMemory:
        cache = pool.cache
        if not cache.is_contiguous():
            raise ValueError("the K/V pool must be one contiguous tensor")
        is_cuda = cache.device.type == "cuda"
        device_id = (cache.device.index or 0) if is_cuda else 0
        return cls(cache.data_ptr(), pool.num_blocks, "VRAM" if is_cuda else "DRAM", device_id)


POLL_S = 0.0002  # between two looks at a READ in flight


class ReadNotReleased(RuntimeError):
    """NIXL could not release (cancel) a READ: it may still write into its pages."""


def read(agent: Any, local: Any, remote: Any, peer: str, timeout_s: float) -> str:
    """One NIXL READ of `remote` descriptors (a transfer descriptor list) from agent `peer`
    into `local`, polled until DONE or ERR or `timeout_s`, then released either way (which
    cancels it if still in flight). Returns the last state seen: DONE on success."""
    handle = agent.initialize_xfer("READ", local, remote, peer)
    state = "ERR"
    try:
        state = agent.transfer(handle)
        deadline = time.monotonic() + timeout_s
        while state not in ("DONE", "ERR") and time.monotonic() < deadline:
            time.sleep(POLL_S)
            state = agent.check_xfer_state(handle)
    finally:
        try:
            agent.release_xfer_handle(handle)
        except Exception as exc:
            nixl_agent.stuck(agent, handle)
            raise ReadNotReleased(str(exc)) from exc
    return state


def add_peer(agent: Any, metadata: bytes) -> str:
    """Load a remote agent's metadata; returns its name."""
    loaded = agent.add_remote_agent(metadata)
    return loaded.decode() if isinstance(loaded, bytes) else str(loaded)


def page_bytes(pool: KvPool) -> int:
    return pool.page_nbytes


def _runs(*tables: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Starts and lengths of the runs of positions where every table's ids go up by one."""
    n = len(tables[0])
    breaks = np.zeros(n, dtype=bool)
    breaks[0] = True
    for ids in tables:
        breaks[1:] |= np.diff(ids) != 1
    starts = np.flatnonzero(breaks)
    return starts, np.diff(np.append(starts, n))


def descriptors(local: PoolMemory, local_ids: list[int], remote: PoolMemory,
                remote_ids: list[int], span: ChunkSpan, page: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """Matching [N, 3] (address, bytes, device) descriptor arrays, local and remote, for the
    span's pages: one per (layer, K/V, run of blocks consecutive on both sides). `*_ids`: each
    side's block ids of the span's logical blocks, in order."""
    lids = np.asarray(local_ids, dtype=np.int64)
    rids = np.asarray(remote_ids, dtype=np.int64)
    starts, lengths = _runs(lids, rids)
    planes = np.arange(span.layer_start * 2, span.layer_end * 2, dtype=np.int64)[:, None]

    def table(mem: PoolMemory, ids: np.ndarray) -> np.ndarray:
        offsets = (planes * mem.num_blocks + ids[starts][None, :]) * page
        out = np.empty((offsets.size, 3), dtype=np.uint64)
        out[:, 0] = (mem.address + offsets).reshape(-1)
        out[:, 1] = np.broadcast_to(lengths * page, offsets.shape).reshape(-1)
        out[:, 2] = mem.device_id
        return out

    return table(local, lids), table(remote, rids)


def _regions(pool: KvPool, ids: list[int], span: ChunkSpan) -> list[torch.Tensor]:
    """The span's pages as contiguous views of the pool, in wire order."""
    table = np.asarray(ids, dtype=np.int64)
    starts, lengths = _runs(table)
    return [pool.cache[layer, kv, int(table[s]): int(table[s]) + int(n)]
            for layer in range(span.layer_start, span.layer_end) for kv in (0, 1)
            for s, n in zip(starts, lengths)]


def span_ids(block_table: list[int], span: ChunkSpan) -> list[int]:
    return block_table[span.block_start: span.block_start + span.num_blocks]


def crc32_pages(pool: KvPool, block_table: list[int], span: ChunkSpan) -> int:
    """CRC-32C of the span's pages in wire order (equal to wire.crc32(wire.pack_array(...))),
    read in place. The crc32c library releases the GIL on large buffers."""
    return crc32_blocks(pool, span_ids(block_table, span), span)


def crc32_blocks(pool: KvPool, ids: list[int], span: ChunkSpan) -> int:
    """`crc32_pages` of the span's pages in blocks `ids` (its logical blocks, in order)."""
    crc = 0
    for region in _regions(pool, ids, span):
        crc = crc32c.crc32c(region.cpu().reshape(-1).view(torch.uint8).numpy(), crc)
    return crc


def pages_finite(pool: KvPool, block_table: list[int], span: ChunkSpan) -> bool:
    return blocks_finite(pool, span_ids(block_table, span), span)


def blocks_finite(pool: KvPool, ids: list[int], span: ChunkSpan) -> bool:
    return all(pool.pages_finite(region) for region in _regions(pool, ids, span))
