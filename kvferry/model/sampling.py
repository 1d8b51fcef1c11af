"""Sampling parameters and per-request token sampling.

Seeded sampling is reproducible whatever the batch: the random stream for output token i of a
request depends only on (seed, i), so prefill (token 0) and decode (tokens 1..) on different
workers, in batches of any composition, draw the same tokens for the same request.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch

from kvferry.errors import InvalidArgument
from kvferry.model.grammar import Constraint
from kvferry.model.logprobs import MAX_LOGPROBS
from kvferry.model.penalties import MAX_BIAS, MAX_PENALTY, History, penalize
from kvferry.settings.sampling import DEFAULT_TEMPERATURE

DEFAULT_MAX_TOKENS = 256
_MIX = 0x9E3779B97F4A7C15
_MASK63 = (1 << 63) - 1
MAX_SEED = 1 << 63  # seeds are in [0, 2^63), as vLLM's (a signed 64-bit integer) are


class FinishReason(Enum):
    """Why a request ended (values match proto FinishReason)."""

    STOP = 1
    LENGTH = 2
    ABORT = 3


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Validated sampling parameters; `max_tokens` is always resolved by the router."""

    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1  # samples of the prompt (parallel sampling); workers get a count of their own
    kv_eviction: str = ""  # "": the deployment's K/V eviction; "none": this request keeps all
    # Log probabilities (kvferry/model/logprobs.py): None, none reported; k, each generated
    # token's and the k most likely at its position; `prompt_logprobs` the same for the
    # prompt's tokens (the first has none).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Penalties and biases on the logits sampled from (kvferry/model/penalties.py)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    # Structured output: what the output must match (kvferry/model/grammar.py)
    constraint: Constraint | None = None

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0)

    @property
    def shapes_logits(self) -> bool:
        """Whether rows are sampled from other than the model's logits (penalties, biases,
        a constraint's mask): then each row needs its History."""
        return self.has_penalties or self.constraint is not None

    def shaped(self, logits: torch.Tensor, history: History | None) -> torch.Tensor:
        """Row `logits` [V] as this request's penalties and biases leave it, then masked to
        what its constraint allows (`history`: what they read; its guide for a constraint)."""
        if not self.shapes_logits:
            return logits
        if history is None:
            raise ValueError("penalties and constraints need the row's history")
        if self.has_penalties:
            logits = penalize(logits, history, self.presence_penalty, self.frequency_penalty,
                              self.repetition_penalty, self.logit_bias)
        if self.constraint is not None:
            if history.guide is None:
                raise ValueError("a constrained row needs its sequence's guide")
            logits = history.guide.shaped(logits, history.output)
        return logits

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def for_sample(self, sample_index: int) -> SamplingParams:
        """Sample `sample_index` of a request of several (parallel sampling): these
        parameters with the seed moved by the index, so the sample equals a request of its
        own with seed + index (unseeded samples draw from independent random streams)."""
        if self.seed is None or sample_index == 0:
            return self
        return dataclasses.replace(self, seed=self.seed + sample_index)

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidArgument naming the first bad field."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidArgument(
                f"sampling.temperature must be finite and >= 0, got {self.temperature}",
                "sampling.temperature",
            )
        if not (0.0 < self.top_p <= 1.0) or math.isnan(self.top_p):
            raise InvalidArgument(
                f"sampling.top_p must be in (0, 1], got {self.top_p}", "sampling.top_p"
            )
        if self.top_k < 0:  # 0: off
            raise InvalidArgument(
                f"sampling.top_k must be >= 0, got {self.top_k}", "sampling.top_k"
            )
        if self.top_k > vocab_size:
            raise InvalidArgument(
                f"sampling.top_k: {self.top_k} is more than the vocabulary of {vocab_size} "
                "tokens (0 keeps every token)", "sampling.top_k"
            )
        if self.seed is not None and not 0 <= self.seed < MAX_SEED:
            raise InvalidArgument(
                f"sampling.seed must be in [0, 2^63), got {self.seed}", "sampling.seed"
            )
        if self.n < 1:
            raise InvalidArgument(f"sampling.n must be >= 1, got {self.n}", "sampling.n")
        if self.kv_eviction not in ("", "none"):
            raise InvalidArgument(
                f"sampling.kv_eviction: empty (the deployment's) or 'none' (keep every token), "
                f"got {self.kv_eviction!r}", "sampling.kv_eviction")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidArgument(f"sampling.{name} must be in [0, {MAX_LOGPROBS}], got "
                                      f"{value}", f"sampling.{name}")
        self._validate_penalties(vocab_size)
        if self.seed is not None and self.seed + self.n > MAX_SEED:
            raise InvalidArgument(
                f"sampling.seed: sample i uses seed + i, so seed + n must be at most 2^63 "
                f"(seed {self.seed}, n {self.n})", "sampling.seed")
        if self.max_tokens < 1:
            raise InvalidArgument(
                f"sampling.max_tokens must be >= 1, got {self.max_tokens}", "sampling.max_tokens"
            )
        for token_id in self.stop_token_ids:
            if not 0 <= token_id < vocab_size:
                raise InvalidArgument(
                    f"sampling.stop_token_ids: {token_id} is outside [0, {vocab_size})",
                    "sampling.stop_token_ids",
                )
        if any(s == "" for s in self.stop):
            raise InvalidArgument("sampling.stop: stop strings must be non-empty", "sampling.stop")
        if self.constraint is not None:
            self.constraint.validate()
            if self.ignore_eos:
                raise InvalidArgument("sampling.ignore_eos: a constrained answer ends where its "
                                      "constraint does; it cannot ignore the end-of-sequence "
                                      "token (sampling.constraint)", "sampling.ignore_eos")


    def _validate_penalties(self, vocab_size: int) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
                raise InvalidArgument(f"sampling.{name} must be in [-{MAX_PENALTY:g}, "
                                      f"{MAX_PENALTY:g}], got {value}", f"sampling.{name}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InvalidArgument(f"sampling.repetition_penalty must be finite and > 0, got "
                                  f"{self.repetition_penalty}", "sampling.repetition_penalty")
        for token_id, bias in self.logit_bias:
            if not 0 <= token_id < vocab_size:
                raise InvalidArgument(f"sampling.logit_bias: token {token_id} is outside "
                                      f"[0, {vocab_size})", "sampling.logit_bias")
            if not (math.isfinite(bias) and -MAX_BIAS <= bias <= MAX_BIAS):
                raise InvalidArgument(f"sampling.logit_bias: the bias of token {token_id} "
                                      f"must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {bias}",
                                      "sampling.logit_bias")


