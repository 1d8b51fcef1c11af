"""`kvferry plan`: what a batch of requests costs in K/V and how many fit, sized as `serve`
would store it on this machine: the default model unless told, the model dtype
`--dtype auto` resolves to (float32 on CPU, bfloat16 on CUDA, as the workers'), quantized
pages with `--kv-cache-dtype`, and serve's own pool size."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from deploy.eviction_args import eviction_args, eviction_config
from kvferry.settings import DEFAULT_BLOCK_SIZE, DEFAULT_KV_POOL_SIZE, DTYPES, KV_CACHE_DTYPES

if TYPE_CHECKING:
    from kvferry.cache.capacity import Plan
    from kvferry.cache.layout import KvShape

WORKLOAD_HELP = ("a trace file (JSON lines with arrival_s, prompt_len, output_len; the "
                 "arrivals keep their shape, scaled to each rate) or a mix "
                 "IN:OUT[:WEIGHT][,IN:OUT:WEIGHT...] of prompt and output tokens with "
                 "Poisson arrivals, e.g. 128:256:0.8,2048:16:0.2")
PLAN_KV_CACHE_DTYPES = (*KV_CACHE_DTYPES, "fp8")  # fp8: vLLM's (a scale per layer), sized only


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="K/V memory per token, per request and how many fit")
    p.add_argument("--model", default=None,
                   help="checkpoint directory, config.json or .gguf file (default: the default "
                        "model, SmolLM2-135M-Instruct, unless --layers, --kv-heads and "
                        "--head-dim are given)")
    p.add_argument("--layers", type=int, default=None, help="without --model: decoder layers")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="without --model: K/V heads (GQA/MQA: fewer than query heads)")
    p.add_argument("--head-dim", type=int, default=None, help="without --model: per head")
    p.add_argument("--dtype", default=DTYPES[0], choices=DTYPES,
                   help="the model's dtype, as the workers take it (auto: float32 on CPU, "
                        "bfloat16 on CUDA, per --device)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where serve would run (auto: cuda if this machine has one); decides "
                        "--dtype auto and a fractional --pool-size")
    p.add_argument("--kv-cache-dtype", default=PLAN_KV_CACHE_DTYPES[0],
                   choices=PLAN_KV_CACHE_DTYPES,
                   help="K/V pages as the model's dtype (auto) or quantized with a scale per "
                        "token and K/V head, as the workers' flag; fp8: vLLM's fp8 cache")
    p.add_argument("--prompt-tokens", type=int, default=1000, help="per request")
    p.add_argument("--output-tokens", type=int, default=0, help="per request")
    p.add_argument("--batch", type=int, default=1, help="requests held at once")
    p.add_argument("--pool-size", default=DEFAULT_KV_POOL_SIZE,
                   help="one decode worker's K/V pool, as serve's --kv-pool-size: auto (sized "
                        "from the device as serve sizes it), bytes (40GiB) or a fraction of "
                        "device memory (0.5)")
    p.add_argument("--memory-utilization", type=float, default=None,
                   help="with --pool-size auto: as serve's flag")
    p.add_argument("--workers", type=int, default=2,
                   help="with --pool-size auto: the workers serve starts sharing the device "
                        "(default 2: one prefill, one decode)")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                   help="tokens per K/V block (page)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="a decode worker split this many ways (its --tensor-parallel-size): "
                        "each rank's pool holds its own K/V heads of every block, and the "
                        "figures are one rank's (default 1: the whole model)")
    for tier in ("host-cache", "disk-cache", "store"):
        p.add_argument(f"--{tier}-size", default=None,
                       help=f"also what a {tier.split('-')[0]} tier of this many bytes holds")
    eviction_args(p, "also the bound a sequence keeps to under this policy: ")
    g = p.add_argument_group("SLA planning (with --sla: the layout to serve a workload with)")
    g.add_argument("--sla", default=None, metavar="ttft-p90=MS,itl-p90=MS",
                   help="latency targets: percentiles of TTFT and ITL at or under MS")
    g.add_argument("--workload", default=None, help=WORKLOAD_HELP)
    g.add_argument("--profile", type=Path, default=None,
                   help="what `kvferry profile` measured (default: the newest profile under "
                        "KVFERRY_HOME/profiles)")
    g.add_argument("--request-rate", type=float, default=None,
                   help="the rate to serve (requests/s): the fewest workers meeting the SLA "
                        "there (default: the most goodput per worker)")
    g.add_argument("--max-workers", type=int, default=4, help="the worker budget")
    g.add_argument("--num-requests", type=int, default=300,
                   help="requests simulated per try (a mix; a trace has its own)")
    g.add_argument("--local-prefill-thresholds", default="0",
                   help="disaggregated layouts also tried with each of these (comma-separated "
                        "prompt tokens below which the decode worker prefills)")


def eviction_line(args: argparse.Namespace, shape: KvShape, result: Plan,
                  pool_bytes: int) -> str | None:
    """What --kv-eviction bounds a sequence to (None without a policy)."""
    from kvferry.cache.budget import KvBudget

    config = eviction_config(args)
    if not config.is_on:
        return None
    budget = config.budget_blocks(args.block_size)
    per_block = shape.bytes_per_block(args.block_size)
    line = (f"kv eviction {config.describe()}, in whole blocks of {args.block_size}): at most "
            f"{budget} blocks, {budget * per_block:,} bytes, per sequence however long it runs; "
            f"this request holds {result.blocks_per_request} of the "
            f"{KvBudget().blocks(args.prompt_tokens, args.output_tokens, args.block_size)} blocks "
            f"it would without eviction")
    if pool_bytes:
        line += f"; the pool holds {pool_bytes // (budget * per_block):,} sequences at the bound"
    return line


def _device(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _memory_bytes(device: str) -> int:
    """The workers' rule (deploy/worker_model.py), refused for CUDA on a machine without."""
    import torch

    from kvferry.cache.pool_budget import device_memory

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("pool_size: a fraction of CUDA memory, and this machine has no GPU: "
                         "give bytes")
    return device_memory(torch.device(device))


