"""A draft model's prompt K/V shipped by the prefill worker against recomputed on the decode
worker (`--speculative-draft-kv ship|recompute`), side by side, in one run.

Two disaggregated deployments of `--model` (router, prefill and decode worker, one torch
thread each; each decode worker pinned to the last core, the rest to the others; no prefix
caching, as every pass sends the same prompts), identical but for `--speculative-draft-kv`,
both drafting with `--speculative-method draft`. The draft is
the model's first `--draft-layers` layers and its own head (an early-exit draft, as LayerSkip
drafts: the default model has no smaller sibling with its tokenizer), so it shares the
tokenizer and drafts what the model would often say.

Per pass: `--streams` decode streams (short prompts, `--stream-tokens` greedy tokens, all
ignore_eos) start together; once they are decoding, `--arrivals` requests with long prompts
(`--arrival-prompt` tokens, 16 tokens out) arrive one after another, `--gap-s` apart. With
recompute, each arrival's first step on the decode worker prefills the draft over its whole
prompt inside the step that also advances the streams; with ship the prefill worker does it
and pushes the pages. Measured per pass: the streams' ITL p50 and p99 (gaps between the chunks
a stream receives), the arrivals' TTFT p50 and the bytes of K/V the prefill worker pushed
(its counter). Per repetition the sides run in ABBA order; reported median
[min-max] over repetitions, with ship / recompute paired by repetition. The rule the design
states: p99 ITL decides, unless TTFT is over 10% worse. Usage:

    .venv/bin/python bench/bench_draft_kv.py [--model default] [--repetitions 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script too
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "kernels"))
from deploy import client  # noqa: E402
from deploy.default_model import BENCH_MODEL_HELP, bench_model  # noqa: E402
from deploy.launcher import Deployment  # noqa: E402
from kvferry.model.config import load_model_config  # noqa: E402

SIDES = ("recompute", "ship")


def early_exit_draft(model: str, layers: int, out: Path) -> Path:
    """A checkpoint of `model`'s first `layers` layers (and its embeddings, final norm and
    head): its config with fewer layers beside links to its files."""
    source = Path(model)
    for path in source.iterdir():
        if path.name not in ("config.json", "manifest.json"):
            (out / path.name).symlink_to(path.resolve())
    config = json.loads((source / "config.json").read_text())
    if not 1 <= layers < config["num_hidden_layers"]:
        raise SystemExit(f"--draft-layers must be in [1, {config['num_hidden_layers']})")
    config["num_hidden_layers"] = layers
    if isinstance(config.get("layer_types"), list):  # one entry per layer
        config["layer_types"] = config["layer_types"][:layers]
    (out / "config.json").write_text(json.dumps(config))
    return out


def _prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (length,), generator=gen).tolist() for _ in range(count)]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _pushed_bytes(deployment: Deployment) -> float:
    """K/V bytes the deployment's prefill workers have pushed (their metrics)."""
    total = 0.0
    for process in deployment.processes:
        if process.name.startswith("prefill"):
            url = f"http://127.0.0.1:{process.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as resp:
                text = resp.read().decode()
            total += sum(s.value for family in text_string_to_metric_families(text)
                         for s in family.samples if s.name == "kvferry_kv_bytes_sent_total")
    return total


async def one_pass(address: str, streams: list[list[int]], arrivals: list[list[int]],
                   args: argparse.Namespace) -> dict[str, Any]:
    """The streams, with the arrivals coming in while they decode."""
    stream_requests = [client.make_request(p, temperature=0.0, max_tokens=args.stream_tokens,
                                           ignore_eos=True) for p in streams]
    running = [asyncio.ensure_future(client.generate(address, r, timeout_s=900))
               for r in stream_requests]
    await asyncio.sleep(args.lead_s)  # the streams are decoding
    arrived = []
    for prompt in arrivals:
        request = client.make_request(prompt, temperature=0.0, max_tokens=16, ignore_eos=True)
        arrived.append(asyncio.ensure_future(client.generate(address, request, timeout_s=900)))
        await asyncio.sleep(args.gap_s)
    done = await asyncio.gather(*running, *arrived)
    got_streams, got_arrivals = done[:len(running)], done[len(running):]
    gaps = [b - a for c in got_streams for a, b in zip(c.token_times_s, c.token_times_s[1:])]
    if any(len(c.token_ids) != args.stream_tokens for c in got_streams):
        raise SystemExit("a stream ended early")
    return {"itl_p50_ms": 1e3 * _percentile(gaps, 50), "itl_p99_ms": 1e3 * _percentile(gaps, 99),
            "ttft_p50_ms": 1e3 * statistics.median(c.ttft_s for c in got_arrivals),
            "outputs": [c.token_ids for c in done]}


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _fmt(s: dict[str, float], digits: int = 1) -> str:
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def _deployments(args: argparse.Namespace, model: str, draft: Path, stack: ExitStack
                 ) -> dict[str, Deployment]:
    out = {}
    cores = sorted(os.sched_getaffinity(0))
    for side in SIDES:
        out[side] = stack.enter_context(Deployment(
            model=model, torch_threads=1, worker_args=[
                "--speculative-method", "draft", "--speculative-model", str(draft),
                "--num-speculative-tokens", str(args.num_speculative_tokens),
                "--speculative-draft-kv", side, "--metrics-port", "0",
                # every pass the same prompts: no prefix cache, or only the first pass would
                # prefill (and ship) them
                "--no-prefix-caching"]))
        out[side].pin("decode", {cores[-1]})
        out[side].pin("router", set(cores[:-1]))
        out[side].pin("prefill", set(cores[:-1]))
    os.sched_setaffinity(0, set(cores[:-1]))
    return out


