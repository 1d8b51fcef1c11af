"""Bad input: property-based GenerateRequests through the public API (text or token
ids, in range or not, empty or huge; any sampling values, NaN and infinities included; odd or
duplicated request ids). Each request is classified from its fields alone (`expect`): a valid
one must be served, a complete stream with a finish reason its length and stop conditions
explain; an invalid one must get INVALID_ARGUMENT naming one of its bad fields. A valid request
sharing its id with another of its batch may instead be refused naming request_id, but one of
them runs. No process dies and no block leaks."""

from __future__ import annotations

import asyncio
import math
import re
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from deploy import client
from deploy.launcher import Deployment
from kvferry.rpc import grpc_util
from kvferry.v1 import generation_pb2, generation_pb2_grpc
from tests.conftest import assert_alive, assert_pools_clean

pytestmark = pytest.mark.slow

VOCAB = 512  # the seeded Qwen3 checkpoint
CONTEXT = 4096
INT32 = st.integers(-(2**31), 2**31 - 1)

token_ids = st.one_of(
    st.lists(st.integers(0, VOCAB - 1), max_size=40),
    st.lists(st.one_of(st.integers(0, VOCAB - 1), INT32), min_size=1, max_size=20),
    st.integers(CONTEXT - 8, 3 * CONTEXT).map(lambda n: [7] * n),  # fills the context
)
text = st.one_of(
    st.text(max_size=60),
    st.integers(CONTEXT, 4 * CONTEXT).map(lambda n: "kv " * n),
)
floats = st.floats(width=32)  # NaN, infinities, subnormals and signed zeros included
wild_sampling = st.builds(
    generation_pb2.SamplingParams,
    temperature=st.one_of(st.none(), floats),
    top_p=st.one_of(st.none(), floats),
    top_k=st.one_of(st.none(), INT32),
    seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    # Small, or past any context: a valid request never decodes for long.
    max_tokens=st.one_of(st.none(), st.integers(-(2**31), 8), st.integers(CONTEXT, 2**31 - 1)),
    stop=st.lists(st.text(max_size=4), max_size=3),
    stop_token_ids=st.lists(st.one_of(st.integers(0, VOCAB - 1), INT32), max_size=3),
    ignore_eos=st.booleans(),
)
# Valid, at the edges: these must run. A temperature of 1e-45 once turned the logits into
# inf / inf = NaN (INTERNAL).
edge_sampling = st.builds(
    generation_pb2.SamplingParams,
    temperature=st.one_of(st.none(), st.sampled_from([0.0, 1e-45, 1e-38, 1e-3, 0.7, 3.4e38])),
    top_p=st.one_of(st.none(), st.sampled_from([1e-45, 0.1, 0.9, 1.0])),
    top_k=st.one_of(st.none(), st.integers(0, VOCAB)),
    seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)),
    max_tokens=st.integers(1, 8),
    stop=st.lists(st.text(min_size=1, max_size=4), max_size=3),
    stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=3),
    ignore_eos=st.booleans(),
)
# At most 32 characters, so at most 128 UTF-8 bytes: the router's default limit
# (--max-request-id-bytes); a longer id is refused by size, not fuzzed here.
request_id = st.one_of(st.just(""), st.just("twin"), st.text(max_size=32))
# One sampling field out of its range (the rest valid), so that each rule is met alone: a
# request with many bad fields shows only that one of them is checked.
one_bad_field = st.one_of(
    st.tuples(st.just("temperature"),
              floats.filter(lambda x: not (math.isfinite(x) and x >= 0))),
    st.tuples(st.just("top_p"), floats.filter(lambda x: not 0 < x <= 1)),
    st.tuples(st.just("top_k"), st.one_of(st.integers(-(2**31), -1),
                                          st.integers(VOCAB + 1, 2**31 - 1))),
    st.tuples(st.just("seed"), st.integers(2**63, 2**64 - 1)),
    st.tuples(st.just("max_tokens"), st.one_of(st.integers(-(2**31), 0),
                                               st.integers(CONTEXT, 2**31 - 1))),
    st.tuples(st.just("stop_token_ids"), st.one_of(st.integers(-(2**31), -1),
                                                   st.integers(VOCAB, 2**31 - 1))),
    st.tuples(st.just("stop"), st.just("")),
)


@st.composite
def requests(draw: st.DrawFn) -> generation_pb2.GenerateRequest:
    """Valid requests at the edges of the sampling ranges, the same with one sampling field
    out of range, and anything at all."""
    msg = generation_pb2.GenerateRequest(request_id=draw(request_id))
    which = draw(st.sampled_from(["edge", "one_bad", "text", "token_ids", "none"]))
    if which in ("edge", "one_bad"):
        msg.sampling.CopyFrom(draw(edge_sampling))
        msg.token_ids.ids.extend(draw(st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                               max_size=40)))
        if which == "one_bad":
            field, bad = draw(one_bad_field)
            if field in ("stop", "stop_token_ids"):
                getattr(msg.sampling, field).append(bad)
            else:
                setattr(msg.sampling, field, bad)
        return msg
    msg.sampling.CopyFrom(draw(st.one_of(edge_sampling, wild_sampling)))
    if which == "text":
        msg.text = draw(text)
    elif which == "token_ids":
        msg.token_ids.ids.extend(draw(token_ids))
    return msg


class Expected(NamedTuple):
    """What the router must answer, worked out from the request alone."""

    prompt: list[int]  # the prompt's token ids (text encoded as the router encodes it)
    bad_fields: frozenset[str]  # empty: the request is valid and must be served
    max_tokens: int  # a valid request's resolved max_tokens


