"""`kvferry bench` against any OpenAI-compatible server: the openai-chat and
openai-completions backends, with vLLM `bench serve`'s semantics.

Each request is one streamed POST to {base}/chat/completions or {base}/completions
(deploy/loadgen/openai_stream.py: the body, and which chunks count as content), timed on the
runner's clock with the gRPC backend's definitions (deploy/loadgen/metrics.py), so runs of
different backends compare in one table and one plot. Token counts: the server's `usage`
(prompt_tokens, completion_tokens, prompt_tokens_details.cached_tokens) when it sends it; else
the prompt's known length, and the answer's token ids (streamed, or its text tokenized with
--tokenizer), else its content chunks. K/V byte counts exist only over gRPC (0 here).

Failures become records: HTTP_<code> (a 4xx/5xx answer, with its OpenAI error message),
STREAM_ERROR (an error object inside the stream), INCOMPLETE (the stream ended, or the
connection dropped, before `data: [DONE]`; or no content chunk came), BAD_RESPONSE (a chunk
that is not a JSON object), UNAVAILABLE (no connection), DEADLINE_EXCEEDED (--timeout-s).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from deploy.loadgen.metrics import OK, RequestRecord
from deploy.loadgen.openai_stream import (
    Answer,
    ConnectionLost,
    StreamState,
    Unreachable,
    error_message,
    read_stream,
    request_body,
)
from deploy.loadgen.runner import Clock, SendOptions
from deploy.loadgen.workload import BenchRequest, Conversation

if TYPE_CHECKING:  # imported where used: every command's parser imports this module, and
    import aiohttp  # aiohttp takes 0.25 s to import (only `kvferry bench` needs it)

BACKENDS = ("grpc", "openai-chat", "openai-completions")
OPENAI_BACKENDS = BACKENDS[1:]
_PATHS = {"openai-chat": "/chat/completions", "openai-completions": "/completions"}
CONNECT_TIMEOUT_S = 30.0
MAX_LINE_BYTES = 1 << 24  # one SSE line (a chunk, or a whole answer's token ids)
# POST url, JSON body, headers -> the answer, open while the context is (tests fake it).
Post = Callable[[str, dict[str, Any], dict[str, str]], AbstractAsyncContextManager[Answer]]


def api_root(base_url: str) -> str:
    """The API root requests are sent under: the URL as given (".../v1", as the openai client
    takes it), with "/v1" added to a bare http(s)://HOST:PORT."""
    url = base_url.rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"base URL: expected http(s)://HOST:PORT[/PATH], got {base_url!r}")
    return url if parts.path else url + "/v1"


@dataclass(frozen=True)
class Codec:
    """A tokenizer: token ids to text (chat prompts) and text to token ids (answers)."""

    path: Path
    tokenizer: Any = field(repr=False, compare=False)

    @staticmethod
    def load(path: Path) -> Codec:
        from tokenizers import Tokenizer

        file = path / "tokenizer.json" if path.is_dir() else path
        return Codec(path, Tokenizer.from_file(str(file)))

    @property
    def vocab_size(self) -> int:
        """The base vocabulary (no added special tokens): safe random prompt ids."""
        return int(self.tokenizer.get_vocab_size(with_added_tokens=False))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))


def check_workload(backend: str, items: Sequence[BenchRequest] | Sequence[Conversation],
                   codec: Codec | None) -> None:
    """Refuse, before sending, what this backend cannot send without a tokenizer."""
    if backend not in OPENAI_BACKENDS or codec is not None or not items:
        return
    if isinstance(items[0], Conversation):
        raise ValueError(f"{backend}: multi-turn needs --tokenizer (each answer's text is "
                         "tokenized into the next turn's prompt): the served model's "
                         "directory, the --model given to `kvferry serve`")
    if backend == "openai-chat" and any(not isinstance(r.prompt, str) for r in items):
        raise ValueError("openai-chat sends text: token-id prompts need --tokenizer to be "
                         "decoded (the served model's directory, the --model given to "
                         "`kvferry serve`), or use --backend openai-completions, which sends "
                         "the ids")


def aiohttp_post(session: aiohttp.ClientSession) -> Post:
    """`Post` over one aiohttp session. aiohttp, as vLLM's `bench serve` uses: its C HTTP
    parser costs the client about half the CPU per streamed chunk that httpx's pure-Python
    stack did here, CPU the measured server shares on a small machine."""
    import aiohttp

    @asynccontextmanager
    async def post(url: str, body: dict[str, Any], headers: dict[str, str]
                   ) -> AsyncIterator[Answer]:
        try:
            async with session.post(url, json=body, headers=headers) as response:
                yield Answer(response.status, _lines(response), response.read)
        except aiohttp.ClientConnectorError as exc:
            raise Unreachable(str(exc) or type(exc).__name__) from exc
        except aiohttp.ClientError as exc:  # dropped before the answer's headers
            raise ConnectionLost(str(exc) or type(exc).__name__) from exc

    return post


