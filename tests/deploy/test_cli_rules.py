"""The rules every `kvferry` command follows: a mistyped flag is
an error naming the flag it resembles, never a prefix match that starts a deployment; every
option's help shows its default; the global flags work before or after the command;
`--version`. The commands run as subprocesses (forked by the run's zygote)."""

from __future__ import annotations

import argparse
import os
from importlib import metadata
from pathlib import Path

import pytest

from deploy import zygote
from deploy.args import build_parser

REPO = Path(__file__).resolve().parents[2]


def _run(*argv: str) -> zygote.subprocess.CompletedProcess[str]:
    return zygote.run(list(argv), dict(os.environ), REPO, 120)


# Where a prefix match would run the command, it fails fast: no model, no server.
@pytest.mark.parametrize("argv,flag,meant", [
    (["serve", "--num-prefil", "2", "--model", "/nonexistent"], "--num-prefil", "--num-prefill"),
    (["generate", "--max-token", "5", "--address", "127.0.0.1:1", "hello"], "--max-token",
     "--max-tokens"),
    (["plan", "--prompt-token", "10"], "--prompt-token", "--prompt-tokens"),
], ids=["serve", "generate", "plan"])
def test_a_mistyped_flag_is_refused_naming_the_flag_it_resembles(
        argv: list[str], flag: str, meant: str) -> None:
    result = _run(*argv)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith(f"kvferry: {argv[0]}: unrecognized arguments: {flag} ")
    assert f"did you mean {meant}?" in lines[0] and f"kvferry {argv[0]} --help" in lines[0]
    assert result.stdout == ""  # nothing started, nothing printed


def test_a_bad_choice_is_one_line_naming_the_command() -> None:
    result = _run("serve", "--kv-transport", "carrier-pigeon")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "usage:" not in result.stderr
    assert result.stderr.startswith("kvferry: serve: argument --kv-transport: invalid choice")


def test_version() -> None:
    result = _run("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"kvferry {metadata.version('kvferry')}"


@pytest.mark.parametrize("argv,level,fmt", [
    (["plan"], "INFO", "text"),
    (["--log-level", "debug", "--log-format", "json", "plan"], "DEBUG", "json"),
    (["plan", "--log-level", "warning", "--log-format", "json"], "WARNING", "json"),
    (["--log-format", "json", "plan", "--log-format", "text"], "INFO", "text"),  # the later
])
def test_global_flags_before_or_after_the_command(argv: list[str], level: str,
                                                  fmt: str) -> None:
    args = build_parser().parse_args(argv)
    assert (args.log_level, args.log_format) == (level, fmt)


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"kvferry": parser, **sub.choices}


@pytest.mark.parametrize("command", list(_commands()))
def test_every_option_has_help_and_shows_its_default(command: str) -> None:
    parser = _commands()[command]
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        flag = action.option_strings[-1]
        assert action.help, f"kvferry {command} {flag}: no help"
        default = action.default
        if default is None or default is False or default == [] or default == argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._VersionAction):
            continue
        if isinstance(action, argparse._StoreConstAction):  # a switch: `(default: True)` on
            assert f"(default: {default})" not in text, flag  # --no-x would read as its value
            continue
        # argparse prints the default where the help does not already name it
        assert f"(default: {default})" in text or "default" in action.help, \
            f"kvferry {command} {flag}: default {default!r} not shown"


def test_client_commands_describe_tls_as_a_client() -> None:
    """`generate --help` and `chat --help` say what a client does with
    each TLS flag, not what a server does."""
    for command in ("generate", "chat"):
        text = " ".join(_commands()[command].format_help().split())
        assert "--tls-ca PEM CA bundle verifying the router's certificate" in text
        assert "only for a router started with --public-client-auth" in text
        assert "serve TLS" not in text


def test_make_model_needs_out_and_says_its_weights_are_random(tmp_path: Path) -> None:
    """No shared default folder, and the output says what it is."""
    result = _run("make-model")
    assert result.returncode == 2 and "--out" in result.stderr
    result = _run("make-model", "--out", str(tmp_path / "tiny"))
    assert result.returncode == 0, result.stderr
    assert "seeded random weights" in result.stdout and "noise" in result.stdout
    assert (tmp_path / "tiny" / "config.json").is_file()


def test_serve_says_at_once_the_name_the_model_is_served_as() -> None:
    from deploy.cli import _starting_line
    from deploy.launcher import Deployment

    deployment = Deployment(model="/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert "a router for SmolLM2-135M-Instruct;" in _starting_line(deployment)
    assert "a router for my-model;" in _starting_line(deployment, "my-model")
