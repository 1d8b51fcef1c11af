"""Structured output through gRPC Generate: on a disaggregated deployment (the prefill worker
masks the first token, the decode worker follows it and masks the rest) and a colocated one
with n-gram drafts (drafts the mask forbids rejected), greedy tokens under a JSON schema are
those of the in-process engine with the same constraint (checked against a masked
transformers oracle in tests/decode_worker/test_constraints.py); a schema the engine
refuses is INVALID_ARGUMENT naming the field, and no block is left behind."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoTokenizer

from deploy import client
from deploy.launcher import Deployment
from kvferry.model.config import load_model_config
from kvferry.model.grammar import Constraint
from kvferry.model.sampling import SamplingParams
from kvferry.model.transformer import Transformer
from kvferry.v1 import generation_pb2
from kvferry_kernels.dispatch import get_attention_backend
from tests.conftest import assert_pools_clean
from tests.decode_worker.engines import collect_tokens, cpu_engine, run_to_idle
from tests.decode_worker.test_constraints import SCHEMA, _prompt

pytestmark = pytest.mark.slow
MAX_TOKENS = 40


def _in_process(checkpoint: Path, prompt: list[int], constraint: Constraint) -> list[int]:
    config = load_model_config(checkpoint)
    engine = cpu_engine(Transformer(config, get_attention_backend("torch"), torch.float32,
                                    torch.device("cpu")), 16, 32)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, constraint=constraint)

    async def body() -> list[int]:
        await engine.reserve("A", len(prompt), MAX_TOKENS, 60.0, prompt)
        first, *_ = await engine.prefill_local("A", prompt, params)
        queue = engine.attach("A", first, params, MAX_TOKENS - 1, list(config.eos_token_ids))
        return await collect_tokens(queue, "A", [first])

    return run_to_idle(engine, body)


@pytest.mark.parametrize("fixture", ["qwen3_deployment", "colocated_deployment"])
def test_constrained_greedy_tokens_are_the_in_process_engines(
        fixture: str, qwen3_checkpoint: Path, request: pytest.FixtureRequest) -> None:
    deployment: Deployment = request.getfixturevalue(fixture)
    prompt = _prompt(qwen3_checkpoint)
    schema = json.dumps(SCHEMA)
    want = _in_process(qwen3_checkpoint, prompt, Constraint("json_schema", schema))
    got = asyncio.run(client.generate(deployment.router_address, client.make_request(
        prompt, temperature=0.0, max_tokens=MAX_TOKENS,
        constraint=generation_pb2.Constraint(json_schema=schema)), 120))
    plain = asyncio.run(client.generate(deployment.router_address, client.make_request(
        prompt, temperature=0.0, max_tokens=MAX_TOKENS), 120))
    assert got.token_ids == want and got.token_ids != plain.token_ids
    text = AutoTokenizer.from_pretrained(qwen3_checkpoint).decode(got.token_ids,
                                                                  skip_special_tokens=True)
    assert set(json.loads(text)) == {"name", "age", "ok"}
    assert_pools_clean(deployment)


def test_a_schema_the_engine_refuses_is_invalid_argument_naming_the_field(
        qwen3_deployment: Deployment) -> None:
    bad = generation_pb2.Constraint(json_schema=json.dumps({"type": "nonsense"}))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        asyncio.run(client.generate(qwen3_deployment.router_address, client.make_request(
            [5, 6, 7], max_tokens=4, constraint=bad), 60))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.constraint.json_schema" in (refused.value.details() or "")
    assert "nonsense" in (refused.value.details() or "")
    ignoring = generation_pb2.Constraint(regex="a+")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        asyncio.run(client.generate(qwen3_deployment.router_address, client.make_request(
            [5, 6, 7], max_tokens=4, ignore_eos=True, constraint=ignoring), 60))
    assert "sampling.ignore_eos" in (refused.value.details() or "")
    assert_pools_clean(qwen3_deployment)


def test_forked_samples_each_follow_their_own_output(qwen3_deployment: Deployment,
                                                     qwen3_checkpoint: Path) -> None:
    """n samples of one constrained prompt (first tokens drawn by the prefill worker from one
    masked row, then forked on the decode worker, each with a matcher of its own): each is
    valid, and sample i equals a request of its own with seed + i."""
    schema = json.dumps(SCHEMA)
    constraint = generation_pb2.Constraint(json_schema=schema)
    prompt = _prompt(qwen3_checkpoint)
    sampling = dict(temperature=1.0, max_tokens=MAX_TOKENS, constraint=constraint)
    samples = asyncio.run(client.generate_samples(qwen3_deployment.router_address,
                                                  client.make_request(prompt, n=3, seed=11,
                                                                      **sampling), 120))
    alone = [asyncio.run(client.generate(qwen3_deployment.router_address, client.make_request(
        prompt, seed=11 + i, **sampling), 120)) for i in range(3)]
    tokenizer = AutoTokenizer.from_pretrained(qwen3_checkpoint)
    for sample, single in zip(samples, alone):
        assert sample.token_ids == single.token_ids
        answer = json.loads(tokenizer.decode(sample.token_ids, skip_special_tokens=True))
        assert set(answer) == {"name", "age", "ok"}
    assert len({tuple(s.token_ids) for s in samples}) > 1  # sampled, not one answer thrice
    assert_pools_clean(qwen3_deployment)
