"""The whole suite on pytest-xdist's workers (tests/suite_order.py): each worker gives out
worker ports from its own slice of the range, so two never hand out the same one."""

from __future__ import annotations

import pytest

from tests.suite_order import this_workers_ports


def test_each_worker_gives_out_ports_from_its_own_slice(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert this_workers_ports("10000-29999") == "10000-29999"  # not under xdist: all of it
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    slices = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        slices.append(this_workers_ports("10000-29999"))
    assert slices == ["10000-19999", "20000-29999"]
    assert this_workers_ports("") == ""  # no range: any free port, as before
