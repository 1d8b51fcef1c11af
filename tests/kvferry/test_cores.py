"""Core lending (kvferry/cores.py): a worker runs threads on its partner's cores only while
the partner's mark says it is idle, and those threads live on the partner's cores."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from kvferry.cores import HOLD_S, CoreLending, create_file
from kvferry.settings import WorkerSettings
from kvferry.settings.cpus import parse_spec


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _on_thread(fn):
    """fn() on a fresh thread (a worker's step thread), its result or its exception."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


class StepThread:
    """One long-lived thread running what it is given, as a worker's executor does."""

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="steps")

    def __call__(self, fn):
        return self.pool.submit(fn).result()

    def close(self) -> None:
        self.pool.shutdown()


@pytest.fixture
def pair(tmp_path: Path):
    path = tmp_path / "cores"
    create_file(path, 2)
    clock = Clock()
    lent = {max(os.sched_getaffinity(0))}
    a = CoreLending(path, 0, 1, lent, own_threads=1, clock=clock)
    b = CoreLending(path, 1, 0, lent, own_threads=1, clock=clock)
    steps_a, steps_b = StepThread(), StepThread()
    yield a, b, clock, steps_a, steps_b
    steps_a.close()
    steps_b.close()
    a.close()
    b.close()


def test_lends_only_while_the_partner_is_idle(pair) -> None:
    a, b, clock, steps_a, steps_b = pair
    # b idle: a's forward runs its own thread and one on b's core
    assert steps_a(lambda: (a.begin(), torch.get_num_threads())[1]) == 2
    assert a.num_lent_forwards == 1
    # b starts a forward while a is in one: b keeps to its own; a gives back at its next layer
    assert steps_b(lambda: (b.begin(), torch.get_num_threads())[1]) == 1
    assert steps_a(lambda: (a.adjust(), torch.get_num_threads())[1]) == 1
    # b's forward ends: still busy for HOLD_S (the next step follows within it)
    steps_b(b.end)
    clock.now += HOLD_S / 2
    assert steps_a(lambda: (a.adjust(), torch.get_num_threads())[1]) == 1
    clock.now += HOLD_S
    assert steps_a(lambda: (a.adjust(), torch.get_num_threads())[1]) == 2
    steps_a(a.end)
    # a busy (within its hold): b's next forward keeps to its own thread
    assert steps_b(lambda: (b.begin(), torch.get_num_threads())[1]) == 1
    assert (b.num_forwards, b.num_lent_forwards) == (2, 0)


def test_lent_threads_run_on_the_partners_cores_only(pair) -> None:
    a, _, _, steps_a, _ = pair
    lent = a.partner_cores

    def begin_and_look() -> tuple[set[int], list[set[int]]]:
        before = set(os.listdir("/proc/self/task"))
        a.begin()
        new = set(os.listdir("/proc/self/task")) - before  # the team's lent threads
        return os.sched_getaffinity(0), [os.sched_getaffinity(int(t)) for t in new]

    mine, team = steps_a(begin_and_look)
    assert mine == os.sched_getaffinity(0)  # the step thread stays where it was
    assert team == [lent] * len(lent)
    assert steps_a(torch.get_num_threads) == 1 + len(lent)  # and runs them


def test_other_threads_forwards_change_nothing(pair) -> None:
    a, _, _, steps_a, _ = pair
    steps_a(a.begin)

    def other() -> tuple[int, int]:
        before = torch.get_num_threads()
        a.begin()
        a.adjust()
        return before, torch.get_num_threads()

    before, after = _on_thread(other)
    assert after == before
    assert a.num_forwards == 1


@pytest.mark.parametrize("spec", ["f:0:1", "f:a:1:0", "f:0:0:1", "f:0:1:x", "f:-1:1:0"])
def test_a_bad_spec_names_the_field(spec: str) -> None:
    with pytest.raises(ValueError, match="^core_lending: "):
        parse_spec(spec)
    with pytest.raises(ValueError, match="^core_lending: "):
        WorkerSettings(role="decode", model="m", core_lending=spec)


def test_a_slot_past_the_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "cores"
    create_file(path, 2)
    with pytest.raises(ValueError, match="core_lending: .* holds 2 slots"):
        CoreLending(path, 0, 2, {0}, own_threads=1)
    assert parse_spec(f"{path}:3:2:0-1,3") == (path, 3, 2, {0, 1, 3})
