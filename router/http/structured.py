"""Structured output and tools on the OpenAI API: the parameters that ask for a constraint
(`response_format`, vLLM's `structured_outputs` and older `guided_*` extras, `tools` with
`tool_choice`), turned into one `Constraint` (kvferry/model/grammar.py), and a tool call's
answer parsed back into `tool_calls`.

Tools, by `tool_choice` (default `auto` when tools are given, as OpenAI's):
- `none`: no tool is offered or called.
- `required`: the answer is constrained to a JSON array of one or more calls (one with
  `parallel_tool_calls: false`), each `{"name": <a tool's name>, "arguments": <that tool's
  parameters>}`.
- a named function: the answer is constrained to that tool's parameters (its arguments).
- `auto`: unconstrained; calls the model writes as `<tool_call>{"name": ..., "arguments":
  ...}</tool_call>` (the Hermes format Qwen, SmolLM and others are trained on) are parsed
  out of the text, the rest stays content.
Whatever the chat template, the tools are described to the model in a system message
(merged into the first one if the conversation has one), with that format.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kvferry.errors import InvalidArgument
from kvferry.model.grammar import Constraint


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`response_format`: {"type": "text" | "json_object" | "json_schema", "json_schema":
    {"name", "schema", "strict"}}."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` extra: one of these."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDef(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    type: str = "function"
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: str = "function"
    function: NamedFunction


def _schema_text(schema: dict[str, Any] | str) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)


def response_format_constraint(fmt: ResponseFormat) -> Constraint | None:
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint("json_object")
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise InvalidArgument("response_format.json_schema.schema: required for type "
                                  "json_schema", "response_format.json_schema.schema")
        return Constraint("json_schema", json.dumps(fmt.json_schema.json_schema))
    raise InvalidArgument(f"response_format.type: one of text, json_object, json_schema, got "
                          f"{fmt.type!r}", "response_format.type")


def structured_constraint(so: StructuredOutputs, param: str) -> Constraint | None:
    given = [(kind, value) for kind, value in (
        ("json_schema", so.json_), ("regex", so.regex), ("choice", so.choice),
        ("grammar", so.grammar), ("json_object", so.json_object or None)) if value is not None]
    if len(given) > 1:
        raise InvalidArgument(f"{param}: give one of json, regex, choice, grammar, "
                              "json_object", param)
    if not given:
        return None
    return guided_constraint(*given[0])


@dataclass(frozen=True)
class ToolCall:
    """One call the answer makes: the tool's name and its arguments as JSON text."""

    name: str
    arguments: str

    def as_json(self) -> dict[str, object]:
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


_HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolUse:
    """How a chat request's answer is read for tool calls: `mode` "required", "named" (the
    answer is `name`'s arguments) or "auto"."""

    mode: str
    name: str = ""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The answer's content (None when it is only calls) and its calls."""
        if self.mode == "named":
            return None, [ToolCall(self.name, text)]
        if self.mode == "required":
            try:
                calls = json.loads(text)
            except ValueError:  # cut short by max_tokens: what was written, as content
                return text, []
            return None, [ToolCall(c["name"], json.dumps(c["arguments"])) for c in calls]
        calls = []
        for match in _HERMES.finditer(text):
            try:
                call = json.loads(match.group(1))
            except ValueError:
                continue
            if isinstance(call, dict) and isinstance(call.get("name"), str):
                calls.append(ToolCall(call["name"], json.dumps(call.get("arguments", {}))))
        if not calls:
            return text, []
        content = _HERMES.sub("", text).strip()
        return content or None, calls


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object"}


def tool_constraint(tools: list[Tool], choice: str | NamedToolChoice | None,
                    is_parallel: bool = True) -> tuple[Constraint | None, ToolUse | None]:
    """The constraint and the reading of the answer that `tools` and `tool_choice` ask
    (`is_parallel`, OpenAI's parallel_tool_calls: false, one call at most)."""
    if not tools:
        if choice not in (None, "none"):
            raise InvalidArgument("tool_choice: needs tools", "tool_choice")
        return None, None
    if any(t.type != "function" for t in tools):
        raise InvalidArgument("tools: only tools of type 'function' are served", "tools")
    if choice is None or choice == "auto":
        return None, ToolUse("auto")
    if choice == "none":
        return None, None
    if choice == "required":
        calls = [{"type": "object", "properties": {
            "name": {"const": t.function.name}, "arguments": _parameters(t)},
            "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls},
                  **({} if is_parallel else {"maxItems": 1})}
        return Constraint("json_schema", json.dumps(schema)), ToolUse("required")
    if isinstance(choice, str):
        raise InvalidArgument(f"tool_choice: none, auto, required or a named function, got "
                              f"{choice!r}", "tool_choice")
    named = [t for t in tools if t.function.name == choice.function.name]
    if not named:
        raise InvalidArgument(f"tool_choice.function.name: no tool named "
                              f"{choice.function.name!r}", "tool_choice.function.name")
    return (Constraint("json_schema", json.dumps(_parameters(named[0]))),
            ToolUse("named", choice.function.name))


def guided_constraint(kind: str, value: object) -> Constraint:
    """A constraint of `kind` from the value a parameter gave it: vLLM's older extras
    (guided_json: a schema, object or text; guided_regex, guided_choice, guided_grammar) and
    the fields of its `structured_outputs`."""
    if kind == "choice":
        return Constraint("choice", choices=tuple(value))  # type: ignore[arg-type]
    if kind == "json_schema":
        return Constraint(kind, _schema_text(value))  # type: ignore[arg-type]
    if kind == "json_object":
        return Constraint(kind)
    return Constraint(kind, str(value))


def tools_prompt(tools: list[Tool]) -> str:
    """The system message's text that offers `tools` to the model."""
    listed = "\n".join(json.dumps({"type": "function", "function": t.function.model_dump(
        exclude_none=True)}) for t in tools)
    return ("You may call one or more functions to answer. The functions:\n<tools>\n"
            f"{listed}\n</tools>\nFor each call, write a JSON object with the function's "
            "name and arguments inside <tool_call></tool_call> tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
