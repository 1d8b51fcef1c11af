"""Chat messages through the public Generate: the same tokens as the template-applied token
ids; bad conversations get INVALID_ARGUMENT naming the field with pools left clean; and
`kvferry generate --chat` / `kvferry chat` against a running deployment."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import pytest
from transformers import AutoTokenizer

from deploy import client
from deploy.launcher import Deployment
from kvferry.rpc import grpc_util
from tests.conftest import assert_alive, assert_pools_clean

pytestmark = pytest.mark.slow

GREEDY = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
CONVERSATION = [("system", "Be brief."), ("user", "The quick brown fox")]


def _template_ids(checkpoint: Path, messages: list[tuple[str, str]]) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    conversation = [{"role": role, "content": content} for role, content in messages]
    return list(tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                              tokenize=True, return_dict=False))


def _answer(address: str, messages: list[tuple[str, str]], **sampling: object) -> str:
    return asyncio.run(client.generate(address, client.make_request(messages=messages,
                                                                    **sampling))).text


async def _error(address: str, request: object) -> grpc.aio.AioRpcError:
    async with grpc_util.channel(address) as chan:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await client.collect(client.public_stub(chan), request, timeout_s=60)
        return exc.value


def test_chat_streams_the_same_tokens_as_template_ids(chat_deployment: Deployment,
                                                      chat_checkpoint: Path) -> None:
    address = chat_deployment.router_address
    ids = _template_ids(chat_checkpoint, CONVERSATION)
    chat, by_ids = asyncio.run(client.generate_many(address, [
        client.make_request(messages=CONVERSATION, **GREEDY),
        client.make_request(ids, **GREEDY)]))
    assert len(chat.token_ids) == 8
    assert chat.token_ids == by_ids.token_ids
    assert chat.text == by_ids.text
    assert chat.finished.usage.prompt_tokens == len(ids)
    assert_pools_clean(chat_deployment)


@pytest.mark.parametrize("messages,field", [
    ([("user", "hi"), ("narrator", "boo")], "input.messages[1].role"),
    ([], "input.messages"),
], ids=["unknown role", "empty conversation"])
def test_bad_chat_is_invalid_argument(messages: list[tuple[str, str]], field: str,
                                      chat_deployment: Deployment) -> None:
    error = asyncio.run(_error(chat_deployment.router_address,
                               client.make_request(messages=messages)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert field in error.details()
    assert_alive(chat_deployment)
    assert_pools_clean(chat_deployment)


def test_model_without_template_is_invalid_argument(qwen3_deployment: Deployment) -> None:
    error = asyncio.run(_error(qwen3_deployment.router_address,
                               client.make_request(messages=[("user", "hi")])))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert "input.messages" in error.details() and "chat template" in error.details()
    assert_alive(qwen3_deployment)
    assert_pools_clean(qwen3_deployment)


def _cli(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONIOENCODING": "utf-8"})


def test_generate_chat_flag(chat_deployment: Deployment) -> None:
    address = chat_deployment.router_address
    expected = _answer(address, [("user", "hello")], **GREEDY)
    out = _cli(["generate", "--address", address, "--chat", "hello", "--max-tokens", "8",
                "--temperature", "0", "--ignore-eos"])
    assert out.returncode == 0, out.stderr
    assert expected and expected in out.stdout
    assert "[8 tokens, finish length]" in out.stdout


def test_chat_command_keeps_history_and_exits_on_eof(chat_deployment: Deployment) -> None:
    address = chat_deployment.router_address
    first = _answer(address, [("user", "hello")], **GREEDY)
    second = _answer(address, [("user", "hello"), ("assistant", first), ("user", "fox")],
                     **GREEDY)
    assert first and second
    out = _cli(["chat", "--address", address, "--max-tokens", "8", "--temperature", "0",
                "--ignore-eos"], stdin="hello\nfox\n")
    assert out.returncode == 0, out.stderr
    assert f"{first}\n" in out.stdout and f"{second}\n" in out.stdout
    assert out.stdout.index(first) < out.stdout.index(second)
    assert out.stdout.count("> ") >= 3  # two questions, then the prompt that met EOF
    assert_pools_clean(chat_deployment)


def test_ctrl_c_in_chat_stops_the_answer_and_keeps_the_session(
        chat_deployment: Deployment) -> None:
    """SIGINT while an answer streams prints [stopped], cancels that call (its blocks come
    back) and returns to the prompt; the next question is answered; end of input exits 0."""
    import signal
    import threading
    import time

    # stderr to a file, so that a failed wait shows it (an answer that ended early says why)
    errors = tempfile.TemporaryFile()
    proc = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "chat", "--address",
         chat_deployment.router_address, "--max-tokens", "3000", "--temperature", "0",
         "--ignore-eos"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, bufsize=0,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = bytearray()
    reader = threading.Thread(target=lambda: [out.extend(b) for b in iter(
        lambda: proc.stdout.read(1), b"")], daemon=True)
    reader.start()

    def wait_for(predicate, what: str) -> None:
        deadline = time.monotonic() + 60
        while not predicate():
            if time.monotonic() >= deadline or proc.poll() is not None:
                errors.seek(0)
                pytest.fail(f"waiting for {what}: stdout {bytes(out)[-400:]!r}, "
                            f"stderr {errors.read().decode(errors='replace')[-2000:]!r}")
            time.sleep(0.02)  # paces the polling

    def interrupt_the_answer() -> None:
        start = len(out)
        wait_for(lambda: len(out) > start + 20, "the answer streams")
        proc.send_signal(signal.SIGINT)
        wait_for(lambda: b" [stopped]" in out[start:], "[stopped]")

    try:
        wait_for(lambda: b"> " in out, "the first prompt")
        proc.stdin.write(b"hello\n")
        interrupt_the_answer()
        wait_for(lambda: out.count(b"> ") >= 2, "back at the prompt")
        proc.stdin.write(b"fox\n")  # the session goes on: a second answer streams
        interrupt_the_answer()
        proc.stdin.close()
        status = proc.wait(30)
        errors.seek(0)
        assert status == 0, errors.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert out.count(b" [stopped]") == 2
    assert_pools_clean(chat_deployment)
