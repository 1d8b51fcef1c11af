"""A worker's model and K/V pool, built from its settings: device, dtype and attention
backend resolved, the decode step compiled and captured where asked, all before serving."""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from deploy import zygote
from kvferry.cache.layout import KvShape, dtype_name, torch_dtype
from kvferry.cache.pool import KvPool
from kvferry.cache.pool_budget import (
    activation_bytes,
    auto_pool_bytes,
    default_utilization,
    device_memory,
    weight_bytes,
)
from kvferry.model.config import load_model_config
from kvferry.settings import (
    COMPILE_CACHE_DIR,
    CPU_POOL_BYTES,
    KERNEL_CACHE_DIR,
    WorkerSettings,
    parse_batch_sizes,
)
from kvferry.settings.sizes import AUTO, parse_pool_size

if TYPE_CHECKING:
    from pathlib import Path

    from kvferry.model.tp_group import TensorParallelModel
    from kvferry.model.transformer import Transformer
    from prefill_worker.draft_kv import DraftPrefill

log = logging.getLogger("kvferry.worker")

EXIT_RANK_LOST = 75  # a tensor-parallel worker's rank died (EX_TEMPFAIL: restart it)


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


def device_and_dtype(settings: WorkerSettings) -> tuple[torch.device, torch.dtype, str]:
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


def auto_pool_bytes_for(settings: WorkerSettings, config, device: torch.device,
                        dtype: torch.dtype) -> int:
    """`--kv-pool-size auto` (kvferry/cache/pool_budget.py): this worker's share of the
    device less its weights and a prefill's activations; on CPU also less the host tier and,
    for a decode worker's default dense stage (as many tokens as the pool, in the model's
    dtype), the stage's share."""
    from decode_worker import kv_stage
    from kvferry.model.prefill_batch import token_budget_for
    from kvferry.settings.tiers import host_cache_bytes

    utilization = settings.memory_utilization or default_utilization(device.type)
    if utilization is None:  # CPU, no share asked for
        return CPU_POOL_BYTES
    tokens = token_budget_for(device, settings.prefill_token_budget)
    activations = activation_bytes(config, tokens, settings.prefill_chunk_size, dtype)
    reserved = 0
    staged = 0.0  # stage bytes per pool byte
    if device.type == "cpu":
        tiers = settings.tiers.host_cache_size
        reserved += host_cache_bytes(tiers) if tiers is not None else 0
        if settings.role != "prefill" and settings.attention_backend in ("auto", "torch"):
            if settings.decode_stage_mib is not None:
                reserved += settings.decode_stage_mib << 20
            elif not kv_stage.reads_pages_in_place(device, _kv_dtype(settings, dtype)):
                staged = (_shape(config, dtype_name(dtype)).bytes_per_token
                          / _shape(config, _kv_dtype(settings, dtype)).bytes_per_token)
    left = auto_pool_bytes(device_memory(device), utilization,
                           weight_bytes(settings.model, dtype), activations, reserved)
    return int(left / (1 + staged))


def pool_bytes(settings: WorkerSettings, config, device: torch.device,
               dtype: torch.dtype) -> int:
    """`--kv-pool-size` in bytes, before rounding down to whole blocks."""
    if settings.kv_pool_size == AUTO:
        return auto_pool_bytes_for(settings, config, device, dtype)
    return parse_pool_size(settings.kv_pool_size, device_memory(device))


def _kv_dtype(settings: WorkerSettings, dtype: torch.dtype) -> str:
    return dtype_name(dtype) if settings.kv_cache_dtype == "auto" else settings.kv_cache_dtype


def _shape(config, kv_dtype: str) -> KvShape:
    return KvShape(config.num_layers, config.num_kv_heads, config.head_dim, kv_dtype)


def kv_block_bytes(settings: WorkerSettings, config, dtype: torch.dtype) -> int:
    """Bytes of one block of every layer's K and V, as the pool stores it."""
    return _shape(config, _kv_dtype(settings, dtype)).bytes_per_block(settings.block_size)


def rank_config(settings: WorkerSettings, config):
    """The model as one rank holds it (its heads, its MLP columns: what its pool is sized
    for); the whole model without tensor parallelism. ValueError naming the flag where the
    size does not split the model."""
    if settings.tensor_parallel_size == 1:
        return config
    from kvferry.model.tensor_parallel import Shard, shard_config

    return shard_config(config, Shard.of(config, 0, settings.tensor_parallel_size))


