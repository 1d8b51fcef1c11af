"""Quantized K/V pages on the real default model: accuracy,
capacity, bytes shipped and decode speed of int8 and fp8 e4m3 pages against full precision,
all through kvferry's paged path (`Transformer.prefill`/`decode` over a `KvPool`), in one run.

For each K/V dtype (auto = the model's fp32, int8, fp8_e4m3):
1. perplexity of the first `--text-tokens` tokens of the committed text
   (bench/data/coriolanus_opening.txt, public domain), cut into `--segments` equal slices:
   prefill each slice's first token, then teacher-force the rest one decode step at a time
   over the pool, the slices as one batch, each step's logits scoring the next true token
   (NLL summed in float64). Slices rather than one sequence: a batch-1 step costs most of a
   batch-4 one here, and the whole text token by token took over 4 minutes per dtype;
2. greedy continuations of `--prompts` windows of the text (32-64 tokens, ragged) decoded
   together as one batch, against the fp32 pool's: the share identical over all
   `--new-tokens` tokens and the mean number of leading tokens that match;
3. blocks and 512+128-token requests a `--pool-mib` pool holds (the worker's pool sizing:
   KvShape.bytes_per_block), and K/V bytes one 512-token prompt ships (wire.plan_chunks);
4. decode step time of a batch of `--batch` sequences of `--context` tokens, the dtypes
   interleaved within each of `--reps` repetitions; median [min-max] over repetitions of
   each repetition's median step, and the ratio to fp32 within each repetition.
Targets: int8 perplexity within 1% of fp32, fp8 within 3%. Usage:

    .venv/bin/python bench/bench_kv_quant.py [--out bench/results/bench_kv_quant.json] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import time
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import AutoTokenizer

from deploy.default_model import BENCH_MODEL_HELP, bench_model
from deploy.worker_model import tune_malloc
from kvferry.cache.budget import blocks_for_tokens, blocks_needed
from kvferry.cache.layout import KvLayout, KvShape
from kvferry.cache.pool import KvPool
from kvferry.model.config import load_model_config
from kvferry.model.transformer import Transformer
from kvferry.transfer import wire
from kvferry_kernels.dispatch import get_attention_backend

TEXT_PATH = Path(__file__).parent / "data" / "coriolanus_opening.txt"
BLOCK_SIZE = 16
KV_DTYPES = ("auto", "int8", "fp8_e4m3")  # auto first: the reference
PPL_TARGETS = {"int8": 0.01, "fp8_e4m3": 0.03}  # relative perplexity increase allowed


class Accuracy(NamedTuple):
    perplexity: float
    num_scored_tokens: int
    argmax_agreement: float  # teacher-forced steps whose argmax equals fp32's
    greedy_identical_share: float  # continuations identical to fp32's over every token
    greedy_mean_leading_match: float  # leading tokens equal to fp32's, mean over prompts


class Capacity(NamedTuple):
    bytes_per_token: int
    blocks: int
    requests: int
    wire_bytes_per_request: int


def text_tokens(model_dir: str) -> list[int]:
    """The committed text (its first line is the source header) as model tokens."""
    text = TEXT_PATH.read_text().split("\n", 1)[1]
    return AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"]


def make_pool(model: Transformer, num_blocks: int, kv_dtype: str) -> KvPool:
    cfg = model.config
    return KvPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK_SIZE, num_blocks,
                  model.dtype, model.device, prefix_caching=False, kv_cache_dtype=kv_dtype)


def teacher_forced(model: Transformer, segments: list[list[int]], kv_dtype: str
                   ) -> tuple[float, list[int]]:
    """Summed NLL (float64) of every segment's tokens after its first, each predicted by the
    decode step of the token before it over a pool of `kv_dtype`, the segments (of equal
    length) decoded together as one batch; and each step's argmax, in step-major order."""
    length = len(segments[0])
    per_seq = blocks_for_tokens(length, BLOCK_SIZE)
    pool = make_pool(model, per_seq * len(segments), kv_dtype)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(segments))]
    block_tables = torch.tensor(tables, dtype=torch.int32)  # [S, per_seq]
    logits = model.prefill(torch.tensor([seg[0] for seg in segments]), [1] * len(segments),
                           torch.cat([pool.slots(t, 0, 1) for t in tables]), pool)
    nll, argmax = 0.0, []
    for pos in range(1, length):
        targets = torch.tensor([seg[pos] for seg in segments])  # [S]
        log_probs = torch.log_softmax(logits.double(), dim=-1)  # [S, vocab]
        nll -= float(log_probs.gather(1, targets[:, None]).sum())
        argmax.extend(logits.argmax(dim=-1).tolist())
        if pos == length - 1:
            break
        used = block_tables[:, :blocks_for_tokens(pos + 1, BLOCK_SIZE)]
        slots = torch.cat([pool.slots(t, pos, pos + 1) for t in tables])
        logits = model.decode(targets, torch.full((len(segments),), pos), slots, used, pool)
    return nll, argmax


