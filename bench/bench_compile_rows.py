"""Dense math per row count: one AOTInductor package with a symbolic row count against one
per static bucket, and eager, in ONE process, interleaved (the follow-up of issue 62).

Every way runs compiled.py's graph (embedding, norms, rotary, projections, MLP, LM head over
every row) with attention stubbed out (`attend_nothing`: the comparison is of the dense math
only, and the same rows run prefill and decode alike):
  eager:    the Transformer's forward_tokens over the rows;
  bucket:   the smallest static package of `--static` holding the rows, padded up to it
            (skipped above the largest);
  dynamic:  one package exported with a symbolic row count (torch.export Dim 1 to
            `--dynamic-max`, example `--example` rows), freezing=True, run at the exact rows;
  padN:     the same dynamic package, rows padded up to a multiple of N (`--pad N`).
Packages are built into `--package-dir` (named static<B>.pt2 and dynamic<E>-<MAX>.pt2) and
reused when already there (delete them after changing the model code). `--inspect` prints,
for each package, the linear ops its generated C++ calls and a digest of its packed weights'
oneDNN layouts (from the wrapper source inside the .pt2): identical digests mean identical
GEMM calls on identical weight formats.

Times are per step: thread CPU time (the default, `--clock cpu`: robust to a shared machine
preempting the process; memory contention still shows) or wall time (`--clock wall`); each
round times every way `--steps` times per row count (median), ways interleaved; figures are
median [min-max] over `--rounds` rounds, and each way's time over the reference way's (bucket
where there is one, else eager) per round. One torch thread. Usage:

    .venv/bin/python bench/bench_compile_rows.py --model default --package-dir /tmp/rows \\
        [--static 1 8 32] [--example 8] [--dynamic-max 2048] [--pad 8] [--inspect]
        [--rows 1 3 8 13 32 64 512 2048] [--rounds 3] [--steps 8] [--clock cpu] [--out FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import statistics
import sys
import time
import zipfile
from pathlib import Path

import torch
from torch._inductor import aoti_load_package

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "kernels"))
from bench.bench_compile_dynamic import span  # noqa: E402
from deploy.default_model import BENCH_MODEL_HELP, bench_model  # noqa: E402
from kvferry.model.compiled import _Graph, _run, attend_nothing, export_package  # noqa: E402
from kvferry.model.config import load_model_config  # noqa: E402
from kvferry.model.transformer import Transformer  # noqa: E402
from kvferry_kernels.dispatch import get_attention_backend  # noqa: E402


def build(model: Transformer, path: Path, rows: int, dynamic_max: int | None) -> float:
    """Export and compile the graph at `rows` example rows into `path` (symbolic rows 1 to
    `dynamic_max` where given, else static); seconds spent."""
    start = time.perf_counter()
    tokens = torch.zeros(rows, dtype=torch.int64)
    shapes = None
    if dynamic_max is not None:
        dim = torch.export.Dim("rows", min=1, max=dynamic_max)
        shapes = ({0: dim}, {0: dim})
    export_package(_Graph(model).eval(), tokens, path, "default", shapes)
    return time.perf_counter() - start


def inspect(path: Path) -> dict:
    """The ATen/oneDNN ops the package's wrapper calls, counted, and a digest of its packed
    (mkldnn) weights' layouts."""
    with zipfile.ZipFile(path) as archive:
        wrapper = next(n for n in archive.namelist() if n.endswith(".wrapper.cpp"))
        source = archive.read(wrapper).decode()
    ops: dict[str, int] = {}
    for op in re.findall(r"aoti_torch_cpu_\w+", source):
        ops[op] = ops.get(op, 0) + 1
    layouts = re.findall(r"opaque_metadata = \{[^}]*\}", source)
    digest = hashlib.sha256("\n".join(layouts).encode()).hexdigest()[:16]
    return {"ops": ops, "packed_weights": len(layouts), "layout_digest": digest}


