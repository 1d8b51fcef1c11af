"""Penalties and biases (kvferry/model/penalties.py) on the in-process engine, greedy, against
transformers: `repetition_penalty` as its RepetitionPenaltyLogitsProcessor (`generate`'s
repetition_penalty), `logit_bias` as its SequenceBiasLogitsProcessor on single tokens, and
`presence_penalty` / `frequency_penalty` (which transformers lacks) as a greedy loop over
its logits applying the OpenAI API's formula; with n-gram drafts verified against the same
penalized rows, the tokens of decoding without them; a migrated leg counts the earlier legs'
tokens as output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from decode_worker.engine import DecodeEngine
from kvferry.model.config import load_model_config
from kvferry.model.penalties import History, penalize
from kvferry.model.sampling import SamplingParams
from kvferry.model.transformer import Transformer
from kvferry.settings import SpeculativeConfig
from kvferry_kernels.dispatch import get_attention_backend
from tests.decode_worker.engines import cpu_engine, run_to_idle, serve_local

PROMPT = [19 + (i * 5) % 11 for i in range(30)]  # repeats: penalties bite, drafts are found
MAX_TOKENS = 24


def _model(checkpoint: Path) -> Transformer:
    return Transformer(load_model_config(checkpoint), get_attention_backend("torch"),
                       torch.float32, torch.device("cpu"))


def _hf(checkpoint: Path) -> AutoModelForCausalLM:
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def _served(engine: DecodeEngine, params: SamplingParams) -> list[int]:
    """Greedy tokens of one request whose Reserve carried its prompt (penalties read it)."""
    from tests.decode_worker.engines import generate_local

    return run_to_idle(engine, lambda: generate_local(engine, "A", PROMPT, MAX_TOKENS, params))


def _hf_generate(checkpoint: Path, **options: object) -> list[int]:
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = _hf(checkpoint).generate(ids, attention_mask=torch.ones_like(ids),
                                       do_sample=False, max_new_tokens=MAX_TOKENS,
                                       min_new_tokens=MAX_TOKENS, **options)
    return out[0, len(PROMPT):].tolist()


def test_repetition_penalty_and_logit_bias_decode_as_transformers(qwen3_checkpoint: Path
                                                                  ) -> None:
    model = _model(qwen3_checkpoint)
    plain = serve_local(cpu_engine(model, 16, 32), PROMPT, MAX_TOKENS)[0]
    repeated = _served(cpu_engine(model, 16, 32), SamplingParams(
        temperature=0.0, repetition_penalty=1.5, ignore_eos=True))
    assert repeated == _hf_generate(qwen3_checkpoint, repetition_penalty=1.5)
    assert repeated != plain
    banned, favoured = plain[0], plain[3]
    bias = ((banned, -100.0), (favoured, 7.5))
    biased = _served(cpu_engine(model, 16, 32), SamplingParams(
        temperature=0.0, logit_bias=bias, ignore_eos=True))
    assert biased == _hf_generate(qwen3_checkpoint, sequence_bias={
        (banned,): -100.0, (favoured,): 7.5})
    assert banned not in biased


def _openai_greedy(checkpoint: Path, presence: float, frequency: float) -> list[int]:
    """Greedy decoding over transformers' logits, each row penalized by the OpenAI formula:
    logit - frequency * count - presence * (count > 0), counts over the output so far."""
    hf, ids, out = _hf(checkpoint), list(PROMPT), []
    for _ in range(MAX_TOKENS):
        with torch.no_grad():
            row = hf(torch.tensor([ids])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(out, dtype=torch.int64),
                                minlength=row.shape[0])[:row.shape[0]]
        token = int((row - frequency * counts - presence * (counts > 0)).argmax())
        out.append(token)
        ids.append(token)
    return out


@pytest.mark.parametrize("speculative", [None, SpeculativeConfig("ngram", 3, 1, 2,
                                                                 is_adaptive=False)],
                         ids=["plain", "ngram"])
def test_presence_and_frequency_penalties_follow_the_openai_formula(
        speculative: SpeculativeConfig | None, qwen3_checkpoint: Path) -> None:
    engine = cpu_engine(_model(qwen3_checkpoint), 16, 32, speculative=speculative)
    got = _served(engine, SamplingParams(temperature=0.0, presence_penalty=0.8,
                                         frequency_penalty=0.6, ignore_eos=True))
    assert got == _openai_greedy(qwen3_checkpoint, 0.8, 0.6)
    if speculative is not None:
        assert engine.stats().spec_draft_tokens > 0


def test_penalize_reads_prompt_and_output_as_each_rule_says() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    history = History(prompt=[0], output=[1, 1, 2])
    out = penalize(logits, history, presence=0.5, frequency=0.25, repetition=2.0,
                   bias=((3, 1.0),))
    # 0: prompt only, repetition halves it; 1: output twice, repetition doubles the
    # negative, then 2 x 0.25 + 0.5; 2: once, 1 / 2 - 0.25 - 0.5; 3: biased only
    assert out.tolist() == pytest.approx([1.0, -4.0 - 0.5 - 0.5, 0.5 - 0.25 - 0.5, 1.5])
    assert logits.tolist() == [2.0, -2.0, 1.0, 0.5]  # a new tensor


def test_a_migrated_leg_counts_earlier_legs_tokens_as_output() -> None:
    from decode_worker.receipt import KvReceipt
    from decode_worker.sequence import DecodeSeq
    from kvferry.model.prefill_batch import PrefillJob

    context = [1, 2, 3, 40, 41]  # a prompt of 3, then 2 tokens an earlier leg streamed
    seq = DecodeSeq("r", len(context), 8, [], 0.0, KvReceipt(np.zeros((1, 1), bool)), 0,
                    output_offset=2,
                    prompt_token_ids=context, tokens=[42, 43])
    assert seq.history() == History([1, 2, 3], [40, 41, 42, 43])
    job = PrefillJob("r", context, SamplingParams(), [], None, output_index=2)  # type: ignore[arg-type]
    assert job.history() == History([1, 2, 3], [40, 41])
