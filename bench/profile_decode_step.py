"""Where one decode step's time goes: the model alone, under torch.profiler, at
several batch sizes, with attention over the dense K/V stage as the CPU decode worker runs it.

For each batch size: `--steps` steps are timed (wall clock, median), then `--steps` more are
profiled; the table gives each operator's share of a profiled step's wall time (self CPU
time, summed over the step's calls), and what no operator accounts for: Python and dispatch
overhead between operators. The profiler adds its own cost to every operator call, so the
shares of small, frequent operators read high; the unprofiled step time is printed too.
The whole measurement repeats `--repeats` times; every figure is median [min-max].
One torch thread, as a deployment's workers run. Usage:

    .venv/bin/python bench/profile_decode_step.py [--model tiny|default|PATH]
        [--batches 1 8 32] [--context 128] [--top 12] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from decode_worker.kv_stage import KvStage
from decode_worker.sequence import PlainSeq, step_inputs
from deploy.default_model import BENCH_MODEL_HELP, bench_model
from deploy.worker_model import tune_malloc
from kvferry.cache.pool import KvPool
from kvferry.model.config import load_model_config
from kvferry.model.transformer import Transformer
from kvferry_kernels.dispatch import get_attention_backend

BLOCK_SIZE = 16




def _profile(model: Transformer, pool: KvPool, batch: int, context: int, steps: int
             ) -> dict[str, object]:
    per_seq = -(-(context + 2 * steps + 2) // BLOCK_SIZE)
    free = list(range(pool.num_blocks))
    seqs = [PlainSeq([free.pop() for _ in range(per_seq)], context) for _ in range(batch)]
    stage = KvStage(pool, 1 << 32)
    seqs = stage.arrange(seqs) or seqs
    vocab = model.config.vocab_size

    def step() -> None:
        inputs = step_inputs(seqs, BLOCK_SIZE)
        model.decode(torch.randint(1, vocab, (batch,)), *inputs[:3], pool, stage)
        for s in seqs:
            s.next_position += 1

    for _ in range(3):  # warm-up: allocator, lazy inits
        step()
    walls = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        walls.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        profiled_ms = (time.perf_counter() - start) / steps * 1e3
    self_us: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        self_us[event.key] += event.self_cpu_time_total
    step_ms = statistics.median(walls) * 1e3
    per_step = {name: us / steps / 1e3 for name, us in self_us.items()}
    # Shares are of the profiled step (the profiler's own cost per operator inflates both
    # the operators' times and the step's); step_ms is the unprofiled median.
    return {"batch": batch, "step_ms": step_ms, "profiled_step_ms": profiled_ms,
            "op_ms": per_step, "ops_total_ms": sum(per_step.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help=BENCH_MODEL_HELP)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    tune_malloc()
    torch.set_num_threads(1)
    config = load_model_config(bench_model(args.model))
    model = Transformer(config, get_attention_backend("torch"))
    per_seq = -(-(args.context + 2 * args.steps + 2) // BLOCK_SIZE)
    pool = KvPool(config.num_layers, config.num_kv_heads, config.head_dim, BLOCK_SIZE,
                  max(args.batches) * per_seq, torch.float32, torch.device("cpu"))
    pool.cache.normal_()
    runs = [[_profile(model, pool, b, args.context, args.steps) for b in args.batches]
            for _ in range(args.repeats)]  # runs[repeat][batch index]
    for r in (r for run in runs for r in run):
        r["share"] = {n: ms / r["profiled_step_ms"] for n, ms in r["op_ms"].items()}
    names = sorted({n for run in runs for r in run for n in r["op_ms"]},
                   key=lambda n: -max(r["share"].get(n, 0.0) for run in runs for r in run))
    top = names[:args.top]

    def rows(r: dict[str, object]) -> dict[str, float]:
        """One profiled run of one batch size: each table row's share of the step."""
        out = {name: r["share"].get(name, 0.0) for name in top}
        out["other operators"] = (r["ops_total_ms"] - sum(r["op_ms"].get(n, 0.0) for n in top)
                                  ) / r["profiled_step_ms"]
        out["outside operators (Python)"] = 1 - r["ops_total_ms"] / r["profiled_step_ms"]
        return out

    table = [[rows(run[i]) for run in runs] for i in range(len(args.batches))]
    print(f"model {Path(config.path).name}, context {args.context}, one thread, "
          f"{args.repeats} repetitions; share of a profiled step's wall time, median [min-max]")
    print(f"{'operator':<30}" + "".join(f"{'batch ' + str(b):>22}" for b in args.batches))

    def cell(values: list[float], scale: float, unit: str) -> str:
        lo, mid, hi = min(values) * scale, statistics.median(values) * scale, max(values) * scale
        return f"{mid:>8.1f}{unit} [{lo:.1f}-{hi:.1f}]".rjust(22)

    for label in table[0][0]:
        print(f"{label:<30}" + "".join(cell([rep[label] for rep in per_batch], 100, "%")
                                        for per_batch in table))
    for key, label in (("profiled_step_ms", "profiled step (ms)"),
                       ("step_ms", "unprofiled step (ms)")):
        print(f"{label:<30}" + "".join(cell([run[i][key] for run in runs], 1, "")
                                        for i in range(len(args.batches))))
    if args.out:
        args.out.write_text(json.dumps({"model": Path(config.path).name, "context": args.context,
                                        "steps": args.steps, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
