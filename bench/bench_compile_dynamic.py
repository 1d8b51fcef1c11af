"""One decode-step graph for every batch size against one per bucket, in one run (issue 62).

Four ways to run the decode step of `--model` (kvferry.model.compiled's graph: the model's
dense math, attention an opaque op), one torch thread, the dense K/V stage as
bench_compiled_step.py runs it:
  eager:    `--compile off`;
  buckets:  today's `--compile default`: one AOTInductor package per batch in `--batches`
            (freezing=True, weights packed into each); other batches padded up to the next
            bucket, above the largest eager;
  dynamic:  ONE package exported with a symbolic batch (1 to `--dynamic-max`), freezing=True,
            run at the real batch (compiled.py's graph, export and cache; not a --compile
            mode: see docs/performance.md);
  inductor: torch.compile(dynamic=True) in-process (mode default, no freezing), as vLLM
            traces once; its on-disk cache is inductor's own (TORCHINDUCTOR_CACHE_DIR).
Every repetition runs each way in fresh processes, ways interleaved: "cold" builds into an
empty cache (seconds to build every graph), "warm" starts again on that cache and times the
load, the process RSS, and `--steps` steps per batch (its median). Warm children also check
logits against eager's on the same inputs (max |diff|, same argmax). Figures are median
[min-max] over repetitions; ratios against eager and against buckets. Usage:

    .venv/bin/python bench/bench_compile_dynamic.py --model default [--batches 1 8 32]
        [--extra-batches 3 13 50] [--dynamic-max 256] [--ways eager buckets dynamic inductor]
        [--repeats 3] [--cold-repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "kernels"))
from bench.bench_decode_step import (  # noqa: E402
    BLOCK_SIZE,
    _median_step_ms,
    random_pool,
    scattered_batch,
)
from decode_worker.sequence import step_inputs  # noqa: E402
from deploy.default_model import BENCH_MODEL_HELP, bench_model  # noqa: E402
from deploy.worker_model import tune_malloc  # noqa: E402
from kvferry.model.compiled import (  # noqa: E402
    PACKAGE,
    CompiledDecode,
    _Graph,
    _run,
    attend_nothing,
    compile_decode,
    export_package,
)
from kvferry.model.config import load_model_config  # noqa: E402
from kvferry.model.transformer import Transformer  # noqa: E402
from kvferry_kernels.dispatch import get_attention_backend  # noqa: E402

WAYS = ("eager", "buckets", "dynamic", "inductor")


def rss_mib() -> float:
    """This process's resident set, MiB (from /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def tree_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


class _Dynamic(CompiledDecode):
    """ONE package for every batch 1..`max_batch` (torch.export with a symbolic batch, weights
    frozen once), cached and loaded as compiled.py does a bucket's, run at the real batch."""

    def __init__(self, model: Transformer, max_batch: int, cache_dir: Path) -> None:
        super().__init__(model, "default", (max_batch,), cache_dir)

    def package_key(self, size: int, mode: str | None = None) -> str:
        return super().package_key(size, "dynamic")

    def _build(self, size: int, mode: str, scratch: Path) -> None:
        batch = torch.export.Dim("batch", min=1, max=size)
        tokens = torch.zeros(min(size, 8), dtype=torch.int64)  # an example away from 0 and 1
        export_package(self._graph, tokens, scratch / PACKAGE, mode, ({0: batch}, {0: batch}))
        self.num_builds += 1

    def __call__(self, token_ids: torch.Tensor, positions: torch.Tensor, attend
                 ) -> torch.Tensor | None:
        size = self.buckets[0]
        if token_ids.shape[0] > size:
            return None
        return _run(self._runners[size], token_ids.shape[0], token_ids, positions, attend)


class _Inductor:
    """torch.compile(dynamic=True) of compiled.py's graph, as the model's `compiled` step."""

    def __init__(self, model: Transformer) -> None:
        self._fn = torch.compile(_Graph(model).eval(), dynamic=True)

    def __call__(self, token_ids: torch.Tensor, positions: torch.Tensor, attend
                 ) -> torch.Tensor:
        return _run(self._fn, token_ids.shape[0], token_ids, positions, attend)


