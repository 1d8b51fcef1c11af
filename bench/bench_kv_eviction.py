"""Perplexity under K/V eviction: what the model still predicts when a sequence keeps only part
of its K/V (docs/kv-eviction-design.md 3.6), on the real default model, in one run.

The text is bench/data/coriolanus_long.txt (the opening of Shakespeare's Coriolanus, public
domain), its first `--tokens` tokens (8,192: the model's whole context, so full attention fits).
Every configuration is a sequence fed the text one token at a time through the decode step
(`Transformer.decode` over the paged pool, the C kernel on CPU), teacher forcing: at each step
the negative log-likelihood of the next token of the text; a sequence's K/V is bounded before
each step by the worker's own eviction code (`decode_worker/eviction.py`). All configurations
run together as one decode batch. Configurations, at each budget of `--budgets` tokens (block
size 16):
  full:            nothing evicted (the reference);
  window:          the last `budget` tokens only (no sinks): StreamingLLM's failing baseline;
  streaming:       sinks (the first block: 16 tokens, `--kv-sink-tokens 4` rounded up to a
                   block) and the last `budget - 16` tokens, positions within the cache (what
                   `--kv-eviction streaming` runs);
  streaming-text:  the same tokens kept, each at the position it was written at (the sinks'
                   distance to the query then grows past anything the window shows).
Printed: perplexity over all predicted tokens and over those predicted once the budget was
full (where eviction acts), per configuration. Deterministic: one run (no timing reported).
H2O is not built yet (design step 6): no row. Usage:

    .venv/bin/python bench/bench_kv_eviction.py [--tokens 8192] [--budgets 256 512 1024]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script too
from decode_worker.eviction import StreamingEviction  # noqa: E402
from decode_worker.sequence import DecodeSeq, step_inputs  # noqa: E402
from deploy.default_model import bench_model  # noqa: E402
from kvferry.cache.layout import blocks_for_tokens  # noqa: E402
from kvferry.cache.pool import KvPool  # noqa: E402
from kvferry.model.config import load_model_config  # noqa: E402
from kvferry.model.transformer import Transformer  # noqa: E402
from kvferry.settings import KERNEL_CACHE_DIR, KvEvictionConfig  # noqa: E402
from kvferry_kernels.dispatch import get_attention_backend  # noqa: E402

TEXT = Path(__file__).resolve().parent / "data" / "coriolanus_long.txt"
BLOCK_SIZE = 16
SINK_TOKENS = 4  # one block


def _text_tokens(model_dir: str, count: int) -> list[int]:
    from transformers import AutoTokenizer

    text = TEXT.read_text().split("\n", 1)[1]  # past the one-line source header
    ids = AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"]
    if len(ids) < count:
        raise SystemExit(f"{TEXT} holds {len(ids)} tokens, fewer than --tokens {count}")
    return ids[:count]


def _configs(budgets: list[int]) -> list[tuple[str, int, KvEvictionConfig | None, bool]]:
    """(name, budget, eviction config or None, text positions)."""
    out: list[tuple[str, int, KvEvictionConfig | None, bool]] = [("full", 0, None, False)]
    for budget in budgets:
        window = KvEvictionConfig("streaming", sink_tokens=0, window_tokens=budget)
        sinks = KvEvictionConfig("streaming", sink_tokens=SINK_TOKENS,
                                 window_tokens=budget - BLOCK_SIZE)
        out += [("window", budget, window, False), ("streaming", budget, sinks, False),
                ("streaming-text", budget, sinks, True)]
    return out


def evaluate(model: Transformer, tokens: list[int], budgets: list[int]) -> list[dict]:
    configs = _configs(budgets)
    blocks = blocks_for_tokens(len(tokens), BLOCK_SIZE) + sum(
        c.budget_blocks(BLOCK_SIZE) + 1 for _, _, c, _ in configs if c is not None)
    cfg = model.config
    pool = KvPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK_SIZE, blocks,
                  torch.float32, model.device, prefix_caching=False)
    seqs, evictions = [], []
    for i, (name, budget, config, text_positions) in enumerate(configs):
        seqs.append(DecodeSeq(request_id=f"{name}-{budget}", num_prompt_tokens=0,
                              max_tokens=len(tokens), block_table=[], lease_deadline=0.0,
                              received=np.zeros((1, 1), bool), arrival=i, tokens=[tokens[0]]))
        evictions.append(None if config is None else StreamingEviction(
            config, model, pool, text_positions=text_positions))
    nll = np.zeros((len(configs), len(tokens) - 1))
    started = time.perf_counter()
    for t in range(len(tokens) - 1):
        for seq, eviction in zip(seqs, evictions):
            if eviction is not None:
                eviction.bound(seq)
            if len(seq.block_table) * BLOCK_SIZE <= seq.cache_position:
                seq.block_table += pool.allocator.alloc(1)
        rows = step_inputs(seqs, BLOCK_SIZE)
        logits = model.decode(torch.full((len(seqs),), tokens[t]), rows.positions, rows.slots,
                              rows.block_tables, pool, seq_lens=rows.seq_lens)
        nll[:, t] = -torch.log_softmax(logits.float(), dim=-1)[:, tokens[t + 1]].numpy()
        for seq in seqs:
            seq.tokens.append(tokens[t + 1])
        if t % 1024 == 1023:
            print(f"{t + 1} tokens, {time.perf_counter() - started:.0f} s", flush=True)
    return [{"config": name, "budget": budget,
             "perplexity": math.exp(float(nll[i].mean())),
             "perplexity_once_full": (math.exp(float(nll[i, budget:].mean())) if budget
                                      else None),
             "kept_blocks_at_end": len(seqs[i].block_table)}
            for i, (name, budget, _, _) in enumerate(configs)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if min(args.budgets) <= BLOCK_SIZE or any(b % BLOCK_SIZE for b in args.budgets):
        p.error(f"--budgets must be multiples of {BLOCK_SIZE} above it")
    torch.set_num_threads(args.threads)
    model_dir = bench_model(args.model)
    config = load_model_config(model_dir)
    if args.tokens > config.max_position_embeddings:
        p.error(f"--tokens past the model's context ({config.max_position_embeddings}): full "
                "attention would not fit")
    model = Transformer(config, get_attention_backend("torch", KERNEL_CACHE_DIR),
                        torch.float32, torch.device("cpu"))
    tokens = _text_tokens(model_dir, args.tokens)
    results = evaluate(model, tokens, args.budgets)
    full = results[0]["perplexity"]
    print(f"{'config':>15} {'budget':>7} {'perplexity':>11} {'once full':>10} {'/ full':>7}")
    for r in results:
        once = r["perplexity_once_full"]
        print(f"{r['config']:>15} {r['budget'] or '-':>7} {r['perplexity']:11.3f} "
              f"{once if once is None else round(once, 3)!s:>10} "
              f"{r['perplexity'] / full:7.3f}")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "results": results}, indent=1))


if __name__ == "__main__":
    main()
