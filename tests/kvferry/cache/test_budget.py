"""One K/V budget (kvferry/cache/budget.py): the router's admission, a decode worker's
reservation and `kvferry plan` agree on what a request holds at most, for every eviction
policy. Each is asked through its own interface: the router admits a request into the
smallest pool that holds it and no smaller; a decode pool of exactly that many usable
blocks accepts the Reserve and one block less refuses it; the plan prints that count."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decode_worker.sequence import check_reservation
from deploy.cli import main
from kvferry.cache.budget import KvBudget, blocks_needed
from kvferry.cache.capacity import plan
from kvferry.cache.layout import KvLayout, KvShape
from kvferry.cache.pool import KvPool
from kvferry.errors import InvalidArgument, ResourceExhausted
from kvferry.settings import KvEvictionConfig
from router.downstream import Downstream
from router.policies.routing import HeadroomPolicy
from router.workers.registry import WorkerSet
from router.workers.worker import Worker

BLOCK_SIZE = 16
POLICIES = {
    "none": KvEvictionConfig(),
    "streaming": KvEvictionConfig("streaming", sink_tokens=4, window_tokens=60),  # 1 + 4
    "h2o": KvEvictionConfig("h2o", heavy_tokens=40, recent_tokens=60),  # 3 + 4 blocks
}
POLICY_FLAGS = {
    "none": [],
    "streaming": ["--kv-eviction", "streaming", "--kv-sink-tokens", "4",
                  "--kv-window-tokens", "60"],
    "h2o": ["--kv-eviction", "h2o", "--kv-heavy-tokens", "40", "--kv-recent-tokens", "60"],
}
# (prompt tokens, max tokens, samples): short and long prompts, generation inside the budget
# and far past the pool, one sample and several.
REQUESTS = [(20, 10, 1), (20, 2000, 1), (150, 3000, 1), (40, 500, 3), (300, 4, 2)]


def _router_admits(budget: KvBudget, prompt: int, max_tokens: int, samples: int,
                   pool_blocks: int) -> bool:
    workers = WorkerSet("fp")
    workers.workers.append(Worker("d0", "decode", channel=None,
                                  layout=KvLayout(2, 2, 32, BLOCK_SIZE, "float32", "fp"),
                                  total_blocks=pool_blocks, is_healthy=True))
    try:
        Downstream(workers, HeadroomPolicy(), 30.0, 30.0, budget).check_fits(
            prompt, max_tokens, samples)
    except InvalidArgument:
        return False
    return True


def _pool_reserves(budget: KvBudget, prompt: int, max_tokens: int, samples: int,
                   usable_blocks: int) -> bool:
    pool = KvPool(1, 1, 4, BLOCK_SIZE, usable_blocks, torch.float32)
    assert pool.num_usable_blocks == usable_blocks
    try:
        check_reservation("r", prompt, max_tokens, 30.0, {}, 1 << 20, pool, samples, budget)
    except ResourceExhausted:
        return False
    return True


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_router_pool_and_plan_agree_on_a_requests_blocks(policy: str) -> None:
    budget = KvBudget(POLICIES[policy])
    for prompt, max_tokens, samples in REQUESTS:
        most = budget.blocks(prompt, max_tokens, BLOCK_SIZE, samples)
        case = (policy, prompt, max_tokens, samples, most)
        assert _router_admits(budget, prompt, max_tokens, samples, most), case
        assert not _router_admits(budget, prompt, max_tokens, samples, most - 1), case
        assert _pool_reserves(budget, prompt, max_tokens, samples, most), case
        assert not _pool_reserves(budget, prompt, max_tokens, samples, most - 1), case
        if samples == 1:
            shape = KvShape(2, 2, 32, "float32")
            assert plan(shape, prompt, max_tokens, 1, 0, BLOCK_SIZE,
                        budget).blocks_per_request == most, case


def test_eviction_bounds_generation_past_any_pool_and_opting_out_does_not() -> None:
    budget = KvBudget(POLICIES["streaming"])
    assert budget.blocks(20, 100_000, BLOCK_SIZE) == 5  # the sinks' block and 4 of window
    assert budget.blocks(150, 100_000, BLOCK_SIZE) == 10  # the prompt pushed whole first
    assert budget.blocks(20, 100_000, BLOCK_SIZE, keeps_all=True) == blocks_needed(
        20, 100_000, BLOCK_SIZE)
    assert budget.blocks(20, 10, BLOCK_SIZE) == 2  # short: what it writes
    assert KvBudget().bounded_blocks(BLOCK_SIZE) is None and not KvBudget().is_bounded


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_kvferry_plan_prints_the_same_count(policy: str, qwen3_checkpoint: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    prompt, max_tokens = 150, 3000
    assert main(["plan", "--model", str(qwen3_checkpoint), "--dtype", "float32",
                 "--block-size", str(BLOCK_SIZE), "--prompt-tokens", str(prompt),
                 "--output-tokens", str(max_tokens), "--pool-size", "64MiB",
                 *POLICY_FLAGS[policy]]) == 0
    most = KvBudget(POLICIES[policy]).blocks(prompt, max_tokens, BLOCK_SIZE)
    assert f"block size {BLOCK_SIZE}: {most:,} blocks per request" in capsys.readouterr().out
