"""Which attention a CPU decode worker runs (deploy/worker_model.py): the C kernel over the
pool's float32 pages in place, with no dense stage by default; the stage (the whole pool's
tokens) where attention would otherwise gather pages every step: quantized pages, or the
kernel switched off; and --decode-stage-mib always wins."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decode_worker.build import stage_bytes
from decode_worker.kv_stage import stage_bytes_for_pool
from deploy.worker_model import build_model
from kvferry.settings import WorkerSettings
from kvferry_kernels.cpu_attention import CPU_ATTENTION_ENV
from kvferry_kernels.paged_attention_torch import paged_decode_attention_torch


def _worker(checkpoint: Path, **kwargs: object) -> tuple[object, object, str]:
    settings = WorkerSettings(role="decode", model=str(checkpoint), device="cpu",
                              kv_pool_size="4MiB", compile="off", **kwargs)  # type: ignore[arg-type]
    return (settings, *build_model(settings))


def test_float32_pages_are_read_in_place_without_a_stage(qwen3_checkpoint: Path) -> None:
    settings, model, pool, backend = _worker(qwen3_checkpoint)
    assert model.backend.cpu_kernel is not None
    assert stage_bytes(settings, pool, backend) == 0
    # The step attends through the kernel: the same numbers as the torch path over the pages.
    q = torch.randn(2, model.config.num_heads, model.config.head_dim)
    pool.cache.normal_()
    tables = torch.tensor([[3, 5], [7, 0]], dtype=torch.int32)
    lens = torch.tensor([20, 9], dtype=torch.int32)
    got = model.backend.decode_attention(q, pool.k_cache(1), pool.v_cache(1), tables, lens, 0.1)
    torch.testing.assert_close(got, paged_decode_attention_torch(
        q, pool.k_cache(1), pool.v_cache(1), tables, lens, 0.1), atol=2e-6, rtol=2e-5)
    settings, _, pool, backend = _worker(qwen3_checkpoint, decode_stage_mib=3)
    assert stage_bytes(settings, pool, backend) == 3 << 20


@pytest.mark.parametrize("case", ["int8 pages", "kernel off"])
def test_otherwise_the_stage_holds_the_pools_tokens(qwen3_checkpoint: Path, case: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    if case == "kernel off":
        monkeypatch.setenv(CPU_ATTENTION_ENV, "torch")
    extra = {"kv_cache_dtype": "int8"} if case == "int8 pages" else {}
    settings, model, pool, backend = _worker(qwen3_checkpoint, **extra)
    assert (model.backend.cpu_kernel is None) == (case == "kernel off")
    assert stage_bytes(settings, pool, backend) == stage_bytes_for_pool(pool) > 0
