"""Quantized K/V end to end (issue 21, acceptance 4): router, prefill and decode processes
with int8 pages on gRPC and on NIXL. Greedy tokens equal an in-process reference that uses
the same quantization (transformers generate whose cache stores K/V fake-quantized as
kvferry's pages hold it), so any difference is a bug, not rounding; a second round of the
same requests (its prompts now in the decode worker's prefix cache) gives the same tokens;
every pool ends all free. A decode worker's stats name its K/V dtype.

The exact rounds send one request at a time. The decode step is not batch-invariant (nor is
vLLM's or SGLang's by default): a row's logits differ by ~1e-6 between a batch of 1 and a
batch of 5, and a K or V value that lands on a rounding edge then takes the next int8 code,
a 1/127 step that can flip this random model's near-tied greedy choices. A concurrent round
of the same requests, whose batches depend on timing, is checked for what holds whatever
the batches: every request completes with all its tokens and the pools end clean."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from deploy import client
from deploy.launcher import Deployment
from kvferry.v1 import generation_pb2
from tests.conftest import ORACLE_DTYPE, assert_alive, assert_pools_clean, worker_stats
from tests.kvferry.model.test_quant_model import (
    NEW_TOKENS,
    _oracle,
    _prompt,
    quantizing_cache,  # noqa: F401 - fixture
)

pytestmark = pytest.mark.slow

PROMPT_LENGTHS = [1, 17, 40, 100, 200]
INT8 = ["--kv-cache-dtype", "int8"]


def _deployment(checkpoint: Path, log_dir: Path, transport: str) -> Deployment:
    return Deployment(model=str(checkpoint), log_dir=log_dir,
                      worker_args=[*ORACLE_DTYPE, *INT8, "--kv-transport", transport]).start()


@pytest.fixture(scope="module", params=["grpc", "nixl"])
def int8_deployment(request: pytest.FixtureRequest, qwen3_checkpoint: Path,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    deployment = _deployment(qwen3_checkpoint, tmp_path_factory.mktemp(
        f"int8-{request.param}-logs"), request.param)
    yield deployment
    deployment.stop()


def _requests() -> list[generation_pb2.GenerateRequest]:
    return [client.make_request(_prompt(n), temperature=0.0, max_tokens=NEW_TOKENS,
                                ignore_eos=True) for n in PROMPT_LENGTHS]


def _one_at_a_time(deployment: Deployment) -> list[list[int]]:
    return [asyncio.run(client.generate(deployment.router_address, r, 300)).token_ids
            for r in _requests()]


def test_int8_pages_through_the_processes_match_the_quantizing_reference(
        int8_deployment: Deployment, qwen3_checkpoint: Path,
        quantizing_cache: list[str]) -> None:  # noqa: F811 - the imported fixture
    hf = AutoModelForCausalLM.from_pretrained(qwen3_checkpoint, dtype=torch.float32).eval()
    quantizing_cache.append("int8")
    expected = [_oracle(hf, _prompt(n)) for n in PROMPT_LENGTHS]
    first = _one_at_a_time(int8_deployment)
    assert first == expected
    assert _one_at_a_time(int8_deployment) == first  # prefix cache hit or not
    together = asyncio.run(client.generate_many(int8_deployment.router_address, _requests(),
                                                300))
    assert [len(r.token_ids) for r in together] == [NEW_TOKENS] * len(PROMPT_LENGTHS)
    assert {client.finish_reason_name(r.finished) for r in together} == {"FINISH_REASON_LENGTH"}
    stats = worker_stats(int8_deployment)
    assert {s.layout.dtype for s in stats} == {"int8"}
    assert_pools_clean(int8_deployment)
    assert_alive(int8_deployment)