def _num_blocks(settings: WorkerSettings, config, device: torch.device,
                dtype: torch.dtype) -> int:
    """Blocks of the worker's pool (of each rank's, split tensor-parallel)."""
    config = rank_config(settings, config)
    size = pool_bytes(settings, config, device, dtype)
    per_block = kv_block_bytes(settings, config, dtype)
    num_blocks = size // per_block
    if num_blocks < 1:
        raise ValueError(f"kv_pool_size: {size} bytes holds no {per_block}-byte block")
    return num_blocks


def max_model_len_for(settings: WorkerSettings, config) -> int:
    """The longest request (prompt + max_tokens) a decode or colocated worker serves:
    `--max-model-len`, refused (ValueError naming the flags) when the pool cannot hold one
    such request or the model's context is shorter; without it, the model's context, lowered
    (and logged) to what the pool holds. vLLM refuses to start in that case too, but its
    pools are sized from the device, as ours are by default (auto); a pool given in bytes
    may be smaller than one request of the model's full context."""
    context = config.max_position_embeddings
    device, dtype, _ = device_and_dtype(settings)
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
    per_block = kv_block_bytes(settings, config, dtype)
    share = settings.memory_utilization or default_utilization(device.type)
    how = (settings.kv_pool_size if settings.kv_pool_size != AUTO else
           f"auto, {share:g} of {device.type} memory less weights and activations" if share
           else "auto: on CPU without --memory-utilization, a fixed size")
    log.info("%s worker's K/V pool: %d bytes (%.1f MiB), %d blocks of %d tokens: K/V for %s "
             "tokens (--kv-pool-size %s)", settings.role, num_blocks * per_block,
             num_blocks * per_block / 2**20, num_blocks, settings.block_size,
             f"{num_blocks * settings.block_size:,}", how)
    return KvPool(config.num_layers, config.num_kv_heads, config.head_dim, settings.block_size,
                  num_blocks, dtype, device, prefix_caching=settings.prefix_caching,
                  kv_cache_dtype=settings.kv_cache_dtype)


def build_draft_prefill(settings: WorkerSettings, model: Transformer, pool: KvPool
                        ) -> DraftPrefill | None:
    """A prefill worker's draft model and pool where its prompt K/V is built here and
    shipped (`WorkerSettings.ships_draft_kv`; None otherwise)."""
    if not settings.ships_draft_kv:
        return None
    from decode_worker.build import build_draft
    from prefill_worker.draft_kv import DraftPrefill

    built = build_draft(settings, model, pool)
    assert built is not None  # noqa: S101 - shipping implies --speculative-method draft
    return DraftPrefill(built.model, built.pool, settings.prefill_chunk_size)


def _exit_on_rank_loss(group: TensorParallelModel) -> Callable[[Exception], None]:
    """A rank lost: the worker cannot serve another step, so it exits at once, its other
    ranks with it. Its streams break, and the router migrates their requests and marks the
    worker unhealthy, as for any worker lost (draining would only fail them)."""

    def exit_now(error: Exception) -> None:
        log.error("%s; exiting so the router moves this worker's requests", error)
        for proc in group.ranks:
            proc.kill()
        logging.shutdown()
        os._exit(EXIT_RANK_LOST)

    return exit_now


def build_group(settings: WorkerSettings, config, device: torch.device, dtype: torch.dtype,
                backend_name: str, kernel_dir: Path | None) -> TensorParallelModel:
    """A tensor-parallel worker's ranks (kvferry/model/tp_group.py): this process is rank 0.
    Each rank's pool holds its own K/V heads of `--kv-pool-size`'s blocks, so the pool and
    `--max-model-len` are sized per rank, as vLLM sizes them."""
    from kvferry.model.tp_group import RankSpec, TensorParallelModel

    size = settings.tensor_parallel_size
    if device.type == "cuda":  # rank r on the r-th device from the worker's (NCCL)
        first, count = device.index or 0, torch.cuda.device_count()
        if first + size > count:
            raise ValueError(f"tensor_parallel_size: {size} ranks need {size} CUDA devices "
                             f"from cuda:{first}; this machine has {count}")
        if settings.cuda_graphs == "on":
            log.info("decode step eager: CUDA graphs are not captured for a split worker yet")
    rank = rank_config(settings, config)  # refuses a size that does not split the model
    if settings.role in ("decode", "colocated") and settings.max_model_len is not None:
        max_model_len_for(settings, config)
    num_blocks = _num_blocks(settings, config, device, dtype)
    spec = RankSpec(str(settings.model), settings.load_format, backend_name,
                    str(dtype).removeprefix("torch."), settings.block_size, num_blocks,
                    settings.torch_threads, None if kernel_dir is None else str(kernel_dir),
                    str(device), settings.role != "prefill" and settings.speculative.is_on,
                    settings.kv_cache_dtype, settings.prefix_caching)
    group = TensorParallelModel(spec, size, zygote.start_rank)
    group.on_lost = _exit_on_rank_loss(group)
    log.info("%s worker split over %d ranks (rank processes: %s): %d of %d K/V heads and a "
             "pool of %d blocks each", settings.role, size,
             ", ".join(str(p.pid) for p in group.ranks), rank.num_kv_heads,
             config.num_kv_heads, num_blocks)
    return group


