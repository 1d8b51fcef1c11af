"""A worker's model and K/V pool, built from its settings: device, dtype and attention
backend resolved, the decode step compiled and captured where asked, all before serving."""

from __future__ import annotations

import ctypes
import logging
import os
from typing import TYPE_CHECKING

import torch

from kvferry.cache.layout import KvShape, dtype_name, torch_dtype
from kvferry.cache.pool import KvPool
from kvferry.model.config import load_model_config
from kvferry.settings import COMPILE_CACHE_DIR, WorkerSettings, parse_batch_sizes
from kvferry.sizes import parse_pool_size

if TYPE_CHECKING:
    from kvferry.model.transformer import Transformer

log = logging.getLogger("kvferry.worker")

def tune_malloc() -> None:
    """Keep freed tensor memory in glibc's heap instead of returning it to the OS.

    Every decode step allocates a few MiB of gathered K/V per layer; with glibc's default
    mmap threshold each allocation is a fresh mmap whose pages fault in on first touch, which
    cost more than the gather itself (measured: a batch-32 step went from ~20 ms to ~12 ms).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 256 << 20)
    libc.mallopt(m_trim_threshold, 1 << 30)


def _device_and_dtype(settings: WorkerSettings) -> tuple[torch.device, torch.dtype, str]:
    device = settings.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    dtype = torch_dtype(settings.dtype) if settings.dtype != "auto" else default_dtype(dev)
    backend = settings.attention_backend
    if backend == "auto":
        backend = "triton" if dev.type == "cuda" else "torch"
    return dev, dtype, backend


def default_dtype(device: torch.device) -> torch.dtype:
    """`--dtype auto`: float32 on CPU, bfloat16 elsewhere."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def memory_bytes(device: torch.device) -> int:
    """What a fractional `--kv-pool-size` is a fraction of: the device's total memory."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _num_blocks(settings: WorkerSettings, config, device: torch.device,
                dtype: torch.dtype) -> int:
    size = parse_pool_size(settings.kv_pool_size, memory_bytes(device))
    kv_dtype = (dtype_name(dtype) if settings.kv_cache_dtype == "auto"
                else settings.kv_cache_dtype)
    shape = KvShape(config.num_layers, config.num_kv_heads, config.head_dim, kv_dtype)
    per_block = shape.bytes_per_block(settings.block_size)
    num_blocks = size // per_block
    if num_blocks < 1:
        raise ValueError(f"kv_pool_size: {size} bytes holds no {per_block}-byte block")
    return num_blocks


def max_model_len_for(settings: WorkerSettings, config) -> int:
    """The longest request (prompt + max_tokens) a decode or colocated worker serves:
    `--max-model-len`, refused (ValueError naming the flags) when the pool cannot hold one
    such request or the model's context is shorter; without it, the model's context, lowered
    (and logged) to what the pool holds. vLLM refuses to start in that case too, but its
    pools are sized from the device; ours default to a fixed DEFAULT_KV_POOL_SIZE, smaller
    than one request of the default model's full context."""
    context = config.max_position_embeddings
    device, dtype, _ = _device_and_dtype(settings)
    capacity = _num_blocks(settings, config, device, dtype) * settings.block_size
    if settings.max_model_len is None:
        if capacity < context:
            log.info("max_model_len: %d tokens (what --kv-pool-size %s holds; the model's "
                     "context is %d; --max-model-len sets it)", capacity,
                     settings.kv_pool_size, context)
        return min(context, capacity)
    if settings.max_model_len > context:
        raise ValueError(f"max_model_len: {settings.max_model_len} is more than the model's "
                         f"context of {context} tokens; lower --max-model-len")
    if capacity < settings.max_model_len:
        raise ValueError(f"kv_pool_size: the pool holds {capacity} tokens, less than one "
                         f"request of max_model_len {settings.max_model_len}; raise "
                         "--kv-pool-size or lower --max-model-len")
    return settings.max_model_len


def build_pool(settings: WorkerSettings, config, device: torch.device,
               dtype: torch.dtype) -> KvPool:
    num_blocks = _num_blocks(settings, config, device, dtype)
    return KvPool(config.num_layers, config.num_kv_heads, config.head_dim, settings.block_size,
                  num_blocks, dtype, device, prefix_caching=settings.prefix_caching,
                  kv_cache_dtype=settings.kv_cache_dtype)


def build_model(settings: WorkerSettings) -> tuple[Transformer, KvPool, str]:
    """The worker's model, its pool and the attention backend's name. Decode and colocated
    workers compile (--compile) and capture (--cuda-graphs) their decode step here: before
    the server exists, so before the worker reports SERVING."""
    from kvferry.model.transformer import Transformer
    from kvferry_kernels.dispatch import get_attention_backend

    tune_malloc()
    if settings.torch_threads > 0:
        torch.set_num_threads(settings.torch_threads)
    config = load_model_config(settings.model)
    device, dtype, backend_name = _device_and_dtype(settings)
    model = Transformer(config, get_attention_backend(backend_name), dtype, device)
    if settings.role in ("decode", "colocated") and settings.max_model_len is not None:
        max_model_len_for(settings, config)  # checked before the pool is allocated
    pool = build_pool(settings, config, device, dtype)
    if settings.role in ("decode", "colocated"):
        buckets = parse_batch_sizes(settings.compile_batch_sizes)
        if settings.compile != "off":
            from kvferry.model.compiled import compile_decode

            compile_decode(model, settings.compile, buckets, COMPILE_CACHE_DIR)
        if settings.cuda_graphs == "on":  # CUDA + Triton only (else None)
            from kvferry.model.cuda_graphs import capture_decode

            capture_decode(model, pool, buckets)
    return model, pool, backend_name
