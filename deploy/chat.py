"""`kvferry chat [--address HOST:PORT]`: a conversation in the terminal with a running
deployment.

It first asks the router for its model (one line and exit status 1 when it cannot reach it)
and prints a banner naming both. The whole history (user and assistant turns) goes with
every request as chat messages; the router renders it with the model's chat template.
Answers stream as they are generated. In a terminal, input has readline editing and a
history kept across sessions (KVFERRY_HOME/chat_history). Lines starting with `/` are
commands (`/help` lists them; `//` sends a message starting with `/`). Ctrl-C while an
answer streams cancels that call (the router frees its blocks) and keeps the session, with
the partial answer as the assistant's turn; Ctrl-C at the prompt just clears the line;
Ctrl-D (end of input) or `/exit` exits 0.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvferry.rpc.security import Credentials

PROMPT = "> "
HELP = """commands:
  /help           this list
  /clear          forget the conversation (the system message stays)
  /system [TEXT]  set the system message (none without TEXT); the conversation restarts
  /exit, /quit    leave (as Ctrl-D)
  //text          send a message that starts with "/"
Ctrl-C stops an answer; Up and Down recall earlier lines."""


@dataclass
class Conversation:
    """The turns so far, as (role, content) pairs, oldest first."""

    turns: list[tuple[str, str]] = field(default_factory=list)

    def add(self, role: str, content: str) -> None:
        self.turns.append((role, content))

    def restart(self, system: str | None) -> None:
        self.turns = [("system", system)] if system else []

    @property
    def system(self) -> str | None:
        return self.turns[0][1] if self.turns and self.turns[0][0] == "system" else None


@dataclass
class Answer:
    """One assistant answer as it streams; `text` holds what arrived even if cut short."""

    text: str = ""
    error: str | None = None


async def _stream_answer(address: str, creds: Credentials, turns: list[tuple[str, str]],
                         sampling: dict[str, object], answer: Answer) -> None:
    import grpc

    from deploy import client
    from kvferry.rpc import security

    request = client.make_request(messages=turns, **sampling)
    async with security.channel(address, creds) as chan:
        try:
            async for msg, _ in client.stream(client.public_stub(chan), request):
                if msg.HasField("chunk"):
                    answer.text += msg.chunk.text
                    print(msg.chunk.text, end="", flush=True)
        except grpc.aio.AioRpcError as exc:
            task = asyncio.current_task()
            if (exc.code() == grpc.StatusCode.CANCELLED and task is not None
                    and task.cancelling()):
                # Ctrl-C: asyncio.run cancelled this task and grpc reported the call it
                # cancelled as an error; the cancellation must go on, so that asyncio.run
                # raises KeyboardInterrupt and the answer is shown as stopped.
                raise asyncio.CancelledError from exc
            answer.error = f"{exc.code().name}: {exc.details()}"


def _ask(address: str, creds: Credentials, conversation: Conversation,
         sampling: dict[str, object]) -> None:
    """Send the conversation, stream the answer, and record it as the assistant's turn.

    A failed request drops the user's last turn, so that the history stays a valid chat."""
    answer = Answer()
    try:
        asyncio.run(_stream_answer(address, creds, list(conversation.turns), sampling, answer))
    except KeyboardInterrupt:  # asyncio.run cancelled the call, which cancels the RPC
        print(" [stopped]", flush=True)
    else:
        print(flush=True)
    if answer.error is not None:
        print(f"error: {answer.error}", file=sys.stderr, flush=True)
    if answer.error is not None or not answer.text:
        conversation.turns.pop()
    else:
        conversation.add("assistant", answer.text)


def command(line: str, conversation: Conversation) -> bool | None:
    """Run `line` if it is a command: True to go on, False to exit; None: a message."""
    if not line.startswith("/") or line.startswith("//"):
        return None
    name, _, rest = line[1:].partition(" ")
    if name in ("exit", "quit"):
        return False
    if name == "help":
        print(HELP, flush=True)
    elif name == "clear":
        conversation.restart(conversation.system)
        print("(conversation cleared)", flush=True)
    elif name == "system":
        conversation.restart(rest.strip() or None)
        print(f"(system message {'set' if rest.strip() else 'removed'}; conversation "
              "restarted)", flush=True)
    else:
        print(f"unknown command /{name}; /help lists them", file=sys.stderr, flush=True)
    return True


async def _model_info(address: str, creds: Credentials):  # noqa: ANN202
    from deploy import client
    from kvferry.rpc import security

    async with security.channel(address, creds) as chan:
        return await client.model_info(chan, timeout_s=10.0)


def _history(enable: bool) -> Path | None:
    """readline editing and a history file, for a terminal only."""
    if not enable:
        return None
    try:
        import readline
    except ImportError:  # a Python without readline: plain input()
        return None
    from kvferry.settings import KVFERRY_HOME

    path = KVFERRY_HOME / "chat_history"
    readline.set_history_length(1000)
    try:
        readline.read_history_file(path)
    except OSError:  # none yet
        pass
    return path


def _save_history(path: Path | None) -> None:
    if path is None:
        return
    import readline

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        readline.write_history_file(path)
    except OSError:  # a read-only home: the history is lost, the session is not
        pass


def run_chat(address: str, sampling: dict[str, object], creds: Credentials,
             system: str | None = None) -> int:
    """The interactive loop; returns the exit status (0 on end of input or /exit, 1 when
    the router cannot be reached)."""
    import grpc

    from deploy.client_errors import EXIT_UNREACHABLE, rpc_error_line

    try:
        info = asyncio.run(_model_info(address, creds))
    except grpc.aio.AioRpcError as exc:
        print(rpc_error_line("chat", exc, address, creds.ca is not None or creds.is_tls),
              file=sys.stderr)
        return EXIT_UNREACHABLE
    name = info.model_name or info.architecture
    print(f"kvferry chat with {name} at {address} ({info.max_context_tokens:,} tokens of "
          "context). /help lists commands; Ctrl-D exits.", flush=True)
    conversation = Conversation()
    conversation.restart(system)
    history = _history(sys.stdin.isatty())
    try:
        return _loop(address, creds, conversation, sampling)
    finally:
        _save_history(history)


def _loop(address: str, creds: Credentials, conversation: Conversation,
          sampling: dict[str, object]) -> int:
    while True:
        try:
            line = input(PROMPT)
        except EOFError:
            print(flush=True)
            return 0
        except KeyboardInterrupt:
            print(flush=True)
            continue
        if not line.strip():
            continue
        went = command(line.strip(), conversation)
        if went is False:
            return 0
        if went:
            continue
        conversation.add("user", line[1:] if line.startswith("//") else line)
        _ask(address, creds, conversation, sampling)


__all__ = ["Answer", "Conversation", "command", "run_chat"]