def _prepare(model: Transformer, way: str, args: argparse.Namespace, cache: Path,
             batches: list[int]) -> int:
    """Make `model` run `way`; the graphs loaded from `cache` (0 for eager/inductor)."""
    if way == "buckets":
        return compile_decode(model, "default", args.batches, cache).num_cache_hits
    if way == "dynamic":
        model.compiled = _Dynamic(model, args.dynamic_max, cache)
        model.compiled.warm_up()
        return model.compiled.num_cache_hits
    if way == "inductor":
        model.compiled = _Inductor(model)
        with torch.inference_mode():
            for batch in batches:  # every graph traced (or found in inductor's cache) now
                tokens = torch.zeros(batch, dtype=torch.int64)
                model.compiled(tokens, tokens, attend_nothing)
    return 0


def _check(model: Transformer, pool, batch: int, context: int) -> tuple[float, bool]:
    """Max |logits - eager's| and whether the argmax agrees, one step over the pages."""
    seqs = scattered_batch(pool, batch, context, 1, seed=batch)
    inputs = step_inputs(seqs, BLOCK_SIZE)
    tokens = torch.randint(1, model.config.vocab_size, (batch,),
                           generator=torch.Generator().manual_seed(batch))
    got = model.decode(tokens, *inputs[:3], pool)
    compiled, model.compiled = model.compiled, None
    want = model.decode(tokens, *inputs[:3], pool)  # the same K/V written again
    model.compiled = compiled
    return float((got - want).abs().max()), bool((got.argmax(-1) == want.argmax(-1)).all())


def child(args: argparse.Namespace) -> dict:
    """One process: build or load `args.child`'s graphs from `args.cache`; when warm, time
    steps and check logits."""
    tune_malloc()
    torch.set_num_threads(1)
    batches = sorted(set(args.batches + args.extra_batches))
    config = load_model_config(bench_model(args.model))
    model = Transformer(config, get_attention_backend("torch"))
    rss_model = rss_mib()
    start = time.perf_counter()
    hits = _prepare(model, args.child, args, args.cache, batches)
    result = {"way": args.child, "load_s": time.perf_counter() - start, "cache_hits": hits,
              "rss_model_mib": rss_model, "rss_mib": rss_mib()}
    if args.kind == "warm":
        pool = random_pool(config, max(batches), args.context, args.steps)
        if args.child != "eager":
            result["check"] = {b: _check(model, pool, b, args.context) for b in batches}
        result["step_ms"] = {b: _median_step_ms(model, pool, b, args.context, args.steps,
                                                staged=True, seed=args.seed) for b in batches}
    return result


def run_child(args: argparse.Namespace, way: str, kind: str, cache: Path, seed: int) -> dict:
    cmd = [sys.executable, __file__, "--child", way, "--kind", kind, "--cache", str(cache),
           "--model", args.model, "--context", str(args.context), "--steps", str(args.steps),
           "--dynamic-max", str(args.dynamic_max), "--seed", str(seed),
           "--batches", *map(str, args.batches), "--extra-batches",
           *map(str, args.extra_batches)]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{way} {kind} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if way in ("buckets", "dynamic"):
        result["package_mib"] = tree_mib(cache / "aoti")
    elif way == "inductor":
        result["package_mib"] = tree_mib(cache / "inductor")
    return result


