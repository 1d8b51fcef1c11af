"""Where pages lie for NIXL: descriptors name exactly the span's pages, one per run of blocks
consecutive on both sides, and the in-place checksum equals the packed chunk's."""

from __future__ import annotations

import os
import time

import pytest
import torch

from kvferry.cache.pool import KvPool
from kvferry.settings import TRANSFER_THREAD
from kvferry.transfer import wire
from kvferry.transfer.nixl import pages as nixl_pages
from kvferry.transfer.wire import ChunkSpan


def _pool(num_blocks: int = 12) -> KvPool:
    pool = KvPool(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4,
                  num_blocks=num_blocks, dtype=torch.float32)
    pool.cache.copy_(torch.randn(pool.cache.shape, generator=torch.Generator().manual_seed(1)))
    return pool


def _pages(table, pool: KvPool, span: ChunkSpan) -> list[tuple[int, int]]:
    """(address, bytes) of every page of the span, in wire order."""
    page = nixl_pages.page_bytes(pool)
    return [(pool.cache[layer, kv, table[b]].data_ptr(), page)
            for layer in range(span.layer_start, span.layer_end) for kv in (0, 1)
            for b in range(span.block_start, span.block_start + span.num_blocks)]


def _expand(desc) -> list[tuple[int, int]]:
    """Descriptors cut back into pages of `page` bytes."""
    return [(int(addr) + i * PAGE, PAGE) for addr, size, _ in desc
            for i in range(int(size) // PAGE)]


PAGE = 4 * 2 * 4 * 4


@pytest.mark.parametrize(("local_table", "remote_table", "runs"), [
    ([0, 1, 2, 3, 4], [5, 6, 7, 8, 9], 1),  # consecutive on both sides: one run
    ([0, 1, 2, 3, 4], [5, 6, 2, 3, 4], 2),  # the remote side breaks after 2 blocks
    ([4, 3, 2, 1, 0], [0, 1, 2, 3, 4], 5),  # descending: every block its own run
    ([7, 8, 0, 1, 2], [1, 2, 3, 4, 5], 2),
])
def test_descriptors_cover_the_span_in_runs(local_table, remote_table, runs) -> None:
    local_pool, remote_pool = _pool(), _pool(num_blocks=10)
    span = ChunkSpan(1, 3, 0, 5)
    local_desc, remote_desc = nixl_pages.descriptors(
        nixl_pages.PoolMemory.of(local_pool), local_table,
        nixl_pages.PoolMemory.of(remote_pool), remote_table, span, PAGE)
    assert len(local_desc) == len(remote_desc) == 2 * 2 * runs  # layers x (K, V) x runs
    assert (local_desc[:, 1] == remote_desc[:, 1]).all()  # pairwise the same length
    assert _expand(local_desc) == _pages(local_table, local_pool, span)
    assert _expand(remote_desc) == _pages(remote_table, remote_pool, span)


@pytest.mark.parametrize("span", [ChunkSpan(0, 3, 0, 4), ChunkSpan(1, 2, 1, 2),
                                  ChunkSpan(2, 3, 3, 1)])
@pytest.mark.parametrize("table", [[0, 1, 2, 3], [9, 2, 3, 7], [11, 10, 4, 5]])
def test_checksum_in_place_equals_the_packed_chunks(span: ChunkSpan, table) -> None:
    pool = _pool()
    packed = wire.pack_array(pool, table, span)
    assert nixl_pages.crc32_pages(pool, table, span) == wire.crc32(packed)


def test_finite_check_sees_only_the_span() -> None:
    pool = _pool()
    pool.cache[2, 1, 5, 3, 1, 0] = float("nan")  # layer 2, V, block 5
    assert nixl_pages.pages_finite(pool, [0, 1], ChunkSpan(0, 3, 0, 2))
    assert not nixl_pages.pages_finite(pool, [0, 5], ChunkSpan(2, 3, 0, 2))
    assert nixl_pages.pages_finite(pool, [0, 5], ChunkSpan(0, 2, 0, 2))


def test_an_idle_agent_does_not_spin() -> None:
    """NIXL's wrapper would start a progress thread polling without pause (a whole core per
    worker); ours sleeps until UCX has work."""
    agent = nixl_pages.make_agent("idle-test")
    pool = _pool()
    agent.register_memory(pool.cache)
    started = time.process_time()
    time.sleep(1.0)  # paces: the idle second whose CPU time is measured
    assert time.process_time() - started < 0.3  # CPU seconds in one second of idling


def test_transfer_threads_are_named_and_pinned_apart(tmp_path) -> None:
    """NIXL's threads carry the transfer name, and Deployment.pin sends them to their own
    CPUs while the rest of the process stays on the stepping core."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from deploy.launcher import Deployment
    from deploy.placement import thread_name

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.fail("needs 2 CPUs to pin apart")
    # The child sleeps only to wait for its kill.
    child = subprocess.Popen(
        [sys.executable, "-c", "from kvferry.transfer.nixl import pages as nixl_pages; "
         "import time; agent = nixl_pages.make_agent('pin-test'); print('ready', flush=True); "
         "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        while child.stdout.readline().strip() != "ready":  # NIXL logs to stdout first
            assert child.poll() is None, "the child died"
        deployment = Deployment()
        deployment.processes.append(SimpleNamespace(name="decode-0", popen=child))
        deployment.pin("decode", {cpus[0]}, {cpus[1]})
        tids = os.listdir(f"/proc/{child.pid}/task")
        names = {tid: thread_name(child.pid, tid) for tid in tids}
        transfer = [tid for tid, name in names.items() if name == TRANSFER_THREAD]
        assert transfer, names  # NIXL's progress thread and UCX's async thread at least
        for tid in tids:
            want = {cpus[1]} if tid in transfer else {cpus[0]}
            assert os.sched_getaffinity(int(tid)) == want, (tid, names[tid])
    finally:
        child.kill()
        child.wait()
