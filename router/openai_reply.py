"""The OpenAI API's response bodies, written from the router engine's events: one JSON body
(`chat.completion`, `text_completion`), or server-sent events (`data: {...}` chunks, then
`data: [DONE]`), and error objects. Text only: the HTTP front sends what this returns."""

from __future__ import annotations

import json
import time

from kvferry.model.sampling import FinishReason
from router.events import DoneEvent

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


def usage(done: DoneEvent) -> dict[str, object]:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_prompt_tokens}}


class Reply:
    """How one request's answer is written, chat or text completion, streamed or whole."""

    def __init__(self, request_id: str, model: str, is_chat: bool, include_usage: bool,
                 return_token_ids: bool) -> None:
        self.request_id = request_id
        self.model = model
        self.is_chat = is_chat
        self.include_usage = include_usage  # streams: chunks carry "usage": null, then one
        self.return_token_ids = return_token_ids
        self.created = int(time.time())

    def _envelope(self, kind: str, choices: list[dict[str, object]],
                  **more: object) -> dict[str, object]:
        return {"id": self.request_id, "object": kind, "created": self.created,
                "model": self.model, "choices": choices, **more}

    def _choice(self, text: str, token_ids: list[int], finish: FinishReason | None,
                content_key: str | None) -> dict[str, object]:
        """A text completion's choice, or a chat one whose content sits under `content_key`
        ("message" or "delta")."""
        choice: dict[str, object] = {"index": 0}
        if content_key is None:
            choice["text"] = text
        elif content_key == "message":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["delta"] = {"content": text} if text or token_ids or finish is None else {}
        choice["logprobs"] = None
        choice["finish_reason"] = None if finish is None else FINISH_REASONS[finish]
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    # ---- a stream -----------------------------------------------------------------------
    def _event(self, choices: list[dict[str, object]], **more: object) -> str:
        kind = "chat.completion.chunk" if self.is_chat else "text_completion"
        if self.include_usage:
            more.setdefault("usage", None)
        return f"data: {_json(self._envelope(kind, choices, **more))}\n\n"

    def role_event(self) -> str:
        """A chat stream's first event: the assistant's role, no content yet."""
        return self._event([{"index": 0, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}])

    def chunk_event(self, text: str, token_ids: list[int],
                    finish: FinishReason | None = None) -> str:
        key = "delta" if self.is_chat else None
        return self._event([self._choice(text, token_ids, finish, key)])

    def usage_event(self, done: DoneEvent) -> str:
        """The last event before [DONE] when the client asked for usage: no choices."""
        return self._event([], usage=usage(done))

    # ---- one body -----------------------------------------------------------------------
    def body(self, text: str, token_ids: list[int], done: DoneEvent) -> str:
        kind = "chat.completion" if self.is_chat else "text_completion"
        choice = self._choice(text, token_ids, done.reason, "message" if self.is_chat else None)
        return _json(self._envelope(kind, [choice], usage=usage(done)))
