"""An 8B-shaped model's decode step and prefill on one GPU against the hardware's roofline.

Llama-3.1-8B- and Qwen3-8B-shaped models (`kvferry make-model --shape`, random bf16 weights
made on the device by `--load-format dummy`'s code: no file is carried, and a step's cost does
not depend on the weights' values) are measured as kvferry runs them:

- decode: the step replayed from CUDA graphs (kvferry.model.cuda_graphs, as a decode worker
  captures it: buckets 1 8 32 128 256, block tables as wide as the model's context) at each
  batch x context that fits the device, every sequence on blocks of its own. Roofline: the
  bytes a step must read (every weight once, but only the batch's rows of the embedding
  table, plus every K/V byte of the batch's contexts) over the device-to-device copy
  bandwidth measured in the same run, or the step's FLOPs over the bf16 GEMM rate measured in
  the same run where that is longer. Ratio = roofline time / measured time.
- prefill: one prompt of 512, 2k and 8k tokens through `Transformer.prefill` (K/V written to
  the pool). Roofline: 2 x parameters x tokens (the LM head for the last token only) plus
  causal attention's 2 x layers x query heads x head_dim x tokens^2, over the measured GEMM
  rate (and over the H200's 989 TFLOP/s bf16 dense datasheet figure, as a second ratio).
- kv-dtype: int8 and fp8 e4m3 pages against bf16 pages: the decode step at batch 32 x 16k and
  batch 1 x 32k tokens, and the attention kernel alone over one layer.

Times are CUDA-event times of `--iters` steps, median [min-max] over `--repeats` rounds.
The JSON (`--out`) is rewritten after every measurement, so a run cut short keeps what it has.
`--dry-run` runs every section on CPU (TRITON_INTERPRET=1, fp32) with a scaled-down shape and
no graph capture: the tests run it. Usage:

    python bench/gpu_roofline.py --out out/gpu_roofline.json [--sections decode prefill kv-dtype]
    python bench/gpu_roofline.py --out /tmp/dry.json --dry-run
"""

from __future__ import annotations

import argparse
import os
import sys

# TRITON_INTERPRET must be set before triton is imported: parse flags first.
_PARSER = argparse.ArgumentParser(description=__doc__.split("\n")[0])
_PARSER.add_argument("--out", required=True, help="where to write the JSON results")
_PARSER.add_argument("--dry-run", action="store_true", help="CPU, interpreter, small shape")
_PARSER.add_argument("--models", nargs="+", default=["llama-3.1-8b", "qwen3-8b"])
_PARSER.add_argument("--sections", nargs="+", default=["decode", "prefill", "kv-dtype"],
                     choices=("decode", "prefill", "kv-dtype"))
_PARSER.add_argument("--batches", type=int, nargs="+", default=None,
                     help="decode batches (default 1 8 32 128 256)")
_PARSER.add_argument("--contexts", type=int, nargs="+", default=None,
                     help="decode contexts (default 1024 4096 16384)")
_PARSER.add_argument("--prompts", type=int, nargs="+", default=None,
                     help="prefill prompt lengths (default 512 2048 8192)")
_PARSER.add_argument("--repeats", type=int, default=3)
_PARSER.add_argument("--iters", type=int, default=10, help="steps timed per round")
_PARSER.add_argument("--time-budget-s", type=float, default=300.0,
                     help="measurements past this are skipped (and say so)")
ARGS = _PARSER.parse_args()
DRY = ARGS.dry_run
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "kernels"))
from decode_worker.sequence import PlainSeq, step_inputs  # noqa: E402
from kvferry.cache.budget import blocks_for_tokens  # noqa: E402
from kvferry.cache.layout import KvShape  # noqa: E402
from kvferry.cache.pool import KvPool  # noqa: E402
from kvferry.model.config import ModelConfig, load_model_config  # noqa: E402
from kvferry.model.cuda_graphs import CudaGraphDecode  # noqa: E402
from kvferry.model.shapes import make_shape  # noqa: E402
from kvferry.model.transformer import Transformer  # noqa: E402
from kvferry_kernels.dispatch import get_attention_backend  # noqa: E402
from kvferry_kernels.triton_paged_attention import paged_decode_attention_triton  # noqa: E402

