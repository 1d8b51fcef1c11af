"""Structured output (kvferry/model/grammar.py) on the in-process engine, greedy, against an
oracle of its own: transformers' logits masked by an xgrammar matcher driven directly, token
by token. The engine's tokens equal the oracle's with the first token sampled by the prefill
and the rest by decode steps; with n-gram drafts (drafts the mask forbids rejected); on a
migrated leg that replays the earlier legs' tokens; and every answer matches its constraint.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
import torch
import xgrammar as xgr
from transformers import AutoModelForCausalLM, AutoTokenizer

from decode_worker.engine import DecodeEngine
from kvferry.errors import InvalidArgument
from kvferry.model.config import load_model_config
from kvferry.model.grammar import Constraint
from kvferry.model.sampling import SamplingParams
from kvferry.model.transformer import Transformer
from kvferry.settings import SpeculativeConfig
from kvferry_kernels.dispatch import get_attention_backend
from tests.decode_worker.engines import collect_tokens, cpu_engine, run_to_idle

SCHEMA = {"type": "object", "properties": {
    "name": {"enum": ["ada", "bob", "cy"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "ok": {"type": "boolean"}},
    "required": ["name", "age", "ok"], "additionalProperties": False}
JSON_SCHEMA = Constraint("json_schema", json.dumps(SCHEMA))
MAX_TOKENS = 48


def _prompt(checkpoint: Path) -> list[int]:
    """A prompt holding the kind of answer asked for, twice: n-gram drafts find it."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    example = '{"name": "bob", "age": 41, "ok": false}'
    return tokenizer.encode(f"Answer as JSON. {example} Again: {example} Now: ")


def _engine(checkpoint: Path, speculative: SpeculativeConfig | None = None) -> DecodeEngine:
    model = Transformer(load_model_config(checkpoint), get_attention_backend("torch"),
                        torch.float32, torch.device("cpu"))
    return cpu_engine(model, 16, 48, speculative=speculative)


def _oracle(checkpoint: Path, prompt: list[int], compile_with: str, spec: object) -> list[int]:
    """Greedy over transformers' logits, each row masked by xgrammar's matcher, to the end of
    the match (its stop token included) or MAX_TOKENS."""
    config = load_model_config(checkpoint)
    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(checkpoint),
                                              vocab_size=config.vocab_size,
                                              stop_token_ids=list(config.eos_token_ids))
    compiler = xgr.GrammarCompiler(info)
    compiled = (compiler.compile_json_schema(spec, any_whitespace=False)
                if compile_with == "json_schema" else getattr(compiler, compile_with)(spec))
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, config.vocab_size)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids, out = list(prompt), []
    for _ in range(MAX_TOKENS):
        with torch.no_grad():
            row = hf(torch.tensor([ids])).logits[0, -1:].float()
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(row, bitmask, vocab_size=config.vocab_size)
        token = int(row.argmax())
        out.append(token)
        if token in config.eos_token_ids:
            break
        assert matcher.accept_token(token)
        ids.append(token)
    return out


async def _generate(engine: DecodeEngine, request_id: str, prompt: list[int],
                    params: SamplingParams, num_generated: int = 0) -> list[int]:
    """One request prefilled here (colocated) and decoded to the end; `num_generated`: the
    prompt's last tokens are an earlier leg's outputs (a migration's new leg)."""
    left = MAX_TOKENS - num_generated
    await engine.reserve(request_id, len(prompt), left, 60.0, prompt)
    first, *_ = await engine.prefill_local(request_id, prompt, params, num_generated)
    queue = engine.attach(request_id, first, params, left - 1,
                          list(engine.model.config.eos_token_ids), num_generated=num_generated)
    return await collect_tokens(queue, request_id, [first])


def _greedy(constraint: Constraint) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, constraint=constraint)


def _answer(checkpoint: Path, tokens: list[int]) -> str:
    return AutoTokenizer.from_pretrained(checkpoint).decode(tokens, skip_special_tokens=True)


