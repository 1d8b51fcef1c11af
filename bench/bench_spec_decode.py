"""Speculative decoding (n-gram drafts) against plain decoding: decode tokens/s per request,
side by side, in one run.

Starts two deployments on `--model` (router + prefill + decode worker each, or one colocated
worker with --colocated), identical but for the decode side's `--speculative-method ngram
--num-speculative-tokens K`, and runs the same prompts on both, greedy (sampled: seeded),
ignore_eos (summary: without), `--max-tokens` tokens at most, `--concurrency` requests at a
time (1: one request alone on the worker, the case speculation is for). Workloads:

  copy:   answers that copy spans of their prompts. A passage of `--prompt-tokens` tokens of
          bench/data/coriolanus_opening.txt (a public-domain play), then the passage again up
          to its first 32 tokens: the model's continuation is the rest of the passage, as an
          edit or a quotation of a text given in the prompt is;
  summary: the same passages in the model's chat template, asked what happens in them: an
          answer in the model's own words, which reuses names and phrases of the prompt but
          rarely whole spans (drafts are made and often rejected: the case speculation must
          not slow down). Not ignore_eos: the answer ends where the model ends it;
  random: `--prompt-tokens` seeded uniform token ids. The continuation copies nothing from the
          prompt; small models fall into a loop after a while, which drafts then follow;
  sampled: the random prompts sampled at temperature 1 (seed per prompt): continuations that
          neither copy nor loop, so drafts are few and mostly rejected (the case speculation
          must not slow down). Seeded, so both sides' outputs are still equal.

Each prompt set has `--prompts` prompts. Per repetition and workload the sides run in ABBA
order (plain, speculative, speculative, plain), so a slow drift of the machine weighs on both.
A request's decode tokens/s is its tokens after the first over the time from its first token
to its last, as the client sees them; a side's figure is the tokens over the time, summed over
its requests. Reported per workload, median [min-max] over repetitions: each side's decode
tokens/s, the ratio speculative / plain within each repetition, the acceptance rate (accepted
over drafted tokens, from each request's Usage) and the tokens a verification step yields
(decode tokens over decode steps; plain decoding: 1). The outputs of both sides are compared
token for token (greedy or seeded: they must be equal). Usage:

    .venv/bin/python bench/bench_spec_decode.py [--model tiny|default|PATH]
        [--workloads copy random] [--num-speculative-tokens 4] [--max-tokens 256]
        [--repetitions 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script too
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "kernels"))
from deploy import client  # noqa: E402
from deploy.default_model import BENCH_MODEL_HELP, bench_model  # noqa: E402
from deploy.launcher import Deployment  # noqa: E402
from kvferry.model.gguf import ensure_converted, is_gguf  # noqa: E402

TEXT = Path(__file__).resolve().parent / "data" / "coriolanus_opening.txt"
COPY_CUE_TOKENS = 32  # the repeat starts with this much of the passage
WORKLOADS = ("copy", "summary", "random", "sampled")
IGNORE_EOS = {"copy": True, "summary": False, "random": True, "sampled": True}
TEMPERATURE = {"sampled": 1.0}  # greedy otherwise


def _tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    directory = ensure_converted(model) if is_gguf(model) else Path(model)
    return AutoTokenizer.from_pretrained(directory)


def copy_prompts(tokenizer: Any, count: int, prompt_tokens: int) -> list[list[int]]:
    """`count` passages of `prompt_tokens` tokens spread over the text, each followed by
    its own first COPY_CUE_TOKENS tokens."""
    ids = tokenizer(TEXT.read_text(), add_special_tokens=False)["input_ids"]
    if len(ids) < prompt_tokens:
        raise SystemExit(f"--prompt-tokens: the text has only {len(ids)} tokens")
    stride = (len(ids) - prompt_tokens) // max(1, count - 1)
    passages = [ids[i * stride: i * stride + prompt_tokens] for i in range(count)]
    return [p + p[:COPY_CUE_TOKENS] for p in passages]


def summary_prompts(tokenizer: Any, count: int, prompt_tokens: int) -> list[list[int]]:
    """The copy workload's passages in the chat template, asked what happens in them."""
    out = []
    for passage in copy_prompts(tokenizer, count, prompt_tokens):
        text = tokenizer.decode(passage[:prompt_tokens])
        messages = [{"role": "user", "content": f"{text}\n\nWhat happens in this scene? "
                                                "Answer in your own words."}]
        out.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True, return_dict=False))
    return out


