"""`kvferry generate --chat` and `kvferry chat` on the command line (no deployment)."""

from __future__ import annotations

import pytest

from deploy.args import build_parser
from deploy.cli import main


@pytest.mark.parametrize("argv", [
    ["generate", "--address", "127.0.0.1:1"],
    ["generate", "--address", "127.0.0.1:1", "hello", "--chat", "hello"],
], ids=["neither", "both"])
def test_generate_needs_exactly_one_of_prompt_and_chat(argv: list[str],
                                                       capsys: pytest.CaptureFixture) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--chat" in err and "PROMPT" in err


def test_generate_chat_parses() -> None:
    args = build_parser().parse_args(["generate", "--chat", "hi there", "--max-tokens", "4"])
    assert args.chat == "hi there" and args.prompt is None and args.max_tokens == 4


def test_chat_command_parses() -> None:
    args = build_parser().parse_args(["chat", "--address", "10.0.0.1:50051", "--system",
                                      "Be brief.", "--temperature", "0", "--stop", "\n"])
    assert (args.command, args.address, args.system) == ("chat", "10.0.0.1:50051", "Be brief.")
    assert args.temperature == 0.0 and args.stop == ["\n"]
