"""The CPU decode step's attention, C kernel (kernels/kvferry_kernels/cpu_attention.py)
against the torch ops it replaces, in the same run: the stage's 30 per-layer callbacks (K/V
append and attention, `KvStage.attend`) and the whole compiled step around them.

At each batch size, contexts either all `--context` tokens ("equal") or spread evenly over
[context/2, 3 context/2] ("spread": what a closed loop of requests of one length gives, each
at another point of its generation; the torch path attends every row over the longest).
One torch thread; the model is the `--compile` package of each batch size (from the compile
cache). Each round times `--steps` steps of every (contexts, batch, attention) in turn; the
figure is the median over rounds of each round's median step, reported as median
[min-max], with the torch / kernel ratio paired by round. Usage:

    .venv/bin/python bench/bench_cpu_attention.py --model default [--compile auto]
        [--batches 1 8 32] [--context 128] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "kernels"))
from bench.bench_compiled_step import _span  # noqa: E402
from bench.bench_decode_step import BLOCK_SIZE, random_pool  # noqa: E402
from bench.bench_step_parts import _TimedStage, add_step_arguments  # noqa: E402
from decode_worker.sequence import PlainSeq, step_inputs  # noqa: E402
from deploy.default_model import bench_model  # noqa: E402
from deploy.worker_model import tune_malloc  # noqa: E402
from kvferry.cache.pool import KvPool  # noqa: E402
from kvferry.model.compiled import compile_decode  # noqa: E402
from kvferry.model.config import load_model_config  # noqa: E402
from kvferry.model.transformer import Transformer  # noqa: E402
from kvferry.settings import COMPILE_CACHE_DIR, COMPILE_MODES  # noqa: E402
from kvferry_kernels.dispatch import get_attention_backend  # noqa: E402

SHAPES = ("equal", "spread")
PATHS = ("torch", "kernel")


def contexts(shape: str, batch: int, context: int) -> list[int]:
    if shape == "equal" or batch == 1:
        return [context] * batch
    return [round(context / 2 + context * i / (batch - 1)) for i in range(batch)]


def run(model: Transformer, pool: KvPool, lengths: list[int], path: str, steps: int,
        seed: int) -> tuple[float, float]:
    """Median ms per step of the whole step and of the stage's attention callbacks."""
    free = list(range(pool.num_blocks))
    random.Random(seed).shuffle(free)
    seqs = [PlainSeq([free.pop() for _ in range(-(-(n + steps + 1) // BLOCK_SIZE))], n)
            for n in lengths]
    stage = _TimedStage(pool, 1 << 31)
    if path == "torch":
        stage.kernel = None
    elif stage.kernel is None:
        raise SystemExit("bench_cpu_attention: the C kernel did not build (see the log)")
    seqs = stage.arrange(seqs) or seqs
    whole, attend = [], []
    for _ in range(steps):
        inputs = step_inputs(seqs, BLOCK_SIZE)
        tokens = torch.randint(1, model.config.vocab_size, (len(seqs),))
        stage.attend_s = 0.0
        start = time.perf_counter()
        model.decode(tokens, *inputs[:3], pool, stage)
        whole.append(time.perf_counter() - start)
        attend.append(stage.attend_s)
        for s in seqs:
            s.next_position += 1
    return statistics.median(whole) * 1e3, statistics.median(attend) * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_arguments(p)
    p.add_argument("--compile", default="auto", choices=COMPILE_MODES)
    args = p.parse_args(argv)
    if min(args.batches) < 1 or min(args.rounds, args.steps, args.context) < 2:
        p.exit(2, "bench_cpu_attention: --batches >= 1; --rounds, --steps, --context >= 2\n")
    tune_malloc()
    torch.set_num_threads(1)
    config = load_model_config(bench_model(args.model))
    model = Transformer(config, get_attention_backend("torch"))
    compile_decode(model, args.compile, args.batches, COMPILE_CACHE_DIR)
    pool = random_pool(config, max(args.batches), args.context * 3 // 2, args.steps)
    runs: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
    for r in range(args.rounds):
        for shape in SHAPES:
            for batch in args.batches:
                for path in PATHS:
                    runs.setdefault((shape, batch, path), []).append(run(
                        model, pool, contexts(shape, batch, args.context), path, args.steps, r))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    rows = []
    print(f"{'contexts':>8} {'batch':>5} {'torch step ms':>20} {'kernel step ms':>20} "
          f"{'torch attn ms':>20} {'kernel attn ms':>20} {'step ratio':>16} {'attn ratio':>16}")
    for shape in SHAPES:
        for batch in args.batches:
            t, k = runs[shape, batch, "torch"], runs[shape, batch, "kernel"]
            step_ratio = [a[0] / b[0] for a, b in zip(t, k)]
            attn_ratio = [a[1] / b[1] for a, b in zip(t, k)]
            print(f"{shape:>8} {batch:>5} {_span([x[0] for x in t]):>20} "
                  f"{_span([x[0] for x in k]):>20} {_span([x[1] for x in t]):>20} "
                  f"{_span([x[1] for x in k]):>20} {_span(step_ratio, 2):>16} "
                  f"{_span(attn_ratio, 2):>16}")
            rows.append({"contexts": shape, "batch": batch,
                         "torch": [{"step_ms": s, "attention_ms": a} for s, a in t],
                         "kernel": [{"step_ms": s, "attention_ms": a} for s, a in k]})
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "compile": args.compile,
                                        "context": args.context, "steps": args.steps,
                                        "rounds": args.rounds, "runs": rows}, indent=2))


if __name__ == "__main__":
    main()
