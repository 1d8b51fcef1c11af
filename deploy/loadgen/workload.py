"""What each request asks for: prompts and output lengths, built reproducibly from a seed.

Synthetic prompts are token ids drawn from [0, vocab_size), so input lengths are exact
without a tokenizer; the server's vocabulary size comes from GetModelInfo. Every request
carries its output length, sent as max_tokens with ignore_eos so runs are comparable.
A multi-turn workload builds conversations instead of requests: a turn's prompt holds the
previous turn's answer, so it is only complete once that answer has come back.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

# Counts the tokens of a text (a tokenizer's encode, wrapped); None where there is none.
TokenCounter = Callable[[str], int]


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload."""

    prompt: str | tuple[int, ...]  # text (the router tokenizes it) or token ids
    output_len: int  # sent as max_tokens, with ignore_eos
    prompt_len: int | None = None  # exact for token ids; None: the server's usage tells
    tag: str = ""  # a label carried into the request's record (e.g. "short", "long")


@dataclass(frozen=True)
class Conversation:
    """A chat whose turns are sent one after another. Turn 1's prompt is messages[0]; turn
    k + 1's prompt is turn k's prompt, the token ids turn k generated, then messages[k]."""

    messages: tuple[tuple[int, ...], ...]  # each turn's new tokens; the first: system + user
    output_len: int  # every turn's max_tokens, with ignore_eos
    think_time_s: float = 0.0  # after an answer, before the next turn is sent

    @property
    def num_turns(self) -> int:
        return len(self.messages)

    def next_prompt(self, prompt: tuple[int, ...], answer: Sequence[int],
                    turn: int) -> tuple[int, ...]:
        """Turn `turn`'s prompt (0-based) from the previous turn's prompt and answer."""
        if turn == 0:
            return self.messages[0]
        return prompt + tuple(answer) + self.messages[turn]


class Workload(Protocol):
    """A recipe for requests: the same arguments always give the same requests."""

    def build(self, num_requests: int, vocab_size: int, seed: int) -> list[BenchRequest]: ...


class ConversationWorkload(Protocol):
    """A recipe for conversations: the same arguments always give the same conversations."""

    def build(self, num_conversations: int, vocab_size: int, seed: int
              ) -> list[Conversation]: ...


def _check_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _lengths(rng: np.random.Generator, mean: int, range_ratio: float, count: int) -> list[int]:
    """Uniform in [mean x (1 - ratio), mean x (1 + ratio)], at least 1 (vLLM's random set)."""
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return [int(x) for x in rng.integers(low, high + 1, size=count)]


def _tokens(rng: np.random.Generator, vocab_size: int, count: int) -> tuple[int, ...]:
    return tuple(int(x) for x in rng.integers(0, vocab_size, size=count))


@dataclass(frozen=True)
class RandomWorkload:
    """Random token prompts; lengths uniform within +-range_ratio of input_len / output_len.

    prefix_len > 0 puts the same random prefix in front of every prompt (counted in
    prompt_len), like vLLM's --random-prefix-len."""

    input_len: int = 128
    output_len: int = 32
    range_ratio: float = 0.0
    prefix_len: int = 0

    def build(self, num_requests: int, vocab_size: int, seed: int) -> list[BenchRequest]:
        _check_positive("input_len", self.input_len)
        _check_positive("output_len", self.output_len)
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        rng = np.random.default_rng(seed)
        prefix = _tokens(rng, vocab_size, self.prefix_len)
        input_lens = _lengths(rng, self.input_len, self.range_ratio, num_requests)
        output_lens = _lengths(rng, self.output_len, self.range_ratio, num_requests)
        requests = []
        for input_len, output_len in zip(input_lens, output_lens):
            prompt = prefix + _tokens(rng, vocab_size, input_len)
            requests.append(BenchRequest(prompt, output_len, len(prompt)))
        return requests


@dataclass(frozen=True)
class SharedPrefixWorkload:
    """num_prefixes random prefixes of prefix_len tokens, each followed by a random suffix
    of suffix_len tokens; requests cycle through the prefixes, in shuffled order."""

    num_prefixes: int = 4
    prefix_len: int = 256
    suffix_len: int = 32
    output_len: int = 32

    def build(self, num_requests: int, vocab_size: int, seed: int) -> list[BenchRequest]:
        for name in ("num_prefixes", "prefix_len", "suffix_len", "output_len"):
            _check_positive(name, getattr(self, name))
        rng = np.random.default_rng(seed)
        prefixes = [_tokens(rng, vocab_size, self.prefix_len) for _ in range(self.num_prefixes)]
        order = [i % self.num_prefixes for i in range(num_requests)]
        rng.shuffle(order)
        requests = []
        for index in order:
            prompt = prefixes[index] + _tokens(rng, vocab_size, self.suffix_len)
            requests.append(BenchRequest(prompt, self.output_len, len(prompt)))
        return requests


