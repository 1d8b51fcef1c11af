"""The command line: `kvferry serve` + `kvferry generate`, clean shutdown on SIGTERM, and the
router refusing a worker that serves a different model."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from deploy import client
from deploy.launcher import _spawn
from deploy.placement import ROUTER, CorePlan, plan_cores
from tests.deployments import start_serve
from tests.e2e.test_metrics import scrape, value
from tests.waiting import until_sync

pytestmark = pytest.mark.slow


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(entry.name))
    return pids


def test_serve_generate_and_sigterm(qwen3_checkpoint: Path, tmp_path: Path) -> None:
    # A private copy, so that only this deployment's processes name its path. Its servers
    # start as a user's do, in fresh interpreters (not forked by the run's zygote, whose
    # children's command lines name no model).
    qwen3_checkpoint = Path(shutil.copytree(qwen3_checkpoint, tmp_path / "model"))
    errors = (tmp_path / "serve.err").open("w+")  # every process logs here
    serve, address = start_serve(["--model", str(qwen3_checkpoint), "--port", "0",
                                  "--http-port", "0", "--memory-utilization", "0.02"], errors)
    try:
        assert serve.stdout is not None
        assert "OpenAI-compatible HTTP API on http://127.0.0.1:" in serve.stdout.readline()
        assert len(_processes_mentioning(str(qwen3_checkpoint))) == 4  # serve + 3 children
        placed = _check_placement(str(qwen3_checkpoint))
        out = subprocess.run(
            [sys.executable, "-m", "deploy.cli", "generate", "--address", address, "hello",
             "--max-tokens", "6", "--temperature", "0", "--ignore-eos"],
            capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "[6 tokens, finish length]" in out.stdout
        assert "TTFT" in out.stdout and "mean ITL" in out.stdout
        piped = subprocess.run(  # the prompt from a pipe, as `echo hello | kvferry generate`
            [sys.executable, "-m", "deploy.cli", "generate", "--address", address,
             "--max-tokens", "6", "--temperature", "0", "--ignore-eos"], input="hello",
            capture_output=True, text=True, timeout=120)
        assert piped.returncode == 0, piped.stderr
        assert piped.stdout.split("\n[")[0] == out.stdout.split("\n[")[0]  # the same text
    finally:
        serve.send_signal(signal.SIGTERM)
        code = serve.wait(timeout=60)
    assert code == 0
    until_sync(lambda: not _processes_mentioning(str(qwen3_checkpoint)),
               "every process of the deployment exited", poll_s=0.1)
    errors.seek(0)
    log = errors.read()
    # serve says what it starts at once; a normal stop stops the router before the
    # workers, so it reports none of them unreachable, and nothing prints a traceback
    assert log.startswith("kvferry: starting 1 prefill + 1 decode worker(s) and a router")
    assert "unreachable" not in log and "Traceback" not in log, log[-3000:]
    # where each process runs, said once; the pool sized from the machine's memory
    assert placed.line() in log and (placed.warning in log if placed.warning else True)
    assert _pool_line(log, "decode") == _planned_pool(qwen3_checkpoint, "0.02", "2")


def _check_placement(model: str) -> CorePlan:
    """The workers of the deployment serving `model` run on the cores serve planned."""
    plan = plan_cores(["prefill-0", "decode-0"], sorted(os.sched_getaffinity(0)))
    for pid in _processes_mentioning(model):
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        if "serve" in args:
            continue  # serve itself runs where it was started
        name = ("prefill-0" if "prefill-worker" in args else
                "decode-0" if "decode-worker" in args else ROUTER)
        want = set(plan.cores[name]) if plan.is_pinned else os.sched_getaffinity(0)
        assert os.sched_getaffinity(pid) == want, (name, pid)
    return plan


def _pool_line(log: str, role: str) -> tuple[int, int]:
    """(bytes, blocks) of a worker's pool, as it logged them."""
    match = re.search(rf"{role} worker's K/V pool: (\d+) bytes \([\d.]+ MiB\), (\d+) blocks", log)
    assert match, log[-3000:]
    blocks = int(match.group(2))
    # the capacity in tokens, in the pool's line and the worker's ready line (with the model)
    tokens = f"K/V for {blocks * 16:,} tokens"
    assert f"{blocks} blocks of 16 tokens: {tokens}" in log
    assert re.search(rf"{role} worker on \S+ ready: [\w.-]+, {tokens} \({blocks} blocks", log)
    return int(match.group(1)), blocks


