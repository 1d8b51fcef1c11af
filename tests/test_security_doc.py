"""docs/security.md names only flags that exist, says which command takes each, and states
the router limits' defaults as the command line has them."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from deploy.args import build_parser

DOC = Path(__file__).resolve().parents[1] / "docs" / "security.md"


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: action for action in parser._actions for flag in action.option_strings}


def test_every_flag_the_page_names_exists() -> None:
    named = set(re.findall(r"`(--[a-z0-9][a-z0-9-]*)", DOC.read_text()))
    assert len(named) >= 20  # the page is there, and read
    known = set().union(*(_flags(p) for p in _commands().values()))
    assert sorted(named - known) == []


def test_the_router_limits_table_has_the_router_defaults() -> None:
    router = _flags(_commands()["router"])
    rows = re.findall(r"^\| `(--[a-z-]+)` \| ([^|]+) \|", DOC.read_text(), re.MULTILINE)
    limits = {flag: value.strip() for flag, value in rows if flag.startswith(("--max", "--http"))}
    assert len(limits) >= 10
    for flag, value in limits.items():
        default = router[flag].default
        stated = int(value.split()[0]) << (20 if value.endswith("MiB") else 0)
        assert stated == default, flag


def test_identity_flags_are_on_every_command_that_serves_or_asks() -> None:
    commands = _commands()
    for name in ("router", "serve", "demo"):
        flags = _flags(commands[name])
        for flag in ("--api-key", "--api-keys-file", "--enable-prompt-tokens-details"):
            assert flag in flags, (name, flag)
    for name in ("generate", "chat"):
        assert "--api-key" in _flags(commands[name]), name
