"""Where `serve`, `demo` and `bench`'s launched deployments run each process on one
machine: every worker on cores of its own, so a prefill burst cannot take a decode
worker's core, and the router (with the clients started beside it) on what is left.

With more than two cores per worker, one core in 16 (at least one) is left to the router
and the clients, and the rest is split evenly, contiguous ranges, decode workers taking the
remainder first (inter-token latency is the figure disaggregation protects). With fewer, the
workers split every core and the router shares the prefill workers' (a colocated worker's):
a router is idle between messages, and prefill is the side whose latency (TTFT) a short
router turn dilutes most, while a core taken from a worker of two would halve it.
With fewer cores than workers, nothing is pinned (the kernel balances better than a fixed
round robin) and one warning says the workers share cores. Each worker runs as many torch
threads as it has cores.

GPUs: with several, worker i sees GPU i modulo their number (CUDA_VISIBLE_DEVICES).

`pin_threads` pins a running process's threads (its K/V transfer threads apart, for
benchmarks that give them a core of their own).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from kvferry.settings import DEPLOYMENT_TORCH_THREADS, TRANSFER_THREAD
from kvferry.settings.cpus import cpu_list

ROUTER = "router"  # the router and the clients started beside it


class CorePlan(NamedTuple):
    """Cores per process name (the workers' and ROUTER's); empty when nothing is pinned."""

    cores: dict[str, tuple[int, ...]]
    num_cores: int
    num_workers: int

    @property
    def is_pinned(self) -> bool:
        return bool(self.cores)

    @property
    def warning(self) -> str:
        """One line when workers must share cores ("" when each has its own)."""
        if self.is_pinned:
            return ""
        return (f"placement: {self.num_workers} workers share {self.num_cores} core(s), so "
                "prefill bursts will slow decode steps (fewer workers or more cores give "
                "each worker its own)")

    def line(self) -> str:
        """Where each process runs, in one log line."""
        if not self.is_pinned:
            return f"placement: not pinned ({self.num_workers} workers, {self.num_cores} cores)"
        parts = [f"{name} on {cpu_list(cores)}" for name, cores in self.cores.items()]
        return ("placement: " + ", ".join(parts)
                + " (pinned; --pin-cores off lets the kernel place them)")


def plan_cores(workers: Sequence[str], cpus: Sequence[int]) -> CorePlan:
    """Cores for `workers` (names like "prefill-0", "decode-1", "colocated-0") and ROUTER,
    from the cores this process may use (`os.sched_getaffinity(0)`)."""
    cpus = sorted(cpus)
    n, w = len(cpus), len(workers)
    if w == 0 or n < w:
        return CorePlan({}, n, w)
    spare = max(1, n // 16) if n > 2 * w else 0
    base, extra = divmod(n - spare, w)
    # Decode (and colocated) workers take the remainder first, then prefill workers.
    order = sorted(range(w), key=lambda i: workers[i].startswith("prefill"))
    counts = [base] * w
    for i in order[:extra]:
        counts[i] += 1
    cores: dict[str, tuple[int, ...]] = {}
    start = 0
    for name, count in zip(workers, counts):
        cores[name] = tuple(cpus[start:start + count])
        start += count
    if spare:
        cores[ROUTER] = tuple(cpus[start:])
    else:  # share the prefill workers' cores (colocated: every worker's)
        shared = [c for name in workers if not name.startswith("decode")
                  for c in cores[name]]
        cores[ROUTER] = tuple(sorted(shared))
    return CorePlan(cores, n, w)


def visible_gpus() -> list[str]:
    """The GPUs workers may use: CUDA_VISIBLE_DEVICES's entries, else the driver's."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip()]
    try:
        return [str(i) for i in range(len(os.listdir("/proc/driver/nvidia/gpus")))]
    except OSError:
        return []


def gpu_env(workers: Sequence[str], gpus: Sequence[str]) -> dict[str, dict[str, str]]:
    """CUDA_VISIBLE_DEVICES per worker: worker i sees GPU i modulo their number (several GPUs
    only: with one, every worker shares it as before)."""
    if len(gpus) < 2:
        return {}
    return {name: {"CUDA_VISIBLE_DEVICES": gpus[i % len(gpus)]}
            for i, name in enumerate(workers)}


