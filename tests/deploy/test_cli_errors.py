"""What a new user meets when something is wrong around a command, each
without a deployment: a client that cannot reach the router says so in one
line with a hint and exits 1; a taken port is refused before any model loads, naming the
flag; Ctrl-C anywhere is one line and exit status 130, what had started stopped; a worker
whose launcher is gone stops quietly. Commands run as subprocesses (forked by the zygote)."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy import cli, zygote
from deploy.certs import make_certs

REPO = Path(__file__).resolve().parents[2]


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return zygote.run(list(argv), dict(os.environ), REPO, 120)


def _one_line(result: subprocess.CompletedProcess[str], status: int) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == status, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def dead_address() -> str:
    """A port nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize("argv", [
    ["generate", "hello"], ["chat"], ["bench", "--num-prompts", "2"],
], ids=["generate", "chat", "bench"])
def test_a_client_that_cannot_connect_says_so_in_one_line(argv: list[str],
                                                         dead_address: str) -> None:
    line = _one_line(_run(*argv, "--address", dead_address), 1)
    assert line.startswith(f"kvferry: {argv[0]}: UNAVAILABLE at {dead_address}: "), line
    assert "is `kvferry serve`" in line


def test_a_client_takes_the_ca_alone(tmp_path: Path, dead_address: str) -> None:
    """The documented `generate --tls-ca ca.crt` passes the flags (it once failed: "tls_ca:
    needs tls_cert and tls_key"); a certificate without its key, or a CA that is no PEM, is
    refused naming the flag."""
    certs = make_certs(tmp_path / "certs")
    line = _one_line(_run("generate", "--address", dead_address, "--tls-ca",
                          str(certs.ca_cert), "hello"), 1)
    assert "UNAVAILABLE" in line and "tls_ca" not in line
    line = _one_line(_run("generate", "--tls-cert", str(certs.cert), "hello"), 2)
    assert line.startswith("kvferry: tls_cert/tls_key: give both or neither")
    line = _one_line(_run("chat", "--tls-ca", str(certs.token)), 2)
    assert line.startswith("kvferry: tls_ca: ") and "no PEM" in line


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


# A model that does not exist: the port is refused before the model is even looked at.
@pytest.mark.parametrize("argv,name", [
    (["serve", "--port", "{port}"], "port"),
    (["serve", "--port", "0", "--http-port", "{port}"], "http_port"),
    (["demo", "--metrics-port", "{port}"], "metrics_port"),
    (["router", "--port", "{port}", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"],
     "port"),
    (["decode-worker", "--port", "{port}"], "port"),
    (["prefill-worker", "--health-port", "{port}"], "health_port"),
], ids=["serve", "serve-http", "demo-metrics", "router", "decode-worker", "health"])
def test_a_taken_port_is_refused_before_the_model_loads(argv: list[str], name: str,
                                                       taken_port: int) -> None:
    command = [a.format(port=taken_port) for a in argv] + ["--model", "/nonexistent-model"]
    line = _one_line(_run(*command), 2)
    flag = "--" + name.replace("_", "-")
    assert line.startswith(f"kvferry: {name}: cannot bind 127.0.0.1:{taken_port} "), line
    assert f"give another {flag}, or 0 for any free port" in line


class _Interrupted:
    """A deployment whose start-up meets Ctrl-C: Deployment.start stops what it started, then
    lets KeyboardInterrupt through (deploy/launcher.py)."""

    num_prefill = num_decode = 1
    is_colocated = False
    model = "/models/qwen3-tiny"

    def __init__(self) -> None:
        self.stopped = False

    def start(self) -> _Interrupted:
        self.stop()
        raise KeyboardInterrupt

    def stop(self) -> None:
        self.stopped = True


def test_ctrl_c_while_serve_starts_is_one_line_and_status_130(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    started = _Interrupted()
    monkeypatch.setattr(cli, "check_inputs", lambda args: None)
    monkeypatch.setattr(cli, "_deployment", lambda args, store_url=None: started)
    assert cli.main(["serve", "--port", "0"]) == cli.EXIT_INTERRUPTED == 130
    err = capsys.readouterr().err
    assert started.stopped
    assert err.splitlines()[0].startswith("kvferry: starting 1 prefill + 1 decode worker(s)")
    assert err.strip().splitlines()[-1] == "kvferry: interrupted"
    assert "Traceback" not in err


def test_ctrl_c_anywhere_in_a_command_is_status_130(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture) -> None:
    def interrupted(args: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr("deploy.plan_cmd.run_plan", interrupted)
    assert cli.main(["plan"]) == 130
    assert capsys.readouterr().err.strip() == "kvferry: interrupted"


def test_a_worker_whose_launcher_is_gone_is_told_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ready line to a closed pipe (the launcher was stopped by Ctrl-C while the worker
    started) is False, and stdout goes to /dev/null: no BrokenPipeError traceback."""
    import sys

    from kvferry.rpc import grpc_util

    read, write = os.pipe()
    os.close(read)
    saved = os.dup(1)
    try:
        os.dup2(write, 1)
        monkeypatch.setattr(sys, "stdout", open(1, "w", closefd=False))  # noqa: SIM115
        assert grpc_util.announce_ready(1234) is False
        print("after", flush=True)  # /dev/null now: no error
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(write)
