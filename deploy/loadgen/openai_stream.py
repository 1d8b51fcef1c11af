"""The OpenAI streaming protocol as `kvferry bench` speaks it: request bodies, server-sent
events, and which chunks count as content (deploy/loadgen/openai_client.py sends them).

Request: `stream: true`, `stream_options.include_usage`, `temperature`, `max_completion_tokens`
(chat) or `max_tokens` (completions), the per-request `seed`, and `ignore_eos` as an extra body
field (vLLM's and kvferry's servers accept it), so every request generates exactly its output
length, as over gRPC. A prompt of token ids goes as is to completions (`prompt: [ids]`); chat
sends text, so token ids are decoded with the tokenizer first.

A content chunk is a streamed choice with a `text` (completions) or `delta.content` (chat)
field, or token ids, other than chat's role announcement and an empty finishing chunk: it
stands for a step of generated tokens, as a gRPC chunk does (the text of a token may be empty,
held back until its UTF-8 character is whole). TTFT is send to the first content chunk, ITL
every gap between content chunks.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from deploy.loadgen.metrics import OK
from deploy.loadgen.runner import Clock, SendOptions
from deploy.loadgen.workload import BenchRequest


class Unreachable(Exception):
    """No connection to the server."""


class ConnectionLost(Exception):
    """The connection dropped before the answer was whole."""


class Answer(NamedTuple):
    """One POST's answer as the HTTP client gives it: its status, then its body as text lines
    (line ends stripped) or whole."""

    status: int
    lines: AsyncIterator[str]
    read: Callable[[], Awaitable[bytes]]


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


def request_body(backend: str, model: str, request: BenchRequest, options: SendOptions,
                 index: int, codec: Decoder | None) -> dict[str, Any]:
    """The JSON body of one streamed request."""
    body: dict[str, Any] = {"model": model, "stream": True,
                            "stream_options": {"include_usage": True},
                            "temperature": options.temperature,
                            "ignore_eos": options.ignore_eos}
    if options.seed is not None:
        body["seed"] = options.seed + index
    if backend == "openai-completions":
        body["prompt"] = request.prompt if isinstance(request.prompt, str) else list(
            request.prompt)
        body["max_tokens"] = request.output_len
        return body
    if isinstance(request.prompt, str):
        text = request.prompt
    elif codec is not None:
        text = codec.decode(list(request.prompt))
    else:
        raise ValueError("openai-chat: a token-id prompt needs a tokenizer")
    body["messages"] = [{"role": "user", "content": text}]
    body["max_completion_tokens"] = request.output_len
    return body


def sse_data(line: str) -> str | None:
    """The payload of an SSE `data:` line; None for blank, comment and other fields."""
    if not line.startswith("data:"):
        return None
    return line[5:].removeprefix(" ").rstrip("\r")


def chunk_content(event: dict[str, Any]) -> tuple[bool, str, list[int]]:
    """(is a content chunk, its text, its token ids) for one streamed JSON object."""
    choices = event.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return False, "", []
    choice = choices[0]
    ids = [int(t) for t in choice.get("token_ids") or []]
    delta = choice.get("delta")
    if isinstance(delta, dict):  # chat
        text = delta.get("content")
        is_role_only = "role" in delta and not text
        has_field = text is not None and not is_role_only
    else:
        text = choice.get("text")
        has_field = text is not None
    text = text or ""
    if choice.get("finish_reason") and not text and not ids:
        return False, "", []
    return bool(ids) or has_field, text, ids


def error_message(body: bytes) -> str:
    """An OpenAI error object's message, else the body's first 200 characters."""
    text = body.decode("utf-8", "replace")
    try:
        data = json.loads(text)
    except ValueError:
        return text[:200]
    error = data.get("error") if isinstance(data, dict) else None
    for holder in (error, data):  # {"error": {"message"}} or vLLM's older {"message"}
        if isinstance(holder, dict) and holder.get("message"):
            return str(holder["message"])
    return text[:200]


@dataclass(slots=True)
class StreamState:
    """What one response stream has shown so far (times from the sender's clock)."""

    start: float
    last: float
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    num_chunks: int = 0
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)
    is_done: bool = False

    def content(self, now: float, text: str, ids: list[int]) -> None:
        if self.num_chunks == 0:
            self.ttft = now - self.start
        else:
            self.itls.append(now - self.last)
        self.last = now
        self.num_chunks += 1
        self.texts.append(text)
        self.token_ids += ids


async def read_stream(lines: AsyncIterator[str], stream: StreamState, clock: Clock
                      ) -> tuple[str, str]:
    """Consume an SSE body's lines into `stream` up to `data: [DONE]`; (status, error), where
    a body that ends before [DONE] is INCOMPLETE and one that is not JSON objects
    BAD_RESPONSE."""
    async for line in lines:
        data = sse_data(line)
        if data is None or not data:
            continue
        if data == "[DONE]":
            stream.is_done = True
            return OK, ""
        try:
            event = json.loads(data)
        except ValueError:
            return "BAD_RESPONSE", f"not JSON: {data[:200]}"
        if not isinstance(event, dict):
            return "BAD_RESPONSE", f"not a JSON object: {data[:200]}"
        if event.get("error") or event.get("object") == "error":
            return "STREAM_ERROR", error_message(data.encode())
        is_content, text, ids = chunk_content(event)
        if is_content:
            stream.content(clock(), text, ids)
        if isinstance(event.get("usage"), dict):
            stream.usage = event["usage"]
    return "INCOMPLETE", "the stream ended before data: [DONE]"
