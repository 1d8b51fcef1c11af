"""How the whole suite is split between pytest-xdist's workers (tests/suite_order.py): each
shared deployment's tests on one worker, every Ray test on one, each worker its own ports."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.suite_order import _worker_group, this_workers_ports


def _item(nodeid: str, *fixtures: str, params: dict[str, object] | None = None,
          marks: tuple[str, ...] = ()) -> object:
    return SimpleNamespace(
        nodeid=nodeid, fixturenames=list(fixtures),
        callspec=SimpleNamespace(params=params) if params is not None else None,
        get_closest_marker=lambda name: name if name in marks else None)


def test_each_shared_deployment_and_ray_get_one_worker() -> None:
    on_qwen3 = _item("tests/e2e/test_a.py::t", "qwen3_deployment", "tmp_path")
    both = _item("tests/e2e/test_b.py::t", "qwen3_tiny_deployment", "qwen3_deployment")
    by_param = _item("tests/e2e/test_c.py::t[x]", params={"name": "colocated_deployment"})
    ray_fixture = _item("tests/e2e/test_d.py::t", "qwen3_ray_deployment")
    ray_marked = _item("tests/deploy/test_e.py::t", "tmp_path", marks=("ray",))
    alone = _item("tests/kvferry/test_f.py::t[1]", "tmp_path")
    groups = [_worker_group(i) for i in (on_qwen3, both, by_param, ray_fixture, ray_marked,
                                         alone)]  # type: ignore[arg-type]
    assert groups == ["qwen3_deployment", "qwen3_deployment", "colocated_deployment", "ray",
                      "ray", "tests/kvferry/test_f.py"]


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
