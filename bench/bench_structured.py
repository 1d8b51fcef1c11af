"""What structured output costs a served request, end to end, on the real default model: the
same chat prompts, greedy, streamed through the OpenAI HTTP API of one deployment (1 prefill +
1 decode worker: the prefill worker masks the first token, the decode worker the rest),
under a `json_schema` response format and without it, one request at a time, the two kinds
alternating (which goes first rotating per prompt) so that both see the same machine.

Reported per repetition: each kind's mean inter-token latency over its requests (a request's
ITL: the time between its first and last content chunks over the chunks between), the ratio
constrained / unconstrained, and how many constrained answers parse as JSON valid for the
schema. Median [min-max] over `--repeats` repetitions in one invocation.

    .venv/bin/python bench/bench_structured.py --repeats 3 --out bench/results/bench_structured.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 24},
    "languages": {"type": "array", "items": {"type": "string", "maxLength": 16},
                  "maxItems": 3}},
    "required": ["name", "age", "city", "languages"], "additionalProperties": False}
PEOPLE = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Katherine Johnson", "Linus Torvalds",
          "Margaret Hamilton", "Dennis Ritchie", "Barbara Liskov"]


def _stream(api: object, person: str, constrained: bool, max_tokens: int
            ) -> tuple[float, str]:
    """One request: its mean ITL (s) and its text."""
    extra = {"response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": SCHEMA}}} if constrained else {}
    times, text = [], ""
    stream = api.chat.completions.create(  # type: ignore[attr-defined]
        model=None, stream=True, temperature=0.0, max_tokens=max_tokens,
        messages=[{"role": "user", "content": f"Describe {person} as JSON with name, age, "
                   "city and languages."}], **extra)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
            text += chunk.choices[0].delta.content
    itl = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")
    return itl, text


def _valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _repetition(api: object, rep: int, max_tokens: int) -> dict[str, float]:
    itls: dict[bool, list[float]] = {True: [], False: []}
    valid = 0
    for i, person in enumerate(PEOPLE):
        order = (True, False) if (i + rep) % 2 == 0 else (False, True)
        for constrained in order:
            itl, text = _stream(api, person, constrained, max_tokens)
            itls[constrained].append(itl)
            valid += constrained and _valid(text)
    on, off = statistics.mean(itls[True]), statistics.mean(itls[False])
    return {"itl_constrained_ms": on * 1e3, "itl_unconstrained_ms": off * 1e3,
            "ratio": on / off, "valid": valid, "prompts": len(PEOPLE)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import openai

    from deploy.default_model import ensure_default_model
    from deploy.launcher import Deployment

    logs = Path(tempfile.mkdtemp(prefix="bench-structured-"))
    deployment = Deployment(model=ensure_default_model(), log_dir=logs, http_port=0).start()
    try:
        api = openai.OpenAI(base_url=f"http://{deployment.http_address}/v1", api_key="x",
                            max_retries=0)
        _stream(api, "Ada Lovelace", True, 8)  # warm: compile caches, first schema
        reps = []
        for rep in range(args.repeats):
            reps.append(_repetition(api, rep, args.max_tokens))
            print(f"rep {rep}: ITL {reps[-1]['itl_constrained_ms']:.2f} ms constrained, "
                  f"{reps[-1]['itl_unconstrained_ms']:.2f} ms not: x{reps[-1]['ratio']:.3f}; "
                  f"{reps[-1]['valid']}/{reps[-1]['prompts']} valid", flush=True)
    finally:
        deployment.stop()
    summary = {key: {"median": statistics.median(r[key] for r in reps),
                     "min": min(r[key] for r in reps), "max": max(r[key] for r in reps)}
               for key in ("itl_constrained_ms", "itl_unconstrained_ms", "ratio", "valid")}
    print("ratio constrained / unconstrained ITL: "
          f"{summary['ratio']['median']:.3f} [{summary['ratio']['min']:.3f}-"
          f"{summary['ratio']['max']:.3f}]; valid {summary['valid']['median']:g} of "
          f"{len(PEOPLE)} [{summary['valid']['min']:g}-{summary['valid']['max']:g}]")
    if args.out is not None:
        args.out.write_text(json.dumps({"repetitions": reps, "summary": summary,
                                        "max_tokens": args.max_tokens}, indent=1))


if __name__ == "__main__":
    main()
