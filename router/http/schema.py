"""The OpenAI API's request bodies, as the HTTP front parses them (pydantic models), and their
translation into the router engine's own input, `router.request.GenerateInput`.

Only types are checked here. Values go through the router's validation, the same as a gRPC
Generate's, whose refusals name proto fields (`sampling.max_tokens`, `input.messages[1].role`);
`OpenAIRequest.param` names the parameter the client sent instead (`max_tokens`,
`messages[1].role`). kvferry's own parameters ride along as extra body fields under vLLM's
names (`top_k`, `ignore_eos`, `stop_token_ids`, `cache_salt`, `return_token_ids`), and
`kv_eviction` ("none": this request keeps all its K/V under a deployment's --kv-eviction); fields of
the API that kvferry does not serve are refused when set to anything that would change the
result (`UNSERVED`), and unknown ones are ignored, as vLLM does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from kvferry.errors import InvalidArgument
from kvferry.model.grammar import Constraint
from kvferry.model.identity import served_model_name  # noqa: F401 - the API's model id
from kvferry.model.sampling import SamplingParams
from kvferry.settings.sampling import KVFERRY_DEFAULTS, SamplingDefaults
from router.http.reply import Echo
from router.http.structured import (
    NamedToolChoice,
    ResponseFormat,
    StructuredOutputs,
    Tool,
    ToolUse,
    guided_constraint,
    response_format_constraint,
    structured_constraint,
    tool_constraint,
    tools_prompt,
)
from router.request import ChatMessage, GenerateInput

# Parameters refused unless neutral (absent, null, false, 0, empty, or the value listed).
UNSERVED: dict[str, object] = {
    "echo": None, "top_logprobs": None, "suffix": None, "best_of": 1,
    "min_tokens": None, "functions": None,
}
GUIDED = (("guided_json", "json_schema"), ("guided_regex", "regex"),
          ("guided_choice", "choice"), ("guided_grammar", "grammar"))


class StreamOptions(BaseModel):
    include_usage: bool = False  # one last chunk with `usage` and no choices


class OpenAIRequest(BaseModel):
    """What chat and text completions share."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None  # None: the served model
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    user: str | None = None  # accepted, unused
    # kvferry's own, under vLLM's names
    top_k: int | None = None  # 0 or -1: off
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    cache_salt: str | None = None  # prefix-cache namespace (kvferry/cache/prefix.py)
    return_token_ids: bool = False  # each choice also carries its `token_ids`
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extra
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> added to its logit
    kv_eviction: str = ""  # "none": every token of this request kept (sampling.kv_eviction)
    # Structured output (router/http/structured.py): at most one of these
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    guided_json: dict[str, Any] | str | None = None  # vLLM's older extras
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # max_tokens when the body sets none (None: the router's, 256), before the context's cap
    default_max_tokens: ClassVar[int | None] = None

    def to_inputs(self, request_id: str, defaults: SamplingDefaults = KVFERRY_DEFAULTS
                  ) -> list[GenerateInput]:
        """The router engine's input for each prompt of the body."""
        raise NotImplementedError

    def to_input(self, request_id: str, defaults: SamplingDefaults = KVFERRY_DEFAULTS
                 ) -> GenerateInput:
        """The input of a body of one prompt."""
        (one,) = self.to_inputs(request_id, defaults)
        return one

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens"

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def param(self, field: str) -> str:
        """The API parameter a kvferry field name stands for (itself when it is one)."""
        if field.startswith("sampling.constraint"):
            given = [name for name, _ in self._constraints()]
            return given[0] if given else "response_format"
        if field.startswith("sampling."):
            name = field.removeprefix("sampling.")
            return self.max_tokens_param if name == "max_tokens" else name
        return field

    def _check_served(self) -> None:
        for name, value in (self.model_extra or {}).items():
            neutral = UNSERVED.get(name, value)
            if value not in (None, False, 0, "", [], {}, neutral):
                raise InvalidArgument(f"{name}: not supported by kvferry", name)

    def _logprobs(self) -> tuple[int | None, int | None]:
        """SamplingParams' (logprobs, prompt_logprobs) as this endpoint's parameters ask."""
        return None, None

    def _constraints(self) -> list[tuple[str, Constraint | None]]:
        """Each parameter given that may constrain the output, and its constraint."""
        given: list[tuple[str, Constraint | None]] = []
        if self.response_format is not None:
            given.append(("response_format", response_format_constraint(self.response_format)))
        if self.structured_outputs is not None:
            given.append(("structured_outputs", structured_constraint(
                self.structured_outputs, "structured_outputs")))
        for name, kind in GUIDED:
            value = getattr(self, name)
            if value is not None:
                given.append((name, guided_constraint(kind, value)))
        return given

    def _constraint(self) -> Constraint | None:
        """The one constraint the body asks for (None: none)."""
        given = [(name, c) for name, c in self._constraints() if c is not None]
        if len(given) > 1:
            raise InvalidArgument(f"{given[1][0]}: the output is constrained by {given[0][0]} "
                                  "already; give one", given[1][0])
        return given[0][1] if given else None

    def _logit_bias(self) -> tuple[tuple[int, float], ...]:
        """`logit_bias` with its keys as token ids (JSON keys are strings)."""
        bias = []
        for key, value in (self.logit_bias or {}).items():
            try:
                bias.append((int(key), float(value)))
            except ValueError:
                raise InvalidArgument(f"logit_bias: keys are token ids, got {key!r}",
                                      "logit_bias") from None
        return tuple(sorted(bias))

    def _sampling(self, defaults: SamplingDefaults) -> tuple[SamplingParams, bool]:
        """The sampling parameters (unset: the model's `defaults`), and whether max_tokens
        was given."""
        logprobs, prompt_logprobs = self._logprobs()
        max_tokens = self.requested_max_tokens()
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        params = SamplingParams(
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            top_k=defaults.top_k if self.top_k is None else 0 if self.top_k == -1 else self.top_k,
            seed=self.seed, stop=stop, stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, n=self.n, kv_eviction=self.kv_eviction,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=(1.0 if self.repetition_penalty is None
                                else self.repetition_penalty),
            logit_bias=self._logit_bias(), constraint=self._constraint(),
            **({} if max_tokens is None and self.default_max_tokens is None
               else {"max_tokens": self.default_max_tokens if max_tokens is None
                     else max_tokens}),
        )
        return params, max_tokens is not None

    def _input(self, request_id: str, defaults: SamplingDefaults, text: str | None = None,
               token_ids: list[int] | None = None,
               messages: tuple[ChatMessage, ...] | None = None) -> GenerateInput:
        self._check_served()
        params, is_max_tokens_set = self._sampling(defaults)
        return GenerateInput(request_id=request_id, text=text, token_ids=token_ids,
                             messages=messages, params=params,
                             is_max_tokens_set=is_max_tokens_set, cache_salt=self.cache_salt or "")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str  # checked by the router's validation, as gRPC's are
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls

    def _calls(self) -> str:
        """An assistant's earlier tool calls, written back as the model was asked to write
        them (router/http/structured.py)."""
        out = ""
        for call in self.tool_calls or []:
            function = call.get("function") or {}
            arguments = function.get("arguments") or "{}"
            try:
                arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            except ValueError:
                pass  # kept as the text it is
            out += ("\n<tool_call>\n" + json.dumps({"name": function.get("name"),
                                                    "arguments": arguments})
                    + "\n</tool_call>")
        return out

    def text(self, index: int) -> str:
        """The content as one string: text parts joined by newlines (as vLLM joins them)."""
        if self.content is None or isinstance(self.content, str):
            return (self.content or "") + self._calls()
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                field = f"messages[{index}].content[{j}]"
                raise InvalidArgument(f"{field}: only text parts are served, got "
                                      f"{part.type!r}", field)
        return "\n".join(part.text or "" for part in self.content)