async def _lines(response: aiohttp.ClientResponse) -> AsyncIterator[str]:
    import aiohttp

    try:
        async for line in response.content:
            yield line.decode("utf-8", "replace").rstrip("\r\n")
    except (aiohttp.ClientError, ValueError) as exc:  # dropped mid-stream; a line too long
        raise ConnectionLost(str(exc) or type(exc).__name__) from exc


@dataclass(frozen=True)
class OpenAISender:
    """The openai-chat / openai-completions backend over one `Post` (runner.Sender)."""

    post: Post
    backend: str
    root: str  # api_root(base URL)
    model: str  # the `model` every request names
    codec: Codec | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every body

    async def send(self, request: BenchRequest, request_id: str, index: int,
                   options: SendOptions, clock: Clock, origin_s: float,
                   answer: list[int] | None = None) -> RequestRecord:
        body = request_body(self.backend, self.model, request, options, index, self.codec)
        body.update(self.extra_body)
        start = clock()
        stream = StreamState(start, start)
        try:
            async with asyncio.timeout(options.timeout_s):
                status, error = await self._post(body, request_id, stream, clock)
        except TimeoutError:
            status, error = "DEADLINE_EXCEEDED", f"no answer within {options.timeout_s} s"
        except Unreachable as exc:
            status, error = "UNAVAILABLE", f"{self.root}: {exc}"
        except ConnectionLost as exc:  # the connection dropped mid-stream
            status, error = "INCOMPLETE", f"connection lost: {exc}"
        if status == OK and stream.num_chunks == 0:
            status, error = "INCOMPLETE", "no content chunk came (TTFT undefined)"
        usage = stream.usage
        ids = self._answer_ids(stream, need=answer is not None or "completion_tokens" not in usage)
        if answer is not None:
            answer.extend(ids)
        details = usage.get("prompt_tokens_details") or {}
        served = int(usage.get("prompt_tokens") or request.prompt_len or 0)
        # a chat request's prompt is the tokens asked for plus the template the server adds
        asked = request.prompt_len if self.backend == "openai-chat" and request.prompt_len \
            and served > request.prompt_len else served
        return RequestRecord(
            prompt_len=asked, template_tokens=served - asked,
            output_len=int(usage.get("completion_tokens") or len(ids) or stream.num_chunks),
            start_s=start - origin_s, ttft_s=stream.ttft, itls_s=tuple(stream.itls),
            latency_s=stream.last - start, status=status, error=error, tag=request.tag,
            cached_prompt_tokens=int(details.get("cached_tokens") or 0),
            cache_reported="cached_tokens" in details)

    async def _post(self, body: dict[str, Any], request_id: str, stream: StreamState,
                    clock: Clock) -> tuple[str, str]:
        url = self.root + _PATHS[self.backend]
        async with self.post(url, body, {"X-Request-Id": request_id}) as response:
            if response.status >= 400:
                return f"HTTP_{response.status}", error_message(await response.read())
            return await read_stream(response.lines, stream, clock)

    def _answer_ids(self, stream: StreamState, need: bool) -> list[int]:
        """The generated token ids: as streamed, else the text tokenized (when needed)."""
        if stream.token_ids or not need or self.codec is None:
            return stream.token_ids
        return self.codec.encode("".join(stream.texts))


async def served_model(session: aiohttp.ClientSession, root: str) -> str:
    """The first model GET {root}/models lists (what `model` names when not given)."""
    import aiohttp

    try:
        async with session.get(root + "/models") as response:
            if response.status == 401:
                raise ValueError(f"{root}/models: 401 Unauthorized: the server wants an API "
                                 "key; set $OPENAI_API_KEY to it")
            response.raise_for_status()
            return str(json.loads(await response.read())["data"][0]["id"])
    except (aiohttp.ClientError, KeyError, IndexError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{root}/models: cannot read the served model ({exc}); give "
                         "--served-model-name") from exc


@asynccontextmanager
async def open_sender(base_url: str, backend: str, model: str | None = None,
                      codec: Codec | None = None, extra_body: dict[str, Any] | None = None
                      ) -> AsyncIterator[OpenAISender]:
    """A sender for one server, its connections pooled without limit (the load sets the
    concurrency); OPENAI_API_KEY, when set, is sent as the bearer token."""
    import aiohttp

    if backend not in OPENAI_BACKENDS:
        raise ValueError(f"backend: expected one of {OPENAI_BACKENDS}, got {backend!r}")
    root = api_root(base_url)
    key = os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0),
                                     read_bufsize=MAX_LINE_BYTES) as session:
        yield OpenAISender(aiohttp_post(session), backend, root,
                           model or await served_model(session, root), codec,
                           dict(extra_body or {}))
