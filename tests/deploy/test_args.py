"""The command line takes its defaults and choices from kvferry.settings, the one place."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from deploy.args import build_parser, router_settings, worker_settings
from deploy.launcher import Deployment
from deploy.loadgen.targets import make_deployment
from kvferry import settings
from kvferry.rpc.grpc_util import announce_ready, parse_ready
from router.policies import POLICIES


def test_worker_flags_default_to_the_settings_defaults() -> None:
    args = build_parser().parse_args(["decode-worker", "--model", "m"])
    assert worker_settings(args) == settings.WorkerSettings(role="decode", model="m")


def test_router_flags_default_to_the_settings_defaults() -> None:
    args = build_parser().parse_args(["router", "--model", "m", "--colocated", "h:1"])
    assert router_settings(args) == settings.RouterSettings(model="m", colocated=("h:1",))


def test_every_policy_name_has_a_policy() -> None:
    assert tuple(POLICIES) == settings.POLICIES


def test_launch_targets_are_fresh_copies_of_the_template(tmp_path: Path) -> None:
    template = Deployment(model="m", num_decode=2, log_dir=tmp_path)
    launched = make_deployment("colocated", template)
    assert launched.is_colocated and not template.is_colocated
    assert launched.log_dir == tmp_path / "colocated" and launched.log_dir.is_dir()
    assert launched.processes is not template.processes
    assert dataclasses.replace(launched, is_colocated=False, log_dir=tmp_path) == template


def test_http_port_is_on_in_serve_and_demo_and_off_in_library_use(capsys) -> None:
    parser = build_parser()
    assert parser.parse_args(["serve"]).http_port == settings.DEFAULT_HTTP_PORT
    assert parser.parse_args(["demo"]).http_port == 0
    assert parser.parse_args(["serve", "--http-port", "off"]).http_port is None
    router = ["router", "--model", "m", "--colocated", "h:1"]
    assert router_settings(parser.parse_args(router)).http_port is None
    assert router_settings(parser.parse_args([*router, "--http-port", "0"])).http_port == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--http-port", "70000"])
    assert Deployment().http_port is None
    assert "--http-port" not in Deployment(model="m")._router_args("h", {})
    assert Deployment(model="m", http_port=0)._router_args("h", {})[-2:] == ["--http-port", "0"]
    announce_ready(1, 2, 3)
    announce_ready(4)
    first, second = capsys.readouterr().out.splitlines()
    assert parse_ready(first) == (1, 2, 3) and parse_ready(second) == (4, 0, 0)
    assert parse_ready("some log line") is None
