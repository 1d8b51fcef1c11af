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


def usage(dones: list[DoneEvent]) -> dict[str, object]:
    """A request's usage from its samples' DoneEvents: the prompt once, every sample's
    completion tokens."""
    first = dones[0]
    completion = sum(d.completion_tokens for d in dones)
    return {"prompt_tokens": first.prompt_tokens, "completion_tokens": completion,
            "total_tokens": first.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": first.cached_prompt_tokens}}


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
                content_key: str | None, index: int = 0) -> dict[str, object]:
        """A text completion's choice, or a chat one whose content sits under `content_key`
        ("message" or "delta"); `index`: the sample's."""
        choice: dict[str, object] = {"index": index}
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

    def role_event(self, index: int = 0) -> str:
        """A chat stream's first event for a choice: the assistant's role, no content yet."""
        return self._event([{"index": index, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}])

    def chunk_event(self, text: str, token_ids: list[int],
                    finish: FinishReason | None = None, index: int = 0) -> str:
        key = "delta" if self.is_chat else None
        return self._event([self._choice(text, token_ids, finish, key, index)])

    def usage_event(self, dones: list[DoneEvent]) -> str:
        """The last event before [DONE] when the client asked for usage: no choices."""
        return self._event([], usage=usage(dones))

    # ---- one body -----------------------------------------------------------------------
    def body(self, texts: list[str], token_ids: list[list[int]], dones: list[DoneEvent]
             ) -> str:
        """Every sample's choice, by index (`dones` in any order)."""
        kind = "chat.completion" if self.is_chat else "text_completion"
        key = "message" if self.is_chat else None
        choices = [self._choice(texts[d.sample_index], token_ids[d.sample_index], d.reason, key,
                                d.sample_index)
                   for d in sorted(dones, key=lambda d: d.sample_index)]
        return _json(self._envelope(kind, choices, usage=usage(dones)))
