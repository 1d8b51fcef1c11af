"""Ctrl-C during a chat answer always shows `[stopped]`: also when grpc surfaces the call
it cancelled as AioRpcError(CANCELLED) instead of letting the cancellation through (which
made the answer look like an error, and the e2e Ctrl-C test wait in vain under load)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator

import grpc
import pytest

from deploy import chat, client
from kvferry.rpc.security import PLAINTEXT
from kvferry.v1 import generation_pb2


def _fake_stream(cancel_as_error: bool):
    async def stream(stub: object, request: object, timeout_s: float | None = None
                     ) -> AsyncIterator[tuple[generation_pb2.GenerateResponse, object]]:
        msg = generation_pb2.GenerateResponse()
        msg.chunk.text = "Paris"
        yield msg, None
        signal.raise_signal(signal.SIGINT)  # the user presses Ctrl-C while it streams
        try:
            await asyncio.sleep(60)  # paces nothing: waits for the cancellation
        except asyncio.CancelledError:
            if cancel_as_error:  # what grpc.aio does when the cancel lands in its read
                raise grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, grpc.aio.Metadata(),
                                           grpc.aio.Metadata(),
                                           "Locally cancelled by application!") from None
            raise
    return stream


@pytest.mark.parametrize("cancel_as_error", [False, True])
def test_ctrl_c_shows_stopped_and_keeps_the_partial_answer(
        cancel_as_error: bool, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(client, "stream", _fake_stream(cancel_as_error))
    conversation = chat.Conversation()
    conversation.add("user", "What is the capital of France?")
    chat._ask("127.0.0.1:1", PLAINTEXT, conversation, {"max_tokens": 8})
    captured = capsys.readouterr()
    assert captured.out == "Paris [stopped]\n"
    assert "error" not in captured.err
    assert conversation.turns[-1] == ("assistant", "Paris")
