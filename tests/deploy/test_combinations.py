"""docs/combinations.md, read as the table it is: every refused pair of flags is refused by
the worker's settings with one line naming both flags, and every working pair names a test
that exists. (That refusals reach the command line as one line and exit status 2 is
tests/deploy/test_bad_input_cli.py's.)"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from deploy.args import build_parser, worker_settings

REPO = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\| (.+?) \| (works|refused) \| (.+?) \| `([^`]+)` \|$")


def _rows() -> list[tuple[str, str, str]]:
    text = (REPO / "docs" / "combinations.md").read_text()
    rows = [(m.group(1), m.group(2), m.group(4)) for m in map(ROW.match, text.splitlines()) if m]
    assert len(rows) >= 10
    return rows


REFUSED = [(flags, where) for flags, status, where in _rows() if status == "refused"]
WORKS = [(flags, where) for flags, status, where in _rows() if status == "works"]


def _names(flag: str) -> tuple[str, str]:
    """A flag as the line may name it: `--kv-eviction` or its field, `kv_eviction`."""
    return flag, flag.lstrip("-").replace("-", "_")


@pytest.mark.parametrize("flags,command", REFUSED, ids=[c for _, c in REFUSED])
def test_a_refused_pair_is_one_line_naming_both_flags(flags: str, command: str) -> None:
    pair = re.findall(r"--[a-z-]+", flags)
    assert len(pair) == 2, flags
    argv = command.split()
    args = build_parser().parse_args([argv[0], "--model", "m", *argv[1:]])
    with pytest.raises(ValueError) as exc:
        worker_settings(args, model="m")
    line = str(exc.value)
    assert "\n" not in line
    for flag in pair:
        assert any(name in line for name in _names(flag)), (flag, line)


@pytest.mark.parametrize("flags,test", WORKS, ids=[t.split("::")[1] for _, t in WORKS])
def test_a_working_pair_names_a_test_that_exists(flags: str, test: str) -> None:
    path, name = test.split("::")
    tree = ast.parse((REPO / path).read_text())
    assert name in {node.name for node in ast.walk(tree)
                    if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
