"""Two prefill workers sharing the K/V store: a prompt prefilled on
prefill-0 writes its blocks through host memory to the store; the same prompt sent to
prefill-1 (which never saw it) finds them there: its store hits grow by the prompt's full
blocks and its store bytes out by as many blocks' bytes, and the tokens are those of
transformers generate."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from deploy import client
from deploy.launcher import Deployment
from kvferry.v1 import worker_pb2
from tests.conftest import DETAILS, QWEN3_BLOCK_BYTES, assert_pools_clean, worker_stats
from tests.deployments import reconfigured, routed
from tests.e2e.test_token_exact import _hf_model, _reference
from tests.waiting import until_sync

pytestmark = pytest.mark.slow

BLOCK = 16
PROMPT_TOKENS = 6 * BLOCK + 3
MAX_TOKENS = 6


def _store(stats: worker_pb2.WorkerStats) -> worker_pb2.TierStats:
    (store,) = [t for t in stats.tiers if t.tier == worker_pb2.KV_TIER_STORE]
    return store


def _generate(deployment: Deployment, prompt: list[int]) -> client.Completion:
    request = client.make_request(prompt, temperature=0.0, max_tokens=MAX_TOKENS,
                                  ignore_eos=True)
    request.cache_salt = "test_kv_store_shared"
    return asyncio.run(client.generate(deployment.router_address, request, 300))


def test_a_prefix_computed_on_one_prefill_worker_is_a_store_hit_on_the_other(
        qwen3_2p2d_deployment: Deployment, kv_store: str, qwen3_checkpoint: Path) -> None:
    shared = qwen3_2p2d_deployment
    vocab = _hf_model(qwen3_checkpoint).config.vocab_size
    prompt = torch.randint(1, vocab, (PROMPT_TOKENS,),
                           generator=torch.Generator().manual_seed(7)).tolist()
    expected = _reference(qwen3_checkpoint, prompt, MAX_TOKENS)
    flags = ["--kv-host-cache-size", "32MiB", "--kv-store-url", kv_store]
    with reconfigured(shared, ["prefill-0", "prefill-1"], flags):
        with routed(shared, "router-store-0", DETAILS, only=["prefill-0", "decode-0"]) as first:
            assert _generate(first, prompt).token_ids == expected
            until_sync(lambda: _store(worker_stats(first)[0]).used_blocks >= 6,
                       "prefill-0's blocks in the store")
            (written,) = [_store(s) for s in worker_stats(first) if s.role == "prefill"]
            assert written.bytes_in == 6 * QWEN3_BLOCK_BYTES
        with routed(shared, "router-store-1", DETAILS, only=["prefill-1", "decode-1"]) as other:
            (before,) = [_store(s) for s in worker_stats(other) if s.role == "prefill"]
            again = _generate(other, prompt)
            assert again.token_ids == expected
            usage = again.finished.usage
            assert usage.cached_prompt_tokens == usage.cached_store_tokens == 6 * BLOCK
            (after,) = [_store(s) for s in worker_stats(other) if s.role == "prefill"]
            assert after.hit_tokens - before.hit_tokens == 6 * BLOCK
            assert after.bytes_out - before.bytes_out == 6 * QWEN3_BLOCK_BYTES
            assert after.corrupt_blocks == 0 and after.state == 0
            assert_pools_clean(other)
