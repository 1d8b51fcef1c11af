"""The OpenAI API's response bodies, written from the router engine's events: one JSON body
(`chat.completion`, `text_completion`), or server-sent events (`data: {...}` chunks, then
`data: [DONE]`), and error objects, with the `logprobs` of each choice in the chat shape
(`content`) or the text completion's legacy one. Text only: the HTTP front sends what this
returns."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field

from kvferry.model.logprobs import TokenLogprob
from kvferry.model.sampling import FinishReason
from router.events import ChunkEvent, DoneEvent
from router.http.structured import ToolUse

SSE_DONE = "data: [DONE]\n\n"
FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
                  FinishReason.ABORT: "abort"}


def _json(body: object) -> str:
    return json.dumps(body, separators=(",", ":"))


def error_json(message: str, kind: str, param: str | None, code: str | None) -> str:
    """An OpenAI error object: {"error": {"message", "type", "param", "code"}}."""
    return _json({"error": {"message": message, "type": kind, "param": param, "code": code}})


def model_list_json(model: str, max_model_len: int) -> str:
    """GET /v1/models: the one model served."""
    card = {"id": model, "object": "model", "created": int(time.time()), "owned_by": "kvferry",
            "max_model_len": max_model_len}
    return _json({"object": "list", "data": [card]})


def usage(dones: list[DoneEvent], n: int = 1) -> dict[str, object]:
    """A request's usage from its samples' DoneEvents (choice i * n + j: prompt i's sample
    j): each prompt once, every sample's completion tokens."""
    firsts = [d for d in dones if d.sample_index % n == 0]
    prompt = sum(d.prompt_tokens for d in firsts)
    completion = sum(d.completion_tokens for d in dones)
    counts: dict[str, object] = {"prompt_tokens": prompt, "completion_tokens": completion,
                                 "total_tokens": prompt + completion}
    if dones[0].details:  # else unknown: left out, as vLLM leaves it
        counts["prompt_tokens_details"] = {"cached_tokens": sum(d.cached_prompt_tokens
                                                                for d in firsts)}
    return counts


class TokenNames:
    """Token ids as the API's logprobs name them: each token's text on its own (a piece of a
    character decodes to U+FFFD, as vLLM reports it)."""

    def __init__(self, tokenizer: object) -> None:
        self._tokenizer = tokenizer
        self._names: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        name = self._names.get(token_id)
        if name is None:
            name = self._tokenizer.decode([token_id])  # type: ignore[attr-defined]
            if len(self._names) < 1 << 16:
                self._names[token_id] = name
        return name


@dataclass(frozen=True)
class Echo:
    """A text completion's prompt, repeated before its completion (`echo`): its text, and
    its tokens (named with their log probabilities when the client asked for those)."""

    text: str
    token_ids: list[int]


