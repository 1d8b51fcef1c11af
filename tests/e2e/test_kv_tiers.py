"""The K/V tiers end to end.

Host memory: workers restarted with pools of 12 blocks and a host tier; a prompt, then four
others that push it out of every pool, then the prompt again. The second time, each worker
finds its prefix in host memory and copies it back (its host `hit_tokens` grow by the
prompt's full blocks, its pool's prefix hits do not), and the tokens are those of
transformers generate, as the first time. Over gRPC and NIXL between prefill and decode
processes, and on a colocated worker.

Disk: a restart keeps the prefix (disk hits, token-identical), and a flipped bit is dropped."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from deploy import client
from deploy.launcher import Deployment
from kvferry.cache.prefix import block_keys, cache_seed
from kvferry.v1 import worker_pb2
from tests.conftest import (
    DETAILS,
    NIXL,
    QWEN3_BLOCK_BYTES,
    assert_alive,
    assert_pools_clean,
    worker_stats,
)
from tests.deployments import reconfigured, restart, routed
from tests.e2e.test_token_exact import _hf_model, _reference
from tests.waiting import until_sync

pytestmark = pytest.mark.slow

BLOCK = 16  # the deployments' block size (the default)
PROMPT_TOKENS = 5 * BLOCK + 1  # 5 full blocks, and the last token's block
MAX_TOKENS = 8
POOL = f"{12 * QWEN3_BLOCK_BYTES}B"  # 12 blocks: four other prompts push one out
HOST = ["--kv-pool-size", POOL, "--kv-host-cache-size", "64MiB"]
SALT = "test_kv_tiers"

# (shared deployment, its workers restarted with tiers, transport flags): the deployment's
# name is a parameter, so the suite's order sees who uses it (tests/suite_order.py).
# The colocated case is tests/e2e/test_kv_tiers_colocated.py: a module of its own runs with
# the colocated deployment's other users instead of holding it from the first group on.
CASES = [pytest.param("qwen3_deployment", ["prefill-0", "decode-0"], [], id="grpc"),
         pytest.param("qwen3_deployment", ["prefill-0", "decode-0"], NIXL, id="nixl")]


@contextmanager
def tiered(shared: Deployment, names: list[str], flags: list[str], router: str
            ) -> Iterator[Deployment]:
    """`shared`'s workers `names` restarted with `flags`, behind a router of their own;
    restarted as they were afterwards."""
    try:
        with (reconfigured(shared, names, flags, restore=False),
              routed(shared, router, DETAILS) as deployment):
            yield deployment
    finally:
        restart(shared, names)


def _prompt(seed: int, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (PROMPT_TOKENS,), generator=gen).tolist()


def _generate(deployment: Deployment, prompt: list[int]) -> client.Completion:
    request = client.make_request(prompt, temperature=0.0, max_tokens=MAX_TOKENS,
                                  ignore_eos=True)
    request.cache_salt = SALT
    return asyncio.run(client.generate(deployment.router_address, request, 300))


def _host(stats: worker_pb2.WorkerStats) -> worker_pb2.TierStats:
    (host,) = stats.tiers
    assert host.tier == worker_pb2.KV_TIER_HOST
    return host


@pytest.mark.parametrize("fixture, names, transport", CASES)
def test_a_prefix_pushed_out_of_every_pool_comes_back_from_host_memory(
        fixture: str, names: list[str], transport: list[str], qwen3_checkpoint: Path,
        request: pytest.FixtureRequest) -> None:
    shared: Deployment = request.getfixturevalue(fixture)
    with tiered(shared, names, [*HOST, *transport], f"router-tiers-{fixture}") as deployment:
        host_round_trip(deployment, qwen3_checkpoint)


def host_round_trip(tier_deployment: Deployment, qwen3_checkpoint: Path) -> None:
    vocab = _hf_model(qwen3_checkpoint).config.vocab_size
    prompt = _prompt(0, vocab)
    expected = _reference(qwen3_checkpoint, prompt, MAX_TOKENS)
    cold = _generate(tier_deployment, prompt)
    assert cold.token_ids == expected
    assert cold.finished.usage.cached_prompt_tokens == 0
    for seed in range(1, 5):
        _generate(tier_deployment, _prompt(seed, vocab))
    assert_pools_clean(tier_deployment)  # also: every write-through copy has let go
    before = worker_stats(tier_deployment)
    again = _generate(tier_deployment, prompt)
    assert again.token_ids == expected
    usage = again.finished.usage
    assert usage.cached_prompt_tokens == usage.cached_host_tokens == 5 * BLOCK
    assert usage.cached_disk_tokens == usage.cached_store_tokens == 0
    after = worker_stats(tier_deployment)
    for old, new in zip(before, after):
        assert new.prefix_cache_hits == old.prefix_cache_hits, f"{new.role}: a pool hit"
        assert _host(new).hit_tokens - _host(old).hit_tokens == 5 * BLOCK, new.role
        assert _host(new).bytes_out > _host(old).bytes_out
        assert _host(new).num_promotions == _host(old).num_promotions + 1
    assert_pools_clean(tier_deployment)
    assert_alive(tier_deployment)


def _disk(stats: worker_pb2.WorkerStats) -> worker_pb2.TierStats:
    host, disk = stats.tiers
    assert (host.tier, disk.tier) == (worker_pb2.KV_TIER_HOST, worker_pb2.KV_TIER_DISK)
    return disk


def _files_of(root: Path, key: bytes) -> list[Path]:
    return list(root.glob(f"*/*/{key[:1].hex()}/{key.hex()}.kvb"))


def test_a_restarted_deployment_finds_its_prefixes_on_disk_and_drops_a_corrupt_one(
        qwen3_deployment: Deployment, qwen3_checkpoint: Path, tmp_path: Path) -> None:
    """Prefill and decode workers share one disk directory (each takes a subdirectory). Two
    prompts go to disk; both workers restart. The first prompt's blocks are disk hits,
    token-identical; a block of the second whose file had a bit flipped meanwhile ends its
    run there (counted corrupt, deleted, never served) and the rest is computed."""
    names = ["prefill-0", "decode-0"]
    root = tmp_path / "kv"
    flags = [*HOST, "--kv-disk-cache-dir", str(root)]
    vocab = _hf_model(qwen3_checkpoint).config.vocab_size
    prompt, other = _prompt(100, vocab), _prompt(101, vocab)
    expected = _reference(qwen3_checkpoint, prompt, MAX_TOKENS)
    other_expected = _reference(qwen3_checkpoint, other, MAX_TOKENS)
    try:
        with (reconfigured(qwen3_deployment, names, flags, restore=False),
              routed(qwen3_deployment, "router-disk-1", DETAILS) as deployment):
            assert _generate(deployment, prompt).token_ids == expected
            assert _generate(deployment, other).token_ids == other_expected
            until_sync(lambda: all(_disk(s).used_blocks >= 10
                                   for s in worker_stats(deployment)),
                       "both prompts' blocks on every worker's disk")
        layout = worker_stats(qwen3_deployment)[0].layout
        keys = block_keys(other, BLOCK, cache_seed(layout.model_fingerprint, layout.dtype,
                                                   SALT))
        with (reconfigured(qwen3_deployment, names, flags, restore=False),
              routed(qwen3_deployment, "router-disk-2", DETAILS) as deployment):
            before = worker_stats(deployment)
            assert all(_disk(s).used_blocks >= 10 and s.cached_blocks == 0 for s in before)
            again = _generate(deployment, prompt)
            assert again.token_ids == expected
            usage = again.finished.usage
            assert usage.cached_prompt_tokens == usage.cached_disk_tokens == 5 * BLOCK
            after = worker_stats(deployment)
            for old, new in zip(before, after):
                assert _disk(new).hit_tokens - _disk(old).hit_tokens == 5 * BLOCK, new.role
            corrupted = _files_of(root, keys[2])
            assert len(corrupted) == 2  # one per worker's directory
            flipped = {}
            for path in corrupted:
                data = bytearray(path.read_bytes())
                data[len(data) // 2] ^= 0x10
                path.write_bytes(bytes(data))
                flipped[path] = bytes(data)
            third = _generate(deployment, other)
            assert third.token_ids == other_expected
            assert third.finished.usage.cached_prompt_tokens == 2 * BLOCK
            for stats in worker_stats(deployment):
                assert _disk(stats).corrupt_blocks == 1, stats.role
                assert stats.integrity_ok, stats.integrity_error
            # Deleted, then written again from the block computed afresh.
            until_sync(lambda: all(p.exists() and p.read_bytes() != data
                                   for p, data in flipped.items()),
                       "the recomputed block on disk again")
            assert_pools_clean(deployment)
    finally:
        restart(qwen3_deployment, names)
