"""Fault injection armed per process (environment) or per request (tags in the id)."""

from __future__ import annotations

import pytest

from decode_worker.step_faults import InjectedFault, StepFaults
from kvferry.faults import FAULTS_ENV, PER_REQUEST, Faults, step_numbers, tag


def test_process_faults_come_from_the_environment() -> None:
    env = {"KVFERRY_FAULT_PUSH_CHUNK_DELAY_S": "0.4", "KVFERRY_FAULT_CORRUPT_PUSHES": "2",
           "KVFERRY_FAULT_DECODE_STEPS": "3-", "UNRELATED": "x"}
    assert Faults.from_env(env) == Faults(push_chunk_delay_s=0.4, corrupt_pushes=2,
                                          decode_steps="3-")
    with pytest.raises(ValueError, match="KVFERRY_FAULT_CORRUPT_PUSHES"):
        Faults.from_env({"KVFERRY_FAULT_CORRUPT_PUSHES": "many"})


def test_request_tags_count_only_where_per_request_faults_are_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    base = Faults(push_chunk_delay_s=0.1)
    request_id = "r1" + tag(corrupt_pushes=1, decode_step_delay_s=0.25) + "@router7"
    monkeypatch.delenv(FAULTS_ENV, raising=False)
    assert base.for_request(request_id) is base  # a production worker never reads ids
    monkeypatch.setenv(FAULTS_ENV, PER_REQUEST)
    assert base.for_request(request_id) == Faults(push_chunk_delay_s=0.1, corrupt_pushes=1,
                                                  decode_step_delay_s=0.25)
    assert base.for_request("plain-id@router7") is base
    assert base.for_request("r2!no_such_fault=1") is base
    with pytest.raises(ValueError, match="unknown faults"):
        tag(no_such_fault=1)


def test_step_numbers() -> None:
    assert [n for n in range(1, 8) if step_numbers("3,5")(n)] == [3, 5]
    assert [n for n in range(1, 8) if step_numbers("5-")(n)] == [5, 6, 7]
    assert not any(step_numbers("")(n) for n in range(1, 8))


def test_step_faults_per_process_and_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULTS_ENV, PER_REQUEST)
    steps = StepFaults(Faults(decode_steps="2"))
    assert steps.before_step(["a"]) == 0.0
    with pytest.raises(InjectedFault, match="decode step 2"):
        steps.before_step(["a"])
    # A request's own steps are counted over the steps that hold it, from its first.
    steps = StepFaults(Faults())
    faulty = "f" + tag(decode_steps="2", decode_step_delay_s=0.5)
    assert steps.before_step(["clean"]) == 0.0
    assert steps.before_step(["clean", faulty]) == 0.5
    with pytest.raises(InjectedFault, match=r"step 2 of f!"):
        steps.before_step([faulty, "clean"])
    assert steps.before_step(["clean", faulty]) == 0.5  # step 3: only step 2 fails
