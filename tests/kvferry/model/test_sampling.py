from __future__ import annotations

import math

import pytest
import torch

from kvferry.errors import InvalidArgument
from kvferry.model.sampling import SamplingParams, sample_tokens


def _logits() -> torch.Tensor:
    return torch.randn(4, 50, generator=torch.Generator().manual_seed(3))


def test_greedy_is_argmax() -> None:
    logits = _logits()
    params = [SamplingParams(temperature=0.0)] * 4
    assert sample_tokens(logits, params, [0] * 4) == logits.argmax(-1).tolist()


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = _logits()
    argmax = logits.argmax(-1).tolist()
    assert sample_tokens(logits, [SamplingParams(top_k=1)] * 4, [0] * 4) == argmax
    assert sample_tokens(logits, [SamplingParams(top_p=1e-6)] * 4, [0] * 4) == argmax


@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 1e-30])
def test_tiny_temperature_is_greedy_not_nan(temperature: float) -> None:
    logits = _logits() * 100
    params = [SamplingParams(temperature=temperature, seed=5)] * 4
    assert sample_tokens(logits, params, [0] * 4) == logits.argmax(-1).tolist()


def test_seeded_sampling_depends_only_on_seed_and_position() -> None:
    logits = _logits()
    params = SamplingParams(temperature=2.0, seed=1234)
    draws = [sample_tokens(logits[:1], [params], [i])[0] for i in range(30)]
    again = [sample_tokens(logits[:1], [params], [i])[0] for i in range(30)]
    assert draws == again
    # Same row inside a different batch, same position: same token.
    batch = sample_tokens(logits, [SamplingParams(temperature=0.0)] * 3 + [params],
                          [0, 0, 0, 5])
    single = sample_tokens(logits[3:4], [params], [5])
    assert batch[3] == single[0]
    other = [sample_tokens(logits[:1], [SamplingParams(temperature=2.0, seed=99)], [i])[0]
             for i in range(30)]
    assert other != draws


def test_top_k_restricts_the_support() -> None:
    logits = _logits()[0:1]
    allowed = set(torch.topk(logits[0], 3).indices.tolist())
    for i in range(40):
        token = sample_tokens(logits, [SamplingParams(temperature=5.0, top_k=3, seed=7)], [i])[0]
        assert token in allowed


@pytest.mark.parametrize("kwargs,field", [
    ({"temperature": -0.5}, "sampling.temperature"),
    ({"temperature": math.nan}, "sampling.temperature"),
    ({"top_p": 0.0}, "sampling.top_p"),
    ({"top_p": 1.5}, "sampling.top_p"),
    ({"top_k": -1}, "sampling.top_k"),
    ({"max_tokens": 0}, "sampling.max_tokens"),
    ({"stop_token_ids": (99,)}, "sampling.stop_token_ids"),
])
def test_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        SamplingParams(**kwargs).validate(vocab_size=50)
    assert exc.value.field == field
