"""One component process of a local deployment: started in a session of its own (or forked by
the tests' zygote), its readiness line read from its stdout, its log appended to a file."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from deploy import zygote
from deploy.child_env import is_router, without_router_secrets
from kvferry.rpc.grpc_util import parse_ready


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[str] | zygote.ZygoteProcess  # forked by the zygote in tests
    host: str = "127.0.0.1"  # where to reach it (its own address in a network namespace)
    port: int = 0
    metrics_port: int = 0  # 0: no metrics server
    http_port: int = 0  # the router's OpenAI-compatible HTTP API; 0: none
    _ready: threading.Event = field(default_factory=threading.Event)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _watch(self) -> None:
        assert self.popen.stdout is not None  # noqa: S101 - created with stdout=PIPE
        for line in self.popen.stdout:
            if (ready := parse_ready(line)) is not None:
                self.port, self.metrics_port, self.http_port = ready
                self._ready.set()
        self._ready.set()  # exited: wake the waiter, who checks the return code

    def wait_ready(self, timeout_s: float) -> None:
        if not self._ready.wait(timeout_s) or self.port == 0:
            code = self.popen.poll()
            raise RuntimeError(f"{self.name} did not become ready (exit code {code})")


class Placement(NamedTuple):
    """Where a component runs: the host it binds, where others reach it, how it is started."""

    bind_host: str
    reach_host: str
    prefix: tuple[str, ...] = ()  # before the command: `ip netns exec NS` in a namespace


LOOPBACK = Placement("127.0.0.1", "127.0.0.1")


def _spawn(name: str, args: list[str], log_dir: Path | None, env: dict[str, str],
           place: Placement = LOOPBACK) -> Process:
    """Start `deploy.cli args` in a session of its own; its log appends (a worker restarted).
    Only a router (`name` "router" or "router-*") keeps the router's secrets (the API key) in
    its environment (deploy/child_env.py)."""
    stderr = open(log_dir / f"{name}.log", "a") if log_dir else None  # noqa: SIM115
    env = {**os.environ, **env}
    if not is_router(name):
        env = without_router_secrets(env)
    popen = (None if place.prefix else zygote.spawn(args, env, stderr)) or subprocess.Popen(
        [*place.prefix, sys.executable, "-m", "deploy.cli", *args], stdout=subprocess.PIPE,
        stderr=stderr, text=True, env=env, start_new_session=True)
    proc = Process(name, popen, place.reach_host)
    threading.Thread(target=proc._watch, daemon=True).start()
    return proc


def serves(name: str, role: str) -> bool:
    """Whether component `name` ("decode-0") serves `role`: colocated workers also decode."""
    return name.startswith(role) or (role == "decode" and name.startswith("colocated"))
