"""Penalties and biases on a row of logits before it is sampled, as the OpenAI API and vLLM
define them: `logit_bias` adds to chosen tokens' logits; `repetition_penalty` r (transformers'
and vLLM's) divides the positive logits of every token seen in the prompt or the output by r
and multiplies the negative ones by r; `frequency_penalty` subtracts it times each token's
count in the output, `presence_penalty` once for each token the output holds. Applied in that
order, to the logits a row is sampled from (greedy included); log probabilities are reported
before them (kvferry/model/logprobs.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvferry.model.grammar import Guide

MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (the OpenAI API's bound)
MAX_BIAS = 100.0  # |logit_bias| values (the OpenAI API's bound)


class History(NamedTuple):
    """What a row's penalties and constraint read: the prompt's tokens and those the request
    produced before the row's (every earlier output, across legs and drafts); `guide`, the
    sequence's matcher where its request is constrained (kvferry/model/grammar.py)."""

    prompt: list[int]
    output: list[int]
    guide: Guide | None = None


def penalize(logits: torch.Tensor, history: History, presence: float, frequency: float,
             repetition: float, bias: tuple[tuple[int, float], ...]) -> torch.Tensor:
    """Row `logits` [V] as the request's penalties and biases leave it (a new tensor)."""
    out = logits.float().clone()
    vocab = out.shape[0]
    if bias:
        ids = torch.tensor([t for t, _ in bias], dtype=torch.int64, device=out.device)
        out.index_add_(0, ids, torch.tensor([b for _, b in bias], device=out.device))
    if repetition != 1.0:
        seen = torch.tensor(sorted(set(history.prompt) | set(history.output)),
                            dtype=torch.int64, device=out.device)
        if seen.numel():
            values = out[seen]
            out[seen] = torch.where(values > 0, values / repetition, values * repetition)
    if (presence or frequency) and history.output:
        counts = torch.bincount(torch.tensor(history.output, dtype=torch.int64,
                                             device=out.device), minlength=vocab)[:vocab]
        out -= frequency * counts + presence * (counts > 0)
    return out
