"""Which grammar engine constrains kvferry's decoding: xgrammar, llguidance and outlines-core
measured side by side on this machine, on the real default model's tokenizer.

For each engine and JSON schema: the time to compile the schema against the vocabulary, and
per generated token the time to fill the next token's mask and to advance past the token,
walking a valid document of the schema (JSON with ", " and ": " between items, as kvferry
constrains it, tokenized as the model would write
it). Each engine must accept every token of the document and end accepting. Repeated
`--repeats` times in one invocation; median [min-max] of each repetition's median.

  .venv/bin/python bench/bench_grammar.py --repeats 3 --out bench/results/bench_grammar.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

SCHEMAS = {
    "person": ({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "age", "email", "tags"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
         "tags": ["mathematics", "engines", "poetry"]}),
    "tool_call": ({"type": "object", "properties": {
        "name": {"enum": ["get_weather", "get_time", "search"]},
        "arguments": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14}},
            "required": ["city", "unit", "days"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False},
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius",
                                              "days": 3}}),
}

# An engine: (compile the schema, returning a factory of matchers), and a matcher's
# (fill the mask, advance past a token, whether it accepts now).
Matcher = tuple[Callable[[], None], Callable[[int], bool], Callable[[], bool]]
Engine = Callable[[str], Callable[[], Matcher]]


def xgrammar_engine(tokenizer: object, vocab_size: int) -> Engine:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile_schema(schema: str) -> Callable[[], Matcher]:
        compiled = compiler.compile_json_schema(schema, any_whitespace=True)

        def matcher() -> Matcher:
            m = xgr.GrammarMatcher(compiled)
            mask = xgr.allocate_token_bitmask(1, info.vocab_size)
            return (lambda: m.fill_next_token_bitmask(mask), m.accept_token,
                    lambda: m.is_terminated() or m.accept_token(info.stop_token_ids[0]))
        return matcher
    return compile_schema


def llguidance_engine(tokenizer: object, vocab_size: int) -> Engine:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def compile_schema(schema: str) -> Callable[[], Matcher]:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": True})

        def matcher() -> Matcher:
            m = llguidance.LLMatcher(lltok, grammar)
            mask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)
            return (lambda: llguidance.torch.fill_next_token_bitmask(m, mask, 0),
                    m.consume_token, m.is_accepting)
        matcher()  # the grammar is checked, and its lexer built, here
        return matcher
    return compile_schema


def outlines_engine(tokenizer: object, vocab_size: int) -> Engine:
    import torch
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    # Vocabulary.from_pretrained would fetch the tokenizer from the Hub: built from the local
    # one instead, each byte-level token as its bytes (the special tokens left out).
    vocabulary = Vocabulary(tokenizer.eos_token_id, _token_bytes(tokenizer))  # type: ignore[attr-defined]

    def compile_schema(schema: str) -> Callable[[], Matcher]:
        index = Index(build_regex_from_schema(schema), vocabulary)

        def matcher() -> Matcher:
            guide = Guide(index)
            mask = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)
            return (lambda: guide.write_mask_into(mask.data_ptr(), mask.numel(), 4),
                    lambda t: guide.advance(t) is not None, guide.is_finished)
        return matcher
    return compile_schema


def _token_bytes(tokenizer: object) -> dict[bytes, list[int]]:
    """The byte-level BPE vocabulary as bytes -> token ids, without special tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    decoder = {c: b for b, c in bytes_to_unicode().items()}
    special = set(tokenizer.all_special_ids)  # type: ignore[attr-defined]
    out: dict[bytes, list[int]] = {}
    for token, token_id in tokenizer.get_vocab().items():  # type: ignore[attr-defined]
        if token_id not in special and all(c in decoder for c in token):
            out.setdefault(bytes(decoder[c] for c in token), []).append(token_id)
    return out


def kvferry_engine(tokenizer: object, vocab_size: int) -> Engine:
    """What kvferry runs per sampled row (kvferry/model/grammar.py, on xgrammar): a Guide
    following the output, filling the mask and applying it to a row of logits."""
    import torch

    from kvferry.model.grammar import Constraint, Grammars

    grammars = Grammars(tokenizer, vocab_size, [tokenizer.eos_token_id])  # type: ignore[attr-defined]
    logits = torch.randn(vocab_size)  # [V]

    def compile_schema(schema: str) -> Callable[[], Matcher]:
        compiled = grammars.compile(Constraint("json_schema", schema))

        def matcher() -> Matcher:
            from kvferry.model.grammar import Guide

            guide, output = Guide(compiled, vocab_size), []
            return (lambda: guide.shaped(logits, output),
                    lambda t: output.append(t) is None, lambda: True)
        return matcher
    return compile_schema


ENGINES = {"xgrammar": xgrammar_engine, "llguidance": llguidance_engine,
           "outlines-core": outlines_engine, "kvferry-guide": kvferry_engine}


def walk(matcher: Matcher, tokens: list[int]) -> list[float]:
    """Seconds per token to fill its mask and advance past it, over a valid document."""
    fill, advance, accepting = matcher
    times = []
    for token in tokens:
        start = time.perf_counter()
        fill()
        if not advance(token):
            raise RuntimeError(f"the engine refused token {token}")
        times.append(time.perf_counter() - start)
    if not accepting():
        raise RuntimeError("the engine does not accept the whole document")
    return times


def measure(name: str, engine: Engine, tokenizer: object, repeats: int) -> dict:
    out: dict[str, dict] = {}
    for schema_name, (schema, doc) in SCHEMAS.items():
        tokens = tokenizer.encode(json.dumps(doc),  # type: ignore[attr-defined]
                                  add_special_tokens=False)
        compiles, per_token = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            factory = engine(json.dumps(schema))
            compiles.append(time.perf_counter() - start)
            per_token.append(statistics.median(walk(factory(), tokens)))
        out[schema_name] = {"tokens": len(tokens), "compile_ms": _spread(compiles, 1e3),
                            "per_token_us": _spread(per_token, 1e6)}
        print(f"{name:14} {schema_name:10} compile {_show(out[schema_name]['compile_ms'])} ms, "
              f"mask + advance {_show(out[schema_name]['per_token_us'])} us/token "
              f"({len(tokens)} tokens)", flush=True)
    return out


def _spread(values: list[float], scale: float) -> dict[str, float]:
    scaled = [v * scale for v in values]
    return {"median": statistics.median(scaled), "min": min(scaled), "max": max(scaled)}


def _show(spread: dict[str, float]) -> str:
    return f"{spread['median']:.1f} [{spread['min']:.1f}-{spread['max']:.1f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from deploy.default_model import default_gguf_path
    from kvferry.model.config import load_model_config
    from kvferry.model.gguf import ensure_converted

    checkpoint = ensure_converted(default_gguf_path())
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    vocab_size = load_model_config(checkpoint).vocab_size
    results = {}
    for name in args.engines.split(","):
        try:
            results[name] = measure(name, ENGINES[name](tokenizer, vocab_size), tokenizer,
                                    args.repeats)
        except Exception as exc:  # reported: an engine that cannot run here is a finding
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"{name:14} failed: {results[name]['error']}", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps({"vocab_size": vocab_size, "repeats": args.repeats,
                                        "results": results}, indent=1))


if __name__ == "__main__":
    main()
