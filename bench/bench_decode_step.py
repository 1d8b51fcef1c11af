"""One decode step of the model alone, batch 1 against batch 32, with attention three ways in
the same run: over the paged pool with torch ops (pages gathered every step), over the dense
K/V stage (decode_worker/kv_stage.py, the C kernel over its rows), and over the pages read in
place by the C kernel (the default on CPU): what the engine's batching can gain at most, with
no serving around it.

Each round times `--steps` consecutive steps of each (mode, batch) on `--model` (the tiny
model unless told), one torch thread, contexts starting at `--context` tokens, block tables
shuffled as a busy pool leaves them; the figure is the median over rounds of the per-round
median step time. Usage:

    .venv/bin/python bench/bench_decode_step.py [--model tiny|default|PATH] [--batches 1 32]
        [--context 128] [--rounds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from decode_worker.kv_stage import KvStage
from decode_worker.sequence import PlainSeq, step_inputs
from deploy.default_model import BENCH_MODEL_HELP, bench_model
from deploy.worker_model import tune_malloc
from kvferry.cache.pool import KvPool
from kvferry.model.config import ModelConfig, load_model_config
from kvferry.model.transformer import Transformer
from kvferry.settings import KERNEL_CACHE_DIR
from kvferry_kernels.dispatch import get_attention_backend

BLOCK_SIZE = 16




def random_pool(config: ModelConfig, max_batch: int, context: int, steps: int) -> KvPool:
    """An fp32 CPU pool with room for `max_batch` sequences of `context` + `steps` tokens,
    filled with random K/V."""
    blocks = max_batch * (-(-(context + steps + 1) // BLOCK_SIZE)) + 1
    pool = KvPool(config.num_layers, config.num_kv_heads, config.head_dim, BLOCK_SIZE, blocks,
                  torch.float32, torch.device("cpu"))
    pool.cache.normal_()
    return pool


def scattered_batch(pool: KvPool, batch: int, context: int, steps: int, seed: int
                    ) -> list[PlainSeq]:
    """`batch` sequences at position `context`, each with blocks for `steps` more tokens,
    taken from the pool in a seeded random order."""
    free = list(range(pool.num_blocks))
    random.Random(seed).shuffle(free)
    per_seq = -(-(context + steps + 1) // BLOCK_SIZE)
    return [PlainSeq([free.pop() for _ in range(per_seq)], context) for _ in range(batch)]


def _median_step_ms(model: Transformer, pool: KvPool, batch: int, context: int, steps: int,
                    staged: bool, seed: int) -> float:
    seqs = scattered_batch(pool, batch, context, steps, seed)
    stage = KvStage(pool, 1 << 30) if staged else None
    if stage is not None:
        seqs = stage.arrange(seqs) or seqs
    times = []
    for _ in range(steps):
        inputs = step_inputs(seqs, BLOCK_SIZE)
        tokens = torch.randint(1, model.config.vocab_size, (batch,))
        start = time.perf_counter()
        model.decode(tokens, *inputs[:3], pool, stage)
        times.append(time.perf_counter() - start)
        for s in seqs:
            s.next_position += 1
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help=BENCH_MODEL_HELP)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    tune_malloc()
    torch.set_num_threads(1)
    config = load_model_config(bench_model(args.model))
    gather = get_attention_backend("torch")
    in_place = get_attention_backend("torch", KERNEL_CACHE_DIR)
    if in_place.cpu_kernel is None:
        raise SystemExit("bench_decode_step: the C attention kernel does not build here")
    model = Transformer(config, gather)
    pool = random_pool(config, max(args.batches), args.context, args.steps)
    # mode: (attention backend, dense stage)
    modes = {"pages": (gather, False), "stage": (gather, True), "in-place": (in_place, False)}
    times: dict[tuple[str, int], list[float]] = {(m, b): [] for m in modes for b in args.batches}
    for r in range(args.rounds):
        for mode, (backend, staged) in modes.items():
            model.backend = backend
            for batch in args.batches:
                times[mode, batch].append(_median_step_ms(model, pool, batch, args.context,
                                                          args.steps, staged, seed=r))
    rows = []
    first = args.batches[0]
    for mode in modes:
        for batch in args.batches:
            ratios = [batch * a / b for a, b in zip(times[mode, first], times[mode, batch])]
            rows.append({"attention": mode, "batch": batch,
                         "step_ms": statistics.median(times[mode, batch]),
                         "tokens_per_s": batch * 1e3 / statistics.median(times[mode, batch]),
                         "throughput_vs_first": statistics.median(ratios),
                         "round_ratios": sorted(ratios)})
    print(f"{'attention':>9} {'batch':>5} {'step ms':>8} {'tokens/s':>9} "
          f"{'vs batch ' + str(first) + ' (median of rounds)':>28}")
    for row in rows:
        print(f"{row['attention']:>9} {row['batch']:>5} {row['step_ms']:>8.2f} "
              f"{row['tokens_per_s']:>9.0f} {row['throughput_vs_first']:>27.2f}x")
    # In place against the stage, step time, within each round.
    versus = {}
    for batch in args.batches:
        ratios = sorted(a / b for a, b in zip(times["in-place", batch], times["stage", batch]))
        versus[batch] = {"median": statistics.median(ratios), "min": ratios[0],
                         "max": ratios[-1]}
        print(f"in-place / stage step time, batch {batch}: {versus[batch]['median']:.3f} "
              f"[{ratios[0]:.3f}-{ratios[-1]:.3f}]")
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "context": args.context,
                                        "steps": args.steps, "rounds": args.rounds,
                                        "rows": rows, "in_place_vs_stage": versus}, indent=2))


if __name__ == "__main__":
    main()
