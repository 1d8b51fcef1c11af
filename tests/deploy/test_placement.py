"""Where serve places its processes (deploy/placement.py): workers on cores of their own, the
router on what is left or beside prefill, nothing pinned (and one warning) when workers must
share, one GPU per worker when there are several, and the flags and log line that say so."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from deploy import placement
from deploy.cli import main
from deploy.launcher import Deployment
from deploy.placement import (
    ROUTER,
    beside_router,
    cpu_list,
    gpu_env,
    lending_argv,
    lending_pairs,
    pin_self,
    placed_argv,
    plan_cores,
)
from kvferry.settings import DEPLOYMENT_TORCH_THREADS
from kvferry.settings.cpus import parse_cpu_list


def test_two_cores_give_each_worker_one_and_the_router_shares_prefills() -> None:
    plan = plan_cores(["prefill-0", "decode-0"], [0, 1])
    assert plan.cores == {"prefill-0": (0,), "decode-0": (1,), ROUTER: (0,)}
    assert plan.warning == ""
    assert plan.line().startswith("placement: prefill-0 on 0, decode-0 on 1, router on 0")


def test_sixteen_cores_split_evenly_decode_first_with_one_left_to_the_router() -> None:
    plan = plan_cores(["prefill-0", "decode-0"], range(16))
    assert plan.cores == {"prefill-0": tuple(range(7)), "decode-0": tuple(range(7, 15)),
                          ROUTER: (15,)}
    plan = plan_cores(["prefill-0", "prefill-1", "decode-0", "decode-1"], range(16))
    assert [len(plan.cores[n]) for n in ("prefill-0", "prefill-1", "decode-0", "decode-1")] \
        == [4, 3, 4, 4]
    every = [c for cores in plan.cores.values() for c in cores]
    assert sorted(every) == list(range(16))  # each core once: no two processes share one


def test_an_affinity_mask_is_what_is_split_not_the_machine() -> None:
    plan = plan_cores(["prefill-0", "decode-0"], [8, 9, 2, 3, 11])  # e.g. a cgroup's cpuset
    assert plan.cores == {"prefill-0": (2, 3), "decode-0": (8, 9), ROUTER: (11,)}
    assert cpu_list(plan.cores["decode-0"]) == "8-9"
    plan = plan_cores(["prefill-0", "decode-0"], [8, 9, 2, 3])  # two each: none to spare
    assert plan.cores == {"prefill-0": (2, 3), "decode-0": (8, 9), ROUTER: (2, 3)}


def test_workers_sharing_cores_are_not_pinned_and_one_warning_says_so() -> None:
    plan = plan_cores(["prefill-0", "prefill-1", "decode-0", "decode-1"], [0, 1])
    assert not plan.is_pinned and plan.cores == {}
    assert "4 workers share 2 core(s)" in plan.warning
    assert placed_argv(plan, "decode-0", 0) == ["--torch-threads",
                                                str(DEPLOYMENT_TORCH_THREADS)]
    assert placed_argv(plan, ROUTER, 0) == []


def test_colocated_workers_share_their_cores_with_the_router_when_none_is_left() -> None:
    plan = plan_cores(["colocated-0", "colocated-1"], [0, 1])
    assert plan.cores == {"colocated-0": (0,), "colocated-1": (1,), ROUTER: (0, 1)}
    plan = plan_cores(["colocated-0"], [0, 1])  # a worker of two cores keeps both
    assert plan.cores == {"colocated-0": (0, 1), ROUTER: (0, 1)}


def test_placed_flags_give_cores_and_one_torch_thread_per_core_unless_threads_are_set() -> None:
    plan = plan_cores(["prefill-0", "decode-0"], range(16))
    assert placed_argv(plan, "decode-0", 0) == ["--cpus", "7-14", "--torch-threads", "8"]
    assert placed_argv(plan, "decode-0", 3) == ["--cpus", "7-14"]  # given: kept
    assert placed_argv(plan, ROUTER, 0) == ["--cpus", "15"]
    assert placed_argv(None, "decode-0", 2) == []


def test_several_gpus_give_each_worker_one_and_a_single_gpu_is_shared() -> None:
    workers = ["prefill-0", "prefill-1", "decode-0"]
    assert gpu_env(workers, ["0", "1"]) == {
        "prefill-0": {"CUDA_VISIBLE_DEVICES": "0"}, "prefill-1": {"CUDA_VISIBLE_DEVICES": "1"},
        "decode-0": {"CUDA_VISIBLE_DEVICES": "0"}}
    assert gpu_env(workers, ["3"]) == {}
    assert gpu_env(workers, ["4", "6"])["prefill-1"] == {"CUDA_VISIBLE_DEVICES": "6"}


def test_core_lists_parse_and_bad_ones_name_the_flag() -> None:
    assert parse_cpu_list("0-2,5") == {0, 1, 2, 5}
    assert cpu_list([5, 0, 1, 2]) == "0-2,5"
    for bad in ("", "a", "2-x", "-1", ","):
        with pytest.raises(ValueError, match="^cpus: "):
            parse_cpu_list(bad)
    with pytest.raises(ValueError, match="^cpus: .* not among the cores"):
        pin_self({max(os.sched_getaffinity(0)) + 1})


def test_the_launcher_logs_the_plan_of_a_sixteen_core_mask(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(placement.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr("deploy.launcher.os.sched_getaffinity", lambda pid: set(range(16)))
    with caplog.at_level(logging.INFO, logger="kvferry"):
        plan = Deployment(model="m", pin_cores=True)._core_plan()
    assert plan is not None and plan.cores["decode-0"] == tuple(range(7, 15))
    assert [r.getMessage() for r in caplog.records] == [
        "placement: prefill-0 on 0-6, decode-0 on 7-14, router on 15 "
        "(pinned; --pin-cores off lets the kernel place them)"]
    caplog.clear()
    monkeypatch.setattr("deploy.launcher.os.sched_getaffinity", lambda pid: {0})
    with caplog.at_level(logging.INFO, logger="kvferry"):
        assert not Deployment(model="m", pin_cores=True)._core_plan().is_pinned  # type: ignore
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.WARNING]
    assert Deployment(model="m")._core_plan() is None  # not asked: nothing placed


def test_a_client_beside_the_router_runs_on_its_cores_then_where_it_was() -> None:
    before = os.sched_getaffinity(0)
    plan = plan_cores(["prefill-0"], sorted(before))
    with beside_router(plan) as where:
        assert os.sched_getaffinity(0) == set(plan.cores[ROUTER])
        assert where["client"] == cpu_list(plan.cores[ROUTER])
        assert where["prefill-0"] == cpu_list(plan.cores["prefill-0"])
    assert os.sched_getaffinity(0) == before
    with beside_router(None) as where:
        assert where == {"client": cpu_list(sorted(before))}


@pytest.mark.parametrize("cpus,said", [("abc", "expected core numbers"),
                                       ("4096", "not among the cores")])
def test_a_bad_cpus_flag_is_one_line_naming_it(cpus: str, said: str, qwen3_checkpoint: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["router", "--model", str(qwen3_checkpoint), "--colocated", "127.0.0.1:1",
                 "--cpus", cpus]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvferry: cpus: ") and said in err and err.count("\n") == 1


def test_paired_workers_lend_each_other_their_cores_through_one_file(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    plan = plan_cores(["prefill-0", "prefill-1", "decode-0"], range(16))
    assert lending_pairs(plan) == [("prefill-0", "decode-0")]  # prefill-1 has no partner
    argv = lending_argv(plan, lending_pairs(plan), tmp_path / "f")
    # prefill-0 on 0-4, prefill-1 on 5-9, decode-0 on 10-14: each gets its partner's cores
    assert argv == {"prefill-0": ["--core-lending", f"{tmp_path / 'f'}:0:1:10-14"],
                    "decode-0": ["--core-lending", f"{tmp_path / 'f'}:1:0:0-4"]}
    assert lending_pairs(plan_cores(["prefill-0", "decode-0"], [0])) == []  # not pinned
    assert lending_pairs(None) == []
    monkeypatch.setattr("deploy.launcher.visible_gpus", lambda: [])
    two = plan_cores(["prefill-0", "decode-0"], [0, 1])
    deployment = Deployment(model="m", pin_cores=True, lend_cores=True)
    argv = deployment._lending_argv(two)
    assert deployment.lending_file is not None and deployment.lending_file.read_bytes() == (
        bytes(16))  # two slots, both idle
    assert argv["decode-0"] == ["--core-lending", f"{deployment.lending_file}:1:0:0"]
    deployment.stop()
    assert deployment.lending_file is None
    assert Deployment(model="m", pin_cores=True)._lending_argv(two) == {}  # not asked
    assert Deployment(model="m", pin_cores=True, lend_cores=True,
                      decode_tensor_parallel_size=2)._lending_argv(two) == {}
    monkeypatch.setattr("deploy.launcher.visible_gpus", lambda: ["0"])
    assert Deployment(model="m", pin_cores=True, lend_cores=True)._lending_argv(two) == {}
