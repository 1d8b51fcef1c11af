"""The `kvferry` parser's rules, for every command alike: no prefix matching of
flags (`--num-prefil` is an error, not `--num-prefill`), every flag's default in its help,
the global flags (`--log-level`, `--log-format`) accepted before or after the command, and
`--version`."""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from importlib import metadata
from typing import NoReturn

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMATS = ("text", "json")


def version() -> str:
    try:
        return metadata.version("kvferry")
    except metadata.PackageNotFoundError:  # run from a tree that was not installed
        return "unknown (not installed)"


def comma_ints(text: str, minimum: int) -> tuple[int, ...]:
    """"16,256,1024" -> (16, 256, 1024), in the order given; ValueError when a value is not an
    integer, is below `minimum`, or there is none."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < minimum:
        raise ValueError(f"expected comma-separated integers >= {minimum}, got {text!r}")
    return values


def _has_no_default(default: object) -> bool:
    # identity, not equality: 0 is a default worth showing, False (a flag's off) is not
    return default is None or default is False or default == argparse.SUPPRESS or default == []


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; each option's help ends with its default, where it has one
    and the help does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        is_switch = isinstance(action, argparse._StoreConstAction)  # store_true/false
        if (action.option_strings and not _has_no_default(action.default)
                and not is_switch and "default" not in text):
            text += (" " if text else "") + "(default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """argparse with the rules above, and a usage error in one line (exit status 2) naming
    the command and its --help; its subcommand parsers are Parsers too."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        """As argparse's, but an unknown flag is reported by the command it was given to,
        with the flag it most resembles."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self._command_parsers().get(getattr(parsed, "command", None), self)
            known = [flag for action in parser._actions for flag in action.option_strings]
            hints = [f"{flag} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(
                flag.split("=")[0], known, n=1)) else flag for flag in extras]
            parser.error(f"unrecognized arguments: {' '.join(hints)}")
        return parsed

    def _command_parsers(self) -> dict[str | None, argparse.ArgumentParser]:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("kvferry").strip()
        where = f"{command}: " if command else ""
        self.exit(2, f"kvferry: {where}{message} (see `{self.prog} --help`)\n")


def global_args(p: argparse.ArgumentParser, is_top: bool) -> None:
    """The flags of every command. On the top-level parser they carry the defaults; on a
    command's parser they default to nothing, so that a value given before the command is
    kept and one given after it wins."""
    def default(value: str) -> str:
        return value if is_top else argparse.SUPPRESS

    p.add_argument("--log-level", default=default("INFO"), type=str.upper, choices=LOG_LEVELS,
                   help="log threshold" + ("" if is_top else " (default: INFO)"))
    p.add_argument("--log-format", default=default("text"), choices=LOG_FORMATS,
                   help="json: one JSON object per line, with the request id it concerns"
                        + ("" if is_top else " (default: text)"))
    if is_top:
        p.add_argument("--version", action="version", version=f"kvferry {version()}")


def add_global_args_to_commands(sub: argparse._SubParsersAction) -> None:
    for command in sub.choices.values():
        global_args(command, is_top=False)
