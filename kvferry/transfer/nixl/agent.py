"""The life of a NIXL agent in a kvferry process, from UCX's environment before the first
agent to an ordered close of every agent.

Why a process with NIXL died by SIGSEGV at exit once rdma-core was installed (Debian's
`libibverbs1`, as on every RDMA-capable node): creating an agent makes UCX load its
transport modules from the wheel (`nixl_cu12.libs/ucx/`). Its InfiniBand modules use the
wheel's own `libibverbs` and `libnl-route-3` (renamed copies), but `libuct_ib_efa.so`
(AWS EFA) needs the system's `libefa.so.1`: missing without rdma-core, so UCX skipped the
module; present with it (package ibverbs-providers), and it pulls in the system's
`libibverbs.so.1` and `libnl-route-3.so.200`. Two libnl-route copies then share one
process, and the system copy's load-time constructors bind `rtnl_tc_register` (and
`nl_cache_mngt_register`) to the wheel's copy, which comes first in that dlopen's lookup
scope (LD_DEBUG=bindings), so entries of both copies end up in the wheel's lists. At exit
`_dl_fini` runs both copies' destructors, and the wheel's faults (gdb):

    #0 rtnl_tc_unregister () from nixl_cu12.libs/libnl-route-3-3ad497a3.so.200.26.0
    #1 _dl_call_fini    #2 _dl_fini    #3 __run_exit_handlers    #4 exit

Python objects play no part: a process that closed its agents before exiting (below)
crashed the same way, and one that only imported NIXL did not. So the fix is that the
second copy never loads: `prepare_ucx` sets `UCX_MODULES=^efa` before UCX is loaded, unless
the node has an EFA device (then the module is wanted; the crash at exit may remain there)
or the operator set UCX_MODULES. UCX's `ib` and `mlx5` modules still load.

The close is ordered all the same, so an agent never outlives what it refers to: `close`
releases transfer handles NIXL refused to release earlier, deregisters memory (newest first),
then drops the binding's agent, whose destructor stops its progress thread and UCX workers.
Owners call it from their stop paths (NixlPuller.close, NixlKvSender.close); agents still
open at exit are closed by an atexit hook, newest first.
"""

from __future__ import annotations

import atexit
import glob
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("kvferry.transport")

WITHOUT_EFA = "^efa"  # UCX module globs: every module but uct_ib's efa


def has_efa_device() -> bool:
    """An AWS EFA device is present (its verbs device is bound to the efa driver)."""
    drivers = glob.glob("/sys/class/infiniband/*/device/driver")
    return any(os.path.basename(os.path.realpath(path)) == "efa" for path in drivers)


def prepare_ucx() -> None:
    """Before the first agent (UCX reads its global options once, when it loads): keep the
    system's libnl-route out of the process (module docstring)."""
    if "UCX_MODULES" not in os.environ and not has_efa_device():
        os.environ["UCX_MODULES"] = WITHOUT_EFA


@dataclass(slots=True)
class _Open:
    """What kvferry knows an open agent holds."""

    agent: Any  # nixl_agent
    registered: list[Any] = field(default_factory=list)  # nixlRegDList, oldest first
    stuck: list[Any] = field(default_factory=list)  # nixl_xfer_handle NIXL would not release


class Closed:
    """Stands in for a closed agent's binding: any use names the agent."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        raise RuntimeError(f"NIXL agent {self._name} is closed")


_lock = threading.Lock()
_open: dict[str, _Open] = {}  # by agent name (unique per process start), oldest first
_hooked = False


def opened(agent: Any) -> None:
    """Track a new agent; the first one hooks `close_all` to the interpreter's exit."""
    global _hooked
    with _lock:
        _open[agent.name] = _Open(agent)
        if not _hooked:
            atexit.register(close_all)
            _hooked = True


def register(agent: Any, tensor: Any) -> Any:
    """`agent.register_memory(tensor)`, deregistered again by `close`."""
    descs = agent.register_memory(tensor)
    with _lock:
        book = _open.get(agent.name)
        if book is not None:
            book.registered.append(descs)
    return descs


def stuck(agent: Any, handle: Any) -> None:
    """A transfer handle whose release failed (a READ NIXL could not cancel): kept alive,
    since its finalizer would release it at an arbitrary moment, and released by `close`."""
    with _lock:
        book = _open.get(agent.name)
        if book is not None:
            book.stuck.append(handle)


def is_open(agent: Any) -> bool:
    with _lock:
        return agent.name in _open


def close(agent: Any) -> None:
    """Release, deregister, destroy, in that order; idempotent. The caller makes sure no
    thread of its own still uses the agent. Failures are logged: a close never raises."""
    with _lock:
        book = _open.pop(agent.name, None)
    if book is None:
        return
    for handle in book.stuck:
        try:
            agent.release_xfer_handle(handle)
        except Exception as exc:  # the agent's destructor gets a last try
            log.error("NIXL agent %s: a transfer handle still refuses release: %s",
                      agent.name, exc)
    book.stuck.clear()
    for descs in reversed(book.registered):
        try:
            agent.deregister_memory(descs)
        except Exception as exc:
            log.error("NIXL agent %s: deregistering memory failed: %s", agent.name, exc)
    book.registered.clear()
    # The last reference to the binding's agent: its destructor joins the progress thread.
    agent.agent = Closed(agent.name)


def close_all() -> None:
    """Close every agent still open, newest first (run at exit)."""
    with _lock:
        agents = [book.agent for book in reversed(_open.values())]
    for agent in agents:
        close(agent)
