"""Perplexity under K/V eviction: what the model still predicts when a sequence keeps only part
of its K/V (docs/kv-eviction-design.md 3.6), on the real default model, in one run.

The text is bench/data/coriolanus_long.txt (the opening of Shakespeare's Coriolanus, public
domain), its first `--tokens` tokens (8,192: the model's whole context, so full attention fits).
Every configuration is a sequence fed the text one token at a time through the decode step
(`Transformer.decode` over the paged pool, the C kernel on CPU), teacher forcing: at each step
the negative log-likelihood of the next token of the text; a sequence's K/V is bounded before
each step by the worker's own eviction code (`kvferry/model/eviction.py`). All configurations
run together as one decode batch. Configurations, at each budget of `--budgets` tokens (block
size 16):
  full:            nothing evicted (the reference);
  window:          the last `budget` tokens only (no sinks): StreamingLLM's failing baseline;
  streaming:       sinks (the first block: 16 tokens, `--kv-sink-tokens 4` rounded up to a
                   block) and the last `budget - 16` tokens, positions within the cache (what
                   `--kv-eviction streaming` runs);
  streaming-text:  the same tokens kept, each at the position it was written at (the sinks'
                   distance to the query then grows past anything the window shows);
  h2o:             heavy hitters over whole blocks (what `--kv-eviction h2o` runs): the
                   last `budget / 2` tokens and the `budget / 2` tokens' worth of older
                   blocks that drew the most attention so far (summed over heads and layers,
                   from the attention kernels), positions those of the text;
  h2o-token:       the same at block size 1, run as a batch of its own: token-level
                   heavy hitters (what compaction inside blocks would buy), against which
                   the block-level choice is measured.
Printed: perplexity over all predicted tokens and over those predicted once the budget was
full (where eviction acts), per configuration. Retrieval (`--sections retrieval`): a fact ("the
secret code of NAME is NNNN") planted after the play's first `--plant-at` tokens (64: past
the sinks)
and asked about after `--filler` tokens of it, for 6 seeded names; a fact counts as retrieved
when every token of its code is the model's argmax (teacher forced), per configuration (no
text-positions row). Deterministic: one run (no timing reported). Usage:

    .venv/bin/python bench/bench_kv_eviction.py [--tokens 8192] [--budgets 256 512 1024]
        [--sections perplexity retrieval] [--configs full window streaming ...]
        [--filler 1500] [--out FILE]
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
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "kernels"))
from decode_worker.receipt import KvReceipt  # noqa: E402
from decode_worker.sequence import DecodeSeq, step_inputs  # noqa: E402
from deploy.default_model import bench_model  # noqa: E402
from kvferry.cache.budget import blocks_for_tokens  # noqa: E402
from kvferry.cache.pool import KvPool  # noqa: E402
from kvferry.model.config import load_model_config  # noqa: E402
from kvferry.model.eviction import StreamingEviction, make_eviction  # noqa: E402
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


CONFIGS = ("full", "window", "streaming", "streaming-text", "h2o", "h2o-token")
TOKEN_LEVEL = "h2o-token"  # run at block size 1


def _configs(budgets: list[int], names: tuple[str, ...] = CONFIGS
             ) -> list[tuple[str, int, KvEvictionConfig | None, bool]]:
    """(name, budget, eviction config or None, text positions), those named in `names`."""
    out: list[tuple[str, int, KvEvictionConfig | None, bool]] = [("full", 0, None, False)]
    for budget in budgets:
        window = KvEvictionConfig("streaming", sink_tokens=0, window_tokens=budget)
        sinks = KvEvictionConfig("streaming", sink_tokens=SINK_TOKENS,
                                 window_tokens=budget - BLOCK_SIZE)
        h2o = KvEvictionConfig("h2o", heavy_tokens=budget // 2, recent_tokens=budget // 2)
        out += [("window", budget, window, False), ("streaming", budget, sinks, False),
                ("streaming-text", budget, sinks, True), ("h2o", budget, h2o, False),
                (TOKEN_LEVEL, budget, h2o, False)]
    return [c for c in out if c[0] in names]


Stream = tuple[str, list[int], KvEvictionConfig | None, bool]


def teacher_forced(model: Transformer, streams: list[Stream], progress: bool = False
                   ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each stream (name, tokens, eviction config or None, text positions) fed its tokens one
    at a time, all streams as one decode batch (a stream leaves it at its end), token-level
    ones (block size 1) as a batch of their own; per stream the negative log-likelihood of
    each next token and whether it was the argmax."""
    token_level = [i for i, s in enumerate(streams) if s[0] == TOKEN_LEVEL]
    blocked = [i for i in range(len(streams)) if i not in token_level]
    out: list[tuple[np.ndarray, np.ndarray]] = [(np.zeros(0), np.zeros(0, bool))] * len(streams)
    for indices, block_size in ((blocked, BLOCK_SIZE), (token_level, 1)):
        if indices:
            runs = _teacher_forced([streams[i] for i in indices], model, block_size, progress)
            for i, run in zip(indices, runs):
                out[i] = run
    return out


