"""`--tensor-parallel-size` on workers and `serve`'s per-side sizes: what is refused (one line,
exit status 2, naming the flag), what reaches the settings and the launched workers, and a
worker's model built split: its pool sized per rank, whole pages read and written through
every rank. The tokens through the processes: tests/e2e/test_tensor_parallel_workers.py."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch

from deploy import cli
from deploy.args import build_parser, worker_settings
from deploy.worker_model import build_model
from kvferry.cache.pool import KvPool
from kvferry.model.config import load_model_config
from kvferry.settings import WorkerSettings
from tests.deploy.test_max_model_len import one_line, run_cli


@pytest.mark.parametrize(("field", "value", "named"), [
    ("compile", "default", "compile"),  # a bucket mode (dynamic, the default, runs eager)
    ("decode_stage_mib", 64, "decode_stage_mib"),
])
def test_what_a_split_worker_does_not_do_yet_is_refused_by_name(field: str, value: object,
                                                                 named: str) -> None:
    with pytest.raises(ValueError, match=f"^{named}: not with tensor_parallel_size 2 yet"):
        WorkerSettings(role="decode", model="m", tensor_parallel_size=2, **{field: value})
    WorkerSettings(role="decode", model="m", **{field: value})  # alone: fine


def _eviction(policy: str) -> object:
    return worker_settings(build_parser().parse_args(
        ["decode-worker", "--model", "m", "--kv-eviction", policy])).kv_eviction


def test_eviction_and_tiers_are_taken_by_a_split_worker() -> None:
    args = build_parser().parse_args(["decode-worker", "--model", "m",
                                      "--tensor-parallel-size", "2"])
    settings = worker_settings(args)
    assert settings.tensor_parallel_size == 2
    for policy in ("streaming", "h2o"):
        changed = dataclasses.replace(settings, kv_eviction=_eviction(policy))
        assert changed.kv_eviction.policy == policy
    tiers = dataclasses.replace(settings.tiers, host_cache_size="64MiB")
    assert dataclasses.replace(settings, tiers=tiers).tiers.host_cache_size == "64MiB"
    with pytest.raises(ValueError, match="^tensor_parallel_size: must be >= 1, got 0"):
        dataclasses.replace(settings, tensor_parallel_size=0)


@pytest.mark.parametrize("argv", [
    ["decode-worker", "--tensor-parallel-size", "3"],
    ["prefill-worker", "--tensor-parallel-size", "8"],
    ["serve", "--decode-tensor-parallel-size", "3", "--port", "0"],
    ["serve", "--prefill-tensor-parallel-size", "3", "--port", "0"],
], ids=["decode-3", "prefill-8", "serve-decode-3", "serve-prefill-3"])
def test_a_size_that_does_not_split_the_model_refuses_to_start(
        argv: list[str], qwen3_checkpoint: Path, tmp_path: Path) -> None:
    line = one_line(run_cli([*argv, "--model", str(qwen3_checkpoint)], tmp_path))
    assert line.startswith("kvferry: tensor_parallel_size: "), line
    assert "does not split this model" in line and "4 attention heads" in line


def test_serve_gives_each_side_its_size() -> None:
    args = build_parser().parse_args(["serve", "--model", "m",
                                      "--prefill-tensor-parallel-size", "2",
                                      "--decode-tensor-parallel-size", "4"])
    deployment = cli._deployment(args)
    for role, size in (("prefill", "2"), ("decode", "4")):
        argv = deployment._worker_args(role)
        assert argv[argv.index("--tensor-parallel-size") + 1] == size
    plain = cli._deployment(build_parser().parse_args(["serve", "--model", "m"]))
    assert "--tensor-parallel-size" not in plain._worker_args("decode")


def test_whole_pages_read_and_written_by_layers() -> None:
    pool = KvPool(3, 2, 4, 4, 8, torch.float32)
    pages = torch.randn(2, 2, 3, *pool.page_shape)
    pool.write_pages([5, 1, 6], pages, slice(1, 3))
    torch.testing.assert_close(pool.read_pages([5, 1, 6], slice(1, 3)), pages, rtol=0, atol=0)
    assert pool.read_pages([5, 1, 6], slice(0, 1)).abs().sum() == 0  # layer 0 untouched
    assert pool.read_pages([0, 2, 3, 4, 7]).abs().sum() == 0  # other blocks untouched


@pytest.mark.slow  # starts a rank process
def test_a_split_worker_sizes_its_pool_per_rank_and_moves_whole_pages(
        qwen3_checkpoint: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Also: --compile dynamic, the product's default, is not refused with a split model;
    its forwards run eager and the log says why."""
    settings = WorkerSettings(role="decode", model=str(qwen3_checkpoint), kv_pool_size="1MiB",
                              dtype="float32", device="cpu", tensor_parallel_size=2,
                              compile="dynamic")
    whole_model, whole_pool, _ = build_model(dataclasses.replace(
        settings, tensor_parallel_size=1, compile="off"))
    with caplog.at_level(logging.INFO, logger="kvferry.worker"):
        model, pool, _ = build_model(settings)
    assert "forwards eager: a model split over 2 ranks is not compiled yet" in caplog.text
    assert getattr(model, "compiled", None) is None
    try:
        config = load_model_config(qwen3_checkpoint)
        assert pool.num_kv_heads == config.num_kv_heads // 2  # rank 0's own
        assert pool.whole_kv_heads == config.num_kv_heads and pool.tensor_parallel_size == 2
        assert pool.num_blocks == 2 * whole_pool.num_blocks  # 1 MiB of half-size blocks
        pages = torch.randn(config.num_layers, 2, 2, *pool.page_shape)
        pool.write_pages([3, 9], pages)
        torch.testing.assert_close(pool.read_pages([3, 9]), pages, rtol=0, atol=0)
        # rank 0 kept its own heads only; the other rank holds the rest
        torch.testing.assert_close(KvPool.read_pages(pool, [3, 9]), pages[..., :1, :],
                                   rtol=0, atol=0)
        pool.copy_blocks([3], [4])
        torch.testing.assert_close(pool.read_pages([4]), pages[:, :, :1], rtol=0, atol=0)
    finally:
        model.close()
    assert not any(p.is_alive() for p in model.ranks)
    del whole_model