def _sizable(args: argparse.Namespace) -> bool:
    """Whether plan has the weights `--pool-size auto` is sized from: the default model, or
    a checkpoint directory (not a config.json, a .gguf's metadata or bare dimensions)."""
    if args.model is None:
        return args.layers is None
    return Path(args.model).is_dir() and any(Path(args.model).glob("*.safetensors"))


def _auto_pool_bytes(args: argparse.Namespace, device: str) -> int:
    """A decode worker's pool as serve would size it (deploy/worker_model.py), whole blocks;
    the sizing printed on its own line."""
    import torch

    from deploy.default_model import ensure_default_model
    from deploy.placement import memory_share
    from deploy.worker_model import (
        auto_pool_bytes_for,
        device_and_dtype,
        kv_block_bytes,
        rank_config,
    )
    from kvferry.model.config import load_model_config
    from kvferry.settings import WorkerSettings

    if args.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"pool_size: auto sizes kvferry's pools, and {args.kv_cache_dtype} "
                         "is vLLM's: give bytes")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("pool_size: auto sizes from CUDA memory, and this machine has no GPU: "
                         "give bytes")
    model = args.model or ensure_default_model()
    share = memory_share(args.memory_utilization, args.workers,
                         ["0"] if device == "cuda" else [], spread=False)
    settings = WorkerSettings(role="decode", model=model, device=device, dtype=args.dtype,
                              block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype,
                              memory_utilization=share,
                              tensor_parallel_size=args.tensor_parallel_size)
    config = rank_config(settings, load_model_config(model))
    dev = torch.device(device)
    _, dtype, _ = device_and_dtype(settings)
    per_block = kv_block_bytes(settings, config, dtype)
    pool = auto_pool_bytes_for(settings, config, dev, dtype) // per_block * per_block
    how = (f"a decode worker's {share:.4g} of {device} memory less weights and activations"
           if share is not None else "on CPU without --memory-utilization, a fixed size")
    blocks = pool // per_block
    print(f"pool: auto, {how}: {pool} bytes ({blocks} blocks): K/V for "
          f"{blocks * args.block_size:,} tokens ({pool / 2**20:.1f} MiB)")
    return pool


