"""Streaming K/V eviction (`--kv-eviction streaming`) on a live deployment: the shared
deployment's decode worker restarted with a budget of 4 sink and 60 window tokens (1 + 4
blocks of 16) serves a greedy request whose prompt alone is past the budget and whose
generation runs far past it: every token arrives, the worker gave up what the budget did not
hold (`kvferry_kv_evicted_blocks_total`), and every pool is clean afterwards. (Each step's
bound is tested in tests/decode_worker/test_streaming_eviction.py.)"""

from __future__ import annotations

import asyncio

import pytest

from deploy import client
from deploy.launcher import Deployment
from tests.conftest import assert_alive, assert_pools_clean
from tests.deployments import reconfigured
from tests.e2e.test_metrics import scrape, value

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
BUDGET_BLOCKS = 1 + 4


def test_streaming_eviction_serves_far_past_its_budget(qwen3_deployment: Deployment) -> None:
    deployment = qwen3_deployment
    flags = ["--kv-eviction", "streaming", "--kv-sink-tokens", "4", "--kv-window-tokens", "60"]
    with reconfigured(deployment, ["decode-0"], flags):
        prompt = [7 + i % 300 for i in range(100)]  # 7 blocks: past the budget on arrival
        request = client.make_request(prompt, temperature=0.0, max_tokens=300, ignore_eos=True)
        got = asyncio.run(client.generate(deployment.router_address, request, 300))
        assert got.finished is not None and len(got.token_ids) == 300
        decode = next(p for p in deployment.processes if p.name == "decode-0")
        evicted = value(scrape(decode.metrics_port), "kvferry_kv_evicted_blocks_total")
        # The last token's position is 398: 25 blocks written, at most the budget's kept.
        written = -(-(len(prompt) + 299) // BLOCK_SIZE)
        assert evicted >= written - BUDGET_BLOCKS, (evicted, written)
        assert_pools_clean(deployment)
        assert_alive(deployment)