def _teacher_forced(streams: list[Stream], model: Transformer, block_size: int,
                    progress: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    cfg = model.config
    blocks = sum(blocks_for_tokens(len(toks), block_size) if c is None
                 else c.budget_blocks(block_size) + 1 for _, toks, c, _ in streams)
    pool = KvPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, blocks,
                  torch.float32, model.device, prefix_caching=False)
    seqs, evictions, out = [], [], []
    for i, (name, toks, config, text_positions) in enumerate(streams):
        seqs.append(DecodeSeq(request_id=f"{name}-{i}", num_prompt_tokens=0,
                              max_tokens=len(toks), block_table=[], lease_deadline=0.0,
                              receipt=KvReceipt(np.zeros((1, 1), bool)), arrival=i,
                              tokens=[toks[0]]))
        evictions.append(StreamingEviction(config, model, pool, text_positions=True)
                         if config is not None and text_positions
                         else make_eviction(config, model, pool))
        out.append((np.zeros(len(toks) - 1), np.zeros(len(toks) - 1, bool)))
    started = time.perf_counter()
    for t in range(max(len(toks) for _, toks, _, _ in streams) - 1):
        live = [i for i, (_, toks, _, _) in enumerate(streams) if t < len(toks) - 1]
        for i in live:
            if evictions[i] is not None:
                evictions[i].bound(seqs[i])
            if len(seqs[i].block_table) * block_size <= seqs[i].cache_position:
                seqs[i].block_table += pool.allocator.alloc(1)
        rows = step_inputs([seqs[i] for i in live], block_size)
        fed = torch.tensor([streams[i][1][t] for i in live])
        mass = (torch.zeros(len(live), rows.block_tables.shape[1] * block_size)
                if any(evictions[i] is not None and evictions[i].wants_mass for i in live)
                else None)
        logits = model.decode(fed, rows.positions, rows.slots, rows.block_tables, pool,
                              seq_lens=rows.seq_lens, mass=mass).float()
        for row, i in enumerate(live):
            if mass is not None and evictions[i] is not None:
                evictions[i].observe([seqs[i]], mass[row:row + 1])
        logp = torch.log_softmax(logits, dim=-1)
        best = logits.argmax(dim=-1).tolist()
        for row, i in enumerate(live):
            nxt = streams[i][1][t + 1]
            out[i][0][t] = -float(logp[row, nxt])
            out[i][1][t] = best[row] == nxt
            seqs[i].tokens.append(nxt)
        if progress and t % 1024 == 1023:
            print(f"{t + 1} tokens, {time.perf_counter() - started:.0f} s", flush=True)
    return out


