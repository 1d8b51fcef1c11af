"""Verifying drafts: the tokens are those decoding without speculation emits, draw for draw
(greedy and seeded sampling), and the first token after a draft follows the target's
distribution (chi-square, the harness of test_sampling_distribution.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvferry.model.rejection import verify
from kvferry.model.sampling import SamplingParams, sample_tokens
from tests.kvferry.model.test_sampling_distribution import LOGITS, _chi2_critical, _expected

VOCAB = 12


def _sequential(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
                output_index: int) -> list[int]:
    """What decoding one token a step emits over the same contexts: row j is only reached
    when the tokens before it were the drafts."""
    tokens = []
    for j in range(len(drafts) + 1):
        token = sample_tokens(logits[j: j + 1], [params], [output_index + j])[0]
        tokens.append(token)
        if j == len(drafts) or token != drafts[j]:
            break
    return tokens


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0),
                                    SamplingParams(temperature=0.8, seed=11),
                                    SamplingParams(temperature=1.0, top_k=4, seed=3),
                                    SamplingParams(temperature=0.7, top_p=0.8, seed=5)])
def test_the_tokens_are_those_of_decoding_without_drafts(params: SamplingParams) -> None:
    generator = torch.Generator().manual_seed(0)
    num_accepted = []
    for trial in range(300):
        k = trial % 5
        logits = torch.randn(k + 1, VOCAB, generator=generator) * 2
        # Drafts right up to a random point (the tokens decoding emits), random after it.
        cut = int(torch.randint(0, k + 1, (1,), generator=generator))
        noise = torch.randint(0, VOCAB, (k,), generator=generator).tolist()
        drafts = _right_drafts(logits, params, trial, cut) + noise[cut:]
        verdict = verify(logits, drafts, params, trial)
        assert verdict.token_ids == _sequential(logits, drafts, params, trial)
        assert verdict.num_accepted == len(verdict.token_ids) - 1
        assert verdict.num_accepted >= min(cut, k)
        num_accepted.append(verdict.num_accepted)
    assert max(num_accepted) == 4  # every draft accepted happens


def _right_drafts(logits: torch.Tensor, params: SamplingParams, output_index: int,
                  n: int) -> list[int]:
    """The first `n` tokens decoding emits over these rows (each row's own sample)."""
    return [sample_tokens(logits[j: j + 1], [params], [output_index + j])[0]
            for j in range(n)]


def test_a_wrong_greedy_draft_gives_the_target_s_token_and_stops() -> None:
    logits = torch.zeros(3, VOCAB)
    logits[0, 4] = logits[1, 7] = logits[2, 1] = 5.0
    assert verify(logits, [4, 7], SamplingParams(temperature=0.0), 0).token_ids == [4, 7, 1]
    assert verify(logits, [4, 2], SamplingParams(temperature=0.0), 0).token_ids == [4, 7]
    assert verify(logits, [3, 7], SamplingParams(temperature=0.0), 0).token_ids == [4]
    with pytest.raises(ValueError):
        verify(logits, [4], SamplingParams(temperature=0.0), 0)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_tokens_after_a_draft_follow_the_target_distribution(temperature: float) -> None:
    """The first token and, where the draft was accepted, the second: each from its row's
    distribution (chi-square at the harness's level)."""
    draft = int(LOGITS.argmax())  # the likeliest token: accepted often enough to test row 1
    second = torch.roll(LOGITS, 3)
    logits = torch.stack([LOGITS, second])
    firsts, seconds = np.zeros(VOCAB), np.zeros(VOCAB)
    for seed in range(6000):
        params = SamplingParams(temperature=temperature, seed=seed)
        tokens = verify(logits, [draft], params, 0).token_ids
        firsts[tokens[0]] += 1
        if len(tokens) == 2:
            seconds[tokens[1]] += 1
    for counts, row in ((firsts, LOGITS), (seconds, second)):
        expected = _expected(row, temperature) * counts.sum()
        statistic = float(((counts - expected) ** 2 / expected).sum())
        assert statistic < _chi2_critical(VOCAB - 1), (statistic, counts, expected)