def random_prompts(vocab_size: int, count: int, prompt_tokens: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(1, vocab_size, (prompt_tokens,), generator=gen).tolist()
            for _ in range(count)]


async def run_side(address: str, prompts: Sequence[list[int]], max_tokens: int,
                   concurrency: int, ignore_eos: bool = True, temperature: float = 0.0
                   ) -> dict[str, Any]:
    """Every prompt once, `concurrency` at a time: tokens, decode time and speculation."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)
    outputs: list[list[int]] = [[] for _ in prompts]
    totals = {"decode_tokens": 0, "decode_s": 0.0, "draft_tokens": 0, "accepted_tokens": 0}

    async def worker() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            request = client.make_request(prompts[i], temperature=temperature, seed=i,
                                          max_tokens=max_tokens, ignore_eos=ignore_eos)
            got = await client.generate(address, request, timeout_s=900)
            if got.finished is None or len(got.token_ids) < 2 or (
                    ignore_eos and len(got.token_ids) != max_tokens):
                raise SystemExit(f"request {i}: {len(got.token_ids)} tokens, "
                                 f"{client.finish_reason_name(got.finished)}")
            outputs[i] = got.token_ids
            totals["decode_tokens"] += len(got.token_ids) - 1
            totals["decode_s"] += got.token_times_s[-1] - got.ttft_s
            totals["draft_tokens"] += got.finished.usage.num_draft_tokens
            totals["accepted_tokens"] += got.finished.usage.num_accepted_tokens

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {**totals, "decode_tokens_per_s": totals["decode_tokens"] / totals["decode_s"],
            "outputs": outputs}


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """One side's two passes (ABBA) as one figure: tokens over time, summed."""
    keys = ("decode_tokens", "decode_s", "draft_tokens", "accepted_tokens")
    out: dict[str, Any] = {k: a[k] + b[k] for k in keys}
    out["decode_tokens_per_s"] = out["decode_tokens"] / out["decode_s"]
    out["acceptance_rate"] = (out["accepted_tokens"] / out["draft_tokens"]
                              if out["draft_tokens"] else 0.0)
    # Each decode step yields its accepted drafts and one more token.
    out["tokens_per_step"] = out["decode_tokens"] / (out["decode_tokens"]
                                                     - out["accepted_tokens"])
    out["passes_equal"] = a["outputs"] == b["outputs"]
    out["outputs"] = a["outputs"]
    return out


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _fmt(s: dict[str, float], digits: int = 2) -> str:
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def report(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per workload: each side's decode tok/s, the ratio within each repetition, the
    speculative side's acceptance, and whether every output matched."""
    out: dict[str, Any] = {}
    for workload, reps in runs.items():
        out[workload] = {
            "plain_tokens_per_s": _summary([r["plain"]["decode_tokens_per_s"] for r in reps]),
            "spec_tokens_per_s": _summary([r["spec"]["decode_tokens_per_s"] for r in reps]),
            "ratio": _summary([r["spec"]["decode_tokens_per_s"]
                               / r["plain"]["decode_tokens_per_s"] for r in reps]),
            "acceptance_rate": _summary([r["spec"]["acceptance_rate"] for r in reps]),
            "tokens_per_step": _summary([r["spec"]["tokens_per_step"] for r in reps]),
            "outputs_equal": all(r["outputs_equal"] for r in reps),
        }
    return out


def _print(summary: dict[str, Any]) -> None:
    print(f"{'workload':>8} {'plain tok/s':>22} {'ngram tok/s':>22} {'ratio':>20} "
          f"{'acceptance':>20} {'tokens/step':>20} {'outputs equal':>14}")
    for workload, s in summary.items():
        print(f"{workload:>8} {_fmt(s['plain_tokens_per_s'], 1):>22} "
              f"{_fmt(s['spec_tokens_per_s'], 1):>22} {_fmt(s['ratio']):>20} "
              f"{_fmt(s['acceptance_rate']):>20} {_fmt(s['tokens_per_step']):>20} "
              f"{str(s['outputs_equal']):>14}")


def _deployments(args: argparse.Namespace, model: str, stack: ExitStack
                 ) -> dict[str, Deployment]:
    spec = ["--speculative-method", "ngram", "--num-speculative-tokens",
            str(args.num_speculative_tokens)]
    sides = {"plain": [], "spec": spec}
    out = {}
    for side, worker_args in sides.items():
        out[side] = stack.enter_context(Deployment(
            model=model, is_colocated=args.colocated, torch_threads=args.torch_threads,
            worker_args=[*worker_args, *args.worker_args]))
        if args.pin_decode:  # both decode workers on the last core: one runs at a time
            cores = sorted(os.sched_getaffinity(0))
            out[side].pin("colocated" if args.colocated else "decode", {cores[-1]})
            for role in ("router",) if args.colocated else ("router", "prefill"):
                out[side].pin(role, set(cores[:-1]))
    if args.pin_decode:
        os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:-1]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help=BENCH_MODEL_HELP)
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=8, help="per workload")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--colocated", action="store_true")
    parser.add_argument("--torch-threads", type=int, default=1, help="per worker process")
    parser.add_argument("--pin-decode", action="store_true",
                        help="pin each decode worker to the last core, the rest elsewhere")
    parser.add_argument("--worker-args", default="",
                        help="extra flags for every worker of both deployments (one string)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.worker_args = args.worker_args.split()
    model = bench_model(args.model)
    tokenizer = _tokenizer(model)
    prompts = {"copy": copy_prompts(tokenizer, args.prompts, args.prompt_tokens),
               "summary": summary_prompts(tokenizer, args.prompts, args.prompt_tokens),
               "random": random_prompts(len(tokenizer), args.prompts, args.prompt_tokens)}
    prompts["sampled"] = prompts["random"]
    runs: dict[str, list[dict[str, Any]]] = {w: [] for w in args.workloads}
    with ExitStack() as stack:
        sides = _deployments(args, model, stack)
        for deployment in sides.values():  # warm-up: first-call costs stay out
            asyncio.run(run_side(deployment.router_address, prompts[args.workloads[0]][:1],
                                 16, 1))
        for rep in range(args.repetitions):
            for workload in args.workloads:
                passes = {side: [] for side in sides}
                for side in ("plain", "spec", "spec", "plain"):
                    passes[side].append(asyncio.run(run_side(
                        sides[side].router_address, prompts[workload], args.max_tokens,
                        args.concurrency, IGNORE_EOS[workload],
                        TEMPERATURE.get(workload, 0.0))))
                merged = {side: _merge(*p) for side, p in passes.items()}
                merged["outputs_equal"] = (merged["plain"]["outputs"]
                                           == merged["spec"]["outputs"]
                                           and merged["plain"]["passes_equal"]
                                           and merged["spec"]["passes_equal"])
                ratio = (merged["spec"]["decode_tokens_per_s"]
                         / merged["plain"]["decode_tokens_per_s"])
                print(f"repetition {rep + 1} {workload}: plain "
                      f"{merged['plain']['decode_tokens_per_s']:.1f} tok/s, ngram "
                      f"{merged['spec']['decode_tokens_per_s']:.1f} tok/s ({ratio:.2f}x), "
                      f"acceptance {merged['spec']['acceptance_rate']:.2f}, outputs equal "
                      f"{merged['outputs_equal']}", flush=True)
                for side in ("plain", "spec"):
                    merged[side].pop("outputs")
                runs[workload].append(merged)
    summary = report(runs)
    _print(summary)
    if args.out:
        args.out.write_text(json.dumps({
            "machine": platform.machine(), "cpus": os.cpu_count(), "model": Path(model).name,
            "colocated": args.colocated, "concurrency": args.concurrency,
            "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_tokens": args.prompt_tokens, "prompts": args.prompts,
            "max_tokens": args.max_tokens, "worker_args": args.worker_args,
            "summary": summary, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