def expect(request: generation_pb2.GenerateRequest, tokenizer: object) -> Expected:
    """The fields of `request` that break the rules the proto documents (generation.proto):
    any of them may be the one the error names. Written from those rules, not from the
    router's code, so that the two check each other."""
    which = request.WhichOneof("input")
    if which == "text" and request.text:
        prompt = list(tokenizer.encode(request.text))  # type: ignore[attr-defined]
    elif which == "token_ids":
        prompt = list(request.token_ids.ids)
    else:
        prompt = []
    bad = set()
    if any(not 0 <= t < VOCAB for t in prompt):
        bad.add("input.token_ids")
    if not prompt or len(prompt) >= CONTEXT:
        bad.add("input")  # empty, or no room left to generate
    if which == "token_ids" and len(prompt) > CONTEXT:
        bad.add("input.token_ids")  # more ids than the context holds, refused by size
    s = request.sampling
    if s.HasField("temperature") and not (math.isfinite(s.temperature) and s.temperature >= 0):
        bad.add("sampling.temperature")
    if s.HasField("top_p") and not 0 < s.top_p <= 1:
        bad.add("sampling.top_p")
    if s.HasField("top_k") and not 0 <= s.top_k <= VOCAB:
        bad.add("sampling.top_k")
    if s.HasField("seed") and s.seed >= 2**63:
        bad.add("sampling.seed")
    room = CONTEXT - len(prompt)
    max_tokens = s.max_tokens if s.HasField("max_tokens") else min(256, room)
    if s.HasField("max_tokens") and not 1 <= s.max_tokens <= room:
        bad.add("sampling.max_tokens")
    if any(not 0 <= t < VOCAB for t in s.stop_token_ids):
        bad.add("sampling.stop_token_ids")
    if "" in s.stop:
        bad.add("sampling.stop")
    return Expected(prompt, frozenset(bad), max_tokens)


def _named_field(details: str) -> str:
    """The field an INVALID_ARGUMENT names: its details begin with it."""
    match = re.match(r"[\w.\[\]]+", details)
    return match.group(0) if match else ""


async def _check(stub: generation_pb2_grpc.GenerationServiceStub,
                 request: generation_pb2.GenerateRequest, expected: Expected,
                 eos_ids: set[int], is_twin: bool) -> str:
    """Send one request and hold its answer to `expected`; returns "served", "refused"
    (invalid, the right field named) or "twin" (valid, refused as a duplicate id)."""
    tokens: list[int] = []
    text, finished = "", None
    try:
        async for msg in stub.Generate(request, timeout=120):
            if msg.HasField("chunk"):
                tokens += msg.chunk.token_ids
                text += msg.chunk.text
            else:
                finished = msg.finished
    except grpc.aio.AioRpcError as exc:
        field = _named_field(exc.details() or "")
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (
            f"{exc.code()}: {exc.details()}\n{request}")
        if expected.bad_fields:
            assert field in expected.bad_fields, (
                f"named {field!r}, expected one of {sorted(expected.bad_fields)}: "
                f"{exc.details()}\n{request}")
            return "refused"
        assert is_twin and field == "request_id", (
            f"valid request refused: {exc.details()}\n{request}")
        return "twin"
    assert not expected.bad_fields, f"served, expected {sorted(expected.bad_fields)}\n{request}"
    assert finished is not None, f"stream ended without its final message\n{request}"
    assert finished.usage.prompt_tokens == len(expected.prompt)
    assert finished.usage.completion_tokens == len(tokens) >= 1
    s = request.sampling
    if finished.reason == generation_pb2.FINISH_REASON_LENGTH:
        assert len(tokens) == expected.max_tokens, request
    else:
        assert finished.reason == generation_pb2.FINISH_REASON_STOP, finished
        assert len(tokens) <= expected.max_tokens
        stop_ids = set(s.stop_token_ids) | (set() if s.ignore_eos else eos_ids)
        assert tokens[-1] in stop_ids or s.stop, f"STOP without a stop condition\n{request}"
    assert not any(stop in text for stop in s.stop), f"{text!r} holds a stop string\n{request}"
    return "served"


async def _send_together(address: str, batch: list[generation_pb2.GenerateRequest],
                         tokenizer: object) -> list[str]:
    ids = Counter(r.request_id for r in batch if r.request_id)
    async with grpc_util.channel(address) as chan:
        stub = generation_pb2_grpc.GenerationServiceStub(chan)
        eos_ids = set((await client.model_info(chan)).eos_token_ids)
        expected = [expect(r, tokenizer) for r in batch]
        outcomes = list(await asyncio.gather(*(
            _check(stub, r, e, eos_ids, ids[r.request_id] > 1)
            for r, e in zip(batch, expected))))
    for request_id in (i for i, n in ids.items() if n > 1):  # of twins, one runs at least
        twins = [o for r, e, o in zip(batch, expected, outcomes)
                 if r.request_id == request_id and not e.bad_fields]
        assert not twins or "served" in twins, twins
    return outcomes


def test_fuzzed_generate_requests(qwen3_deployment: Deployment, qwen3_checkpoint: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(qwen3_checkpoint))  # the router's own
    seen: Counter[str] = Counter()

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.large_base_example])
    @given(batch=st.lists(requests(), min_size=1, max_size=3))  # sent concurrently
    @example(batch=[client.make_request(list(range(10, 50)), temperature=1e-45, max_tokens=4)])
    def check(batch: list[generation_pb2.GenerateRequest]) -> None:
        seen.update(asyncio.run(_send_together(qwen3_deployment.router_address, batch,
                                               tokenizer)))
        assert_alive(qwen3_deployment)

    check()
    assert seen["served"] >= 20 and seen["refused"] >= 20, seen
    assert_pools_clean(qwen3_deployment)