def stepper(model: Transformer, way: str, runner, size: int, rows: int):
    tokens = torch.randint(1, model.config.vocab_size, (rows,),
                           generator=torch.Generator().manual_seed(rows))
    positions = torch.arange(rows) % 128
    if way == "eager":
        return lambda: model.forward_tokens(model.weights, model.inv_freq, tokens, positions,
                                            attend_nothing)
    return lambda: _run(runner, size, tokens, positions, attend_nothing)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help=BENCH_MODEL_HELP)
    p.add_argument("--package-dir", type=Path, required=True)
    p.add_argument("--static", type=int, nargs="*", default=[1, 8, 32])
    p.add_argument("--example", type=int, default=8)
    p.add_argument("--dynamic-max", type=int, default=2048)
    p.add_argument("--pad", type=int, nargs="*", default=[])
    p.add_argument("--no-eager", action="store_true")
    p.add_argument("--inspect", action="store_true")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 3, 8, 13, 32, 64, 512])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8,
                   help="steps per round per way (a quarter above 64 rows, 2 above 512)")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.example < 2 or args.dynamic_max < max(args.rows + [args.example]):
        p.error("--example >= 2 (export specialises 1) and --dynamic-max >= every row count")
    torch.set_num_threads(1)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    model = Transformer(load_model_config(bench_model(args.model)),
                        get_attention_backend("torch"))
    args.package_dir.mkdir(parents=True, exist_ok=True)
    paths = {f"static{b}": (args.package_dir / f"static{b}.pt2", b, None)
             for b in sorted(args.static)}
    paths["dynamic"] = (args.package_dir / f"dynamic{args.example}-{args.dynamic_max}.pt2",
                        args.example, args.dynamic_max)
    built = {}
    for name, (path, rows, dynamic_max) in paths.items():
        if not path.exists():
            built[name] = build(model, path, rows, dynamic_max)
            print(f"{name}: built in {built[name]:.1f} s", flush=True)
    inspected = {name: inspect(path) for name, (path, _, _) in paths.items()} if (
        args.inspect) else {}
    for name, info in inspected.items():
        print(f"{name}: {info['packed_weights']} packed weights, layouts "
              f"{info['layout_digest']}, ops {info['ops']}")
    runners = {name: aoti_load_package(str(path))
               for name, (path, _, _) in paths.items()}
    statics = sorted(args.static)
    times: dict[int, dict[str, list[float]]] = {}
    with torch.inference_mode():
        for rows in args.rows:
            ways: dict[str, tuple[object, int]] = {}
            bucket = next((b for b in statics if b >= rows), None)
            if bucket is not None:
                ways[f"bucket{bucket}"] = (runners[f"static{bucket}"], bucket)
            ways["dynamic"] = (runners["dynamic"], rows)
            for pad in args.pad:
                ways[f"pad{pad}"] = (runners["dynamic"],
                                     min(-(-rows // pad) * pad, args.dynamic_max))
            if not args.no_eager:
                ways["eager"] = (None, rows)
            steps = args.steps if rows <= 64 else max(2, args.steps // 4) if rows <= 512 else 2
            times[rows] = {way: [] for way in ways}
            for _ in range(args.rounds):
                for way, (runner, size) in ways.items():
                    step = stepper(model, way, runner, size, rows)
                    step()
                    per_step = []
                    for _ in range(steps):
                        start = clock()
                        step()
                        per_step.append((clock() - start) * 1e3)
                    times[rows][way].append(statistics.median(per_step))
            ref = next(iter(ways))
            cells = []
            for way, ms in times[rows].items():
                cell = f"{way} {span(ms)}"
                if way != ref:
                    ratios = [t / r for t, r in zip(ms, times[rows][ref])]
                    cell += f" ({span(ratios, 2)}x {ref})"
                cells.append(cell)
            print(f"{rows:>5} rows, ms ({args.clock}): " + "; ".join(cells), flush=True)
    if args.out:
        args.out.write_text(json.dumps({
            "model": args.model, "static": statics, "example": args.example,
            "dynamic_max": args.dynamic_max, "clock": args.clock, "rounds": args.rounds,
            "steps": args.steps, "torch": torch.__version__, "built_s": built,
            "inspect": inspected, "step_ms": times}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