def prompt_windows(tokens: list[int], num_prompts: int, new_tokens: int) -> list[list[int]]:
    """`num_prompts` windows of 32-64 tokens (ragged) at evenly spread offsets."""
    lengths = [32 + (7 * i) % 33 for i in range(num_prompts)]
    room = len(tokens) - 64 - new_tokens
    if room < num_prompts:
        raise ValueError(f"text-tokens: {len(tokens)} tokens hold no {num_prompts} prompts")
    return [tokens[i * room // num_prompts:][:n] for i, n in enumerate(lengths)]


def greedy_batch(model: Transformer, prompts: list[list[int]], kv_dtype: str,
                 new_tokens: int) -> list[list[int]]:
    """Greedy continuations of every prompt: one packed prefill, then one ragged decode
    batch of all of them per step."""
    per_seq = blocks_for_tokens(64 + new_tokens, BLOCK_SIZE)
    pool = make_pool(model, per_seq * len(prompts), kv_dtype)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    block_tables = torch.tensor(tables, dtype=torch.int32)  # [B, per_seq]
    slots = torch.cat([pool.slots(t, 0, len(p)) for t, p in zip(tables, prompts)])
    logits = model.prefill(torch.tensor(sum(prompts, [])), [len(p) for p in prompts],
                           slots, pool)
    outs = [[int(t)] for t in logits.argmax(dim=-1)]
    for _ in range(new_tokens - 1):
        positions = [len(p) + len(o) - 1 for p, o in zip(prompts, outs)]
        slots = torch.cat([pool.slots(t, n, n + 1) for t, n in zip(tables, positions)])
        logits = model.decode(torch.tensor([o[-1] for o in outs]), torch.tensor(positions),
                              slots, block_tables, pool)
        for out, token in zip(outs, logits.argmax(dim=-1).tolist()):
            out.append(token)
    return outs


def leading_match(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def capacity(model: Transformer, kv_dtype: str, pool_bytes: int, prompt_tokens: int,
             output_tokens: int) -> Capacity:
    """The worker's pool arithmetic (deploy.worker_model.build_pool) and the wire plan of
    one prompt's K/V (what a prefill worker ships)."""
    cfg = model.config
    layout = KvLayout.of_pool(make_pool(model, 1, kv_dtype), cfg.fingerprint)
    shape = KvShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, layout.dtype)
    blocks = pool_bytes // shape.bytes_per_block(BLOCK_SIZE)
    requests = blocks // blocks_needed(prompt_tokens, output_tokens, BLOCK_SIZE)
    shipped = sum(wire.span_bytes(layout, s) for s in wire.plan_chunks(layout, prompt_tokens))
    return Capacity(shape.bytes_per_token, blocks, requests, shipped)


class DecodeBatch(NamedTuple):
    pool: KvPool
    block_tables: torch.Tensor  # [B, blocks per sequence] int32
    tables: list[list[int]]


def decode_batch(model: Transformer, tokens: list[int], kv_dtype: str, batch: int,
                 context: int, steps: int) -> DecodeBatch:
    """`batch` sequences of `context` tokens of the text in a pool of `kv_dtype`, their
    blocks shuffled as a busy pool leaves them. One sequence is prefilled; the others get
    copies of its pages (same bytes, same attention work)."""
    per_seq = blocks_for_tokens(context + steps + 1, BLOCK_SIZE)
    pool = make_pool(model, per_seq * batch, kv_dtype)
    free = list(range(pool.num_blocks))
    random.Random(0).shuffle(free)
    tables = [free[i * per_seq:(i + 1) * per_seq] for i in range(batch)]
    model.prefill(torch.tensor(tokens[:context]), [context], pool.slots(tables[0], 0, context),
                  pool)
    used = blocks_for_tokens(context, BLOCK_SIZE)
    src = torch.tensor(tables[0][:used])
    for table in tables[1:]:
        pool.cache[:, :, torch.tensor(table[:used])] = pool.cache[:, :, src]
    return DecodeBatch(pool, torch.tensor(tables, dtype=torch.int32), tables)


def median_step_ms(model: Transformer, run: DecodeBatch, tokens: list[int], context: int,
                   steps: int) -> float:
    """Median time of `steps` decode steps from position `context` (one untimed first)."""
    times = []
    for step in range(steps + 1):
        positions = [context + step] * len(run.tables)
        slots = torch.cat([run.pool.slots(t, n, n + 1) for t, n in zip(run.tables, positions)])
        token_ids = torch.tensor(tokens[step: step + len(run.tables)])
        start = time.perf_counter()
        model.decode(token_ids, torch.tensor(positions), slots, run.block_tables, run.pool)
        if step:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def accuracy(model: Transformer, tokens: list[int], args: argparse.Namespace
             ) -> dict[str, Accuracy]:
    prompts = prompt_windows(tokens, args.prompts, args.new_tokens)
    scored = tokens[:args.text_tokens] if args.text_tokens > 0 else tokens
    length = len(scored) // args.segments
    segments = [scored[i * length:(i + 1) * length] for i in range(args.segments)]
    results: dict[str, Accuracy] = {}
    ref_argmax: list[int] = []
    ref_outs: list[list[int]] = []
    for kv_dtype in KV_DTYPES:
        start = time.perf_counter()
        nll, argmax = teacher_forced(model, segments, kv_dtype)
        middle = time.perf_counter()
        outs = greedy_batch(model, prompts, kv_dtype, args.new_tokens)
        if kv_dtype == "auto":
            ref_argmax, ref_outs = argmax, outs
        matches = [leading_match(o, r) for o, r in zip(outs, ref_outs)]
        results[kv_dtype] = Accuracy(
            perplexity=math.exp(nll / len(argmax)), num_scored_tokens=len(argmax),
            argmax_agreement=sum(a == r for a, r in zip(argmax, ref_argmax)) / len(argmax),
            greedy_identical_share=sum(m == args.new_tokens for m in matches) / len(matches),
            greedy_mean_leading_match=statistics.mean(matches))
        print(f"{kv_dtype}: perplexity {middle - start:.0f} s, greedy "
              f"{time.perf_counter() - middle:.0f} s", flush=True)
    return results


def throughput(model: Transformer, tokens: list[int], args: argparse.Namespace
               ) -> dict[str, list[float]]:
    """Per dtype, each repetition's median step ms, the dtypes interleaved within each."""
    runs = {d: decode_batch(model, tokens, d, args.batch, args.context, args.steps)
            for d in KV_DTYPES}
    for kv_dtype in KV_DTYPES:  # warm-up: the allocator's first pass over these shapes
        median_step_ms(model, runs[kv_dtype], tokens, args.context, 2)
    times: dict[str, list[float]] = {d: [] for d in KV_DTYPES}
    for rep in range(args.reps):
        order = KV_DTYPES if rep % 2 == 0 else KV_DTYPES[::-1]
        for kv_dtype in order:
            times[kv_dtype].append(median_step_ms(model, runs[kv_dtype], tokens, args.context,
                                                  args.steps))
        print(f"throughput rep {rep}: " + ", ".join(f"{d} {times[d][-1]:.1f} ms"
                                                    for d in KV_DTYPES), flush=True)
    return times


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def rows(acc: dict[str, Accuracy], cap: dict[str, Capacity], times: dict[str, list[float]]
         ) -> list[dict]:
    ref_ppl, ref_cap, ref_times = acc["auto"].perplexity, cap["auto"], times["auto"]
    out = []
    for kv_dtype in KV_DTYPES:
        ppl_increase = acc[kv_dtype].perplexity / ref_ppl - 1
        target = PPL_TARGETS.get(kv_dtype)
        out.append({
            "kv_cache_dtype": kv_dtype, **acc[kv_dtype]._asdict(),
            "perplexity_increase": ppl_increase, "perplexity_target": target,
            "perplexity_target_met": None if target is None else ppl_increase <= target,
            **cap[kv_dtype]._asdict(),
            "requests_vs_fp32": cap[kv_dtype].requests / ref_cap.requests,
            "wire_bytes_vs_fp32": (cap[kv_dtype].wire_bytes_per_request
                                   / ref_cap.wire_bytes_per_request),
            "step_ms": spread(times[kv_dtype]), "step_ms_reps": times[kv_dtype],
            "step_time_vs_fp32": spread([t / r for t, r in zip(times[kv_dtype], ref_times)]),
        })
    return out


def print_table(table: list[dict]) -> None:
    print(f"{'kv dtype':>8} {'ppl':>7} {'vs fp32':>8} {'target':>11} {'argmax=':>7} "
          f"{'greedy=':>7} {'lead':>5} {'blocks':>6} {'reqs':>5} {'x':>5} {'wire MB':>7} "
          f"{'x':>5} {'step ms median [min-max]':>24} {'x fp32 [min-max]':>17}")
    for r in table:
        target = ("-" if r["perplexity_target"] is None else
                  f"{r['perplexity_target']:.0%} " + ("pass" if r["perplexity_target_met"]
                                                       else "MISS"))
        s, x = r["step_ms"], r["step_time_vs_fp32"]
        print(f"{r['kv_cache_dtype']:>8} {r['perplexity']:>7.3f} "
              f"{r['perplexity_increase']:>+8.2%} {target:>11} {r['argmax_agreement']:>7.1%} "
              f"{r['greedy_identical_share']:>7.0%} {r['greedy_mean_leading_match']:>5.1f} "
              f"{r['blocks']:>6} {r['requests']:>5} {r['requests_vs_fp32']:>4.2f}x "
              f"{r['wire_bytes_per_request'] / 1e6:>7.2f} {r['wire_bytes_vs_fp32']:>4.3f}x "
              f"{s['median']:>9.1f} [{s['min']:.1f}-{s['max']:.1f}] "
              f"{x['median']:>6.2f}x [{x['min']:.2f}-{x['max']:.2f}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help=BENCH_MODEL_HELP)
    parser.add_argument("--text-tokens", type=int, default=2048,
                        help="tokens of the text scored for perplexity (0: all of it)")
    parser.add_argument("--segments", type=int, default=4,
                        help="equal slices of those tokens, teacher-forced as one batch")
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--pool-mib", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8, help="timed decode steps per rep")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: steadier on a shared machine)")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny sizes: checks the script runs end to end")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.dry_run:
        args.text_tokens, args.prompts, args.new_tokens = 300, 4, 8
        args.batch, args.steps, args.reps = 4, 2, 2
    tune_malloc()
    torch.set_num_threads(args.threads)
    model_dir = bench_model(args.model)
    model = Transformer(load_model_config(model_dir), get_attention_backend("torch"),
                        torch.float32, torch.device("cpu"))
    tokens = text_tokens(model_dir)
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    acc = accuracy(model, tokens, args)
    cap = {d: capacity(model, d, args.pool_mib << 20, args.prompt_tokens, args.output_tokens)
           for d in KV_DTYPES}
    times = throughput(model, tokens, args)
    table = rows(acc, cap, times)
    print_table(table)
    wall_s = time.perf_counter() - started
    print(f"{acc['auto'].num_scored_tokens} scored tokens, {args.prompts} prompts x "
          f"{args.new_tokens} tokens, "
          f"{args.pool_mib} MiB pool, batch {args.batch} x {args.context} context, "
          f"{args.reps} reps; {wall_s:.0f} s")
    if args.out:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        args.out.write_text(json.dumps({
            "model": Path(model_dir).name, "text": TEXT_PATH.name, "block_size": BLOCK_SIZE,
            "torch": torch.__version__, "wall_s": wall_s, "settings": settings,
            "load_average_1m": {"start": load_start, "end": os.getloadavg()[0]},
            "rows": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