def memory_share(utilization: float | None, num_workers: int, gpus: Sequence[str],
                 spread: bool) -> float | None:
    """What each worker may use of its device with `--kv-pool-size auto`: serve's
    `utilization` (None: the device's default) divided among the workers sharing a device:
    every one on CPU or on one GPU, those given the same GPU when `spread` over several.
    None: no share (CPU without one asked for: the workers' CPU_POOL_BYTES)."""
    from kvferry.cache.pool_budget import default_utilization

    total = utilization if utilization is not None else default_utilization(
        "cuda" if gpus else "cpu")
    if total is None:
        return None
    sharing = -(-num_workers // len(gpus)) if spread and len(gpus) >= 2 else num_workers
    return total / max(sharing, 1)


def placed_argv(plan: CorePlan | None, name: str, torch_threads: int) -> list[str]:
    """Flags placing process `name` by `plan` (None: placement off). A worker's
    `torch_threads` of 0 (auto) becomes one per core of its own, else
    DEPLOYMENT_TORCH_THREADS; given later on its command line, these win."""
    cores = plan.cores.get(name) if plan is not None else None
    argv = ["--cpus", cpu_list(cores)] if cores else []
    if name != ROUTER and torch_threads == 0:
        argv += ["--torch-threads", str(len(cores) if cores else DEPLOYMENT_TORCH_THREADS)]
    return argv


def lending_pairs(plan: CorePlan | None) -> list[tuple[str, str]]:
    """(prefill-i, decode-i) for every i both exist, when each has cores of its own: the
    workers that lend each other their cores while idle (kvferry/cores.py)."""
    if plan is None or not plan.is_pinned:
        return []
    pairs = [(name, "decode-" + name.removeprefix("prefill-")) for name in plan.cores
             if name.startswith("prefill-")]
    return [(prefill, decode) for prefill, decode in pairs if decode in plan.cores]


def lending_argv(plan: CorePlan | None, pairs: Sequence[tuple[str, str]], path: Path
                 ) -> dict[str, list[str]]:
    """Each paired worker's --core-lending: slot 2i for the prefill worker of pair i, 2i+1
    for its decode worker, in the shared file `path` (create_file's, 2 x pairs slots), and
    the partner's cores."""
    argv: dict[str, list[str]] = {}
    for i, (prefill, decode) in enumerate(pairs):
        assert plan is not None  # noqa: S101 - pairs come from a pinned plan
        for name, slot, partner, other in ((prefill, 2 * i, 2 * i + 1, decode),
                                           (decode, 2 * i + 1, 2 * i, prefill)):
            spec = f"{path}:{slot}:{partner}:{cpu_list(plan.cores[other])}"
            argv[name] = ["--core-lending", spec]
    return argv


def pin_self(cores: set[int]) -> None:
    """This process, every thread it has and every one it starts, onto `cores` (among those
    it may use: ValueError naming --cpus otherwise)."""
    allowed = os.sched_getaffinity(0)
    if not cores <= allowed:
        raise ValueError(f"cpus: {cpu_list(sorted(cores - allowed))} not among the cores this "
                         f"process may use ({cpu_list(sorted(allowed))})")
    _pin(cores)


def _pin(cores: set[int]) -> None:
    os.sched_setaffinity(0, cores)
    pin_threads(os.getpid(), cores)


def client_placement() -> dict[str, str]:
    """Where this process (a benchmark's client) may run."""
    return {"client": cpu_list(sorted(os.sched_getaffinity(0)))}


@contextmanager
def beside_router(plan: CorePlan | None) -> Iterator[dict[str, str]]:
    """This process (a client of a launched deployment) on the router's cores while the
    block runs, then back where it was. Yields the placement: every process's cores."""
    if plan is None or not plan.is_pinned:
        yield client_placement()
        return
    before = os.sched_getaffinity(0)
    pin_self(set(plan.cores[ROUTER]))
    try:
        yield {**{name: cpu_list(cores) for name, cores in plan.cores.items()},
               **client_placement()}
    finally:
        _pin(before)


# ---- pinning a running process's threads (Deployment.pin, bench/bench_interference.py: a
# worker on its own core, its K/V transfer threads on another) ------------------------------
def thread_name(pid: int, tid: str) -> str:
    """The OS name of thread `tid` of process `pid` ("" once it has ended)."""
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return ""


def pin_threads(pid: int, cpus: set[int], transfer_cpus: set[int] | None = None) -> None:
    """Every thread of process `pid` onto `cpus` (later threads inherit it); the K/V
    transfer threads (TRANSFER_THREAD) onto `transfer_cpus` when given."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        is_transfer = transfer_cpus is not None and thread_name(pid, tid) == TRANSFER_THREAD
        try:
            os.sched_setaffinity(int(tid), transfer_cpus if is_transfer else cpus)
        except ProcessLookupError:
            continue  # the thread ended meanwhile