def _run(args: argparse.Namespace, sides: dict[str, Deployment], streams: list[list[int]],
         arrivals: list[list[int]]) -> list[dict[str, Any]]:
    reps = []
    for rep in range(args.repetitions):
        passes: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
        for side in (*SIDES, *reversed(SIDES)):  # ABBA
            before = _pushed_bytes(sides[side])
            result = asyncio.run(one_pass(sides[side].router_address, streams, arrivals, args))
            result["pushed_bytes"] = _pushed_bytes(sides[side]) - before
            passes[side].append(result)
        merged: dict[str, Any] = {}
        for side, (a, b) in passes.items():
            merged[side] = {k: (a[k] + b[k]) / 2 for k in
                            ("itl_p50_ms", "itl_p99_ms", "ttft_p50_ms", "pushed_bytes")}
        merged["outputs_equal"] = (passes["ship"][0]["outputs"] == passes["ship"][1]["outputs"]
                                   == passes["recompute"][0]["outputs"]
                                   == passes["recompute"][1]["outputs"])
        print(f"repetition {rep + 1}: " + "; ".join(
            f"{side} ITL p99 {merged[side]['itl_p99_ms']:.1f} ms, TTFT p50 "
            f"{merged[side]['ttft_p50_ms']:.1f} ms" for side in SIDES)
            + f"; outputs equal {merged['outputs_equal']}", flush=True)
        reps.append(merged)
    return reps


def report(reps: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for side in SIDES:
        out[side] = {k: _summary([r[side][k] for r in reps])
                     for k in ("itl_p50_ms", "itl_p99_ms", "ttft_p50_ms")}
        out[side]["pushed_bytes_per_pass"] = _summary([r[side]["pushed_bytes"] for r in reps])
    for k in ("itl_p50_ms", "itl_p99_ms", "ttft_p50_ms"):
        out[f"ship_over_recompute_{k}"] = _summary(
            [r["ship"][k] / r["recompute"][k] for r in reps])
    out["outputs_equal"] = all(r["outputs_equal"] for r in reps)
    itl = out["ship_over_recompute_itl_p99_ms"]["median"]
    ttft = out["ship_over_recompute_ttft_p50_ms"]["median"]
    out["choice"] = "ship" if itl < 1.0 and ttft <= 1.10 else "recompute"
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help=BENCH_MODEL_HELP)
    p.add_argument("--draft-layers", type=int, default=4)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=192)
    p.add_argument("--arrivals", type=int, default=3)
    p.add_argument("--arrival-prompt", type=int, default=1536)
    p.add_argument("--lead-s", type=float, default=2.0)
    p.add_argument("--gap-s", type=float, default=2.0)
    p.add_argument("--repetitions", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.repetitions < 3:
        p.error("--repetitions must be >= 3")
    model = bench_model(args.model)
    vocab = load_model_config(model).vocab_size
    streams = _prompts(vocab, args.streams, 64, seed=1)
    arrivals = _prompts(vocab, args.arrivals, args.arrival_prompt, seed=2)
    with ExitStack() as stack:
        draft = early_exit_draft(model, args.draft_layers,
                                 Path(stack.enter_context(tempfile.TemporaryDirectory())))
        sides = _deployments(args, model, draft, stack)
        for deployment in sides.values():  # warm-up: first-call costs stay out
            asyncio.run(one_pass(deployment.router_address, streams[:1], arrivals[:1],
                                 argparse.Namespace(**{**vars(args), "stream_tokens": 16,
                                                       "lead_s": 0.1, "gap_s": 0.1})))
        started = time.perf_counter()
        reps = _run(args, sides, streams, arrivals)
    summary = report(reps)
    for side in SIDES:
        s = summary[side]
        print(f"{side:>9}: ITL p50 {_fmt(s['itl_p50_ms'])} ms, p99 {_fmt(s['itl_p99_ms'])} ms,"
              f" arrivals' TTFT p50 {_fmt(s['ttft_p50_ms'])} ms, K/V pushed per pass "
              f"{_fmt({k: v / 2**20 for k, v in s['pushed_bytes_per_pass'].items()}, 2)} MiB")
    for k in ("itl_p50_ms", "itl_p99_ms", "ttft_p50_ms"):
        print(f"ship / recompute {k}: {_fmt(summary[f'ship_over_recompute_{k}'], 2)}")
    print(f"outputs equal: {summary['outputs_equal']}; choice: {summary['choice']} "
          f"({time.perf_counter() - started:.0f} s)")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "repetitions": reps, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