def span(values: list[float], digits: int = 1) -> str:
    if not values:
        return "-"
    return (f"{statistics.median(values):.{digits}f} "
            f"[{min(values):.{digits}f}-{max(values):.{digits}f}]")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help=BENCH_MODEL_HELP)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32],
                   help="buckets of the per-bucket packages, and batches timed")
    p.add_argument("--extra-batches", type=int, nargs="*", default=[3, 13, 50],
                   help="batches timed that are not buckets")
    p.add_argument("--dynamic-max", type=int, default=256)
    p.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cold-repeats", type=int, default=None,
                   help="repetitions that build into an empty cache (default: all); later "
                        "ones reuse the last cold build's cache")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--child", choices=WAYS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--kind", choices=("cold", "warm"), default="warm", help=argparse.SUPPRESS)
    p.add_argument("--cache", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args)))
        return 0
    batches = sorted(set(args.batches + args.extra_batches))
    if min(batches) < 1 or args.repeats < 1 or args.steps < 1 or (
            args.dynamic_max < max(batches)):
        p.error("batches, --repeats, --steps >= 1 and --dynamic-max >= every batch")
    cold_repeats = args.repeats if args.cold_repeats is None else args.cold_repeats
    bench_model(args.model)  # converted once, before anything is timed
    results: dict[str, dict[str, list]] = {w: {"cold": [], "warm": []} for w in args.ways}
    with tempfile.TemporaryDirectory(prefix="bench_compile_dynamic-") as tmp:
        caches = {way: Path(tmp) / way for way in args.ways}
        for r in range(args.repeats):
            for way in args.ways:
                if way != "eager" and r < cold_repeats:
                    shutil.rmtree(caches[way], ignore_errors=True)
                    caches[way].mkdir(mode=0o700)
                    cold = run_child(args, way, "cold", caches[way], r)
                    results[way]["cold"].append(cold)
                    print(f"repetition {r + 1} {way} cold: {cold['load_s']:.1f} s, "
                          f"{cold.get('package_mib', 0):.0f} MiB", flush=True)
                caches[way].mkdir(mode=0o700, exist_ok=True)
                warm = run_child(args, way, "warm", caches[way], r)
                results[way]["warm"].append(warm)
                print(f"repetition {r + 1} {way} warm: load {warm['load_s']:.1f} s, "
                      f"RSS {warm['rss_mib']:.0f} MiB, steps "
                      + " ".join(f"{b}:{ms:.1f}" for b, ms in warm["step_ms"].items()),
                      flush=True)
    report(args, batches, results)
    return 0


def report(args: argparse.Namespace, batches: list[int], results: dict) -> None:
    def steps(way: str, batch: int) -> list[float]:
        return [w["step_ms"][str(batch)] if str(batch) in w["step_ms"] else w["step_ms"][batch]
                for w in results[way]["warm"]]

    print(f"\n{args.model}, buckets {args.batches}, dynamic max {args.dynamic_max}, "
          f"{args.repeats} repetitions, median [min-max]")
    print(f"{'way':>9} {'cold build s':>20} {'warm load s':>16} {'package MiB':>12} "
          f"{'RSS MiB':>16} {'(model only)':>12}")
    for way, runs in results.items():
        print(f"{way:>9} {span([c['load_s'] for c in runs['cold']]):>20} "
              f"{span([w['load_s'] for w in runs['warm']]):>16} "
              f"{span([c.get('package_mib', 0.0) for c in runs['cold']], 0):>12} "
              f"{span([w['rss_mib'] for w in runs['warm']], 0):>16} "
              f"{span([w['rss_model_mib'] for w in runs['warm']], 0):>12}")
    rows = []
    print(f"\n{'batch':>5} {'way':>9} {'step ms':>20} {'eager/way':>18} {'buckets/way':>18}")
    for batch in batches:
        for way in results:
            times = steps(way, batch)
            row = {"batch": batch, "way": way, "step_ms": times}
            line = f"{batch:>5} {way:>9} {span(times):>20}"
            for base in ("eager", "buckets"):
                if base in results:
                    ratios = [b / t for b, t in zip(steps(base, batch), times)]
                    row[f"{base}_over_way"] = ratios
                    line += f" {span(ratios, 2):>17}x"
            rows.append(row)
            print(line)
    for way, runs in results.items():
        checks = [w["check"] for w in runs["warm"] if "check" in w]
        if checks:
            worst = max(c[str(b)][0] for c in checks for b in batches)
            same = all(c[str(b)][1] for c in checks for b in batches)
            print(f"{way}: logits against eager's, max |diff| {worst:.2e}, argmax "
                  f"{'the same' if same else 'DIFFERS'} at every batch")
    if args.out:
        args.out.write_text(json.dumps({
            "model": args.model, "buckets": args.batches, "batches": batches,
            "dynamic_max": args.dynamic_max, "context": args.context, "steps": args.steps,
            "repeats": args.repeats, "torch": torch.__version__, "runs": results,
            "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
