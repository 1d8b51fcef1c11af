"""Where a compiled decode step's time goes, and what its linear layers could cost.

For each `--modes` (the AOTInductor packages of kvferry.model.compiled, built or loaded from the
compile cache for exactly `--batches`) and each `--threads`, at each batch size, with attention
over the dense K/V stage as the CPU decode worker runs it:
  step:       the whole compiled step (`Transformer.decode`), attention included;
  dense only: the same package with attention answering zeros (the GEMMs, norms, rotary
              embedding and LM head alone);
  attention:  the time spent in `KvStage.attend` during the whole step (append + attend,
              the 30 per-layer callbacks out of the package).
Then every linear layer of one step (the model's real shapes, LM head included) as plain
`F.linear`, on MKL-packed weights (what inductor's freezing uses for fp32) and on
oneDNN-packed weights (what vLLM's CPU build calls): the GEMM floor each backend gives.
Every figure is the median step of `--steps`, over `--rounds` rounds (configurations
interleaved), reported as median [min-max]. Usage:

    .venv/bin/python bench/bench_step_parts.py --model default [--modes default max-autotune]
        [--threads 1 2] [--batches 1 8 32] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "kernels"))
from bench.bench_compiled_step import _span  # noqa: E402
from bench.bench_decode_step import BLOCK_SIZE, random_pool, scattered_batch  # noqa: E402
from decode_worker.kv_stage import KvStage  # noqa: E402
from decode_worker.sequence import step_inputs  # noqa: E402
from deploy.default_model import BENCH_MODEL_HELP, bench_model  # noqa: E402
from deploy.worker_model import tune_malloc  # noqa: E402
from kvferry.cache.pool import KvPool  # noqa: E402
from kvferry.model.compiled import compile_decode  # noqa: E402
from kvferry.model.config import ModelConfig, load_model_config  # noqa: E402
from kvferry.model.transformer import Transformer  # noqa: E402
from kvferry.settings import COMPILE_CACHE_DIR, COMPILE_MODES  # noqa: E402
from kvferry_kernels.dispatch import get_attention_backend  # noqa: E402


class _TimedStage(KvStage):
    """A stage that adds the time spent in `attend` to `attend_s`."""

    attend_s = 0.0

    def attend(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        try:
            return super().attend(*args, **kwargs)
        finally:
            self.attend_s += time.perf_counter() - start


def _zeros(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(q)


def step_parts(model: Transformer, pool: KvPool, batch: int, context: int, steps: int,
               seed: int) -> dict[str, float]:
    """Median ms per step of the whole step, of the package with no attention, and of the
    stage's attention callbacks within the whole step."""
    seqs = scattered_batch(pool, batch, context, steps, seed)
    stage = _TimedStage(pool, 1 << 30)
    seqs = stage.arrange(seqs) or seqs
    whole, dense, attend = [], [], []
    for _ in range(steps):
        inputs = step_inputs(seqs, BLOCK_SIZE)
        tokens = torch.randint(1, model.config.vocab_size, (batch,))
        stage.attend_s = 0.0
        start = time.perf_counter()
        model.decode(tokens, *inputs[:3], pool, stage)
        whole.append(time.perf_counter() - start)
        attend.append(stage.attend_s)
        start = time.perf_counter()
        assert model.compiled is not None  # noqa: S101 - compiled by main
        model.compiled(tokens, inputs.positions, _zeros)
        dense.append(time.perf_counter() - start)
        for s in seqs:
            s.next_position += 1
    return {name: statistics.median(values) * 1e3
            for name, values in (("step", whole), ("dense only", dense), ("attention", attend))}


def linear_shapes(config: ModelConfig) -> list[tuple[int, int, int]]:
    """(out, in, count) of every linear layer one step runs, fused as the model loads them."""
    hidden, inter = config.hidden_size, config.intermediate_size
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    layers = config.num_layers
    return [(qkv, hidden, layers), (hidden, config.num_heads * config.head_dim, layers),
            (2 * inter, hidden, layers), (hidden, inter, layers),
            (config.vocab_size, hidden, 1)]


