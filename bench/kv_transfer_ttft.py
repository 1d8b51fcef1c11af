"""Part 2 of bench/bench_kv_transfer.py: TTFT and time to the 2nd token of one long prompt,
a colocated worker against disaggregated deployments on each K/V transport."""

from __future__ import annotations

import asyncio
import statistics

import torch

from deploy import client
from deploy.default_model import tiny_model
from deploy.launcher import Deployment

NIXL_WORKER_ARGS = ["--kv-transport", "nixl"]


async def _first_two_tokens(address: str, prompt: list[int]) -> tuple[float, float]:
    """Client-side seconds to the first and to the second token of one request."""
    request = client.make_request(prompt, temperature=0.0, max_tokens=2, ignore_eos=True)
    got = await client.generate(address, request, timeout_s=600)
    return got.token_times_s[0], got.token_times_s[-1]


def ttft_rows(prompt_tokens: int, reps: int, transports: list[str]) -> list[dict[str, object]]:
    """Median TTFT and time to the 2nd token of one long prompt on the tiny model: a
    colocated worker (prefill compute alone, no transfer) against disaggregated deployments
    whose K/V push is pipelined with the prefill. The 2nd token needs the K/V to have landed
    on the decode worker, so it shows what the transfer adds to the critical path."""
    model = tiny_model()
    prompt = torch.randint(1, 500, (prompt_tokens,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    setups = [("colocated (compute alone)", Deployment(model=model, is_colocated=True))]
    if "grpc" in transports:
        setups.append(("disaggregated, gRPC", Deployment(model=model)))
    if "nixl" in transports:
        setups.append(("disaggregated, NIXL", Deployment(model=model,
                                                         worker_args=NIXL_WORKER_ARGS)))
    if "ray" in transports:
        from deploy.ray_launcher import RayDeployment

        setups.append(("disaggregated, Ray", RayDeployment(model=model)))
    rows = []
    for name, deployment in setups:
        with deployment:
            asyncio.run(_first_two_tokens(deployment.router_address, prompt))  # warm-up
            times = [asyncio.run(_first_two_tokens(deployment.router_address, prompt))
                     for _ in range(reps)]
        rows.append({"setup": name, "ttft_s": statistics.median(t[0] for t in times),
                     "second_token_s": statistics.median(t[1] for t in times)})
    for row in rows:
        row["ttft_ratio"] = row["ttft_s"] / rows[0]["ttft_s"]
        row["second_token_ratio"] = row["second_token_s"] / rows[0]["second_token_s"]
    return rows


def print_ttft(rows: list[dict[str, object]], prompt_tokens: int, reps: int) -> None:
    print(f"\n{prompt_tokens}-token prompt, tiny model (median of {reps})")
    print(f"{'setup':<28} {'TTFT ms':>8} {'x':>6} {'2nd token ms':>13} {'x':>6}")
    for r in rows:
        print(f"{r['setup']:<28} {r['ttft_s'] * 1e3:>8.1f} {r['ttft_ratio']:>6.2f} "
              f"{r['second_token_s'] * 1e3:>13.1f} {r['second_token_ratio']:>6.2f}")
