"""Penalties and biases through gRPC Generate: on a disaggregated deployment (the prefill
worker penalizes the first token, the decode worker the rest, reading the prompt the
reservation carries) and a colocated one with n-gram drafts, greedy tokens under
`repetition_penalty`, `presence_penalty`, `frequency_penalty` and `logit_bias` are those of
the in-process engine with the same parameters (checked against transformers in
tests/decode_worker/test_penalties.py), and differ from those without them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from deploy import client
from deploy.launcher import Deployment
from kvferry.model.config import load_model_config
from kvferry.model.sampling import SamplingParams
from kvferry.model.transformer import Transformer
from kvferry_kernels.dispatch import get_attention_backend
from tests.conftest import assert_pools_clean
from tests.decode_worker.engines import cpu_engine, generate_local, run_to_idle

pytestmark = pytest.mark.slow

PROMPT = [19 + (i * 5) % 11 for i in range(30)]
PENALTIES = dict(repetition_penalty=1.25, presence_penalty=0.5, frequency_penalty=0.75)


@pytest.mark.parametrize("fixture", ["qwen3_deployment", "colocated_deployment"])
def test_penalized_greedy_tokens_are_the_in_process_engines(
        fixture: str, qwen3_checkpoint: Path, request: pytest.FixtureRequest) -> None:
    deployment: Deployment = request.getfixturevalue(fixture)
    model = Transformer(load_model_config(qwen3_checkpoint), get_attention_backend("torch"),
                        torch.float32, torch.device("cpu"))
    bias = ((PROMPT[-1], -100.0),)
    params = SamplingParams(temperature=0.0, ignore_eos=True, logit_bias=bias, **PENALTIES)
    engine = cpu_engine(model, 16, 32)
    want = run_to_idle(engine, lambda: generate_local(engine, "A", PROMPT, 20, params))
    generate = client.make_request(PROMPT, temperature=0.0, max_tokens=20, ignore_eos=True,
                                   logit_bias=dict(bias), **PENALTIES)
    got = asyncio.run(client.generate(deployment.router_address, generate, 120))
    plain = asyncio.run(client.generate(deployment.router_address, client.make_request(
        PROMPT, temperature=0.0, max_tokens=20, ignore_eos=True), 120))
    assert got.token_ids == want and got.token_ids != plain.token_ids
    assert PROMPT[-1] not in got.token_ids
    assert_pools_clean(deployment)
