"""Every `kvferry` command the README and docs/ show parses with today's command line: a
renamed or removed flag, or a command whose arguments changed (as `chat HOST:PORT` did),
fails here. Flags are not abbreviated any more, so a doc's flag must
be the whole flag. The README's TLS commands run as written in tests/e2e/test_security.py,
and `plan` commands run here (`plan --sla` ones on the profiles committed under bench/results)."""

from __future__ import annotations

import pytest

from deploy.args import build_parser
from deploy.cli import main
from tests.doc_commands import doc_commands

COMMANDS = doc_commands()


def test_the_docs_show_commands() -> None:
    """The extraction finds them (an empty list would pass everything below)."""
    assert len(COMMANDS) >= 40
    shown = {c.argv()[0] for c in COMMANDS if c.argv()}
    assert {"serve", "generate", "chat", "demo", "bench", "plan", "make-certs",
            "make-model", "router"} <= shown


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{c.source}: {c.text[:60]}"
                                                   for c in COMMANDS])
def test_a_doc_command_parses(command, capsys: pytest.CaptureFixture) -> None:  # noqa: ANN001
    parser = build_parser()
    argv = command.argv(parser)
    if len(argv) == 1 and not argv[0].startswith("-"):  # names a command: it must exist
        commands = next(a.choices for a in parser._actions if a.dest == "command")
        assert argv[0] in commands, f"{command.source}: no command {argv[0]!r}"
        return
    if argv in (["--version"], ["--help"]):
        with pytest.raises(SystemExit) as done:
            parser.parse_args(argv)
        assert done.value.code == 0
        return
    try:
        parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"{command.source}: `{command.text}` does not parse as {argv}: "
                    f"{capsys.readouterr().err.strip()}")


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.argv()[:1] == ["plan"]],
                         ids=lambda c: c.text[:60])
def test_a_doc_plan_command_runs(command, capsys: pytest.CaptureFixture) -> None:  # noqa: ANN001
    argv = command.argv(build_parser())
    if "--model" in argv:  # a placeholder DIR: the default model stands in
        i = argv.index("--model")
        del argv[i:i + 2]
    if "--sla" in argv and "--workload" not in argv:  # names the mode in prose; parsed above
        return
    assert main(argv) == 0, capsys.readouterr().err
    # with --sla: a layout for a workload, from a committed profile; else K/V sizes
    said = "recommendation:" if "--sla" in argv else "bytes per token:"
    assert said in capsys.readouterr().out
