"""Log probabilities on the in-process engine (kvferry/model/logprobs.py): the prompt's
(`prompt_logprobs`, computed chunk by chunk while prefilling), the first token's (sampled with
the prompt's last logits) and every decoded token's (`logprobs`), each equal to the log-softmax
of transformers' logits at its position, with the most likely tokens there; with n-gram
speculation, the accepted drafts' are read from their verification rows and equal those of
decoding one token a step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from decode_worker.engine import DecodeEngine
from decode_worker.sequence import FinishedEvent, TokensEvent
from kvferry.errors import InvalidArgument
from kvferry.model.config import load_model_config
from kvferry.model.logprobs import MAX_LOGPROBS, TokenLogprob, logprobs_of
from kvferry.model.sampling import SamplingParams
from kvferry.model.transformer import Transformer
from kvferry.settings import SpeculativeConfig
from kvferry_kernels.dispatch import get_attention_backend
from tests.decode_worker.engines import cpu_engine, run_to_idle
from tests.waiting import within

TOP = 3


def _served(engine: DecodeEngine, prompt: list[int], max_tokens: int, params: SamplingParams
            ) -> tuple[list[int], list[TokenLogprob], list[TokenLogprob]]:
    """One request prefilled on the engine and decoded to the end: its tokens, their log
    probabilities and the prompt's."""
    async def run() -> tuple[list[int], list[TokenLogprob], list[TokenLogprob]]:
        await engine.reserve("A", len(prompt), max_tokens, 60.0)
        done = await engine.prefill_local("A", prompt, params)
        queue = engine.attach("A", done.token_id, params, max_tokens - 1, [])
        tokens, logprobs = [done.token_id], list(done.logprobs)
        while not isinstance(event := await within(queue.get(), "the next update"),
                             FinishedEvent):
            assert isinstance(event, TokensEvent), event
            assert len(event.logprobs) == len(event.token_ids)
            tokens += event.token_ids
            logprobs += event.logprobs
        return tokens, logprobs, list(done.prompt_logprobs)

    return run_to_idle(engine, run)


def _reference(checkpoint: Path, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax [len(ids), V]: row i predicts the token after ids[i]."""
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def _assert_matches(got: list[TokenLogprob], tokens: list[int], want: torch.Tensor) -> None:
    """`got[i]` is token `tokens[i]`'s log probability under row `want[i]`, with its TOP most
    likely tokens in order."""
    assert len(got) == len(tokens) == want.shape[0]
    for lp, token, row in zip(got, tokens, want):
        assert lp.logprob == pytest.approx(row[token].item(), abs=1e-4)
        values, ids = torch.topk(row, TOP)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)


def _model(checkpoint: Path) -> Transformer:
    return Transformer(load_model_config(checkpoint), get_attention_backend("torch"),
                       torch.float32, torch.device("cpu"))


def test_prompt_and_generated_logprobs_are_transformers_log_softmax(
        qwen3_checkpoint: Path) -> None:
    """A 45-token prompt prefilled in chunks of 16 (prompt logprobs gathered across three
    forwards), then 12 greedy tokens at temperature 0.7's seed: each reported value is the
    model's own log-softmax at that position, not the sampling distribution's."""
    prompt = [5 + (i * 7) % 180 for i in range(45)]
    params = SamplingParams(temperature=0.7, seed=11, logprobs=TOP, prompt_logprobs=TOP)
    engine = cpu_engine(_model(qwen3_checkpoint), 16, 32, chunk_size=16)
    tokens, logprobs, prompt_logprobs = _served(engine, prompt, 12, params)
    want = _reference(qwen3_checkpoint, prompt + tokens)
    _assert_matches(prompt_logprobs, prompt[1:], want[:len(prompt) - 1])
    _assert_matches(logprobs, tokens, want[len(prompt) - 1:-1])


def test_speculated_tokens_report_what_one_token_a_step_reports(qwen3_checkpoint: Path
                                                                ) -> None:
    """With n-gram drafts (a repeating prompt: drafts are accepted), each kept token's log
    probability comes from the verification row that predicted it: the tokens and values of
    decoding without speculation."""
    prompt = [19 + (i * 5) % 11 for i in range(40)]
    params = SamplingParams(temperature=0.0, logprobs=TOP)
    model = _model(qwen3_checkpoint)
    plain = _served(cpu_engine(model, 16, 32), prompt, 40, params)
    engine = cpu_engine(model, 16, 32,
                        speculative=SpeculativeConfig("ngram", 3, 1, 2, is_adaptive=False))
    drafted = _served(engine, prompt, 40, params)
    assert engine.stats().spec_accepted_tokens > 0
    assert drafted[0] == plain[0]
    for got, want in zip(drafted[1], plain[1]):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]


def test_logprobs_of_checks_its_rows_and_bounds() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    got = logprobs_of(logits, [2, 1], 0)
    assert [lp.top for lp in got] == [(), ()]
    assert got[1].logprob == pytest.approx(torch.log_softmax(logits[1], -1)[1].item())
    with pytest.raises(ValueError):
        logprobs_of(logits, [2], 1)
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(InvalidArgument) as exc:
            SamplingParams(**{field: MAX_LOGPROBS + 1}).validate(3)  # type: ignore[arg-type]
        assert exc.value.field == f"sampling.{field}"
