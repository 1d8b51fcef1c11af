"""Builders in one cache directory take turns (kvferry_kernels.artifact_cache.get_or_build): two
callers asking at once for a missing entry build it once; the one that waited loads it."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from kvferry_kernels import artifact_cache

log = logging.getLogger("test")


def test_callers_at_once_build_an_entry_once_and_the_waiter_loads_it(tmp_path: Path) -> None:
    entry = tmp_path / "entry"
    builds: list[str] = []
    started = threading.Event()

    def build(scratch: Path) -> None:
        builds.append(threading.current_thread().name)
        started.set()
        time.sleep(0.5)  # the second caller arrives meanwhile
        (scratch / "artifact").write_bytes(b"built once")

    results: dict[str, artifact_cache.Cached] = {}

    def ask(name: str) -> None:
        results[name] = artifact_cache.get_or_build(entry, build, log)

    first = threading.Thread(target=ask, args=("first",), name="first")
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=ask, args=("second",), name="second")
    second.start()
    first.join(10)
    second.join(10)
    assert builds == ["first"]
    assert not results["first"].is_hit and results["second"].is_hit
    assert (results["second"].path / "artifact").read_bytes() == b"built once"
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]  # no lock file, no scratch


def test_a_failed_build_releases_the_lock_for_the_next_caller(tmp_path: Path) -> None:
    entry = tmp_path / "entry"

    def fail(scratch: Path) -> None:
        raise RuntimeError("no compiler")

    with pytest.raises(RuntimeError, match="no compiler"):
        artifact_cache.get_or_build(entry, fail, log)
    got = artifact_cache.get_or_build(
        entry, lambda scratch: (scratch / "artifact").write_bytes(b"ok"), log)
    assert not got.is_hit and (got.path / "artifact").read_bytes() == b"ok"