def _generator_for(seed: int | None, output_index: int) -> torch.Generator:
    gen = torch.Generator()
    if seed is None:
        gen.manual_seed(random.getrandbits(63))
    else:
        gen.manual_seed(((seed & _MASK63) * _MIX + output_index) & _MASK63)
    return gen


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution [V] a sampled row draws from: softmax(logits / T) cut to the top k,
    then to the smallest prefix whose mass reaches top_p (not renormalized: `draw` needs
    no normalization)."""
    # Shifted so the largest is 0 before scaling: a tiny temperature (1e-45 is finite and
    # valid) then gives 0 and -inf, a one-hot softmax, instead of inf / inf = NaN.
    scaled = (logits.float() - logits.max().float()) / params.temperature  # [V]
    if 0 < params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = (cumulative - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs


def draw(probs: torch.Tensor, params: SamplingParams, output_index: int) -> int:
    """One token from `probs` with the random stream of the request's output `output_index`
    (the same draw wherever and in whatever batch it is made)."""
    gen = _generator_for(params.seed, output_index)
    return int(torch.multinomial(probs.cpu(), 1, generator=gen).item())


def _sample_row(logits: torch.Tensor, params: SamplingParams, output_index: int) -> int:
    return draw(target_probs(logits, params), params, output_index)


def sample_tokens(
    logits: torch.Tensor,  # [B, V]
    params: list[SamplingParams],
    output_indices: list[int],
    histories: Sequence[History | None] | None = None,
) -> list[int]:
    """One token per row; `output_indices[i]` is how many tokens row i's request produced;
    `histories[i]`, what its penalties and constraint read (where its request has any)."""
    greedy = logits.argmax(dim=-1).tolist()
    tokens = []
    for i, p in enumerate(params):
        if p.shapes_logits:
            row = p.shaped(logits[i], histories[i] if histories is not None else None)
            tokens.append(int(row.argmax().item()) if p.is_greedy
                          else _sample_row(row, p, output_indices[i]))
        else:
            tokens.append(greedy[i] if p.is_greedy
                          else _sample_row(logits[i], p, output_indices[i]))
    return tokens


def validate_prompt(prompt: list[int], vocab_size: int, context: int) -> None:
    """Worker-side prompt checks (the router checks first, naming the public fields)."""
    if not prompt:
        raise InvalidArgument("prompt_token_ids must be non-empty", "prompt_token_ids")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise InvalidArgument(f"prompt_token_ids must be in [0, {vocab_size})",
                              "prompt_token_ids")
    if len(prompt) >= context:
        raise InvalidArgument("prompt fills the model's context", "prompt_token_ids")