def build_model(settings: WorkerSettings) -> tuple[Transformer, KvPool, str]:
    """The worker's model, its pool and the attention backend's name. Decode and colocated
    workers compile (--compile) and capture (--cuda-graphs) their decode step here: before
    the server exists, so before the worker reports SERVING."""
    from kvferry.model.transformer import Transformer
    from kvferry_kernels.dispatch import get_attention_backend

    tune_malloc()
    if settings.torch_threads > 0:
        torch.set_num_threads(settings.torch_threads)
    config = load_model_config(settings.model, load_format=settings.load_format)
    device, dtype, backend_name = device_and_dtype(settings)
    kernel_dir = KERNEL_CACHE_DIR if device.type == "cpu" else None
    if settings.tensor_parallel_size > 1:
        if settings.compile != "off":  # only "dynamic" gets here (settings refuse buckets)
            log.info("forwards eager: a model split over %d ranks is not compiled yet",
                     settings.tensor_parallel_size)
        group = build_group(settings, config, device, dtype, backend_name, kernel_dir)
        return group, group.pool, backend_name  # type: ignore[return-value]
    model = Transformer(config, get_attention_backend(backend_name, kernel_dir), dtype, device)
    if settings.role in ("decode", "colocated") and settings.max_model_len is not None:
        max_model_len_for(settings, config)  # checked before the pool is allocated
    pool = build_pool(settings, config, device, dtype)
    buckets = parse_batch_sizes(settings.compile_batch_sizes)
    compile_forwards(model, settings, buckets)
    lend_cores(model, settings)
    if settings.role in ("decode", "colocated"):
        model.query_runs = settings.speculative.is_on  # verification's rows
        if settings.cuda_graphs == "on":  # CUDA + Triton only (else None)
            from kvferry.model.cuda_graphs import capture_decode

            capture_decode(model, pool, buckets)
    return model, pool, backend_name


def lend_cores(model: Transformer, settings: WorkerSettings) -> None:
    """--core-lending: the forwards also run threads on the partner's cores while it is idle
    (kvferry/cores.py); CPU workers only (a GPU worker's forwards are not the CPU's)."""
    if settings.core_lending is None:
        return
    if model.device.type != "cpu":
        log.info("core lending off: the model runs on %s", model.device.type)
        return
    from kvferry.cores import CoreLending

    model.cores = CoreLending.from_spec(settings.core_lending, torch.get_num_threads())


def compile_forwards(model: Transformer, settings: WorkerSettings, buckets: Sequence[int]
                     ) -> None:
    """--compile: "dynamic" (the default) compiles the prefill forward and the decode step of
    every role into one package on CPU; on CUDA they stay eager (not yet measured there: the
    decode step replays CUDA graphs), and where the build fails (no C++ compiler, say) the
    worker serves eagerly, saying why. The bucket modes compile the decode step of decode and
    colocated workers and fail the start if they cannot."""
    if settings.compile == "off":
        return
    from kvferry.model.compiled import DYNAMIC, compile_model

    if settings.compile != DYNAMIC:
        if settings.role in ("decode", "colocated"):
            compile_model(model, settings.compile, buckets, COMPILE_CACHE_DIR)
        return
    if model.device.type != "cpu":
        log.info("forwards eager: --compile dynamic builds for CPU only so far (%s here)",
                 model.device.type)
        return
    try:
        compile_model(model, DYNAMIC, cache_dir=COMPILE_CACHE_DIR)
    except Exception as exc:  # noqa: BLE001 - eager is the fallback, and the log says why
        log.warning("forwards eager: compiling the model failed (%s: %s)",
                    type(exc).__name__, exc)
        model.compiled = None