@dataclass
class ChoiceSoFar:
    """What a sample's events carried so far (a whole answer is written from it)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()

    def add(self, event: ChunkEvent) -> None:
        self.text += event.text
        self.token_ids += event.token_ids
        self.logprobs += event.logprobs
        self.prompt_logprobs = self.prompt_logprobs or event.prompt_logprobs


class Reply:
    """How one request's answer is written, chat or text completion, streamed or whole;
    with `names` (the client asked for logprobs) each choice's log probabilities; with
    `echoes` (one per prompt) a text completion's prompt before it. Choice i * n + j is
    prompt i's sample j."""

    def __init__(self, request_id: str, model: str, is_chat: bool, include_usage: bool,
                 return_token_ids: bool, names: TokenNames | None = None,
                 echoes: list[Echo] | None = None, n: int = 1,
                 tools: ToolUse | None = None) -> None:
        self.request_id = request_id
        self.model = model
        self.is_chat = is_chat
        self.include_usage = include_usage  # streams: chunks carry "usage": null, then one
        self.return_token_ids = return_token_ids
        self.names = names
        self.echoes = echoes or []
        self.n = n
        self.tools = tools  # chat with tools in play: answers read for tool calls
        self.created = int(time.time())
        self._echoed: set[int] = set()  # streamed choices whose prompt went out already
        self._offsets: dict[int, int] = {}  # each choice's text offset past its last token

    def _envelope(self, kind: str, choices: list[dict[str, object]],
                  **more: object) -> dict[str, object]:
        return {"id": self.request_id, "object": kind, "created": self.created,
                "model": self.model, "choices": choices, **more}

    def _choice(self, so_far: ChoiceSoFar, finish: FinishReason | None,
                content_key: str | None, index: int = 0) -> dict[str, object]:
        """A text completion's choice, or a chat one whose content sits under `content_key`
        ("message" or "delta"); `index`: the sample's. `so_far`: its tokens (of this chunk,
        streaming)."""
        choice: dict[str, object] = {"index": index}
        text, finish_reason = so_far.text, None
        if content_key is None:
            choice["text"] = text
        elif content_key == "message" and self.tools is not None:
            choice["message"], finish_reason = self._tool_message(text, finish)
        elif content_key == "message":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["delta"] = ({"content": text} if text or so_far.token_ids or finish is None
                               else {})
        choice["logprobs"] = self._logprobs(so_far, index)
        choice["finish_reason"] = (finish_reason if finish_reason is not None
                                   else None if finish is None else FINISH_REASONS[finish])
        if self.return_token_ids:
            choice["token_ids"] = so_far.token_ids
        return choice

    def _tool_message(self, text: str, finish: FinishReason | None
                      ) -> tuple[dict[str, object], str | None]:
        """A chat answer read for tool calls (`self.tools`): the message with its content
        and `tool_calls`, and "tool_calls" as the finish reason when it made any."""
        assert self.tools is not None  # noqa: S101 - the caller checked
        content, calls = self.tools.parse(text)
        message: dict[str, object] = {"role": "assistant", "content": content}
        if not calls:
            return message, None
        message["tool_calls"] = [call.as_json() for call in calls]
        return message, "tool_calls" if finish is FinishReason.STOP else None

    def tool_event(self, so_far: ChoiceSoFar, finish: FinishReason, index: int) -> str:
        """A chat stream's answer for a choice with tools in play, whole as it ends (its text
        is held back until it can be read for calls): content and `tool_calls` in one
        delta, with the finish reason."""
        message, reason = self._tool_message(so_far.text, finish)
        delta = {k: v for k, v in message.items() if k != "role" and v is not None}
        if "tool_calls" in delta:
            delta["tool_calls"] = [{"index": i, **call} for i, call in  # type: ignore[dict-item]
                                   enumerate(delta["tool_calls"])]  # type: ignore[arg-type]
        return self._event([{"index": index, "delta": delta,
                             "logprobs": self._logprobs(so_far, index),
                             "finish_reason": reason or FINISH_REASONS[finish]}])

    def _logprobs(self, so_far: ChoiceSoFar, index: int) -> dict[str, object] | None:
        names = self.names
        if names is None or not (so_far.token_ids or so_far.prompt_logprobs):
            return None
        if self.is_chat:
            return {"content": [_chat_logprob(names, t, lp)
                                for t, lp in zip(so_far.token_ids, so_far.logprobs)]}
        ids: list[int] = list(so_far.token_ids)
        lps: list[TokenLogprob | None] = list(so_far.logprobs)
        echo = self._echo(index)
        if index not in self._offsets:  # its first tokens: after the echoed prompt, if any
            self._offsets[index] = 0 if echo is None else len(echo.text)
        if echo is not None and so_far.prompt_logprobs:  # the prompt's first has none
            ids = [*echo.token_ids, *ids]
            lps = [None, *so_far.prompt_logprobs, *lps]
            self._offsets[index] = 0
        logprobs = _completion_logprobs(names, ids, lps, self._offsets[index])
        self._offsets[index] += sum(len(t) for t in logprobs["tokens"])  # type: ignore[attr-defined]
        return logprobs

    def _echo(self, index: int) -> Echo | None:
        """What choice `index` echoes (its prompt's), if anything."""
        return self.echoes[index // self.n] if self.echoes else None

    def _echoing(self, so_far: ChoiceSoFar, index: int) -> ChoiceSoFar:
        """`so_far` with the prompt's text before it, the first time a choice is written."""
        echo = self._echo(index)
        if echo is None or index in self._echoed:
            return so_far
        self._echoed.add(index)
        return dataclasses.replace(so_far, text=echo.text + so_far.text)

    # ---- a stream -----------------------------------------------------------------------
    def _event(self, choices: list[dict[str, object]], **more: object) -> str:
        kind = "chat.completion.chunk" if self.is_chat else "text_completion"
        if self.include_usage:
            more.setdefault("usage", None)
        return f"data: {_json(self._envelope(kind, choices, **more))}\n\n"

    def role_event(self, index: int = 0) -> str:
        """A chat stream's first event for a choice: the assistant's role, no content yet."""
        return self._event([{"index": index, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}])

    def chunk_event(self, event: ChunkEvent | None, finish: FinishReason | None = None,
                    index: int = 0) -> str:
        """One chunk's event (None: a choice's closing one, with its finish reason)."""
        so_far = ChoiceSoFar()
        if event is not None:
            so_far.add(event)
            index = event.sample_index
        key = "delta" if self.is_chat else None
        return self._event([self._choice(self._echoing(so_far, index), finish, key, index)])

    def usage_event(self, dones: list[DoneEvent]) -> str:
        """The last event before [DONE] when the client asked for usage: no choices."""
        return self._event([], usage=usage(dones, self.n))

    # ---- one body -----------------------------------------------------------------------
    def body(self, choices: list[ChoiceSoFar], dones: list[DoneEvent]) -> str:
        """Every sample's choice, by index (`dones` in any order)."""
        kind = "chat.completion" if self.is_chat else "text_completion"
        key = "message" if self.is_chat else None
        written = [self._choice(self._echoing(choices[d.sample_index], d.sample_index),
                                d.reason, key, d.sample_index)
                   for d in sorted(dones, key=lambda d: d.sample_index)]
        return _json(self._envelope(kind, written, usage=usage(dones, self.n)))


def _chat_logprob(names: TokenNames, token_id: int, lp: TokenLogprob) -> dict[str, object]:
    """A chat choice's entry for one token (OpenAI's `logprobs.content[i]`)."""
    def entry(tid: int, value: float) -> dict[str, object]:
        name = names(tid)
        return {"token": name, "logprob": value, "bytes": list(name.encode())}

    return {**entry(token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}


def _completion_logprobs(names: TokenNames, ids: list[int], lps: list[TokenLogprob | None],
                         offset: int) -> dict[str, object]:
    """A text completion's `logprobs` (the legacy shape lm-evaluation-harness reads): each
    token's name, log probability, most likely tokens (the token itself among them, as vLLM
    gives them) and character offset in the choice's text (from `offset`)."""
    tokens = [names(t) for t in ids]
    text_offset = []
    for token in tokens:
        text_offset.append(offset)
        offset += len(token)
    top: list[dict[str, float] | None] = []
    for token_id, lp in zip(ids, lps):
        top.append(None if lp is None else
                   {**{names(t): v for t, v in lp.top}, names(token_id): lp.logprob})
    return {"tokens": tokens, "token_logprobs": [None if lp is None else lp.logprob
                                                 for lp in lps],
            "top_logprobs": top, "text_offset": text_offset}
