"""The order of the suite and the lifetime of its shared deployments.

Starting a deployment is the expensive part of the suite (each process imports torch and
loads a model), so a few deployments are shared by many test modules (tests/conftest.py).
Pytest keeps a session fixture until the session ends; here instead each shared deployment
stops right after the last test that uses it, and modules are ordered so that its users run
together: first the modules that start nothing (unit tests, on a quiet machine), then the
modules grouped by the first shared deployment they use, those that set FIRST_ON_SHARED
first in their group (they need the deployment as it starts). Module order never splits a module,
so module-scoped fixtures still start once. With pytest-xdist (`-n 2`, the whole-suite
command) each worker starts the shared deployments its tests need, and gives out worker
ports from its own slice of the range (`this_workers_ports`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

# Shared fixtures in the order their groups run; `ray_session` last so it outlives the Ray
# deployments that need it.
SHARED = ("qwen3_deployment", "qwen3_2p2d_deployment", "qwen3_tiny_deployment",
          "colocated_deployment", "chat_deployment", "llama_deployment",
          "qwen3_nixl_deployment", "qwen3_ray_deployment",
          "llama_ray_deployment", "ray_session")

_LAST_USER = pytest.StashKey[dict[str, pytest.Item]]()  # fixture -> its last user
_stoppers: dict[str, Callable[[], None]] = {}  # live shared fixtures -> how to stop them


def shared(name: str, start: Callable[[], object], stop: Callable[[object], None]
           ) -> Iterator[object]:
    """The body of a shared fixture: start, yield, stop (unless stopped early already)."""
    value = start()
    done = False

    def stop_once() -> None:
        nonlocal done
        if not done:
            done = True
            stop(value)

    _stoppers[name] = stop_once
    try:
        yield value
    finally:
        _stoppers.pop(name, None)
        stop_once()


def _uses(item: pytest.Item) -> list[str]:
    """The shared fixtures `item` uses: those it asks for, and those named by its parameters
    (a test that calls request.getfixturevalue(name) must take `name` as a parameter)."""
    names = set(getattr(item, "fixturenames", ()))
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        names |= {value for value in callspec.params.values() if isinstance(value, str)}
    if any(name.endswith("_ray_deployment") for name in names):
        names.add("ray_session")
    return [name for name in SHARED if name in names]


def order(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Reorder `items` by module as described above, and note each shared fixture's last
    user."""
    modules: dict[object, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.module if hasattr(item, "module") else item.parent, []
                           ).append(item)

    def rank(group: list[pytest.Item]) -> tuple[int, bool]:
        used = {name for item in group for name in _uses(item)}
        first = getattr(getattr(group[0], "module", None), "FIRST_ON_SHARED", False)
        return min((SHARED.index(name) + 1 for name in used), default=0), not first

    items[:] = [item for group in sorted(modules.values(), key=rank) for item in group]
    last: dict[str, pytest.Item] = {}
    for item in items:
        for name in _uses(item):
            last[name] = item
    config.stash[_LAST_USER] = last


def stop_after_last_user(item: pytest.Item) -> None:
    """Stop every shared fixture whose last user `item` was (Ray deployments before Ray)."""
    last = item.config.stash.get(_LAST_USER, {})
    for name in _uses(item):
        if last.get(name) is item and name in _stoppers:
            _stoppers.pop(name)()


def this_workers_ports(text: str) -> str:
    """Under pytest-xdist, this worker process's own slice of the range (`gw0` the first),
    so that two workers never give out one port before its server binds it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not text or not worker.startswith("gw"):
        return text
    low, high = map(int, text.split("-"))
    size = (high - low + 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    first = low + int(worker[2:]) * size
    return f"{first}-{first + size - 1}"
