"""GPU time of a call without its launch overhead, for benchmarks of small kernels."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def graph_ms(fn: Callable[[], object], device: torch.device, repeats: int = 3,
             iters: int = 20) -> float:
    """GPU ms per call of `fn` without launch overhead: `iters` calls captured in one CUDA
    graph, each after an L2 flush (as triton.testing.do_bench flushes), minus a graph of the
    flushes alone; the median of `repeats` x 5 replays of each."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device=device)

    def capture(body: Callable[[], object]) -> torch.cuda.CUDAGraph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()  # compile and warm outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                body()
        return graph

    def replay_ms(graph: torch.cuda.CUDAGraph) -> float:
        times = []
        for _ in range(5 * repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    both = capture(lambda: (flush.zero_(), fn()))
    flushes = capture(flush.zero_)
    return (replay_ms(both) - replay_ms(flushes)) / iters
