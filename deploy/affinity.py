"""CPU affinity of a running kvferry process's threads (benchmarks give a worker its own core,
and its K/V transfer threads another: `Deployment.pin`, bench/bench_interference.py)."""

from __future__ import annotations

import os
from pathlib import Path

from kvferry.settings import TRANSFER_THREAD


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
