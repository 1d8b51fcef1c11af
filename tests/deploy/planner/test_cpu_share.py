"""The router's and the client's CPU in the simulator: alone they run at full speed; on the
cores computing workers hold, they go first and the workers share what is left; with cores
of their own they slow nobody."""

from __future__ import annotations

import pytest

from deploy.planner.cpu_share import SharedCores
from deploy.planner.simulator import Clock


def _run(shared_with: list[str], forwards: dict[str, float], jobs: list[float],
         client_jobs: tuple[float, ...] = ()) -> dict[str, float]:
    clock = Clock()
    cores = SharedCores(clock.at, lambda: clock.now, shared_with, ("router", "client"))
    done: dict[str, float] = {}
    for worker, work in forwards.items():
        cores.run_forward(worker, work, lambda w=worker: done.__setitem__(w, clock.now))
    for i, work in enumerate(jobs):
        cores.submit(work, lambda i=i: done.__setitem__(f"job{i}", clock.now))
    for i, work in enumerate(client_jobs):
        cores.submit(work, lambda i=i: done.__setitem__(f"client{i}", clock.now), "client")
    clock.run()
    return done


def test_alone_everything_runs_at_full_speed() -> None:
    assert _run([], {"prefill": 1.0}, [0.25, 0.25]) == pytest.approx(
        {"prefill": 1.0, "job0": 0.25, "job1": 0.5})


def test_on_a_busy_workers_core_the_router_goes_first() -> None:
    done = _run(["prefill"], {"prefill": 1.0}, [0.2])
    assert done["job0"] == pytest.approx(0.2)
    # the worker lost what the router took: 1.0 of work plus the router's 0.2
    assert done["prefill"] == pytest.approx(1.2)


def test_router_and_client_on_one_busy_core_split_it() -> None:
    done = _run(["prefill"], {"prefill": 1.0}, [0.1], (0.1,))
    assert done["job0"] == pytest.approx(0.2) and done["client0"] == pytest.approx(0.2)
    assert done["prefill"] == pytest.approx(1.2)


def test_two_busy_workers_share_the_core_the_router_leaves() -> None:
    done = _run(["colocated-0", "colocated-1"], {"colocated-0": 1.0, "colocated-1": 1.0},
                [0.2])
    assert done["job0"] == pytest.approx(0.2)  # a core of its own out of the two
    assert done["colocated-0"] == pytest.approx(1.1)  # each at half speed for 0.2 s


def test_an_idle_worker_in_the_group_leaves_the_router_a_core() -> None:
    done = _run(["prefill-0", "prefill-1"], {"prefill-0": 1.0}, [0.2])
    assert done == pytest.approx({"job0": 0.2, "prefill-0": 1.0})


def test_workers_off_the_routers_cores_never_slow_down() -> None:
    done = _run(["prefill"], {"prefill": 1.0, "decode": 1.0}, [0.2])
    assert done["decode"] == pytest.approx(1.0) and done["prefill"] == pytest.approx(1.2)


def test_zero_work_completes_in_order_at_once() -> None:
    done = _run(["prefill"], {}, [0.0, 0.0, 0.1])
    assert done == pytest.approx({"job0": 0.0, "job1": 0.0, "job2": 0.1})
