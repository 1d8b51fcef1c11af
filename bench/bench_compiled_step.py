"""The decode step eager against compiled (`--compile default` and `max-autotune`), same run.

One model per mode (compiled for exactly the batches measured, so every step runs a graph),
one torch thread, attention over the dense K/V stage as the CPU decode worker runs it.
Each round times `--steps` consecutive steps of every (mode, batch), modes interleaved; the
figures are median [min-max] over rounds of the per-round median step time, and the compile
time of each mode's warm-up (every batch). Usage:

    .venv/bin/python bench/bench_compiled_step.py --model default [--batches 1 8 32]
        [--modes off default max-autotune] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "kernels"))
from bench.bench_decode_step import _median_step_ms, random_pool  # noqa: E402
from deploy.default_model import BENCH_MODEL_HELP, bench_model  # noqa: E402
from deploy.worker_model import tune_malloc  # noqa: E402
from kvferry.model.compiled import compile_decode  # noqa: E402
from kvferry.model.config import load_model_config  # noqa: E402
from kvferry.model.transformer import Transformer  # noqa: E402
from kvferry.settings import COMPILE_CACHE_DIR, COMPILE_MODES  # noqa: E402
from kvferry_kernels.dispatch import get_attention_backend  # noqa: E402


def _span(values: list[float], digits: int = 1) -> str:
    """median [min-max], with `digits` decimals."""
    return (f"{statistics.median(values):.{digits}f} "
            f"[{min(values):.{digits}f}-{max(values):.{digits}f}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help=BENCH_MODEL_HELP)
    parser.add_argument("--modes", nargs="+", default=list(COMPILE_MODES), choices=COMPILE_MODES)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if min(args.batches) < 1 or args.rounds < 1 or args.steps < 1:
        parser.exit(2, "bench_compiled_step: --batches, --rounds and --steps must be >= 1\n")
    tune_malloc()
    torch.set_num_threads(1)
    path = bench_model(args.model)
    config = load_model_config(path)
    pool = random_pool(config, max(args.batches), args.context, args.steps)
    models, compile_s = {}, {}
    for mode in args.modes:
        model = Transformer(config, get_attention_backend("torch"))
        compiled = compile_decode(model, mode, args.batches, COMPILE_CACHE_DIR)
        compile_s[mode] = compiled.warm_up_s if compiled is not None else 0.0
        print(f"{mode}: compiled batches {args.batches} in {compile_s[mode]:.1f} s", flush=True)
        models[mode] = model
    times: dict[tuple[str, int], list[float]] = {(m, b): [] for m in args.modes
                                                 for b in args.batches}
    for r in range(args.rounds):
        for batch in args.batches:
            for mode in args.modes:
                times[mode, batch].append(_median_step_ms(models[mode], pool, batch, args.context,
                                                          args.steps, staged=True, seed=r))
    first = args.modes[0]
    rows = []
    print(f"{'mode':>13} {'batch':>5} {'step ms':>22} {'vs ' + first:>22}")
    for batch in args.batches:
        for mode in args.modes:
            ratios = [a / b for a, b in zip(times[first, batch], times[mode, batch])]
            rows.append({"mode": mode, "batch": batch, "step_ms": times[mode, batch],
                         "speedup_vs_first": ratios})
            print(f"{mode:>13} {batch:>5} {_span(times[mode, batch]):>22} "
                  f"{_span(ratios):>21}x", flush=True)
    if args.out:
        args.out.write_text(json.dumps({
            "model": args.model if args.model in ("tiny", "default") else Path(path).name,
            "context": args.context, "steps": args.steps, "rounds": args.rounds,
            "compile_s": compile_s, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
