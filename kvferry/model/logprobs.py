"""Log probabilities of tokens under the model, as the OpenAI API's `logprobs` reports them.

A token's log probability is read from its position's logits before temperature, top-k and
top-p (the model's own distribution, as vLLM reports by default), so it is the same whatever
the request's sampling and equals `log_softmax` of the logits `transformers` computes. The
worker that computes a position's logits reports it: the prefill worker for the prompt's
tokens (`SamplingParams.prompt_logprobs`) and the first generated token, the decode worker for
the rest (`SamplingParams.logprobs`); each with that many of the most likely tokens there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20  # most likely tokens a position may report (OpenAI's top_logprobs bound)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One position: the log probability of the token there, and the `top` most likely
    tokens at it, most likely first (token id, log probability)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def logprobs_of(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprob]:
    """Row i of `logits` [R, V] is the model's prediction at the position of `token_ids[i]`:
    that token's log probability and the `num_top` most likely at each row."""
    if logits.shape[0] != len(token_ids):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(token_ids)} tokens")
    if not token_ids:
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(token_ids, device=logp.device)[:, None])[:, 0]
    chosen_list = chosen.tolist()
    if num_top <= 0:
        return [TokenLogprob(v) for v in chosen_list]
    values, ids = torch.topk(logp, min(num_top, logp.shape[1]), dim=-1)
    return [TokenLogprob(v, tuple(zip(row_ids, row_values)))
            for v, row_ids, row_values in zip(chosen_list, ids.tolist(), values.tolist())]
