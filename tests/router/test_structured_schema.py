"""Structured output and tools in OpenAI bodies (router/http/structured.py): each parameter's
constraint, tools offered in a system message, earlier calls written back into the
conversation, and answers read back into tool calls, auto mode's Hermes tags included."""

from __future__ import annotations

import json

import pytest

from kvferry.errors import InvalidArgument
from kvferry.model.grammar import Constraint
from router.http.schema import ChatCompletionRequest, CompletionRequest
from router.http.structured import ToolCall, ToolUse

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}


def _chat(**body: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **body})


@pytest.mark.parametrize("body, constraint", [
    ({"response_format": {"type": "json_object"}}, Constraint("json_object")),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "object"}}}},
     Constraint("json_schema", '{"type": "object"}')),
    ({"guided_choice": ["a", "b"]}, Constraint("choice", choices=("a", "b"))),
    ({"guided_json": '{"type": "integer"}'}, Constraint("json_schema", '{"type": "integer"}')),
    ({"structured_outputs": {"grammar": 'root ::= "x"'}}, Constraint("grammar", 'root ::= "x"')),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     Constraint("json_schema", json.dumps(TOOL["function"]["parameters"]))),  # type: ignore[index]
    ({"tools": [TOOL]}, None),  # auto: unconstrained
])
def test_each_parameter_gives_its_constraint(body: dict, constraint: Constraint | None) -> None:
    assert _chat(**body).to_input("r").params.constraint == constraint


def test_required_is_an_array_of_calls_and_one_without_parallel_calls() -> None:
    for parallel, most in [(True, None), (False, 1)]:
        constraint = _chat(tools=[TOOL], tool_choice="required",
                           parallel_tool_calls=parallel).to_input("r").params.constraint
        assert constraint is not None and constraint.kind == "json_schema"
        schema = json.loads(constraint.spec)
        assert schema["minItems"] == 1 and schema.get("maxItems") == most
        call = schema["items"]["anyOf"][0]["properties"]
        assert call["name"] == {"const": "get_time"}
        assert call["arguments"] == TOOL["function"]["parameters"]  # type: ignore[index]


def test_two_constraints_are_refused_naming_the_second() -> None:
    with pytest.raises(InvalidArgument) as refused:
        _chat(response_format={"type": "json_object"}, guided_regex="a").to_input("r")
    assert refused.value.field == "guided_regex"
    body = CompletionRequest.model_validate({"prompt": "x", "guided_regex": "(("})
    assert body.param("sampling.constraint.regex") == "guided_regex"


def test_tools_are_offered_in_a_system_message_and_earlier_calls_written_back() -> None:
    body = _chat(tools=[TOOL], messages=[
        {"role": "system", "content": "Be brief."}, *USER,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
         "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "content": "12:00", "tool_call_id": "c"}])
    messages = body.to_input("r").messages
    assert messages is not None and messages[0].role == "system"
    assert messages[0].content.startswith("Be brief.") and '"get_time"' in messages[0].content
    assert messages[2].content == ('\n<tool_call>\n{"name": "get_time", "arguments": '
                                   '{"zone": "UTC"}}\n</tool_call>')
    assert messages[3].role == "tool"
    assert _chat(tools=[TOOL], tool_choice="none").to_input("r").messages == tuple(
        _chat().to_input("r").messages or ())


def test_answers_are_read_back_into_calls() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n'
            '</tool_call>\n<tool_call>{"bad json</tool_call>')
    content, calls = ToolUse("auto").parse(text)
    assert calls == [ToolCall("get_time", '{"zone": "CET"}')]
    assert content == 'Let me check.\n\n<tool_call>{"bad json</tool_call>'
    assert ToolUse("auto").parse("plain") == ("plain", [])
    assert ToolUse("named", "f").parse('{"a": 1}') == (None, [ToolCall("f", '{"a": 1}')])
    assert ToolUse("required").parse('[{"name": "f", "arguments": {}}]') == (
        None, [ToolCall("f", "{}")])
    assert ToolUse("required").parse('[{"name": "f", "argu') == ('[{"name": "f", "argu', [])
