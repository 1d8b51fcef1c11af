"""CPU time of each process while one deployment serves the same load through its gRPC front
and through its HTTP front with two HTTP clients: where an HTTP front's added
latency goes on a small machine, where the load generator shares the cores with the server.

One deployment (tiny seeded model, router with `--http-port 0`, 1 prefill + 1 decode worker,
`--no-prefix-caching`). Each repetition runs `kvferry bench`'s workload (`--num-prompts`
random prompts of 128 token ids, 64 tokens out, greedy, `ignore_eos`, 4 req/s Poisson) once
per client, one after another, order rotating: `grpc` (Generate), `aiohttp` (the OpenAI
backend as `kvferry bench` ships it) and `httpx` (the same backend over httpx, the client it
used before). Reported per client: CPU seconds (user + system) of the router, the prefill
and decode workers and the load generator during the run, and p50 TTFT; median [min-max]
over the repetitions. Usage:

    .venv/bin/python bench/http_client_cpu.py [--repeats 3] [--num-prompts 40]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script too
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "kernels"))
from bench.bench_prefix_cache import spread  # noqa: E402
from deploy.default_model import bench_model  # noqa: E402
from deploy.launcher import Deployment  # noqa: E402
from deploy.loadgen import (  # noqa: E402
    BenchConfig,
    RandomWorkload,
    Target,
    openai_client,  # noqa: E402
    run_benchmark,
)
from deploy.loadgen import bench as loadgen_bench  # noqa: E402
from deploy.loadgen.openai_stream import Answer, ConnectionLost  # noqa: E402

CLIENTS = ("grpc", "aiohttp", "httpx")
TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid`, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S  # utime, stime


@asynccontextmanager
async def httpx_sender(base_url: str, backend: str, model: str | None = None,
                       codec: Any = None, extra_body: dict[str, Any] | None = None
                       ) -> AsyncIterator[openai_client.OpenAISender]:
    """The OpenAI backend over one httpx client, as `kvferry bench` had it before aiohttp."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None)) as client:
        async def lines(response: httpx.Response) -> AsyncIterator[str]:
            try:
                async for line in response.aiter_lines():
                    yield line
            except httpx.TransportError as exc:
                raise ConnectionLost(str(exc)) from exc

        @asynccontextmanager
        async def post(url: str, body: dict[str, Any], headers: dict[str, str]
                       ) -> AsyncIterator[Answer]:
            async with client.stream("POST", url, json=body, headers=headers) as response:
                yield Answer(response.status_code, lines(response), response.aread)

        root = openai_client.api_root(base_url)
        name = model or (await client.get(root + "/models")).json()["data"][0]["id"]
        yield openai_client.OpenAISender(post, backend, root, name, codec,
                                         dict(extra_body or {}))


def run_client(deployment: Deployment, client: str, seed: int, num_prompts: int,
               processes: dict[str, int]) -> dict[str, float]:
    config = BenchConfig(num_requests=num_prompts, request_rates=(4.0,), num_warmups=4,
                         seed=seed, percentiles=(50.0,), vocab_size=512)
    if client == "grpc":
        target = Target(client, address=deployment.router_address)
    else:
        target = Target(client, base_url=f"http://{deployment.http_address}/v1",
                        backend="openai-completions")
    original = loadgen_bench.open_sender
    if client == "httpx":
        loadgen_bench.open_sender = httpx_sender  # type: ignore[assignment]
    try:
        before = {name: cpu_s(pid) for name, pid in processes.items()}
        (run,) = run_benchmark([target], RandomWorkload(input_len=128, output_len=64),
                               config).runs
        after = {name: cpu_s(pid) for name, pid in processes.items()}
    finally:
        loadgen_bench.open_sender = original
    if run.metrics.failed:
        raise RuntimeError(f"{client}: {run.metrics.failed} requests failed")
    out = {name: after[name] - before[name] for name in processes}
    out["p50_ttft_ms"] = run.metrics.ttft.median_ms
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=40)
    args = p.parse_args()
    deployment = Deployment(model=bench_model("tiny"), num_prefill=1, num_decode=1,
                            http_port=0, torch_threads=1,
                            log_dir=Path(tempfile.mkdtemp(prefix="http_client_cpu-")),
                            worker_args=["--no-prefix-caching"])
    runs: dict[str, list[dict[str, float]]] = {c: [] for c in CLIENTS}
    with deployment:
        processes = {proc.name: proc.popen.pid for proc in deployment.processes}
        processes["load generator"] = os.getpid()
        for r in range(args.repeats):
            for client in CLIENTS[r % 3:] + CLIENTS[:r % 3]:
                runs[client].append(run_client(deployment, client, r, args.num_prompts,
                                               processes))
                print(f"  repetition {r + 1} {client}: {runs[client][-1]}", flush=True)
    names = [*processes, "p50_ttft_ms"]
    print("| client | " + " | ".join(f"{n} (CPU-s)" if n in processes else "p50 TTFT (ms)"
                                      for n in names) + " |")
    print("|---" + "|---:" * len(names) + "|")
    for client in CLIENTS:
        cells = [spread([run[n] for run in runs[client]]).text() for n in names]
        print(f"| {client} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
