"""`serve` and `demo` pass on the router and process flags docs/cli.md promises for every
process: checked on the Deployment they would start (not started)."""

from __future__ import annotations

import pytest

from deploy import cli
from deploy.args import build_parser


def _flags(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


@pytest.mark.parametrize("command", ["serve", "demo"])
def test_serve_passes_router_and_process_flags_on(command: str) -> None:
    args = build_parser().parse_args([
        command, "--model", "/models/m", "--policy", "priced", "--prefix-weight", "3",
        "--drain-timeout-s", "7", "--health-port", "9123", "--public-client-auth",
        "--served-model-name", "mine"])
    deployment = cli._deployment(args)
    router, worker = deployment.router_args, deployment.worker_args
    assert _flags(router, "--policy") == "priced" and _flags(router, "--prefix-weight") == "3.0"
    assert _flags(router, "--drain-timeout-s") == _flags(worker, "--drain-timeout-s") == "7.0"
    assert _flags(router, "--health-port") == "9123" and "--health-port" not in worker
    assert "--public-client-auth" in router and "--public-client-auth" not in worker
    assert _flags(router, "--served-model-name") == "mine"
    # each flag the router is given parses as the router's own
    parsed = build_parser().parse_args(["router", *router, "--prefill", "h:1", "--decode", "h:2"])
    assert (parsed.policy, parsed.drain_timeout_s, parsed.health_port) == ("priced", 7.0, 9123)
    assert parsed.public_client_auth and parsed.served_model_name == "mine"


def test_serve_refuses_client_auth_without_a_ca(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["serve", "--model", "/nonexistent", "--public-client-auth"]) == 2
    assert "public_client_auth: needs --tls-ca" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "demo"])
def test_serve_lends_cores_unless_told_not_to(command: str) -> None:
    parser = build_parser()
    assert cli._deployment(parser.parse_args([command, "--model", "/m"])).lend_cores
    assert not cli._deployment(parser.parse_args(
        [command, "--model", "/m", "--lend-cores", "off"])).lend_cores
