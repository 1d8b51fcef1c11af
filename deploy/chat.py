"""`kvferry chat ADDRESS`: a conversation in the terminal with a running deployment.

Plain input()/print. The whole history (user and assistant turns) goes with every request as
chat messages; the router renders it with the model's chat template. Answers stream as they
are generated. Ctrl-C while an answer streams cancels that call (the router frees its
blocks) and keeps the session, with the partial answer as the assistant's turn; Ctrl-C at
the prompt just clears the line; Ctrl-D (end of input) exits 0.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass, field

from kvferry.rpc.security import Credentials

PROMPT = "> "


@dataclass
class Conversation:
    """The turns so far, as (role, content) pairs, oldest first."""

    turns: list[tuple[str, str]] = field(default_factory=list)

    def add(self, role: str, content: str) -> None:
        self.turns.append((role, content))


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


def run_chat(address: str, sampling: dict[str, object], creds: Credentials,
             system: str | None = None) -> int:
    """The interactive loop; returns the exit status (0 on end of input)."""
    conversation = Conversation()
    if system:
        conversation.add("system", system)
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
        conversation.add("user", line)
        _ask(address, creds, conversation, sampling)


__all__ = ["Answer", "Conversation", "run_chat"]