class ChatCompletionRequest(OpenAIRequest):
    """POST /v1/chat/completions."""

    messages: list[Message]
    max_completion_tokens: int | None = None  # the newer name; wins over max_tokens
    logprobs: bool = False  # each token's log probability (choices[].logprobs.content)
    top_logprobs: int | None = None  # and this many most likely tokens at it (needs logprobs)
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None  # default: auto with tools, else none
    parallel_tool_calls: bool = True  # false: one call at most

    def _constraints(self) -> list[tuple[str, Constraint | None]]:
        constraint, _ = tool_constraint(self.tools or [], self.tool_choice,
                                        self.parallel_tool_calls)
        return [*super()._constraints(), *([("tools", constraint)] if constraint else [])]

    def tool_use(self) -> ToolUse | None:
        """How the answer is read for tool calls (None: it is not)."""
        return tool_constraint(self.tools or [], self.tool_choice)[1]

    def _logprobs(self) -> tuple[int | None, int | None]:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidArgument("top_logprobs: needs logprobs set to true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None, None

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def param(self, field: str) -> str:
        if field.startswith("input.messages"):  # input.messages[1].role, ...
            return "messages" + field.removeprefix("input.messages")
        if field.startswith("input"):  # the prompt as a whole
            return "messages"
        if field == "sampling.logprobs":
            return "top_logprobs"
        return super().param(field)

    def to_inputs(self, request_id: str, defaults: SamplingDefaults = KVFERRY_DEFAULTS
                  ) -> list[GenerateInput]:
        messages = tuple(ChatMessage(m.role, m.text(i)) for i, m in enumerate(self.messages))
        if self.tools and self.tool_use() is not None:  # offered in a system message
            offer = tools_prompt(self.tools)
            if messages and messages[0].role in ("system", "developer"):
                messages = (ChatMessage("system", f"{messages[0].content}\n\n{offer}"),
                            *messages[1:])
            else:
                messages = (ChatMessage("system", offer), *messages)
        return [self._input(request_id, defaults, messages=messages)]


class CompletionRequest(OpenAIRequest):
    """POST /v1/completions. `prompt` is text or token ids, or a list of prompts (a batch:
    one choice per prompt and sample, router/http/batch.py)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    # each token's log probability and this many most likely tokens at it (the legacy
    # choices[].logprobs); with `echo`, the prompt's tokens' too
    logprobs: int | None = None
    echo: bool = False  # the prompt repeated before each choice's text
    default_max_tokens: ClassVar[int | None] = 16  # OpenAI's and vLLM's

    def _logprobs(self) -> tuple[int | None, int | None]:
        return self.logprobs, self.logprobs if self.echo else None

    def echo_of(self, prompt_ids: list[list[int]], tokenizer: object) -> list[Echo]:
        """What `echo` repeats of each prompt: its text (decoded, for token ids) and tokens."""
        if not self.echo:
            return []
        return [Echo(prompt if isinstance(prompt, str)
                     else tokenizer.decode(ids), ids)  # type: ignore[attr-defined]
                for prompt, ids in zip(self.prompts(), prompt_ids)]

    def param(self, field: str) -> str:
        if field.startswith("input"):  # input, input.text, input.token_ids
            return "prompt"  # (in a batch, the prompt named in the message)
        if field == "sampling.prompt_logprobs":
            return "logprobs"
        return super().param(field)

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each text or token ids: one, or a batch (a list of either)."""
        prompt = self.prompt
        if prompt and not isinstance(prompt, str) and not isinstance(prompt[0], int):
            return list(prompt)  # type: ignore[arg-type]
        return [prompt]  # type: ignore[list-item]

    def to_inputs(self, request_id: str, defaults: SamplingDefaults = KVFERRY_DEFAULTS
                  ) -> list[GenerateInput]:
        """One input per prompt (request ids `<id>-<i>` for a batch of several)."""
        prompts = self.prompts()
        inputs = []
        for i, prompt in enumerate(prompts):
            one = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            inputs.append(self._input(one, defaults, text=prompt) if isinstance(prompt, str)
                          else self._input(one, defaults, token_ids=list(prompt)))
        return inputs


def _is_union_tag(part: str) -> bool:
    """pydantic names the member of a union it tried ('str', 'list[int]', 'ContentPart')."""
    return part in ("str", "int", "float", "bool") or "[" in part or part[:1].isupper()


def body_error(errors: Sequence[Any]) -> tuple[str | None, str]:
    """The parameter and message of the first error pydantic found in a body (its type or
    shape: values are the router's to check); no parameter for a body that is not JSON."""
    error = errors[0]
    loc = [part for part in error.get("loc", ())
           if not (isinstance(part, str) and _is_union_tag(part))]
    loc = loc[1:] if loc[:1] == ["body"] else loc  # FastAPI's, where the error was found
    if error.get("type") == "json_invalid" or not loc or not isinstance(loc[0], str):
        return None, f"the body is not valid JSON: {error.get('ctx', {}).get('error', '')}"
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    return param, f"{param}: {error.get('msg', 'invalid')}"
