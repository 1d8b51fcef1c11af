"""Structured output: a request's constraint (a JSON schema, any JSON object, a regular
expression, a choice of strings, or an EBNF grammar) as a mask on the logits it samples from,
with xgrammar (chosen by measurement, bench/bench_grammar.py: docs/performance.md).

A matcher's state is a function of the constraint and the tokens the request produced, so it
never crosses a process: every worker that samples for a sequence keeps a `Guide` of its own,
which follows the row's history before it fills the row's mask: it advances through the
tokens it has not seen (the first token the prefill worker sampled, an earlier leg's outputs
after a migration, a draft before the row), and rolls back past drafts that were not kept.
A draft the mask forbids is never sampled, so verification rejects it (rejection.verify).

JSON is written without free whitespace (`, ` and `: ` between items): a model may otherwise
fill a document with spaces and newlines until max_tokens, and a schema whose strings and
numbers are bounded then always ends. Log probabilities stay the model's own, before the mask.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvferry.errors import InvalidArgument
from kvferry.model.config import ModelConfig

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_BYTES = 256 * 1024  # a schema, regex or grammar; the choices together


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a request's output must match: `kind` one of KINDS; `spec` the JSON schema (as
    JSON text), the regex or the EBNF grammar (root rule `root`); `choices` the strings of a
    choice (the output is exactly one of them)."""

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()

    @property
    def field(self) -> str:
        """The gRPC field that carries it (named by refusals)."""
        return f"sampling.constraint.{self.kind}"

    def validate(self) -> None:
        """Raise InvalidArgument naming the field for what is wrong before compiling."""
        if self.kind not in KINDS:
            raise InvalidArgument(f"sampling.constraint: one of {', '.join(KINDS)}, got "
                                  f"{self.kind!r}", "sampling.constraint")
        size = len(self.spec.encode()) + sum(len(c.encode()) for c in self.choices)
        if size > MAX_SPEC_BYTES:
            raise InvalidArgument(f"{self.field}: {size} bytes, more than {MAX_SPEC_BYTES}",
                                  self.field)
        if self.kind == "choice":
            if not self.choices or any(c == "" for c in self.choices):
                raise InvalidArgument(f"{self.field}: one or more non-empty strings",
                                      self.field)
        elif self.kind != "json_object" and not self.spec:
            raise InvalidArgument(f"{self.field}: must be non-empty", self.field)
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except ValueError as exc:
                raise InvalidArgument(f"{self.field}: not valid JSON ({exc})",
                                      self.field) from None
            if not isinstance(schema, dict):
                raise InvalidArgument(f"{self.field}: a JSON schema is an object", self.field)


class Guide:
    """One sequence's matcher: `shaped(logits, output)` is `logits` [V] with every token the
    constraint forbids after `output` (the sequence's tokens so far) at -inf."""

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self._compiled = compiled
        self._vocab_size = vocab_size
        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V / 32)] int32
        self._consumed: list[int] = []  # the output it follows
        self._num_fed = 0  # of those, the ones the matcher took (the rest: past its end)

    def fresh(self) -> Guide:
        """A guide of the same constraint that has seen nothing (a fork's sample)."""
        return Guide(self._compiled, self._vocab_size)

    def shaped(self, logits: torch.Tensor, output: Sequence[int]) -> torch.Tensor:
        import xgrammar as xgr

        self.follow(output)
        out = logits.float().clone()[None]  # [1, V]
        if self._matcher.is_terminated():  # a stop token that did not stop the sequence
            allowed = torch.tensor(self._matcher.stop_token_ids, device=out.device)
            return torch.full_like(out[0], float("-inf")).index_copy_(0, allowed,
                                                                     out[0, allowed])
        self._matcher.fill_next_token_bitmask(self._bitmask)
        if out.device.type == "cpu":
            # bits unpacked by numpy, then one masked fill: 87 us a row of 49,152 here
            # against 225 us for xgrammar's CPU kernel and 1.1 ms for its "auto" choice
            bits = np.unpackbits(self._bitmask[0].numpy().view(np.uint8), bitorder="little")
            return out[0].masked_fill_(torch.from_numpy(bits[:out.shape[1]] == 0),
                                       float("-inf"))
        xgr.apply_token_bitmask_inplace(out, self._bitmask.to(out.device),
                                        vocab_size=self._vocab_size)
        return out[0]

    def follow(self, output: Sequence[int]) -> None:
        """Bring the matcher to the state after `output`: roll back past what it consumed
        that `output` does not hold, then accept the rest (InvalidArgument at a token the
        constraint does not allow, the matcher left before it)."""
        consumed = self._consumed
        if list(output[:len(consumed)]) != consumed:
            common = 0
            while common < min(len(consumed), len(output)) and \
                    consumed[common] == output[common]:
                common += 1
            if common < self._num_fed:
                self._matcher.rollback(self._num_fed - common)
                self._num_fed = common
            del consumed[common:]
        for token in output[len(consumed):]:
            consumed.append(token)
            if self._matcher.is_terminated():  # past the end: only stop tokens follow
                continue
            if not self._matcher.accept_token(token):
                consumed.pop()
                raise InvalidArgument(f"token {token} at output {len(consumed) - 1} does not "
                                      "match the request's constraint", "sampling.constraint")
            self._num_fed += 1


