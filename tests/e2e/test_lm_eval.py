"""lm-evaluation-harness (`lm-eval`, PyPI) against kvferry: its `local-completions` model
(the OpenAI API: token-id prompts, `echo` and `logprobs` for every loglikelihood) on the
deployment's HTTP front gives, item by item, the loglikelihoods its `hf` model computes with
transformers on the same checkpoint (within 1e-3), the same greedy verdicts and the same
scores, on two small tasks whose data the test ships (tests/e2e/lm_eval_tasks): a
multiple-choice one, and a loglikelihood one whose accuracy reads `top_logprobs` (is the
target the greedy continuation; half the targets are the model's own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from deploy.launcher import Deployment

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ITEMS = REPO / "tests" / "e2e" / "lm_eval_tasks" / "items.jsonl"
SIZES = {"kvferry_tiny_choice": 10, "kvferry_tiny_greedy": 20}
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}


def _evaluate(tmp_path: Path, model: str, model_args: str) -> dict:
    out = tmp_path / f"{model}.json"
    run = subprocess.run([sys.executable, "-m", "tests.e2e.lm_eval_tasks.run", str(out), model,
                          model_args, str(tmp_path / "greedy.jsonl")], cwd=REPO,
                         env={**os.environ, **OFFLINE},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text())


def _write_greedy_items(checkpoint: Path, path: Path) -> None:
    """The shipped questions, each twice: once with a choice as its target, once with the
    model's own greedy continuation (two tokens), so that some targets are greedy."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    lines = []
    for line in (ITEMS).read_text().splitlines():
        item = json.loads(line)
        ids = tokenizer.encode(item["question"], return_tensors="pt")
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=2)
        greedy = tokenizer.decode(out[0, ids.shape[1]:])  # may not encode back the same
        for target in (" " + item["choices"][item["answer"]], greedy):
            lines.append(json.dumps({"question": item["question"], "target": target}))
    path.write_text("\n".join(lines) + "\n")


def test_local_completions_scores_as_transformers(chat_checkpoint: Path,
                                                  chat_deployment: Deployment,
                                                  tmp_path: Path) -> None:
    _write_greedy_items(chat_checkpoint, tmp_path / "greedy.jsonl")
    hf = _evaluate(tmp_path, "hf", f"pretrained={chat_checkpoint},dtype=float32")
    served = _evaluate(tmp_path, "local-completions", ",".join([
        f"base_url=http://{chat_deployment.http_address}/v1/completions",
        "model=tiny-chat", f"tokenizer={chat_checkpoint}", "tokenizer_backend=huggingface",
        "tokenized_requests=True", "num_concurrent=1", "max_retries=1"]))
    assert hf["responses"].keys() == served["responses"].keys() == {
        "kvferry_tiny_choice", "kvferry_tiny_greedy"}
    for task, items in hf["responses"].items():
        assert len(items) == len(served["responses"][task]) == SIZES[task]
        for want, got in zip(items, served["responses"][task]):
            assert [g for _, g in got] == [g for _, g in want], task
            assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in want], abs=1e-3)
    for task, metrics in hf["metrics"].items():
        scores = {k: v for k, v in metrics.items() if k.startswith("acc")}
        assert scores and scores == {k: served["metrics"][task][k] for k in scores}
    assert hf["metrics"]["kvferry_tiny_greedy"]["acc,none"] > 0  # some targets are greedy
