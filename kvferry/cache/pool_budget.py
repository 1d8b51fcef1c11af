"""`--kv-pool-size auto`: the K/V pool sized from the device, as vLLM sizes its cache from
`gpu_memory_utilization`.

A worker may use `utilization` of its device's memory in all; the pool gets what is left of
that after the weights, a prefill forward's activations at the worker's token budget, and,
on CPU (where they share the same RAM), the host tier and the decode stage:

    pool = utilization * device_memory - weights - activations - (CPU: host tier + stage)

rounded down to whole blocks. Every term comes from the flags and the checkpoint's shapes
(safetensors headers, the model config), none from a measurement, so `kvferry plan` with
the same flags prints the same pool the worker allocates. Device memory: CUDA's total, or
the machine's RAM capped by the cgroup's memory limit (a container's). `serve` divides its
utilization among the workers sharing a device (on CPU, every worker it starts). On CPU a
share is taken only when asked for (`kvferry.settings.CPU_POOL_BYTES` says why).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from kvferry.settings import CUDA_UTILIZATION

_CGROUP_LIMIT = Path("/sys/fs/cgroup/memory.max")


def device_memory(device: torch.device) -> int:
    """What a fraction of the device is a fraction of: CUDA's total memory, or RAM (capped
    by a cgroup memory limit)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = _CGROUP_LIMIT.read_text().strip()
    except OSError:
        return ram
    return min(ram, int(limit)) if limit.isdigit() else ram


def default_utilization(device_type: str) -> float | None:
    """The share a worker takes unless told: CUDA_UTILIZATION of a GPU; None on CPU, where
    the pool is CPU_POOL_BYTES instead."""
    return CUDA_UTILIZATION if device_type == "cuda" else None


def weight_bytes(checkpoint: Path, dtype: torch.dtype) -> int:
    """The weights as a worker holds them: every tensor in the checkpoint's safetensors
    headers, in `dtype` (a tied LM head shares the embedding's memory)."""
    from safetensors import safe_open

    numel = 0
    for path in sorted(Path(checkpoint).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                numel += math.prod(f.get_slice(name).get_shape())
    return numel * torch.empty((), dtype=dtype).element_size()


def activation_bytes(config, tokens: int, chunk: int, dtype: torch.dtype) -> int:
    """A prefill forward of `tokens` tokens (attention over chunks of `chunk`): the hidden
    states, fused q/k/v and gate/up outputs, and float32 attention scores, estimated from
    the shapes."""
    size = torch.empty((), dtype=dtype).element_size()
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    per_token = (4 * config.hidden_size + 3 * config.intermediate_size + qkv) * size
    scores = config.num_heads * min(tokens, chunk) * chunk * 4
    return tokens * per_token + scores


def auto_pool_bytes(memory: int, utilization: float, weights: int, activations: int,
                    reserved: int = 0) -> int:
    """The pool's bytes; ValueError naming the flags when nothing is left for it."""
    if not 0 < utilization <= 1:
        raise ValueError(f"memory_utilization: expected a fraction in (0, 1], got {utilization}")
    pool = int(utilization * memory) - weights - activations - reserved
    if pool <= 0:
        raise ValueError(
            f"kv_pool_size: auto leaves no memory for the pool ({utilization:g} of "
            f"{memory / 2**30:.1f} GiB is less than the weights' {weights / 2**30:.2f} GiB, "
            f"{activations / 2**20:.0f} MiB of activations and {reserved / 2**30:.2f} GiB "
            "of tiers and stage); raise --memory-utilization or give --kv-pool-size in bytes")
    return pool
