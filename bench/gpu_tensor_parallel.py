"""Tensor parallelism on several GPUs (docs/tensor-parallel.md): ranks on their own CUDA
devices in an NCCL group, checked token for token.

    python bench/gpu_tensor_parallel.py --out tp.json [--sizes 1-2,2-1,2-2]
    python bench/gpu_tensor_parallel.py --dry-run --out tp.json   # CPU, gloo: everything else

Two sections, each for every prefill/decode size pair (P, D), on the tiny seeded Qwen3 and
Llama checkpoints made here (fp32, so transformers on the CPU is the oracle):
- model: the prompts prefilled split P ways, their pages read whole, written into a decode
  side split D ways at the same block ids and decoded there; the greedy tokens against the
  whole model's on the same device.
- workers: a deployment (router, a prefill worker split P ways, a decode worker split D
  ways, pages over gRPC); every prompt at once, greedy, against transformers' generate.

Writes one JSON object; the exit status is the number of checks that failed (2 where the
machine lacks the devices asked for).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "kernels"))

from deploy import client  # noqa: E402
from deploy.launcher import Deployment  # noqa: E402
from kvferry.cache.budget import blocks_for_tokens  # noqa: E402
from kvferry.cache.pool import KvPool  # noqa: E402
from kvferry.model.checkpoint import LLAMA_SPEC, ModelSpec, make_model  # noqa: E402
from kvferry.model.config import load_model_config  # noqa: E402
from kvferry.model.tp_group import RankSpec, TensorParallelModel  # noqa: E402
from kvferry.model.transformer import Transformer  # noqa: E402
from kvferry_kernels.dispatch import get_attention_backend  # noqa: E402

PROMPTS = [[5, 9, 200, 31, 7], list(range(40, 77)), list(range(300, 390))]
STEPS = 8
BLOCK = 16


def _side(checkpoint: Path, size: int, device: torch.device, backend: str
          ) -> tuple[Transformer | TensorParallelModel, KvPool]:
    if size == 1:
        model = Transformer(load_model_config(checkpoint), get_attention_backend(backend),
                            torch.float32, device)
        cfg = model.config
        return model, KvPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK, 64,
                             torch.float32, device)
    spec = RankSpec(str(checkpoint), "auto", backend, "float32", BLOCK, 64, device=str(device))
    group = TensorParallelModel(spec, size)
    return group, group.pool


def _prefill(model: Transformer | TensorParallelModel, pool: KvPool, device: torch.device
             ) -> tuple[list[list[int]], list[list[int]]]:
    tables = [pool.allocator.alloc(blocks_for_tokens(len(p) + STEPS, BLOCK)) for p in PROMPTS]
    slots = torch.cat([pool.slots(t, 0, len(p)) for t, p in zip(tables, PROMPTS)])
    logits = model.prefill(torch.tensor(sum(PROMPTS, [])).to(device),
                           [len(p) for p in PROMPTS], slots.to(device), pool)
    return tables, [[int(row.argmax())] for row in logits]


def _decode(model: Transformer | TensorParallelModel, pool: KvPool, device: torch.device,
            tables: list[list[int]], tokens: list[list[int]]) -> list[list[int]]:
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                dtype=torch.int32, device=device)
    for _ in range(STEPS - 1):
        positions = [len(p) + len(t) - 1 for p, t in zip(PROMPTS, tokens)]
        slots = torch.cat([pool.slots(t, pos, pos + 1) for t, pos in zip(tables, positions)])
        logits = model.decode(torch.tensor([t[-1] for t in tokens], device=device),
                              torch.tensor(positions, device=device), slots.to(device),
                              block_tables, pool)
        for row, t in zip(logits, tokens):
            t.append(int(row.argmax()))
    return tokens


def _close(model: Transformer | TensorParallelModel) -> None:
    if isinstance(model, TensorParallelModel):
        model.close()


def model_check(checkpoint: Path, sizes: tuple[int, int], device: torch.device,
                backend: str) -> dict[str, object]:
    """Prefill split P ways, pages read whole, written into D ways, decoded there."""
    whole, pool = _side(checkpoint, 1, device, backend)
    expected = _decode(whole, pool, device, *_prefill(whole, pool, device))
    start = time.perf_counter()
    prefill, pool = _side(checkpoint, sizes[0], device, backend)
    try:
        tables, tokens = _prefill(prefill, pool, device)
        blocks = [b for table in tables for b in table]
        pages = pool.read_pages(blocks)
    finally:
        _close(prefill)
    decode, pool = _side(checkpoint, sizes[1], device, backend)
    try:
        for table in tables:
            assert pool.allocator.alloc(len(table)) == table  # noqa: S101 - same block ids
        pool.write_pages(blocks, pages)
        got = _decode(decode, pool, device, tables, tokens)
    finally:
        _close(decode)
    return {"sizes": list(sizes), "tokens_match": got == expected, "tokens": got,
            "expected": expected, "seconds": round(time.perf_counter() - start, 2)}


def _reference(checkpoint: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_tokens
                            )[0, len(p):].tolist() for p in prompts]


def worker_check(checkpoint: Path, sizes: tuple[int, int], device: str, logs: Path
                 ) -> dict[str, object]:
    """A deployment split (P, D) ways over gRPC: greedy tokens against transformers'."""
    max_tokens = 24
    expected = _reference(checkpoint, PROMPTS, max_tokens)
    logs.mkdir(parents=True, exist_ok=True)
    deployment = Deployment(model=str(checkpoint), log_dir=logs,
                            worker_args=["--dtype", "float32", "--device", device],
                            prefill_tensor_parallel_size=sizes[0],
                            decode_tensor_parallel_size=sizes[1])
    start = time.perf_counter()
    deployment.start()
    try:
        requests = [client.make_request(p, temperature=0.0, max_tokens=max_tokens)
                    for p in PROMPTS]
        results = asyncio.run(client.generate_many(deployment.router_address, requests, 300))
        got = [list(r.token_ids) for r in results]
        ttft = [r.finished.timing.time_to_first_token_s for r in results if r.finished]
    finally:
        deployment.stop()
    return {"sizes": list(sizes), "tokens_match": got == expected, "tokens": got,
            "expected": expected, "ttft_s": ttft,
            "seconds": round(time.perf_counter() - start, 2)}