@pytest.mark.parametrize("speculative", [None, SpeculativeConfig("ngram", 3, 1, 2,
                                                                 is_adaptive=False)],
                         ids=["plain", "ngram"])
def test_a_json_schema_decodes_as_the_masked_oracle(speculative: SpeculativeConfig | None,
                                                    qwen3_checkpoint: Path) -> None:
    prompt = _prompt(qwen3_checkpoint)
    expected = _oracle(qwen3_checkpoint, prompt, "json_schema", json.dumps(SCHEMA))
    engine = _engine(qwen3_checkpoint, speculative)
    got = run_to_idle(engine, lambda: _generate(engine, "A", prompt, _greedy(JSON_SCHEMA)))
    assert got == expected
    answer = json.loads(_answer(qwen3_checkpoint, got))
    assert set(answer) == {"name", "age", "ok"} and answer["name"] in ("ada", "bob", "cy")
    assert 0 <= answer["age"] <= 120 and isinstance(answer["ok"], bool)
    if speculative is not None:
        assert engine.stats().spec_draft_tokens > 0


def test_unconstrained_greedy_is_not_json(qwen3_checkpoint: Path) -> None:
    """The mask is what makes the answers above JSON: the same prompt, unconstrained."""
    engine = _engine(qwen3_checkpoint)
    got = run_to_idle(engine, lambda: _generate(
        engine, "A", _prompt(qwen3_checkpoint), SamplingParams(temperature=0.0)))
    with pytest.raises(ValueError):
        json.loads(_answer(qwen3_checkpoint, got))


def test_a_migrated_leg_replays_the_earlier_tokens_into_its_matcher(qwen3_checkpoint: Path
                                                                    ) -> None:
    prompt = _prompt(qwen3_checkpoint)
    whole = _oracle(qwen3_checkpoint, prompt, "json_schema", json.dumps(SCHEMA))
    done = 5  # the first leg streamed these before its worker was lost
    engine = _engine(qwen3_checkpoint)
    rest = run_to_idle(engine, lambda: _generate(engine, "B", prompt + whole[:done],
                                                 _greedy(JSON_SCHEMA), num_generated=done))
    assert whole[:done] + rest == whole


@pytest.mark.parametrize("constraint, compile_with, spec", [
    (Constraint("regex", r"[a-c]{2}-\d{1,3}"), "compile_regex", r"[a-c]{2}-\d{1,3}"),
    (Constraint("choice", choices=("yes", "no", "maybe so")), "compile_grammar",
     'root ::= "yes" | "no" | "maybe so"'),
], ids=["regex", "choice"])
def test_regex_and_choice_decode_as_the_masked_oracle(constraint: Constraint,
                                                      compile_with: str, spec: str,
                                                      qwen3_checkpoint: Path) -> None:
    prompt = _prompt(qwen3_checkpoint)
    engine = _engine(qwen3_checkpoint)
    got = run_to_idle(engine, lambda: _generate(engine, "A", prompt, _greedy(constraint)))
    assert got == _oracle(qwen3_checkpoint, prompt, compile_with, spec)
    answer = _answer(qwen3_checkpoint, got)
    if constraint.kind == "regex":
        assert re.fullmatch(constraint.spec, answer), answer
    else:
        assert answer in constraint.choices


def test_a_bad_constraint_is_refused_naming_its_field_and_leaks_nothing(
        qwen3_checkpoint: Path) -> None:
    engine = _engine(qwen3_checkpoint)
    prompt = _prompt(qwen3_checkpoint)

    async def body() -> None:
        for constraint, message in [(Constraint("regex", "(("), "not closed"),
                                    (Constraint("grammar", "root ::= foo"), "not defined"),
                                    (Constraint("json_schema", "[1]"), "is an object")]:
            await engine.reserve("C", len(prompt), 8, 60.0, prompt)
            with pytest.raises(InvalidArgument, match=message) as refused:
                await engine.prefill_local("C", prompt, _greedy(constraint))
            assert refused.value.field == constraint.field
            engine.abort("C")
            await asyncio.sleep(0.05)

    run_to_idle(engine, body)
