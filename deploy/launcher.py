"""Start and stop a local deployment: router + P prefill + D decode worker processes.

Each process binds the ports it is given (0 = any free port) and prints one readiness line
with the bound ports; the launcher reads it, so no port is ever guessed. Workers start in
parallel; the router starts once they are all serving.

`isolation="netns"` runs every component in its own network namespace with its own address
(deploy/netns.py), so `cut(name)` can partition it; where the machine does not allow that
(not root, no iproute2) the deployment runs on loopback and `cut` stops the process instead
(SIGSTOP): its peers see the same silence, though its kernel still answers TCP
(`isolation_used` says which one ran).

`pin_cores` gives each worker cores (and with several GPUs, a GPU) of its own
(deploy/placement.py); the processes themselves (deploy/spawn.py) are started alike either way.

KVFERRY_WORKER_PORTS=LOW-HIGH gives workers gRPC ports from that range (each found free
first) instead of any free one: the kernel picks those from its ephemeral range, where any
outgoing connection may take a killed worker's port before it is started again at its
address (the test suite sets it; keep the range outside ip_local_port_range).
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from deploy import netns
from deploy.default_model import default_model_router_args, ensure_default_model
from deploy.placement import (
    CorePlan,
    gpu_env,
    lending_argv,
    lending_pairs,
    memory_share,
    pin_threads,
    placed_argv,
    plan_cores,
    visible_gpus,
)
from deploy.spawn import Placement, Process, _spawn, serves
from deploy.start_log import record_start
from kvferry.cores import create_file
from kvferry.model.gguf import ensure_converted, is_gguf
from kvferry.settings import (
    ATTENTION_BACKENDS,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_COMPILE_BATCH_SIZES,
    DEFAULT_COMPILE_MODE,
    DEPLOYMENT_TORCH_THREADS,
    LAUNCHED_KV_POOL_SIZE,
)
from kvferry.settings.sizes import AUTO

log = logging.getLogger("kvferry")
ISOLATIONS = ("loopback", "netns")
WORKER_PORTS_ENV = "KVFERRY_WORKER_PORTS"
_next_port: dict[tuple[int, int], int] = {}  # range -> where the next search starts


def worker_port(host: str) -> int:
    """A worker's --port: 0 (any free port), or with KVFERRY_WORKER_PORTS the next port of
    that range that binds on `host` now (a search that goes round, so a port just given
    out is not given again soon)."""
    text = os.environ.get(WORKER_PORTS_ENV, "")
    if not text:
        return 0
    try:
        low, high = (int(part) for part in text.split("-"))
    except ValueError:
        raise ValueError(f"{WORKER_PORTS_ENV}: expected LOW-HIGH, got {text!r}") from None
    if not 0 < low <= high < 65536:
        raise ValueError(f"{WORKER_PORTS_ENV}: expected 0 < LOW <= HIGH < 65536, got {text!r}")
    size = high - low + 1
    start = _next_port.setdefault((low, high), low + os.getpid() % size)
    for i in range(size):
        port = low + (start - low + i) % size
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError as exc:
                if exc.errno == errno.EADDRNOTAVAIL:  # a namespace's address: its own ports
                    return 0
                continue
        _next_port[(low, high)] = low + (port - low + 1) % size
        return port
    raise RuntimeError(f"{WORKER_PORTS_ENV}: no free port in {text}")


@dataclass
class Deployment:
    """A deployment's shape and, once started, its processes. Not started, it is also the
    template of the deployments a benchmark launches (deploy/loadgen/targets.py)."""

    # A checkpoint directory or a .gguf file; None: the default model (deploy/default_model.py)
    model: str | None = None
    num_prefill: int = 1
    num_decode: int = 1
    router_port: int = 0
    http_port: int | None = None  # the router's OpenAI-compatible HTTP API (0: any free port)
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_pool_size: str = LAUNCHED_KV_POOL_SIZE  # serve's default is auto
    memory_utilization: float | None = None  # kv_pool_size auto: every worker's, together
    torch_threads: int = DEPLOYMENT_TORCH_THREADS  # per worker (0: one per core it is placed on)
    pin_cores: bool = False  # workers on cores (and GPUs) of their own: deploy/placement.py
    core_plan: CorePlan | None = None  # once started with pin_cores: where each process runs
    # With pin_cores on CPU: paired prefill and decode workers run threads on each other's
    # cores while the other is idle (kvferry/cores.py); the file their marks live in.
    lend_cores: bool = False
    lending_file: Path | None = None
    attention_backend: str = ATTENTION_BACKENDS[0]
    compile: str = DEFAULT_COMPILE_MODE  # every worker's --compile
    compile_batch_sizes: str = DEFAULT_COMPILE_BATCH_SIZES
    host: str = "127.0.0.1"  # what every server binds; 0.0.0.0 for other hosts to reach it
    is_colocated: bool = False  # num_decode workers each serving both roles; no prefill ones
    worker_args: list[str] = field(default_factory=list)  # extra flags for every worker
    role_args: dict[str, list[str]] = field(default_factory=dict)  # extra flags by role
    # Ranks each prefill worker's model is split over, and each decode (or colocated) one's
    prefill_tensor_parallel_size: int = 1
    decode_tensor_parallel_size: int = 1
    router_args: list[str] = field(default_factory=list)  # extra flags for the router
    log_dir: Path | None = None
    log_format: str = "text"  # or "json": one object per line, with the request id
    env: dict[str, str] = field(default_factory=dict)
    # "netns": each component in its own network namespace where the machine allows it
    # (see the module docstring); "loopback" otherwise, and always when asked for.
    isolation: str = "loopback"
    processes: list[Process] = field(default_factory=list)
    network: netns.Network | None = None  # set while the components run in namespaces

    @property
    def isolation_used(self) -> str:
        return "netns" if self.network is not None else "loopback"

    def _worker_args(self, role: str, host: str | None = None) -> list[str]:
        return ["--log-format", self.log_format,
                f"{role}-worker", "--model", self.model or ensure_default_model(),
                "--host", host or self.host, "--port", str(worker_port(host or self.host)),
                "--block-size", str(self.block_size), "--kv-pool-size", self.kv_pool_size,
                "--torch-threads", str(self.torch_threads),
                "--attention-backend", self.attention_backend,
                "--compile", self.compile, "--compile-batch-sizes", self.compile_batch_sizes,
                *self._tensor_parallel_args(role), *self.worker_args,
                *self.role_args.get(role, [])]

    def tensor_parallel_size(self, role: str) -> int:
        """Ranks a worker of `role` splits its model over."""
        return (self.prefill_tensor_parallel_size if role == "prefill"
                else self.decode_tensor_parallel_size)

    def _tensor_parallel_args(self, role: str) -> list[str]:
        size = self.tensor_parallel_size(role)
        return ["--tensor-parallel-size", str(size)] if size != 1 else []

    def _convert_gguf_once(self) -> None:
        """Convert a `.gguf` model here, before its processes start: each would otherwise
        find the cache empty and convert it at the same time (safe, but N times the work)."""
        if self.model and is_gguf(self.model):
            ensure_converted(self.model)

    def _start_network(self) -> None:
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"isolation: {self.isolation!r} is not one of {ISOLATIONS}")
        if self.isolation == "loopback":
            return
        if not netns.is_available():
            log.warning("isolation: network namespaces unavailable (root and iproute2 "
                        "needed); running on loopback, cut() stops processes instead")
            return
        self.network = netns.Network.create()

    def _place(self, name: str) -> Placement:
        """A namespace of its own with its own address when isolated, else `self.host`."""
        if self.network is None:
            return Placement(self.host, "127.0.0.1")
        address = self.network.add(name)
        return Placement(address, address, tuple(self.network.exec_prefix(name)))

    def _worker_names(self) -> list[str]:
        """"prefill-0", ..., then "decode-0" (or "colocated-0"), ...: the workers to start."""
        decode_role = "colocated" if self.is_colocated else "decode"
        num_prefill = 0 if self.is_colocated else self.num_prefill
        return ([f"prefill-{i}" for i in range(num_prefill)]
                + [f"{decode_role}-{i}" for i in range(self.num_decode)])

    def _router_args(self, host: str, workers: dict[str, str]) -> list[str]:
        """The router's command line; `workers`: name -> address."""
        args = ["--log-format", self.log_format, "router",
                "--model", self.model or ensure_default_model(),
                "--host", host, "--port", str(self.router_port), *self.router_args,
                *([] if self.model else default_model_router_args(self.router_args))]
        if self.http_port is not None:
            args += ["--http-port", str(self.http_port)]
        for name, address in workers.items():
            args += [f"--{name.rsplit('-', 1)[0]}", address]
        return args

    def start(self, timeout_s: float | None = None) -> Deployment:
        """Start every process; each must be ready within `timeout_s` (default 180 s, 1800 s
        where workers compile their model first)."""
        if timeout_s is None:
            timeout_s = 180.0 if self.compile == "off" else 1800.0
        record_start("deployment", self.shape)
        try:
            self._start_network()
            self._convert_gguf_once()
            names = self._worker_names()
            plan = self.core_plan = self._core_plan()
            gpus, memory = gpu_env(names, self._gpus()), self._memory_argv()
            lending = self._lending_argv(plan)
            for name in names:
                place = self._place(name)
                args = (self._worker_args(name.rsplit("-", 1)[0], place.bind_host)
                        + placed_argv(plan, name, self.torch_threads) + memory
                        + lending.get(name, []))
                self.processes.append(_spawn(name, args, self.log_dir,
                                             {**self.env, **gpus.get(name, {})}, place))
            workers = list(self.processes)
            for proc in workers:
                proc.wait_ready(timeout_s)
            place = self._place("router")
            args = self._router_args(place.bind_host, {p.name: p.address for p in workers})
            router = _spawn("router", args + placed_argv(plan, "router", 1), self.log_dir,
                            self.env, place)
            self.processes.append(router)
            router.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _core_plan(self) -> CorePlan | None:
        """With `pin_cores`: where each process runs, logged (in `log_dir/placement.log` with a
        log folder), and a warning when workers must share cores."""
        if not self.pin_cores:
            return None
        plan = plan_cores(self._worker_names(), sorted(os.sched_getaffinity(0)))
        if self.log_dir is not None:  # with the processes' logs (demo's terminal stays quiet)
            with open(self.log_dir / "placement.log", "a") as out:
                out.write(plan.line() + "\n")
        else:
            log.info("%s", plan.line())
        if plan.warning:
            log.warning("%s", plan.warning)
        return plan

    def _lending_argv(self, plan: CorePlan | None) -> dict[str, list[str]]:
        """With lend_cores: each paired CPU worker's --core-lending (none on GPUs, or where a
        worker splits its model over ranks), and the file they share, made now."""
        if not self.lend_cores or visible_gpus() or 1 != (
                self.prefill_tensor_parallel_size * self.decode_tensor_parallel_size):
            return {}
        pairs = lending_pairs(plan)
        if not pairs:
            return {}
        shm = Path("/dev/shm")
        fd, name = tempfile.mkstemp(prefix="kvferry-cores-", dir=shm if shm.is_dir() else None)
        os.close(fd)
        self.lending_file = Path(name)
        create_file(self.lending_file, 2 * len(pairs))
        return lending_argv(plan, pairs, self.lending_file)

    def _gpus(self) -> list[str]:
        return visible_gpus() if self.pin_cores else []

    def _memory_argv(self) -> list[str]:
        """With kv_pool_size auto, each worker's share of its device (deploy/placement.py)."""
        if self.kv_pool_size != AUTO:
            return []
        share = memory_share(self.memory_utilization, len(self._worker_names()),
                             visible_gpus(), self.pin_cores)
        return [] if share is None else ["--memory-utilization", f"{share:.6g}"]

    @property
    def shape(self) -> str:
        """What is started, in one word: `2p1d`, `colocated1`."""
        if self.is_colocated:
            return f"colocated{self.num_decode}"
        return f"{self.num_prefill}p{self.num_decode}d"

    @property
    def router_address(self) -> str:
        return self.processes[-1].address

    @property
    def http_address(self) -> str:
        """The router's OpenAI-compatible HTTP API, HOST:PORT (with `http_port` set)."""
        router = self.processes[-1]
        if not router.http_port:
            raise ValueError("http_port: this deployment's router serves no HTTP API")
        return f"{router.host}:{router.http_port}"

    def addresses(self, role: str) -> list[str]:
        """Workers serving `role`; colocated workers serve both prefill and decode."""
        return [p.address for p in self.processes if serves(p.name, role)]

    def pids(self) -> dict[str, int]:
        """Each component's process id, by name ("router", "decode-0", ...)."""
        return {p.name: p.popen.pid for p in self.processes}

    def pin(self, role: str, cpus: set[int], transfer_cpus: set[int] | None = None) -> None:
        """`pin_threads` for every `role` process (benchmarks give a worker its own core)."""
        for proc in self.processes:
            if proc.name.rsplit("-", 1)[0] == role:
                pin_threads(proc.popen.pid, cpus, transfer_cpus)

    def _process(self, name: str) -> Process:
        for proc in (p for p in self.processes if p.name == name):
            return proc
        raise ValueError(f"name: no process {name!r} in this deployment")

    def cut(self, name: str) -> None:
        """Make component `name` silent to everyone: its link goes down (netns: packets
        vanish, no RST, no FIN), or, on loopback, the process is stopped (SIGSTOP)."""
        if self.network is not None:
            self.network.cut(name)
        else:
            os.kill(self._process(name).popen.pid, signal.SIGSTOP)

    def heal(self, name: str) -> None:
        """Undo `cut(name)`."""
        if self.network is not None:
            self.network.heal(name)
        else:
            os.kill(self._process(name).popen.pid, signal.SIGCONT)

    def dead(self) -> list[str]:
        """Names of processes that have exited."""
        return [p.name for p in self.processes if p.popen.poll() is not None]

    def stop(self, grace_s: float = 10.0) -> list[int | None]:
        """SIGTERM the router, wait, then the workers (so it logs none as unreachable); SIGKILL
        what is left at `grace_s`; then remove the namespaces, veths and bridge, if any,
        whatever failed before. Returns exit codes, the router's first."""
        try:
            deadline, codes = time.monotonic() + grace_s, []
            router = [p for p in self.processes if p.name == "router"]
            for group in (router, [p for p in reversed(self.processes) if p not in router]):
                for proc in (p for p in group if p.popen.poll() is None):
                    proc.popen.send_signal(signal.SIGTERM)
                    proc.popen.send_signal(signal.SIGCONT)  # a stopped one must see it
                for proc in group:
                    try:
                        codes.append(proc.popen.wait(max(deadline - time.monotonic(), 0.1)))
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.popen.pid, signal.SIGKILL)
                        codes.append(proc.popen.wait())
            self.processes = []
        finally:
            if self.network is not None:  # after the processes: nothing left inside
                self.network.destroy()
                self.network = None
            if self.lending_file is not None:
                self.lending_file.unlink(missing_ok=True)
                self.lending_file = None
        return codes

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
