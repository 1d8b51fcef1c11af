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


class _Terminal:
    """`kvferry chat` on a pseudo-terminal, as a user runs it: readline is on, keys are
    bytes written to the terminal, the screen is what the command wrote back."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        import pty

        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the command, its stdin and stdout the terminal
            os.execvpe(sys.executable, [sys.executable, "-m", "deploy.cli", *argv], env)
        self.screen = b""

    def read_until(self, text: bytes, timeout_s: float = 60.0) -> bytes:
        """The screen up to and including the next `text` after what was read so far."""
        import select
        import time

        start = len(self.screen)
        deadline = time.monotonic() + timeout_s
        while text not in self.screen[start:]:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.fd], [], [], max(left, 0))
            if not ready:
                pytest.fail(f"waiting for {text!r}: screen {self.screen[-600:]!r}")
            try:
                chunk = os.read(self.fd, 4096)
            except OSError:  # the command exited: the terminal is closed
                chunk = b""
            if not chunk:
                pytest.fail(f"exited before {text!r}: screen {self.screen[-600:]!r}")
            self.screen += chunk
        end = self.screen.index(text, start) + len(text)
        return self.screen[start:end]

    def type(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def exit_status(self) -> int:
        _, status = os.waitpid(self.pid, 0)
        os.close(self.fd)
        return os.waitstatus_to_exitcode(status)


def test_chat_in_a_terminal_has_a_banner_commands_and_line_history(
        chat_deployment: Deployment, tmp_path: Path) -> None:
    """A banner naming the model and address; /help, /system, /clear,
    an unknown command refused without reaching the model, /exit; the Up arrow recalls the
    last line (readline, not `^[[A`), and the history outlives the session."""
    address = chat_deployment.router_address
    env = {**os.environ, "KVFERRY_HOME": str(tmp_path), "TERM": "xterm"}
    term = _Terminal(["chat", "--address", address, "--max-tokens", "4", "--temperature", "0",
                      "--ignore-eos"], env)
    banner = term.read_until(b"> ")
    assert f"kvferry chat with tiny-chat at {address}".encode() in banner
    term.type(b"/help\r")
    assert b"/system [TEXT]" in term.read_until(b"> ")
    term.type(b"/nope\r")
    assert b"unknown command /nope" in term.read_until(b"> ")
    term.type(b"hello\r")
    first = term.read_until(b"> ")
    term.type(b"\x1b[A")  # Up: the last line comes back, to send again
    assert b"hello" in term.read_until(b"hello")
    term.type(b"\r")
    term.read_until(b"> ")
    term.type(b"/system Be brief.\r")
    assert b"system message set; conversation restarted" in term.read_until(b"> ")
    term.type(b"/clear\r")
    assert b"conversation cleared" in term.read_until(b"> ")
    term.type(b"/exit\r")
    assert term.exit_status() == 0
    assert b"^[[A" not in term.screen
    expected = _answer(address, [("user", "hello")], temperature=0.0, max_tokens=4,
                       ignore_eos=True)
    assert expected and expected.encode() in first.replace(b"\r\n", b"\n")
    assert "hello" in (tmp_path / "chat_history").read_text()
    assert_pools_clean(chat_deployment)


def test_ctrl_c_during_generate_is_one_line_and_status_130(
        chat_deployment: Deployment) -> None:
    """No KeyboardInterrupt traceback; the call is cancelled, so its
    blocks come back."""
    import signal

    proc = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "generate", "--address",
         chat_deployment.router_address, "--max-tokens", "3000", "--temperature", "0",
         "--ignore-eos", "The quick brown fox"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ,
                                                             "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout is not None and proc.stdout.read(20)  # the answer streams
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert err.decode().strip().splitlines() == ["kvferry: interrupted"]
    assert_pools_clean(chat_deployment)
