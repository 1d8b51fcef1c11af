"""Verifying drafted tokens (speculative decoding): which of k drafts the target model
accepts, and the token after them, from one forward over k + 1 positions.

Drafts here are deterministic given the context (prompt lookup, or a draft model's argmax):
a draft distribution q that is one-hot. For those, Leviathan et al.'s rejection rule
(accept d with probability min(1, p(d) / q(d)), else sample from max(p - q, 0) normalized)
accepts d with probability p(d) and otherwise samples p restricted to tokens other than d.
Drawing x from p and accepting d when x == d has the same law, so `verify` does that: row j
is sampled exactly as sequential decoding samples output `output_index + j` (the same
`target_probs`, the same seeded stream), and drafts are accepted while they equal those
samples. The tokens are therefore the ones decoding without speculation emits, draw for draw,
whatever k and the drafts were: greedy and seeded sampling alike.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvferry.model.penalties import History
from kvferry.model.sampling import SamplingParams, draw, target_probs


class Verdict(NamedTuple):
    token_ids: list[int]  # the accepted drafts, then one token sampled from the target
    num_accepted: int  # drafts accepted: len(token_ids) - 1


def verify(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
           output_index: int, history: History | None = None) -> Verdict:
    """`logits` [k + 1, V]: row j is the target's prediction after the context and the first
    j drafts (row 0 after the context alone). `output_index`: how many tokens the request
    produced before row 0's. The caller cuts the tokens at a stop token or max_tokens, and
    rolls back the K/V of positions past the last token kept. `history`: what the
    request's penalties and constraint read before row 0 (row j's adds the first j drafts;
    a draft the constraint forbids is never sampled, so it is rejected)."""
    if logits.shape[0] != len(drafts) + 1:
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(drafts)} drafts")
    greedy = (logits.argmax(dim=-1).tolist()
              if params.is_greedy and not params.shapes_logits else None)
    tokens: list[int] = []
    for j in range(len(drafts) + 1):
        row = logits[j]
        if params.shapes_logits:  # row j's history holds the drafts before it
            row = params.shaped(row, None if history is None else
                                history._replace(output=history.output + drafts[:j]))
        if greedy is not None:
            token = greedy[j]
        elif params.is_greedy:
            token = int(row.argmax().item())
        else:
            token = draw(target_probs(row, params), params, output_index + j)
        tokens.append(token)
        if j == len(drafts) or token != drafts[j]:
            break
    return Verdict(tokens, len(tokens) - 1)
