"""`kvferry profile`: launch one prefill and one decode worker behind a router on this
machine, measure what prefill, decode steps and K/V transfer cost there
(deploy/planner/profiler.py), then one colocated worker on the decode worker's cores, and
keep the result as a profile per model, dtype, device and transport for `kvferry plan --sla`
(deploy/planner/profile.py)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from kvferry.settings import DEFAULT_PREFILL_CHUNK_SIZE


def _sweep(args: argparse.Namespace):
    from deploy.planner.profiler import Sweep

    given = {name: value for name in ("prompt_lens", "decode_batches", "decode_contexts")
             if (value := getattr(args, name)) is not None}
    return Sweep(**given, repeats=args.repeats)


def run_profile(args: argparse.Namespace) -> int:
    from deploy.default_model import ensure_default_model
    from kvferry.settings import KVFERRY_HOME
    from kvferry.settings.sizes import check_pool_size

    try:
        sweep = _sweep(args)
        check_pool_size(args.kv_pool_size)
    except ValueError as exc:
        print(f"kvferry: profile: {exc}", file=sys.stderr)
        return 2
    model = args.model or ensure_default_model()
    if not (Path(model) / "config.json").exists():
        print(f"kvferry: profile: --model: no config.json in {model}", file=sys.stderr)
        return 2
    log_dir = args.log_dir or KVFERRY_HOME / "logs" / time.strftime("profile-%Y%m%d-%H%M%S")
    print(f"profile: the deployment logs to {log_dir}", file=sys.stderr)
    profile = profile_deployment(model, sweep, args.kv_transport, args.kv_pool_size,
                                 args.block_size, args.load_format, log_dir,
                                 log=lambda line: print(line, file=sys.stderr))
    path = profile.save(args.out)
    from deploy.planner.profile import CostModel

    print(CostModel(profile).describe())
    print(f"profile: {path}")
    return 0


def profile_deployment(model: str, sweep, kv_transport: str, kv_pool_size: str,
                       block_size: int, load_format: str = "auto", log_dir: Path | None = None,
                       log=lambda _: None):
    """Launch 1 prefill + 1 decode worker on this machine, measure, then 1 colocated worker
    (not on Ray), and return the Profile."""
    import asyncio

    import torch

    from deploy.launcher import Deployment
    from deploy.loadgen.bench import _model_info
    from deploy.placement import beside_router
    from deploy.planner.profiler import measure
    from kvferry.cache.layout import read_hf_config

    max_len = read_hf_config(model).max_position_embeddings
    load = ["--load-format", load_format] if load_format != "auto" else []
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    if kv_transport == "ray":  # actors, as `serve --kv-transport ray` runs them
        from deploy.ray_launcher import RayDeployment

        threads = max(1, len(os.sched_getaffinity(0)) // 2)  # the cores, split as pinned
        deployment = RayDeployment(model=model, kv_pool_size=kv_pool_size,
                                   block_size=block_size, torch_threads=threads,
                                   log_dir=log_dir, worker_args=load, router_args=load)
    else:
        deployment = Deployment(model=model, kv_pool_size=kv_pool_size, block_size=block_size,
                                torch_threads=0, pin_cores=True, log_dir=log_dir,
                                worker_args=["--kv-transport", kv_transport, *load],
                                router_args=load)
    # this process (the client) beside the router, as the load tester runs (loadgen/targets.py)
    with deployment, beside_router(deployment.core_plan):
        vocab, name = asyncio.run(_model_info(deployment.router_address))
        pids = deployment.pids()
        measured = measure(deployment.router_address, sweep, vocab, max_len, log,
                           router_pid=pids["router"], decode_pid=pids["decode-0"])
        plan = deployment.core_plan
    decode_cores = (set(plan.cores["decode-0"]) if plan is not None and plan.is_pinned
                    else None)
    colocated = None
    if kv_transport != "ray":  # (colocated workers run as processes only)
        threads = len(decode_cores) if decode_cores else torch.get_num_threads()
        colocated = _measure_colocated(
            Deployment(model=model, kv_pool_size=kv_pool_size, block_size=block_size,
                       torch_threads=0, pin_cores=True, is_colocated=True, num_decode=1,
                       log_dir=log_dir / "colocated" if log_dir is not None else None,
                       worker_args=load, router_args=load),
            decode_cores or os.sched_getaffinity(0), sweep, vocab, max_len, log)
    return _profile(model, name, measured, kv_transport, kv_pool_size, block_size, threads,
                    colocated)


def _measure_colocated(deployment, cores: set[int], sweep, vocab: int, max_len: int, log):
    """The sweep on one colocated worker, with it, its router and this client held to
    `cores` (a decode worker's, above): as a colocated layout places each worker on few
    cores, their turns shared with it."""
    from deploy.placement import ROUTER, CorePlan, beside_router
    from deploy.planner.profiler import measure

    log("colocated worker:")
    if deployment.log_dir is not None:
        deployment.log_dir.mkdir(parents=True, exist_ok=True)
    # this process on `cores` while it runs: the launch places what it starts within them
    with beside_router(CorePlan({ROUTER: tuple(sorted(cores))}, len(cores), 1)), deployment:
        return measure(deployment.router_address, sweep, vocab, max_len, log)


def _profile(model: str, name: str, measured, kv_transport: str, kv_pool_size: str,
             block_size: int, threads: int, colocated=None):
    """The Profile of what `measure` found, with the workers' shape and this machine's."""
    import torch

    from deploy.planner.profile import DecodeFit, Profile
    from deploy.planner.profiler import cpu_costs, transfer_points
    from deploy.worker_model import default_dtype
    from kvferry.cache.layout import KvShape, dtype_name, read_hf_config
    from kvferry.model.prefill_batch import token_budget_for
    from kvferry.settings.sizes import parse_pool_size

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype_name(default_dtype(device))
    shape = KvShape.from_config(model, dtype)
    (per_request, per_update, per_token), (client_request, client_token) = cpu_costs(
        measured.cpu)
    decode_fit = DecodeFit(measured.decode)

    def step(n: int) -> float:
        return decode_fit.step_s(1, n)

    def forward(points):
        """A prompt alone: the client's and the router's turns, then the forward (the
        simulator charges the turns)."""
        return tuple(replace(p, seconds=max(p.seconds - per_request - client_request,
                                            p.seconds / 2)) for p in points)

    prefill = forward(measured.prefill)
    return Profile(
        model=name, dtype=dtype, device=device.type, kv_transport=kv_transport,
        torch_threads=threads, block_size=block_size,
        kv_bytes_per_token=shape.bytes_per_token,
        num_blocks=parse_pool_size(kv_pool_size, 0) // shape.bytes_per_block(block_size),
        prefill_token_budget=token_budget_for(device),
        prefill_chunk_size=DEFAULT_PREFILL_CHUNK_SIZE, batch_buckets=(),
        max_model_len=read_hf_config(model).max_position_embeddings, prefill=prefill,
        decode=measured.decode, transfer=transfer_points(measured.second_gaps, step),
        receive=transfer_points(measured.decode_cpu, step),
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"), relay_s_per_token=per_token,
        router_s_per_request=per_request, router_s_per_update=per_update,
        client_s_per_token=client_token, client_s_per_request=client_request,
        num_cores=len(os.sched_getaffinity(0)),
        colocated_prefill=forward(colocated.prefill) if colocated else (),
        colocated_decode=colocated.decode if colocated else ())