def per_rank(shape: KvShape, size: int) -> KvShape:
    """The K/V one rank of a worker split `size` ways holds per token: its share of the K/V
    heads (one each where `size` is a multiple of them: replicated, as vLLM does)."""
    import dataclasses

    from kvferry.model.tensor_parallel import kv_heads_per_rank, splits_kv_heads

    heads = shape.num_kv_heads
    if size < 1 or not splits_kv_heads(heads, size):
        raise ValueError(f"tensor_parallel_size: {size} must divide the {heads} K/V heads or "
                         "be a multiple of them")
    return dataclasses.replace(shape, num_kv_heads=kv_heads_per_rank(heads, size))


def kv_dtype(args: argparse.Namespace, device: str) -> str:
    """The element type serve's pools would hold: the workers' `--dtype auto` rule."""
    import torch

    from deploy.worker_model import default_dtype
    from kvferry.cache.layout import dtype_name

    if args.kv_cache_dtype != "auto":
        return args.kv_cache_dtype
    if args.dtype != "auto":
        return args.dtype
    return dtype_name(default_dtype(torch.device(device)))


def _config_path(model: str | Path) -> str | Path:
    """Where `model`'s config is read: a GGUF file's cached conversion where there is one
    (the file's own metadata takes seconds to parse), else `model` itself."""
    from kvferry.model.gguf import cached_conversion, is_gguf

    return (cached_conversion(model) or model) if is_gguf(model) else model


def run_plan(args: argparse.Namespace) -> int:
    if args.sla is not None or args.workload is not None:
        from deploy.planner.plan_sla import run_sla_plan

        return run_sla_plan(args)
    from deploy.default_model import MISSING_EXIT_STATUS, DefaultModelMissing, default_gguf_path
    from kvferry.cache.budget import KvBudget
    from kvferry.cache.capacity import format_plan, format_tiers, plan, tier_plans
    from kvferry.cache.layout import KvShape
    from kvferry.settings.sizes import AUTO, is_fraction, parse_pool_size

    device = _device(args.device)
    dtype = kv_dtype(args, device)
    dims = (args.layers, args.kv_heads, args.head_dim)
    if args.model is None and None not in dims:
        shape = KvShape(args.layers, args.kv_heads, args.head_dim, dtype)
    elif args.model is None and dims != (None, None, None):
        print("kvferry: plan: give --layers, --kv-heads and --head-dim together (or --model)",
              file=sys.stderr)
        return 2
    else:
        try:
            shape = KvShape.from_config(_config_path(args.model or default_gguf_path()), dtype)
        except DefaultModelMissing as exc:
            print(exc, file=sys.stderr)
            return MISSING_EXIT_STATUS
    whole_heads = shape.num_kv_heads
    shape = per_rank(shape, args.tensor_parallel_size)
    unsized = args.pool_size == AUTO and not _sizable(args)
    if unsized:
        print("pool: auto is sized from a checkpoint's weights, and plan has none here (a "
              "config, a .gguf's metadata or dimensions): --pool-size BYTES shows what fits")
        pool_bytes = 0
    elif args.pool_size == AUTO:
        pool_bytes = _auto_pool_bytes(args, device)
    else:
        memory = _memory_bytes(device) if is_fraction(args.pool_size) else 0
        pool_bytes = parse_pool_size(args.pool_size, memory, "pool_size")
    result = plan(shape, args.prompt_tokens, args.output_tokens, args.batch, pool_bytes,
                  args.block_size, KvBudget(eviction_config(args)))
    source = (args.model or ("the given dimensions" if args.model is None and None not in dims
                             else "the default model, SmolLM2-135M-Instruct"))
    print(f"model: {source}; K/V as serve stores it on {device}")
    if args.tensor_parallel_size > 1:
        print(f"split {args.tensor_parallel_size} ways: each rank holds {shape.num_kv_heads} "
              f"of the {whole_heads} K/V heads of every block; the figures are one rank's")
    lines = format_plan(shape, result, args.batch, args.block_size).splitlines()
    if unsized:  # no pool: blocks per request only
        lines[-1] = lines[-1].split(", pool holds")[0]
    print("\n".join(lines))
    if (bounded := eviction_line(args, shape, result, pool_bytes)) is not None:
        print(bounded)
    sizes = {tier: parse_pool_size(size, 0, f"{tier}_cache_size") for tier, size in
             (("host", args.host_cache_size), ("disk", args.disk_cache_size),
              ("store", args.store_size)) if size is not None}
    if sizes:
        print(format_tiers(tier_plans(shape, args.block_size, result.blocks_per_request,
                                      sizes)))
    return 0