DEVICE = torch.device("cpu" if DRY else "cuda")
DTYPE = torch.float32 if DRY else torch.bfloat16  # the interpreter cannot do bf16
BLOCK_SIZE = 16
BATCHES = ARGS.batches or ([1, 3] if DRY else [1, 8, 32, 128, 256])
CONTEXTS = ARGS.contexts or ([32, 64] if DRY else [1024, 4096, 16384])
PROMPTS = ARGS.prompts or ([16, 48] if DRY else [512, 2048, 8192])
# kv-dtype section: (batch, context) pairs
KV_DTYPE_SHAPES = [(3, 64), (1, 96)] if DRY else [(32, 16384), (1, 32768)]
KV_DTYPES = ("auto", "int8", "fp8_e4m3")
H200_BF16_DENSE_TFLOPS = 989.0  # datasheet, dense (no sparsity)
# The dry run's model: the 8B shape's architecture scaled down (the interpreter is slow).
DRY_SHAPE = dict(vocab_size=1024, hidden_size=128, intermediate_size=256,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, max_position_embeddings=16384, bos_token_id=1, eos_token_id=2)
START = time.perf_counter()
REPORT: dict[str, Any] = {"decode": [], "prefill": [], "kv_dtype": [], "models": {}}


def save() -> None:
    REPORT["elapsed_s"] = round(time.perf_counter() - START, 2)
    Path(ARGS.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ARGS.out).write_text(json.dumps(REPORT, indent=2))


def over_budget() -> bool:
    return time.perf_counter() - START > ARGS.time_budget_s


def sync() -> None:
    if not DRY:
        torch.cuda.synchronize()


def timed_ms(fn: Callable[[], object], iters: int | None = None) -> dict[str, Any]:
    """ms per call: `iters` calls per round timed with CUDA events (a wall clock in the dry
    run), median [min-max] over --repeats rounds, after one warm-up call."""
    iters = iters or (1 if DRY else ARGS.iters)
    fn()
    sync()
    rounds = []
    for _ in range(ARGS.repeats):
        if DRY:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            rounds.append((time.perf_counter() - t0) * 1e3 / iters)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        rounds.append(start.elapsed_time(end) / iters)
    return {"median": statistics.median(rounds), "min": min(rounds), "max": max(rounds),
            "rounds": rounds}


def device_rates() -> None:
    """Copy bandwidth (bytes read + written / time) and the bf16 GEMM rate, measured now."""
    size = (16 << 20) if DRY else (4 << 30)
    buffers = [torch.empty(size, dtype=torch.uint8, device=DEVICE) for _ in range(2)]
    copy = timed_ms(lambda: buffers[1].copy_(buffers[0]))
    REPORT["copy_bandwidth_gbps"] = 2 * size / (copy["median"] * 1e-3) / 1e9
    REPORT["copy_ms"] = copy
    buffers.clear()
    n = 256 if DRY else 8192
    a = torch.randn(n, n, dtype=DTYPE, device=DEVICE)
    b = torch.randn(n, n, dtype=DTYPE, device=DEVICE)
    gemm = timed_ms(lambda: a @ b)
    REPORT["gemm_tflops"] = 2 * n**3 / (gemm["median"] * 1e-3) / 1e12
    REPORT["gemm_ms"] = gemm
    save()


