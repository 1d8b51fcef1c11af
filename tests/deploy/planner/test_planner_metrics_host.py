"""`kvferry planner --metrics-port` binds `--host`, loopback unless given, as every kvferry
server does (docs/security.md, "Ports"); the planner overlay's pod gives 0.0.0.0."""

from __future__ import annotations

import os

import pytest

from deploy import planner_cmd
from deploy.args import build_parser
from kvferry.rpc.grpc_util import free_port
from tests.listening import listeners


class _Stop(BaseException):
    """Ends run_planner's loop after its metrics server started."""


class _OneRound:
    def run_once(self) -> None:
        raise _Stop


@pytest.mark.parametrize(("flags", "address"), [((), "127.0.0.1"),
                                                (("--host", "0.0.0.0"), "0.0.0.0")])
def test_the_planners_metrics_bind_its_host(monkeypatch, flags, address) -> None:
    port = free_port()
    args = build_parser().parse_args(
        ["planner", "--router-metrics", "http://127.0.0.1:1/metrics", "--profile", "p.json",
         "--sla", "ttft-p90=1000,itl-p90=100", "--dry-run", "--current", "1,1",
         "--metrics-port", str(port), *flags])
    monkeypatch.setattr(planner_cmd, "build_loop", lambda args: _OneRound())
    with pytest.raises(_Stop):
        planner_cmd.run_planner(args)
    bound = {(found.address, found.port) for found in listeners([os.getpid()])}
    assert (address, port) in bound