def _linear_runners(weight: torch.Tensor, batch: int) -> dict[str, Callable[[torch.Tensor],
                                                                             torch.Tensor]]:
    mkl = torch.ops.mkl._mkl_reorder_linear_weight(weight, batch)
    onednn = torch.ops.mkldnn._reorder_linear_weight(weight, batch)
    return {
        "F.linear": lambda x: F.linear(x, weight),
        "MKL packed": lambda x: torch.ops.mkl._mkl_linear(x, mkl, weight, None, batch),
        "oneDNN packed": lambda x: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none",
                                                                      [], ""),
    }


def linear_floor(config: ModelConfig, batch: int, reps: int = 5) -> dict[str, float]:
    """ms per step of all the step's linear layers, per backend: one weight per shape, each
    timed `reps` times (median), times the number of layers with that shape."""
    totals: dict[str, float] = {}
    for out_features, in_features, count in linear_shapes(config):
        weight = torch.randn(out_features, in_features)
        x = torch.randn(batch, in_features)
        for name, run in _linear_runners(weight, batch).items():
            run(x)
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                run(x)
                times.append(time.perf_counter() - start)
            totals[name] = totals.get(name, 0.0) + statistics.median(times) * count * 1e3
    return totals


def add_step_arguments(p: argparse.ArgumentParser) -> None:
    """What the step benchmarks share: model, batch sizes, context, steps, rounds, output."""
    p.add_argument("--model", default="default", help=BENCH_MODEL_HELP)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_arguments(p)
    p.add_argument("--modes", nargs="+", default=["default", "max-autotune"],
                   choices=COMPILE_MODES[1:])
    p.add_argument("--threads", type=int, nargs="+", default=[1])
    args = p.parse_args(argv)
    if min(args.batches + args.threads) < 1 or min(args.rounds, args.steps) < 1:
        p.exit(2, "bench_step_parts: --batches, --threads, --rounds, --steps must be >= 1\n")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    tune_malloc()
    config = load_model_config(bench_model(args.model))
    pool = random_pool(config, max(args.batches), args.context, args.steps)
    models = {}
    for mode in args.modes:
        models[mode] = Transformer(config, get_attention_backend("torch"))
        compile_decode(models[mode], mode, args.batches, COMPILE_CACHE_DIR)
    parts: dict[tuple[str, int, int], list[dict[str, float]]] = {}
    linears: dict[tuple[int, int], list[dict[str, float]]] = {}
    for r in range(args.rounds):
        for threads in args.threads:
            torch.set_num_threads(threads)
            for batch in args.batches:
                for mode in args.modes:
                    parts.setdefault((mode, threads, batch), []).append(
                        step_parts(models[mode], pool, batch, args.context, args.steps, r))
                linears.setdefault((threads, batch), []).append(linear_floor(config, batch))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    print(f"{'mode':>13} {'threads':>7} {'batch':>5} {'step ms':>20} {'dense only ms':>20} "
          f"{'attention ms':>20}")
    for (mode, threads, batch), runs in parts.items():
        cells = [_span([run[k] for run in runs]) for k in ("step", "dense only", "attention")]
        print(f"{mode:>13} {threads:>7} {batch:>5} " + " ".join(f"{c:>20}" for c in cells))
    names = list(next(iter(linears.values()))[0])
    print(f"every linear layer of one step, ms: {'threads':>7} {'batch':>5} "
          + " ".join(f"{n:>20}" for n in names))
    for (threads, batch), runs in linears.items():
        print(f"{'':>36}{threads:>7} {batch:>5} "
              + " ".join(f"{_span([run[n] for run in runs]):>20}" for n in names))
    if args.out:
        args.out.write_text(json.dumps({
            "model": args.model, "context": args.context, "steps": args.steps,
            "rounds": args.rounds,
            "parts": [{"mode": m, "threads": t, "batch": b, "runs": runs}
                      for (m, t, b), runs in parts.items()],
            "linears": [{"threads": t, "batch": b, "runs": runs}
                        for (t, b), runs in linears.items()]}, indent=2))


if __name__ == "__main__":
    main()
