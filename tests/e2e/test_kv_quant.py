"""Quantized K/V end to end: router, prefill and decode processes with
int8 pages on gRPC and fp8 (e4m3) pages on NIXL (the shared deployment's workers, restarted
so). Greedy tokens equal an in-process reference that uses the same quantization
(transformers generate whose cache stores K/V fake-quantized by the formula written out in
tests/kvferry/model/test_quant_model.py, not by kvferry's quantizer), so any difference is a
bug, not rounding; a second round of the same requests finds every full block but the last
token's in the prefix cache and gives the same tokens; every pool ends all free. A decode
worker's stats name its K/V dtype.

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
from tests.conftest import DETAILS, assert_alive, assert_pools_clean, worker_stats
from tests.deployments import reconfigured, restart, routed
from tests.kvferry.model.test_quant_model import (
    NEW_TOKENS,
    _oracle,
    _prompt,
    quantizing_cache,  # noqa: F401 - fixture
)

pytestmark = pytest.mark.slow

PROMPT_LENGTHS = [1, 17, 40, 100, 200]
BLOCK = 16  # the deployments' block size (the default)


WORKERS = ["prefill-0", "decode-0"]


@pytest.fixture(scope="module")
def quant_workers(qwen3_deployment: Deployment) -> Iterator[Deployment]:
    """The shared deployment, whose workers each case restarts with its pages and transport;
    restarted as they were after the last case."""
    yield qwen3_deployment
    restart(qwen3_deployment, WORKERS)


@pytest.fixture(scope="module", params=[("grpc", "int8"), ("nixl", "fp8_e4m3")],
                ids=["grpc-int8", "nixl-fp8"])
def quant_deployment(request: pytest.FixtureRequest, quant_workers: Deployment
                     ) -> Iterator[Deployment]:
    """The workers restarted with quantized pages, behind a router of their own (the shared
    router, which knew their fp32 layout, refuses them meanwhile)."""
    transport, kv_dtype = request.param
    with (reconfigured(quant_workers, WORKERS, ["--kv-cache-dtype", kv_dtype,
                                                "--kv-transport", transport], restore=False),
          routed(quant_workers, f"router-{kv_dtype}", DETAILS) as deployment):
        deployment.kv_dtype = kv_dtype  # type: ignore[attr-defined]
        yield deployment


def _requests() -> list[generation_pb2.GenerateRequest]:
    requests = [client.make_request(_prompt(n), temperature=0.0, max_tokens=NEW_TOKENS,
                                    ignore_eos=True) for n in PROMPT_LENGTHS]
    for request in requests:
        request.cache_salt = "test_kv_quant"
    return requests


def _one_at_a_time(deployment: Deployment) -> list[client.Completion]:
    return [asyncio.run(client.generate(deployment.router_address, r, 300))
            for r in _requests()]


def test_quantized_pages_through_the_processes_match_the_quantizing_reference(
        quant_deployment: Deployment, qwen3_checkpoint: Path,
        quantizing_cache: list[str]) -> None:  # noqa: F811 - the imported fixture
    kv_dtype = quant_deployment.kv_dtype  # type: ignore[attr-defined]
    hf = AutoModelForCausalLM.from_pretrained(qwen3_checkpoint, dtype=torch.float32).eval()
    quantizing_cache.append(kv_dtype)
    expected = [_oracle(hf, _prompt(n)).tokens for n in PROMPT_LENGTHS]
    first = _one_at_a_time(quant_deployment)
    assert [c.token_ids for c in first] == expected
    again = _one_at_a_time(quant_deployment)
    assert [c.token_ids for c in again] == expected
    # The second round found every full block but the one holding the prompt's last token.
    assert [c.finished.usage.cached_prompt_tokens for c in first] == [0] * len(PROMPT_LENGTHS)
    assert [c.finished.usage.cached_prompt_tokens for c in again] == [
        (n - 1) // BLOCK * BLOCK for n in PROMPT_LENGTHS]
    int8_deployment = quant_deployment
    together = asyncio.run(client.generate_many(int8_deployment.router_address, _requests(),
                                                300))
    assert [len(r.token_ids) for r in together] == [NEW_TOKENS] * len(PROMPT_LENGTHS)
    assert {client.finish_reason_name(r.finished) for r in together} == {"FINISH_REASON_LENGTH"}
    stats = worker_stats(int8_deployment)
    assert {s.layout.dtype for s in stats} == {kv_dtype}
    assert_pools_clean(int8_deployment)
    assert_alive(int8_deployment)