class Rig:
    """One model with random weights on the device, and the pool its steps run over."""

    def __init__(self, name: str, root: Path) -> None:
        overrides = DRY_SHAPE if DRY else {}
        path = make_shape(root / name, name, **overrides)
        self.name = name
        self.config: ModelConfig = load_model_config(path, load_format="dummy")
        self.model = Transformer(self.config, get_attention_backend("triton"), DTYPE, DEVICE)
        cfg = self.config
        self.shape = KvShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                             "float32" if DRY else "bfloat16")
        weights = {id(t): t for t in self.model.weights.values()}  # tied ones once
        self.weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        self.params = sum(t.numel() for t in weights.values())
        embed = self.model.weights["model.embed_tokens.weight"]
        self.embed_bytes = embed.numel() * embed.element_size()
        self.row_bytes = embed.shape[1] * embed.element_size()
        REPORT["models"][name] = {"config": str(path / "config.json"),
                                  "parameters": self.params, "weight_bytes": self.weight_bytes,
                                  "kv_bytes_per_token": self.shape.bytes_per_token}

    def pool(self, tokens: int, kv_cache_dtype: str = "auto") -> KvPool | None:
        """A pool of `tokens` tokens plus the graphs' scratch block, filled with finite
        values; None where it does not fit the device (with room for activations)."""
        cfg = self.config
        blocks = blocks_for_tokens(tokens, BLOCK_SIZE) + 2
        shape = self.shape if kv_cache_dtype == "auto" else KvShape(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_cache_dtype)
        need = blocks * shape.bytes_per_block(BLOCK_SIZE)
        if not DRY and need > torch.cuda.mem_get_info()[0] - (8 << 30):
            return None
        pool = KvPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK_SIZE, blocks,
                      DTYPE, DEVICE, prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
        if not pool.is_quantized:
            pool.cache.normal_()
            return pool
        pool.cache.random_(0, 0x7F)  # bytes below 0x7f: finite int8 and fp8 e4m3 values
        for layer in range(cfg.num_layers):
            for pages in (pool.k_cache(layer), pool.v_cache(layer)):
                pages.scale.fill_(1.0 / 64)  # finite scales over the bytes above
        return pool

    def release(self) -> None:
        del self.model
        release_memory()


def release_memory() -> None:
    """Give what the last section held back to the device (its pools: tens of GiB), so the
    next one's free-memory check sees it."""
    gc.collect()
    if not DRY:
        torch.cuda.empty_cache()


def _span(timed: dict[str, Any]) -> str:
    return f"{timed['median']:.3f} [{timed['min']:.3f}-{timed['max']:.3f}]"




def _step_inputs(pool: KvPool, batch: int, context: int) -> tuple[torch.Tensor, ...]:
    """One decode step of `batch` sequences of `context` tokens (the new one included), each
    on blocks of its own: token ids, positions, slots, block tables, on the device."""
    seqs = [PlainSeq(pool.allocator.alloc(blocks_for_tokens(context, BLOCK_SIZE)), context - 1)
            for _ in range(batch)]
    paging = step_inputs(seqs, BLOCK_SIZE)
    token_ids = torch.arange(1, batch + 1) % 1000
    return tuple(x.to(DEVICE) for x in (token_ids, *paging[:3]))


def _graphs(rig: Rig, pool: KvPool, buckets: list[int]) -> CudaGraphDecode:
    graphs = CudaGraphDecode(rig.model, pool, buckets)
    if not DRY:
        graphs.capture_all()
    return graphs


def _step_fn(rig: Rig, graphs: CudaGraphDecode, inputs: tuple[torch.Tensor, ...],
             pool: KvPool) -> Callable[[], object]:
    """One decode step as the worker runs it: replayed from its bucket's graph (the dry run:
    the captured function on the same buffers)."""
    if DRY:
        def body() -> object:
            return graphs.run_body(graphs.prepare(*inputs))
        return body
    rig.model.graphs = graphs

    def step() -> object:
        return rig.model.decode(*inputs, pool)
    return step


