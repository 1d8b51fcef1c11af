"""KVFERRY_WORKER_PORTS: launched workers' ports from a range outside the kernel's ephemeral
one, each free when given, a port in use skipped, a bad range named."""

from __future__ import annotations

import socket

import pytest

from deploy import launcher


def test_ports_come_from_the_range_each_free_and_not_given_twice_in_a_row(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        base = probe.getsockname()[1]  # a free port to build a small range around
    low, high = base, min(base + 3, 65535)
    monkeypatch.setenv(launcher.WORKER_PORTS_ENV, f"{low}-{high}")
    monkeypatch.setattr(launcher, "_next_port", {(low, high): low})
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", low))  # taken: skipped
        busy.listen()
        first = launcher.worker_port("127.0.0.1")
        second = launcher.worker_port("127.0.0.1")
    assert low < first <= high and first != second and low <= second <= high


def test_without_the_variable_any_free_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(launcher.WORKER_PORTS_ENV, raising=False)
    assert launcher.worker_port("127.0.0.1") == 0


@pytest.mark.parametrize("text", ["20000", "a-b", "0-10", "30000-20000", "60000-70000"])
def test_a_bad_range_is_named(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv(launcher.WORKER_PORTS_ENV, text)
    with pytest.raises(ValueError, match="KVFERRY_WORKER_PORTS"):
        launcher.worker_port("127.0.0.1")


def test_the_suite_keeps_its_workers_out_of_the_ephemeral_range() -> None:
    import os
    from pathlib import Path

    text = os.environ.get(launcher.WORKER_PORTS_ENV, "")
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    if text:
        first, last = map(int, text.split("-"))
        assert last < low or first > high
    else:
        assert low <= 11000 and high >= 64000  # no room outside it