@dataclass(frozen=True)
class MultiTurnWorkload:
    """Chats of num_turns turns: turn 1 sends input_len random tokens (system prompt and first
    user message); every later turn adds the answer and a new message of turn_len tokens, so
    turn k's prompt is input_len + (k - 1) x (output_len + turn_len) tokens long."""

    num_turns: int = 4
    input_len: int = 256
    turn_len: int = 32
    output_len: int = 32
    think_time_s: float = 0.0

    def build(self, num_conversations: int, vocab_size: int, seed: int) -> list[Conversation]:
        for name in ("num_turns", "input_len", "turn_len", "output_len"):
            _check_positive(name, getattr(self, name))
        if not self.think_time_s >= 0:
            raise ValueError(f"think_time_s must be >= 0, got {self.think_time_s}")
        rng = np.random.default_rng(seed)
        conversations = []
        for _ in range(num_conversations):
            first = _tokens(rng, vocab_size, self.input_len)
            later = [_tokens(rng, vocab_size, self.turn_len) for _ in range(self.num_turns - 1)]
            conversations.append(Conversation((first, *later), self.output_len,
                                              self.think_time_s))
        return conversations


def _take(items: Sequence[BenchRequest], num_requests: int, seed: int) -> list[BenchRequest]:
    """num_requests of items in a seeded shuffled order, cycling when there are too few."""
    if not items:
        raise ValueError("the dataset has no usable requests")
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    return [items[order[i % len(order)]] for i in range(num_requests)]


@dataclass(frozen=True)
class JsonlWorkload:
    """One JSON object a line: {"prompt": "..."} or {"prompt_token_ids": [...]}, with an
    optional "output_len"; lines without one use output_len."""

    path: Path
    output_len: int = 32
    count_tokens: TokenCounter | None = None

    def build(self, num_requests: int, vocab_size: int, seed: int) -> list[BenchRequest]:
        items = []
        for number, line in enumerate(Path(self.path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            row = json.loads(line)
            output_len = int(row.get("output_len", self.output_len))
            if "prompt_token_ids" in row:
                ids = tuple(int(x) for x in row["prompt_token_ids"])
                items.append(BenchRequest(ids, output_len, len(ids)))
            elif isinstance(row.get("prompt"), str):
                text = row["prompt"]
                count = self.count_tokens(text) if self.count_tokens else None
                items.append(BenchRequest(text, output_len, count))
            else:
                raise ValueError(f"{self.path}:{number}: needs 'prompt' or 'prompt_token_ids'")
        return _take(items, num_requests, seed)


@dataclass(frozen=True)
class ShareGptWorkload:
    """ShareGPT JSON: a list of {"conversations": [{"from": ..., "value": ...}, ...]}.

    The first turn is the prompt; the output length is output_len when given, else the
    length of the second turn counted with count_tokens (one of the two is required).
    With a token counter, vLLM's filters apply: prompt and output >= 4 tokens, prompt <=
    1024 and prompt + output <= 2048."""

    path: Path
    output_len: int | None = None
    count_tokens: TokenCounter | None = None

    def build(self, num_requests: int, vocab_size: int, seed: int) -> list[BenchRequest]:
        if self.output_len is None and self.count_tokens is None:
            raise ValueError("output_len: ShareGPT needs a fixed output_len or a tokenizer")
        items = []
        for entry in json.loads(Path(self.path).read_text()):
            turns = entry.get("conversations") or entry.get("conversation") or []
            if len(turns) < 2 or not turns[0].get("value"):
                continue
            prompt, completion = str(turns[0]["value"]), str(turns[1].get("value", ""))
            if self.count_tokens is None:
                items.append(BenchRequest(prompt, int(self.output_len or 0)))
                continue
            prompt_len = self.count_tokens(prompt)
            output_len = self.output_len or self.count_tokens(completion)
            if prompt_len < 4 or output_len < 4 or prompt_len > 1024:
                continue
            if prompt_len + output_len > 2048:
                continue
            items.append(BenchRequest(prompt, output_len, prompt_len))
        return _take(items, num_requests, seed)


@dataclass(frozen=True)
class MixedWorkload:
    """Several workloads interleaved: each request comes from part i with probability
    weight_i / sum(weights), and is tagged with that part's name (e.g. short requests with
    long prompts among them, to measure interference on the short ones)."""

    parts: tuple[tuple[str, Workload, float], ...]  # (tag, workload, weight)

    def build(self, num_requests: int, vocab_size: int, seed: int) -> list[BenchRequest]:
        if not self.parts or any(weight < 0 for _, _, weight in self.parts):
            raise ValueError("parts: give at least one (tag, workload, weight >= 0)")
        weights = np.array([weight for _, _, weight in self.parts], dtype=float)
        if not weights.sum() > 0:
            raise ValueError("parts: the weights must not all be 0")
        rng = np.random.default_rng(seed)
        choice = rng.choice(len(self.parts), size=num_requests, p=weights / weights.sum())
        pools = [iter(workload.build(int((choice == i).sum()), vocab_size, seed + 1 + i))
                 for i, (_, workload, _) in enumerate(self.parts)]
        return [dataclasses.replace(next(pools[i]), tag=self.parts[i][0]) for i in choice]
