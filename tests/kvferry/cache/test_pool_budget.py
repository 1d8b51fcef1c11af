"""`--kv-pool-size auto`: the pool is the worker's share of the device less its
weights, a prefill's activations and, on CPU, its host tier and dense stage; the weights
counted from the checkpoint's headers are the bytes the loaded model holds; serve divides
its share among the workers on a device; a cgroup limit caps RAM; nothing left is refused
naming the flags; on a GPU (dry-run) the default pool is CUDA_UTILIZATION of its memory after
the weights."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from deploy.launcher import Deployment
from deploy.placement import memory_share
from deploy.worker_model import auto_pool_bytes_for, build_pool, kv_block_bytes
from kvferry.cache import pool_budget
from kvferry.cache.layout import KvShape
from kvferry.cache.pool_budget import (
    activation_bytes,
    auto_pool_bytes,
    device_memory,
    weight_bytes,
)
from kvferry.model.config import load_model_config
from kvferry.model.prefill_batch import token_budget_for
from kvferry.model.transformer import Transformer
from kvferry.settings import CPU_POOL_BYTES, CUDA_UTILIZATION, WorkerSettings
from kvferry.settings.tiers import TierSettings
from kvferry_kernels.cpu_attention import CPU_ATTENTION_ENV
from kvferry_kernels.dispatch import get_attention_backend

CPU = torch.device("cpu")


@pytest.mark.parametrize("fixture", ["qwen3_checkpoint", "llama_checkpoint"])
def test_weights_counted_from_the_headers_are_what_the_loaded_model_holds(
        fixture: str, request: pytest.FixtureRequest) -> None:
    checkpoint: Path = request.getfixturevalue(fixture)
    model = Transformer(load_model_config(checkpoint), get_attention_backend("torch"),
                        torch.float32, CPU)
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in model.weights.values()}  # a tied head shares the embedding's storage
    assert weight_bytes(checkpoint, torch.float32) == sum(held.values())
    assert weight_bytes(checkpoint, torch.bfloat16) * 2 == sum(held.values())


def _settings(checkpoint: Path, role: str, **kwargs: object) -> WorkerSettings:
    kwargs = {"memory_utilization": 0.01, **kwargs}
    return WorkerSettings(role=role, model=str(checkpoint), device="cpu",
                          **kwargs)  # type: ignore[arg-type]


def test_the_pool_is_the_share_less_weights_activations_tiers_and_stage(
        qwen3_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_model_config(qwen3_checkpoint)
    left = (int(0.01 * device_memory(CPU)) - weight_bytes(qwen3_checkpoint, torch.float32)
            - activation_bytes(config, 512, 512, torch.float32))
    prefill = auto_pool_bytes_for(_settings(qwen3_checkpoint, "prefill"), config, CPU,
                                  torch.float32)
    assert prefill == left
    # float32 pages: the C kernel reads them in place, no stage by default; without it (the
    # torch path) the default stage mirrors the pool in the model's dtype, so half each; int8
    # pages (64 + 4 bytes a head) keep a float32 stage (256)
    decode = auto_pool_bytes_for(_settings(qwen3_checkpoint, "decode"), config, CPU,
                                 torch.float32)
    assert decode == left
    int8 = auto_pool_bytes_for(_settings(qwen3_checkpoint, "decode", kv_cache_dtype="int8"),
                               config, CPU, torch.float32)
    f32, q8 = (KvShape.from_config(qwen3_checkpoint, d).bytes_per_token
               for d in ("float32", "int8"))
    assert int8 == int(left / (1 + f32 / q8))
    staged = auto_pool_bytes_for(_settings(qwen3_checkpoint, "decode", decode_stage_mib=8),
                                 config, CPU, torch.float32)
    assert staged == left - (8 << 20)
    tiered = auto_pool_bytes_for(
        _settings(qwen3_checkpoint, "prefill", tiers=TierSettings(host_cache_size="16MiB")),
        config, CPU, torch.float32)
    assert tiered == left - (16 << 20)
    monkeypatch.setenv(CPU_ATTENTION_ENV, "torch")
    torch_path = auto_pool_bytes_for(_settings(qwen3_checkpoint, "decode"), config, CPU,
                                     torch.float32)
    assert torch_path == left // 2


def test_the_built_pool_holds_whole_blocks_of_that_and_says_so(
        qwen3_checkpoint: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = load_model_config(qwen3_checkpoint)
    settings = _settings(qwen3_checkpoint, "prefill")
    want = auto_pool_bytes_for(settings, config, CPU, torch.float32)
    per_block = kv_block_bytes(settings, config, torch.float32)
    with caplog.at_level(logging.INFO, logger="kvferry.worker"):
        pool = build_pool(settings, config, CPU, torch.float32)
    assert pool.num_blocks == want // per_block and pool.cache.nbytes == pool.num_blocks * per_block
    assert (f"prefill worker's K/V pool: {pool.cache.nbytes} bytes "
            f"({pool.cache.nbytes / 2**20:.1f} MiB), {pool.num_blocks} blocks of 16 tokens: K/V "
            f"for {pool.num_blocks * 16:,} tokens (--kv-pool-size auto, 0.01 of cpu memory"
            ) in caplog.text


def test_nothing_left_for_the_pool_names_the_flags(qwen3_checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="kv_pool_size: auto leaves no memory.*"
                                         "--memory-utilization"):
        auto_pool_bytes(1 << 30, 0.5, 1 << 29, 1 << 20)
    with pytest.raises(ValueError, match="memory_utilization"):
        _settings(qwen3_checkpoint, "decode", memory_utilization=1.5)


def test_serve_divides_its_share_among_the_workers_on_a_device() -> None:
    assert memory_share(None, 2, [], spread=True) is None  # CPU: none unless asked for
    assert memory_share(0.5, 4, [], spread=True) == 0.125  # every one in RAM
    assert memory_share(None, 4, ["0"], spread=True) == CUDA_UTILIZATION / 4  # one GPU
    assert memory_share(None, 4, ["0", "1"], spread=True) == CUDA_UTILIZATION / 2
    assert memory_share(None, 4, ["0", "1"], spread=False) == CUDA_UTILIZATION / 4  # not spread
    assert memory_share(None, 1, ["0", "1", "2"], spread=True) == CUDA_UTILIZATION


def test_a_cgroup_limit_caps_the_machines_memory(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    limit = tmp_path / "memory.max"
    monkeypatch.setattr(pool_budget, "_CGROUP_LIMIT", limit)
    ram = device_memory(CPU)  # no such file: the machine's
    limit.write_text(f"{ram // 4}\n")
    assert device_memory(CPU) == ram // 4
    limit.write_text("max\n")
    assert device_memory(CPU) == ram


def test_on_cpu_without_a_share_the_pool_is_the_fixed_size(qwen3_checkpoint: Path) -> None:
    """CPU pools stay fixed unless a share is asked for (see
    CPU_POOL_BYTES); serve then passes the workers no share either."""
    config = load_model_config(qwen3_checkpoint)
    settings = _settings(qwen3_checkpoint, "decode", memory_utilization=None)
    assert auto_pool_bytes_for(settings, config, CPU, torch.float32) == CPU_POOL_BYTES
    assert Deployment(model="m", kv_pool_size="auto")._memory_argv() == []
    assert Deployment(model="m", kv_pool_size="auto", memory_utilization=0.5,
                      num_prefill=1, num_decode=3)._memory_argv() == ["--memory-utilization",
                                                                      "0.125"]


def test_on_a_gpu_the_default_pool_is_the_share_of_its_memory_after_the_weights(
        qwen3_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dry run (no GPU here): a decode worker on an H200-sized device (141 GiB)
    with no flags takes CUDA_UTILIZATION of it less its bfloat16 weights and a prefill's
    activations at the CUDA token budget, not CPU_POOL_BYTES; a share asked for wins."""
    total = 141 << 30
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: type("Props", (), {"total_memory": total})())
    cuda = torch.device("cuda")
    config = load_model_config(qwen3_checkpoint)
    weights = weight_bytes(qwen3_checkpoint, torch.bfloat16)
    activations = activation_bytes(config, token_budget_for(cuda), 512, torch.bfloat16)
    settings = WorkerSettings(role="decode", model=str(qwen3_checkpoint), device="cuda")
    pool = auto_pool_bytes_for(settings, config, cuda, torch.bfloat16)
    assert pool == int(CUDA_UTILIZATION * total) - weights - activations
    assert pool > 100 * CPU_POOL_BYTES
    half = WorkerSettings(role="decode", model=str(qwen3_checkpoint), device="cuda",
                          memory_utilization=0.45)
    assert auto_pool_bytes_for(half, config, cuda, torch.bfloat16) == \
        int(0.45 * total) - weights - activations