def evaluate(model: Transformer, tokens: list[int], budgets: list[int],
             names: tuple[str, ...] = CONFIGS) -> list[dict]:
    """Perplexity of each configuration over `tokens`."""
    configs = _configs(budgets, names)
    runs = teacher_forced(model, [(n, tokens, c, tp) for n, _, c, tp in configs],
                          progress=True)
    return [{"config": name, "budget": budget,
             "perplexity": math.exp(float(nll.mean())),
             "perplexity_once_full": (math.exp(float(nll[budget:].mean())) if budget
                                      else None)}
            for (name, budget, _, _), (nll, _) in zip(configs, runs)]


NAMES = ("Ada", "Basil", "Clara", "Dorian", "Elsa", "Felix")


def retrieval(model: Transformer, model_dir: str, filler: int, budgets: list[int],
              names: tuple[str, ...] = CONFIGS, plant_at: int = 64) -> list[dict]:
    """A fact planted after the play's first 64 tokens (past the sink block) and before the
    rest of `filler` tokens of it, asked about after them: per
    configuration, the facts whose answer (a 4-digit code) the model predicts token for
    token (greedy, teacher forced) out of len(NAMES)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    play = _text_tokens(model_dir, filler)
    gen = torch.Generator().manual_seed(11)
    cases = []  # (prompt tokens, answer tokens)
    for name in NAMES:
        code = int(torch.randint(1000, 10000, (1,), generator=gen))
        head = tokenizer(f"Remember this: the secret code of {name} is {code}.\n\n")["input_ids"]
        ask = tokenizer(f"\n\nQuestion: what is the secret code of {name}?\nAnswer: the "
                        f"secret code of {name} is")["input_ids"]
        # past the sinks: only a window (or a heavy hitter) can keep it
        cases.append((play[:plant_at] + head + play[plant_at:] + ask,
                       tokenizer(f" {code}")["input_ids"]))
    configs = [c for c in _configs(budgets, names) if c[0] != "streaming-text"]
    runs = teacher_forced(model, [(name, prompt + answer, config, text_positions)
                                  for name, _, config, text_positions in configs
                                  for prompt, answer in cases])
    out = []
    for k, (name, budget, _, _) in enumerate(configs):
        hits = sum(bool(runs[k * len(cases) + j][1][-len(answer):].all())
                   for j, (_, answer) in enumerate(cases))
        out.append({"config": name, "budget": budget, "retrieved": hits, "of": len(cases),
                    "prompt_tokens": len(cases[0][0]), "plant_at": plant_at})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sections", nargs="+", choices=("perplexity", "retrieval"),
                   default=["perplexity", "retrieval"])
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS),
                   help="the configurations run (full is the reference the ratios need)")
    p.add_argument("--plant-at", type=int, default=64,
                   help="retrieval: tokens of the play before the fact")
    p.add_argument("--filler", type=int, default=1500,
                   help="retrieval: tokens of the play between the fact and the question")
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
    report: dict[str, object] = {"args": {k: str(v) for k, v in vars(args).items()}}
    if "perplexity" in args.sections:
        results = evaluate(model, _text_tokens(model_dir, args.tokens), args.budgets,
                           tuple(args.configs))
        full = next((r["perplexity"] for r in results if r["config"] == "full"), math.nan)
        print(f"{'config':>15} {'budget':>7} {'perplexity':>11} {'once full':>10} "
              f"{'/ full':>7}")
        for r in results:
            once = r["perplexity_once_full"]
            print(f"{r['config']:>15} {r['budget'] or '-':>7} {r['perplexity']:11.3f} "
                  f"{once if once is None else round(once, 3)!s:>10} "
                  f"{r['perplexity'] / full:7.3f}")
        report["results"] = results
    if "retrieval" in args.sections:
        found = retrieval(model, model_dir, args.filler, args.budgets, tuple(args.configs),
                          args.plant_at)
        for r in found:
            print(f"retrieval {r['config']:>10} {r['budget'] or '-':>6}: {r['retrieved']} of "
                  f"{r['of']} ({r['prompt_tokens']}-token prompts)")
        report["retrieval"] = found
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
