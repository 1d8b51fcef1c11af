"""Each stage of a Ray K/V push on its own, for bench/bench_kv_transfer.py: where a Ray push's
time goes, measured in one process."""

from __future__ import annotations

import time

from kvferry.cache.budget import blocks_for_tokens
from kvferry.cache.layout import KvLayout
from kvferry.cache.pool import KvPool
from kvferry.transfer import wire


def ray_stage_gbps(pool: KvPool, num_tokens: int, chunk_bytes: int) -> dict[str, float]:
    """Each stage of a Ray push on its own, in this process, over `num_tokens` of pages in the
    Ray transport's chunks: gather out of the pool, checksum, `ray.put`, `ray.get` (a
    zero-copy map on one node), and the write into a second pool. GB/s of each."""
    import ray

    layout = KvLayout.of_pool(pool, "bench")
    table = list(range(blocks_for_tokens(num_tokens, pool.block_size)))
    spans = wire.plan_chunks(layout, num_tokens, chunk_bytes)
    target = KvPool(pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.block_size,
                    len(table), pool.dtype)
    seconds = dict.fromkeys(("gather", "checksum", "ray.put", "ray.get", "write"), 0.0)
    num_bytes = 0
    for _ in range(2):  # the second pass counts: first-touch page faults stay out
        seconds = dict.fromkeys(seconds, 0.0)
        num_bytes = 0
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
            num_bytes += data.nbytes
            del ref, got
    return {name: num_bytes / t / 1e9 for name, t in seconds.items()}