class Grammars:
    """Compiles constraints against one model's vocabulary (`tokenizer`, padded to
    `vocab_size` ids; a complete match allows only `stop_token_ids`), caching by constraint."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True,
                                             cache_limit_bytes=64 << 20)

    def compile(self, constraint: Constraint) -> Any:
        """The compiled grammar; InvalidArgument naming the field, with xgrammar's message,
        for a schema, regex or grammar it refuses."""
        constraint.validate()
        compiler = self._compiler
        try:
            if constraint.kind == "json_schema":
                return compiler.compile_json_schema(constraint.spec, any_whitespace=False)
            if constraint.kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            if constraint.kind == "regex":
                return compiler.compile_regex(constraint.spec)
            if constraint.kind == "choice":
                return compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c) for c in constraint.choices))
            return compiler.compile_grammar(constraint.spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            # xgrammar's messages start with a time and its source line: "[01:44:22]
            # /project/cpp/regex_converter.cc:94: Regex parsing error at position 3: ..."
            lines = str(exc).strip().splitlines() or [repr(exc)]
            message = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", lines[-1])
            raise InvalidArgument(f"{constraint.field}: {message}", constraint.field) from None

    def guide(self, constraint: Constraint) -> Guide:
        return Guide(self.compile(constraint), self.vocab_size)


@functools.lru_cache(maxsize=4)
def grammars_for(checkpoint: str, vocab_size: int, stop_token_ids: tuple[int, ...]) -> Grammars:
    """The process's compiler for a checkpoint (its tokenizer read from the directory)."""
    from transformers import AutoTokenizer

    return Grammars(AutoTokenizer.from_pretrained(checkpoint), vocab_size, stop_token_ids)


def _grammars(config: ModelConfig) -> Grammars:
    """The process's compiler for `config`'s model (its end-of-sequence ids stop a match)."""
    return grammars_for(str(config.path), config.vocab_size, tuple(config.eos_token_ids))


def check_constraint(config: ModelConfig, constraint: Constraint) -> None:
    """InvalidArgument, naming the field, for a constraint the engine refuses for `config`'s
    model (compiled into the process's cache, which the workers' compiles share nothing
    with: each process compiles its own)."""
    _grammars(config).compile(constraint)


def guide_for(config: ModelConfig, constraint: Constraint | None,
              output: Sequence[int] = ()) -> Guide | None:
    """A matcher of `constraint` for a sequence of `config`'s model, past its `output` so far
    (an earlier leg's tokens, the first token); None without a constraint. InvalidArgument
    for a constraint the engine refuses, or an output it does not match."""
    if constraint is None:
        return None
    guide = _grammars(config).guide(constraint)
    guide.follow(output)
    return guide