def roofline(rig: Rig, batch: int, context: int, kv_bytes_per_token: int) -> dict[str, Any]:
    """The step's bytes and FLOPs, and the time each takes at the rates measured now."""
    read = (rig.weight_bytes - rig.embed_bytes + batch * rig.row_bytes
            + batch * context * kv_bytes_per_token)
    cfg = rig.config
    flops = 2 * (rig.params - rig.embed_bytes // rig.row_bytes * cfg.hidden_size) * batch
    flops += 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context * batch  # attention
    memory_ms = read / (REPORT["copy_bandwidth_gbps"] * 1e9) * 1e3
    compute_ms = flops / (REPORT["gemm_tflops"] * 1e12) * 1e3
    return {"bytes_read": read, "flops": flops, "memory_ms": memory_ms,
            "compute_ms": compute_ms, "roofline_ms": max(memory_ms, compute_ms),
            "bound": "memory" if memory_ms >= compute_ms else "compute"}


def decode_section(rig: Rig) -> None:
    fits = [(b, c) for c in CONTEXTS for b in BATCHES]
    tokens = max(b * c for b, c in fits)
    pool = None
    while pool is None and fits:  # the largest pool that fits; shapes past it are skipped
        pool = rig.pool(tokens)
        if pool is None:
            fits = [(b, c) for b, c in fits if b * c < tokens]
            tokens = max((b * c for b, c in fits), default=0)
    graphs = _graphs(rig, pool, BATCHES)
    for batch in BATCHES:
        for context in CONTEXTS:
            row = {"model": rig.name, "batch": batch, "context": context}
            if (batch, context) not in fits:
                row["skipped"] = (f"needs {batch * context * rig.shape.bytes_per_token / 2**30:.0f}"
                                  " GiB of K/V: more than the device has beside the weights")
            elif over_budget():
                row["skipped"] = "time budget"
            else:
                row |= _decode_row(rig, graphs, pool, batch, context)
            REPORT["decode"].append(row)
            save()
    graphs.release()
    del pool


def _decode_row(rig: Rig, graphs: CudaGraphDecode, pool: KvPool, batch: int, context: int
                ) -> dict[str, Any]:
    inputs = _step_inputs(pool, batch, context)
    replays = graphs.num_replays
    timed = timed_ms(_step_fn(rig, graphs, inputs, pool))
    rig.model.graphs = None
    calls = 1 + ARGS.repeats * (1 if DRY else ARGS.iters)
    if not DRY and graphs.num_replays - replays != calls:
        raise RuntimeError(f"batch {batch} x {context}: the step ran without its graph")
    for row in inputs[3].tolist():  # give the blocks back
        pool.allocator.free(row[:blocks_for_tokens(context, BLOCK_SIZE)])
    line = roofline(rig, batch, context, rig.shape.bytes_per_token)
    line |= {"step_ms": timed, "of_roofline": line["roofline_ms"] / timed["median"],
             "graph_bucket": graphs.bucket(batch),
             "tokens_per_s": batch / (timed["median"] * 1e-3)}
    print(f"decode {rig.name} batch {batch} context {context}: {_span(timed)} ms, "
          f"{line['of_roofline']:.2f} of the {line['bound']} roofline", flush=True)
    return line


def prefill_section(rig: Rig) -> None:
    cfg = rig.config
    pool = rig.pool(max(PROMPTS))
    for n in PROMPTS:
        row: dict[str, Any] = {"model": rig.name, "prompt_tokens": n}
        if over_budget():
            REPORT["prefill"].append(row | {"skipped": "time budget"})
            continue
        table = pool.allocator.alloc(blocks_for_tokens(n, BLOCK_SIZE))
        tokens = (torch.arange(n) % 1000).to(DEVICE)
        slots = pool.slots(table, 0, n).to(DEVICE)
        timed = timed_ms(lambda t=tokens, n=n, s=slots, p=pool: rig.model.prefill(t, [n], s, p),
                         iters=1)
        pool.allocator.free(table)
        vocab_params = cfg.vocab_size * cfg.hidden_size
        heads = 0 if cfg.tie_word_embeddings else 1
        linear = rig.params - (1 + heads) * vocab_params  # the decoder layers and norms
        flops = 2 * linear * n + 2 * vocab_params  # the LM head for the last token only
        flops += 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * n * n  # causal
        seconds = timed["median"] * 1e-3
        row |= {"prefill_ms": timed, "tokens_per_s": n / seconds, "flops": flops,
                "achieved_tflops": flops / seconds / 1e12,
                "of_measured_gemm_rate": flops / seconds / 1e12 / REPORT["gemm_tflops"],
                "of_datasheet_bf16": flops / seconds / 1e12 / H200_BF16_DENSE_TFLOPS}
        print(f"prefill {rig.name} {n} tokens: {_span(timed)} ms, "
              f"{row['achieved_tflops']:.0f} TFLOP/s, {row['of_measured_gemm_rate']:.2f} of the "
              "measured GEMM rate", flush=True)
        REPORT["prefill"].append(row)
        save()


def kv_dtype_section(rig: Rig) -> None:
    """int8 and fp8 pages against the model's own dtype: the step, and attention alone."""
    for batch, context in KV_DTYPE_SHAPES:
        base: dict[str, float] = {}
        for kv_dtype in KV_DTYPES:
            row: dict[str, Any] = {"model": rig.name, "batch": batch, "context": context,
                                   "kv_cache_dtype": kv_dtype}
            pool = None if over_budget() else rig.pool(batch * context, kv_dtype)
            if pool is None:
                REPORT["kv_dtype"].append(row | {"skipped": "time budget or memory"})
                continue
            row |= _kv_dtype_row(rig, pool, batch, context)
            if kv_dtype == "auto":
                base = {"step": row["step_ms"]["median"], "attn": row["attention_ms"]["median"]}
            elif base:
                row["step_vs_auto"] = base["step"] / row["step_ms"]["median"]
                row["attention_vs_auto"] = base["attn"] / row["attention_ms"]["median"]
            REPORT["kv_dtype"].append(row)
            save()
            del pool
            release_memory()


def _kv_dtype_row(rig: Rig, pool: KvPool, batch: int, context: int) -> dict[str, Any]:
    cfg = rig.config
    graphs = _graphs(rig, pool, [batch])
    inputs = _step_inputs(pool, batch, context)
    step = timed_ms(_step_fn(rig, graphs, inputs, pool))
    rig.model.graphs = None
    graphs.release()
    q = torch.randn(batch, cfg.num_heads, cfg.head_dim, dtype=DTYPE, device=DEVICE)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    attention = timed_ms(lambda: paged_decode_attention_triton(
        q, pool.k_cache(0), pool.v_cache(0), inputs[3], seq_lens, cfg.head_dim**-0.5))
    kv_bytes = pool.cache[0].numel() * pool.cache.element_size() * batch * context / (
        pool.num_blocks * BLOCK_SIZE)  # one layer's pages of these sequences
    print(f"kv-dtype {rig.name} {pool.kv_cache_dtype} batch {batch} context {context}: step "
          f"{_span(step)} ms, attention {_span(attention)} ms", flush=True)
    return {"step_ms": step, "attention_ms": attention,
            "attention_gbps": kv_bytes / (attention["median"] * 1e-3) / 1e9}


def main() -> int:
    if not DRY and not torch.cuda.is_available():
        _PARSER.error("no CUDA device: run with --dry-run on CPU")
    REPORT["meta"] = {"device": "cpu (dry run, TRITON_INTERPRET=1)" if DRY
                      else torch.cuda.get_device_name(), "torch": torch.__version__,
                      "dry_run": DRY, "dtype": str(DTYPE), "block_size": BLOCK_SIZE,
                      "repeats": ARGS.repeats, "iters": ARGS.iters}
    device_rates()
    sections = {"decode": decode_section, "prefill": prefill_section,
                "kv-dtype": kv_dtype_section}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ARGS.models:
            rig = Rig(name, Path(tmp))
            save()
            for section in ARGS.sections:
                sections[section](rig)
                release_memory()
            rig.release()
    save()
    print(f"wrote {ARGS.out} in {REPORT['elapsed_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