def _sizes(text: str) -> list[tuple[int, int]]:
    pairs = []
    for part in text.split(","):
        p, d = part.split("-")
        pairs.append((int(p), int(d)))
    return pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON report")
    parser.add_argument("--sizes", default="1-2,2-1,2-2",
                        help="prefill-decode size pairs, comma-separated (default: 1-2,2-1,2-2)")
    parser.add_argument("--dry-run", action="store_true",
                        help="run on the CPU with gloo (default: off, CUDA with NCCL)")
    parser.add_argument("--sections", default="model,workers",
                        help="which checks (default: model,workers)")
    args = parser.parse_args(argv)
    pairs = _sizes(args.sizes)
    device = torch.device("cpu" if args.dry_run else "cuda")
    needed = max(max(pair) for pair in pairs)
    if device.type == "cuda" and torch.cuda.device_count() < needed:
        print(f"gpu_tensor_parallel: needs {needed} CUDA devices, found "
              f"{torch.cuda.device_count()}", file=sys.stderr)
        return 2
    backend = "triton" if device.type == "cuda" else "torch"
    report: dict[str, object] = {"device": device.type, "ranks_backend":
                                 "nccl" if device.type == "cuda" else "gloo",
                                 "gpus": torch.cuda.device_count(), "model": [], "workers": []}
    sections = args.sections.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        models = {"qwen3": make_model(Path(tmp) / "qwen3", ModelSpec()),
                  "llama": make_model(Path(tmp) / "llama", LLAMA_SPEC)}
        for arch, checkpoint in models.items():
            for pair in pairs:
                if "model" in sections:
                    row = model_check(checkpoint, pair, device, backend)
                    report["model"].append({"arch": arch, **row})  # type: ignore[union-attr]
                if "workers" in sections and arch == "qwen3":
                    row = worker_check(checkpoint, pair, device.type, Path(tmp) / f"logs-{pair}")
                    report["workers"].append({"arch": arch, **row})  # type: ignore[union-attr]
    args.out.write_text(json.dumps(report, indent=1))
    rows = [*report["model"], *report["workers"]]  # type: ignore[misc]
    failed = sum(not r["tokens_match"] for r in rows)
    print(f"gpu_tensor_parallel: {len(rows) - failed} of {len(rows)} checks token-exact "
          f"({device.type}); {args.out}")
    return failed


if __name__ == "__main__":
    sys.exit(main())
