"""Start and stop a local deployment: router + P prefill + D decode worker processes.

Each process binds the port it is given (0 = any free port) and prints one readiness line
with the bound port; the launcher reads it, so no port is ever guessed. Workers start in
parallel; the router starts once they are all serving.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvferry.grpc_util import READY_PREFIX


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[str]
    port: int = 0
    metrics_port: int = 0  # 0: no metrics server
    _ready: threading.Event = field(default_factory=threading.Event)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _watch(self) -> None:
        assert self.popen.stdout is not None  # noqa: S101 - created with stdout=PIPE
        for line in self.popen.stdout:
            if line.startswith(READY_PREFIX):
                fields = dict(item.split("=") for item in line.split()[1:])
                self.metrics_port = int(fields["metrics_port"])
                self.port = int(fields["port"])
                self._ready.set()
        self._ready.set()  # exited: wake the waiter, who checks the return code

    def wait_ready(self, timeout_s: float) -> None:
        if not self._ready.wait(timeout_s) or self.port == 0:
            code = self.popen.poll()
            raise RuntimeError(f"{self.name} did not become ready (exit code {code})")


def _spawn(name: str, args: list[str], log_dir: Path | None, env: dict[str, str]) -> Process:
    stderr = open(log_dir / f"{name}.log", "w") if log_dir else None  # noqa: SIM115
    popen = subprocess.Popen(
        [sys.executable, "-m", "kvferry.cli", *args],
        stdout=subprocess.PIPE, stderr=stderr, text=True, env={**os.environ, **env},
        start_new_session=True,
    )
    proc = Process(name, popen)
    threading.Thread(target=proc._watch, daemon=True).start()
    return proc


@dataclass
class Deployment:
    model: str
    num_prefill: int = 1
    num_decode: int = 1
    router_port: int = 0
    block_size: int = 16
    kv_pool_size: str = "256MiB"
    torch_threads: int = 1
    attention_backend: str = "auto"
    host: str = "127.0.0.1"  # what every server binds; 0.0.0.0 for other hosts to reach it
    is_colocated: bool = False  # num_decode workers each serving both roles; no prefill ones
    worker_args: list[str] = field(default_factory=list)  # extra flags for every worker
    role_args: dict[str, list[str]] = field(default_factory=dict)  # extra flags by role
    router_args: list[str] = field(default_factory=list)  # extra flags for the router
    log_dir: Path | None = None
    log_format: str = "text"  # or "json": one object per line, with the request id
    env: dict[str, str] = field(default_factory=dict)
    processes: list[Process] = field(default_factory=list)

    def _worker_args(self, role: str) -> list[str]:
        return ["--log-format", self.log_format,
                f"{role}-worker", "--model", self.model, "--host", self.host, "--port", "0",
                "--block-size", str(self.block_size), "--kv-pool-size", self.kv_pool_size,
                "--torch-threads", str(self.torch_threads),
                "--attention-backend", self.attention_backend, *self.worker_args,
                *self.role_args.get(role, [])]

    def start(self, timeout_s: float = 180.0) -> Deployment:
        try:
            decode_role = "colocated" if self.is_colocated else "decode"
            num_prefill = 0 if self.is_colocated else self.num_prefill
            workers = [_spawn(f"prefill-{i}", self._worker_args("prefill"), self.log_dir,
                              self.env) for i in range(num_prefill)]
            workers += [_spawn(f"{decode_role}-{i}", self._worker_args(decode_role),
                               self.log_dir, self.env) for i in range(self.num_decode)]
            self.processes = list(workers)
            for proc in workers:
                proc.wait_ready(timeout_s)
            args = ["--log-format", self.log_format, "router", "--model", self.model,
                    "--host", self.host, "--port", str(self.router_port), *self.router_args]
            for proc in workers:
                args += [f"--{proc.name.rsplit('-', 1)[0]}", proc.address]
            router = _spawn("router", args, self.log_dir, self.env)
            self.processes.append(router)
            router.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def router_address(self) -> str:
        return self.processes[-1].address

    def addresses(self, role: str) -> list[str]:
        """Workers serving `role`; colocated workers serve both prefill and decode."""
        return [p.address for p in self.processes
                if p.name.startswith(role) or (role == "decode" and p.name.startswith("colocated"))]

    def pin(self, role: str, cpus: set[int]) -> None:
        """Pin every thread of the `role` processes to `cpus` (threads started later inherit
        it): benchmarks on a small machine give latency-critical workers their own core."""
        for proc in self.processes:
            if proc.name.rsplit("-", 1)[0] != role:
                continue
            for tid in os.listdir(f"/proc/{proc.popen.pid}/task"):
                os.sched_setaffinity(int(tid), cpus)

    def dead(self) -> list[str]:
        """Names of processes that have exited."""
        return [p.name for p in self.processes if p.popen.poll() is not None]

    def stop(self, grace_s: float = 10.0) -> list[int | None]:
        """SIGTERM everything (router first), wait, SIGKILL stragglers. Returns exit codes."""
        for proc in reversed(self.processes):
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        codes = []
        for proc in reversed(self.processes):
            try:
                codes.append(proc.popen.wait(max(deadline - time.monotonic(), 0.1)))
            except subprocess.TimeoutExpired:
                os.killpg(proc.popen.pid, signal.SIGKILL)
                codes.append(proc.popen.wait())
        self.processes = []
        return codes

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
