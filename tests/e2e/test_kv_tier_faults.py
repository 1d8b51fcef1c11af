"""K/V tier faults through worker processes: a disk that fills up
(an injected cap) turns its tier read-only with one warning; a worker killed with SIGKILL
while blocks are being written to disk leaves none of them visible after its restart; a
block file forged as NaNs under valid CRCs is dropped and counted, never served; a
store server that stops mid-run disables its tier and serving goes on, and it is enabled
again once the server is back. Every answer is transformers' greedy tokens, every pool ends
free and passes its integrity check."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
import torch

from deploy import client
from deploy.launcher import Deployment
from deploy.store_server import StoreServer
from kvferry.cache.tiers import codec
from kvferry.v1 import worker_pb2
from tests.conftest import DETAILS, QWEN3_BLOCK_BYTES, assert_pools_clean, worker_stats
from tests.deployments import reconfigured, restart, routed
from tests.e2e.test_token_exact import _hf_model, _reference
from tests.waiting import until_sync

pytestmark = pytest.mark.slow

BLOCK = 16
NAMES = ["prefill-0", "decode-0"]
HOST = ["--kv-host-cache-size", "32MiB"]
MAX_TOKENS = 6
FILE_BYTES = codec.HEADER_BYTES + QWEN3_BLOCK_BYTES


def _prompt(seed: int, vocab: int, num_tokens: int = 5 * BLOCK + 1) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (num_tokens,), generator=gen).tolist()


def _generate(deployment: Deployment, prompt: list[int]) -> client.Completion:
    request = client.make_request(prompt, temperature=0.0, max_tokens=MAX_TOKENS,
                                  ignore_eos=True)
    request.cache_salt = "test_kv_tier_faults"
    return asyncio.run(client.generate(deployment.router_address, request, 300))


def _tier(stats: worker_pb2.WorkerStats, tier: int) -> worker_pb2.TierStats:
    (found,) = [t for t in stats.tiers if t.tier == tier]
    return found


def test_a_full_disk_turns_read_only_with_one_warning(
        qwen3_deployment: Deployment, qwen3_checkpoint: Path, tmp_path: Path) -> None:
    vocab = _hf_model(qwen3_checkpoint).config.vocab_size
    flags = [*HOST, "--kv-disk-cache-dir", str(tmp_path / "kv")]
    prompts = [_prompt(seed, vocab) for seed in (1, 2)]
    try:
        with (reconfigured(qwen3_deployment, NAMES, flags, restore=False, extra_env={
                "KVFERRY_FAULT_DISK_FULL_AFTER_BYTES": str(3 * FILE_BYTES)}),
              routed(qwen3_deployment, "router-disk-full", DETAILS) as deployment):
            for prompt in prompts:
                assert _generate(deployment, prompt).token_ids == _reference(
                    qwen3_checkpoint, prompt, MAX_TOKENS)
            until_sync(lambda: all(_tier(s, worker_pb2.KV_TIER_DISK).state == 1
                                   for s in worker_stats(deployment)), "every disk full")
            for stats in worker_stats(deployment):
                disk = _tier(stats, worker_pb2.KV_TIER_DISK)
                assert disk.used_blocks == 3 and disk.dropped_writes > 0, stats.role
            assert_pools_clean(deployment)
        for name in NAMES:
            log = (qwen3_deployment.log_dir / f"{name}.log").read_text()
            assert log.count("is full: it serves") == 1, name
    finally:
        restart(qwen3_deployment, NAMES)


def test_kill_9_during_disk_writes_leaves_no_block_visible(
        qwen3_deployment: Deployment, qwen3_checkpoint: Path, tmp_path: Path) -> None:
    vocab = _hf_model(qwen3_checkpoint).config.vocab_size
    root = tmp_path / "kv"
    flags = [*HOST, "--kv-disk-cache-dir", str(root)]
    prompt = _prompt(3, vocab)
    expected = _reference(qwen3_checkpoint, prompt, MAX_TOKENS)
    try:
        with (reconfigured(qwen3_deployment, NAMES, flags, restore=False, extra_env={
                "KVFERRY_FAULT_TIER_WRITE_DELAY_S": "120"}) as workers,
              routed(qwen3_deployment, "router-disk-kill", DETAILS) as deployment):
            assert _generate(deployment, prompt).token_ids == expected
            until_sync(lambda: len(list(root.glob("*/*/tmp/*"))) >= 2,
                       "each worker's first block half-written")
            for proc in workers:
                os.kill(proc.popen.pid, signal.SIGKILL)
                proc.popen.wait()
        with (reconfigured(qwen3_deployment, NAMES, flags, restore=False),
              routed(qwen3_deployment, "router-disk-kill-2", DETAILS) as deployment):
            for stats in worker_stats(deployment):
                assert _tier(stats, worker_pb2.KV_TIER_DISK).used_blocks == 0, stats.role
            assert not list(root.glob("*/*/tmp/*")) and not list(root.glob("*/*/*/*.kvb"))
            again = _generate(deployment, prompt)
            assert again.token_ids == expected
            assert again.finished.usage.cached_prompt_tokens == 0
            assert_pools_clean(deployment)
    finally:
        restart(qwen3_deployment, NAMES)


def _forge_non_finite(path: Path) -> None:
    """A block file rewritten as NaNs (0xFF bytes: NaN in fp32, bf16 and fp16) under a header
    and CRCs recomputed to match: nothing secret is needed to do it."""
    data = path.read_bytes()
    layout, key = data[8:16], data[16:32]
    payload = b"\xff" * (len(data) - codec.HEADER_BYTES)
    path.write_bytes(codec.header(layout, key, memoryview(payload)) + payload)


def test_a_forged_disk_block_is_dropped_and_the_answer_stays_exact(
        qwen3_deployment: Deployment, qwen3_checkpoint: Path, tmp_path: Path) -> None:
    vocab = _hf_model(qwen3_checkpoint).config.vocab_size
    root = tmp_path / "kv"
    flags = [*HOST, "--kv-disk-cache-dir", str(root)]
    prompt = _prompt(7, vocab)
    expected = _reference(qwen3_checkpoint, prompt, MAX_TOKENS)
    try:
        with (reconfigured(qwen3_deployment, NAMES, flags, restore=False),
              routed(qwen3_deployment, "router-disk-forged", DETAILS) as deployment):
            assert _generate(deployment, prompt).token_ids == expected
            until_sync(lambda: len({p.parents[1] for p in root.glob("*/*/*/*.kvb")}) == 2,
                       "both workers' blocks on disk")
        with (reconfigured(qwen3_deployment, NAMES, flags, restore=False),
              routed(qwen3_deployment, "router-disk-forged-2", DETAILS) as deployment):
            files = list(root.glob("*/*/*/*.kvb"))
            for path in files:  # after the restart's scan: found by size, checked at read
                _forge_non_finite(path)
            again = _generate(deployment, prompt)
            assert again.token_ids == expected
            assert again.finished.usage.cached_prompt_tokens == 0
            corrupt = [_tier(s, worker_pb2.KV_TIER_DISK).corrupt_blocks
                       for s in worker_stats(deployment)]
            assert all(n >= 1 for n in corrupt), corrupt
            assert_pools_clean(deployment)
    finally:
        restart(qwen3_deployment, NAMES)


def test_a_store_that_stops_mid_run_is_disabled_then_enabled_again(
        qwen3_deployment: Deployment, qwen3_checkpoint: Path, tmp_path: Path) -> None:
    vocab = _hf_model(qwen3_checkpoint).config.vocab_size
    server = StoreServer(tmp_path / "store", 64 << 20).start()
    flags = [*HOST, "--kv-store-url", server.url]
    prompts = [_prompt(seed, vocab) for seed in (4, 5, 6)]

    def states(deployment: Deployment) -> set[int]:
        return {_tier(s, worker_pb2.KV_TIER_STORE).state for s in worker_stats(deployment)}

    try:
        with (reconfigured(qwen3_deployment, NAMES, flags, restore=False),
              routed(qwen3_deployment, "router-store-down", DETAILS) as deployment):
            for i, prompt in enumerate(prompts):
                if i == 1:
                    server.stop()
                if i == 2:
                    server.start()
                    until_sync(lambda: states(deployment) == {0}, "the store enabled again")
                assert _generate(deployment, prompt).token_ids == _reference(
                    qwen3_checkpoint, prompt, MAX_TOKENS)
                if i == 1:
                    until_sync(lambda: states(deployment) == {2}, "the store disabled")
            assert_pools_clean(deployment)
        for name in NAMES:
            log = (qwen3_deployment.log_dir / f"{name}.log").read_text()
            assert log.count("unreachable") == 1 and "answers again: enabled" in log, name
    finally:
        server.stop()
        restart(qwen3_deployment, NAMES)