def _planned_pool(model: Path, utilization: str, workers: str) -> tuple[int, int]:
    """(bytes, blocks) of a decode worker's pool as `kvferry plan` sizes it."""
    out = subprocess.run([sys.executable, "-m", "deploy.cli", "plan", "--model", str(model),
                          "--device", "cpu", "--memory-utilization", utilization,
                          "--workers", workers], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    match = re.search(r"pool: auto, .*: (\d+) bytes \((\d+) blocks\)", out.stdout)
    assert match, out.stdout
    return int(match.group(1)), int(match.group(2))


def test_router_refuses_a_worker_of_another_model(qwen3_checkpoint: Path, llama_checkpoint: Path,
                                                  tmp_path: Path) -> None:
    procs = []
    try:
        # Pools sized from the device (auto), small: also what /metrics and plan say of one
        auto = ["--memory-utilization", "0.01"]
        prefill = _spawn("prefill", ["prefill-worker", "--model", str(qwen3_checkpoint), *auto],
                         tmp_path, {})
        decode = _spawn("decode", ["decode-worker", "--model", str(llama_checkpoint), *auto,
                                   "--metrics-port", "0"], tmp_path, {})
        procs += [prefill, decode]
        prefill.wait_ready(120)
        decode.wait_ready(120)
        router = _spawn("router", ["router", "--model", str(qwen3_checkpoint), "--prefill",
                                   prefill.address, "--decode", decode.address], tmp_path, {})
        procs.append(router)
        router.wait_ready(120)
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            asyncio.run(client.generate(router.address, client.make_request("hi"), 30))
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no healthy decode worker" in exc.value.details()
        log = (tmp_path / "router.log").read_text()
        assert "refusing decode worker" in log and "fingerprint" in log
        pool = _planned_pool(llama_checkpoint, "0.01", "1")
        assert _pool_line((tmp_path / "decode.log").read_text(), "decode") == pool
        assert value(scrape(decode.metrics_port), "kvferry_kv_cache_pool_bytes") == pool[0]
    finally:
        for proc in procs:
            proc.popen.terminate()
            proc.popen.wait(30)


@pytest.mark.ray
def test_demo_on_ray_starts_and_stops_its_own_ray(qwen3_checkpoint: Path, tmp_path: Path) -> None:
    """`kvferry demo --kv-transport ray`: a local Ray instance, router and workers as actors,
    K/V pages as object refs; the completion streams and Ray is shut down afterwards."""
    import tempfile

    ray_tmp = tempfile.mkdtemp(prefix="kvr", dir="/tmp")  # unix socket paths must stay short
    env = {**os.environ, "RAY_ADDRESS": "", "RAY_TMPDIR": ray_tmp}
    out = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "demo", "--model", str(qwen3_checkpoint),
         "--kv-transport", "ray", "--prompt", "hello there", "--max-tokens", "5",
         "--kv-pool-size", "256MiB",
         "--temperature", "0", "--ignore-eos"],
        capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[5 tokens, finish length]" in out.stdout
    until_sync(lambda: not _processes_mentioning(ray_tmp),  # no raylet or actor left behind
               "every Ray process exited", poll_s=0.2)
    shutil.rmtree(ray_tmp, ignore_errors=True)


def test_demo_asks_the_real_model_over_nixl_and_keeps_logs_apart(smollm2_checkpoint: Path,
                                                                 tmp_path: Path) -> None:
    """`kvferry demo --kv-transport nixl`: a chat question to the real model, answered
    greedily (asked for: unasked, demo samples as the model's defaults say); the answer, the
    finish reason and the timings stream on stdout, the processes' logs go to files. Every
    worker runs the NIXL transport, and the prefill worker registered its pool with a NIXL
    agent for the decode worker to read. (The default transport, gRPC, is `serve`'s above.)
    The workers also run a host tier and the shared store demo started (`--kv-store-size`),
    which it stops with them."""
    log_dir = tmp_path / "logs"
    out = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "demo", "--model", str(smollm2_checkpoint),
         "--kv-transport", "nixl", "--log-dir", str(log_dir), "--kv-host-cache-size", "128MiB",
         "--kv-store-size", "64MiB", "--temperature", "0", "--kv-pool-size", "256MiB"],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "> What is the capital of France?" in out.stdout
    assert "Paris" in out.stdout
    assert "finish stop]" in out.stdout
    assert f"logs: {log_dir}" in out.stdout
    assert " INFO " not in out.stdout and " INFO " not in out.stderr
    logs = {path.name: path.read_text() for path in log_dir.iterdir()}
    assert {"router.log", "prefill-0.log", "decode-0.log"} <= set(logs)
    assert logs["placement.log"].startswith("placement: ")  # where each one ran
    assert " INFO " in logs["router.log"]
    for role in ("prefill", "decode"):
        assert "nixl K/V transport" in logs[f"{role}-0.log"]
    assert "registered a" in logs["prefill-0.log"]
    for role in ("prefill", "decode"):
        assert "store K/V tier at unix://" in logs[f"{role}-0.log"]
        assert "host K/V tier: " in logs[f"{role}-0.log"]
    until_sync(lambda: not _processes_mentioning("kvferry-store-"), "the store server stopped",
               poll_s=0.2)
