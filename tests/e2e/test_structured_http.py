"""Structured output and tools through the OpenAI-compatible HTTP API, driven by the official
`openai` client against the chat deployment (one prefill and one decode worker: the prefill
worker masks the first token, the decode worker the rest): a `json_schema` response format
on 20 prompts, each answer valid JSON of the schema and token-exact with gRPC Generate under
the same constraint; `tool_choice: required` and a named function answered with
`tool_calls`, whole and streamed; vLLM's extras; bad schemas refused naming the parameter."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

from deploy import client
from deploy.launcher import Deployment
from kvferry.v1 import generation_pb2
from tests.conftest import assert_pools_clean

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"enum": ["Paris", "Lagos", "Lima"]}},
    "required": ["name", "age", "city"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 16},
    "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description":
                                           "The weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


def _client(deployment: Deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{deployment.http_address}/v1", api_key="unused",
                         max_retries=0)


def _person_format() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                   "strict": True}}


def test_a_json_schema_gives_valid_json_on_20_prompts(chat_deployment: Deployment) -> None:
    api = _client(chat_deployment)
    for i in range(20):
        answer = api.chat.completions.create(
            model=None, messages=[{"role": "user", "content": f"Person number {i}, as JSON."}],  # type: ignore[arg-type]
            temperature=0.0, max_tokens=64, response_format=_person_format())  # type: ignore[arg-type]
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)
    assert_pools_clean(chat_deployment)


def test_the_http_answer_is_grpcs_under_the_same_constraint(chat_deployment: Deployment
                                                            ) -> None:
    messages = [("user", "Describe someone as JSON.")]
    answer = _client(chat_deployment).chat.completions.create(
        model=None, messages=[{"role": r, "content": c} for r, c in messages],  # type: ignore[arg-type]
        temperature=0.0, max_tokens=64, response_format=_person_format(),  # type: ignore[arg-type]
        extra_body={"return_token_ids": True})
    grpc_answer = asyncio.run(client.generate(chat_deployment.router_address, client.make_request(
        messages=messages, temperature=0.0, max_tokens=64,
        constraint=generation_pb2.Constraint(json_schema=json.dumps(PERSON))), 60))
    plain = asyncio.run(client.generate(chat_deployment.router_address, client.make_request(
        messages=messages, temperature=0.0, max_tokens=64), 60))
    token_ids = answer.choices[0].token_ids  # type: ignore[attr-defined]
    assert token_ids == list(grpc_answer.token_ids) != list(plain.token_ids)


def _check_calls(calls: list, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_choice_required_and_named_are_answered_with_tool_calls(
        chat_deployment: Deployment) -> None:
    api = _client(chat_deployment)
    ask = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
    for choice, names in [("required", set(SCHEMAS)),
                          ({"type": "function", "function": {"name": "get_time"}},
                           {"get_time"})]:
        # (one call: a random model's greedy calls would go on to max_tokens)
        answer = api.chat.completions.create(model=None, messages=ask, tools=TOOLS,  # type: ignore[arg-type]
                                             tool_choice=choice, temperature=0.0,  # type: ignore[arg-type]
                                             max_tokens=96, parallel_tool_calls=False)
        assert answer.choices[0].finish_reason == "tool_calls"
        assert answer.choices[0].message.content is None
        _check_calls(answer.choices[0].message.tool_calls or [], names)
        assert len(answer.choices[0].message.tool_calls or []) == 1
        streamed = list(api.chat.completions.create(
            model=None, messages=ask, tools=TOOLS, tool_choice=choice,  # type: ignore[arg-type]
            temperature=0.0, max_tokens=96, stream=True, parallel_tool_calls=False))
        calls = [c for chunk in streamed for ch in chunk.choices
                 for c in (ch.delta.tool_calls or [])]
        assert [c.function.arguments for c in calls] == [
            c.function.arguments for c in answer.choices[0].message.tool_calls or []]
        assert streamed[-1].choices[0].finish_reason == "tool_calls"
    # a conversation carrying the calls and a tool's result goes on
    answer = api.chat.completions.create(model=None, messages=[
        *ask, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}],  # type: ignore[list-item]
        tools=TOOLS, tool_choice="none", temperature=0.0, max_tokens=4)  # type: ignore[arg-type]
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    assert_pools_clean(chat_deployment)


def test_vllm_extras_constrain_text_completions(chat_deployment: Deployment) -> None:
    api = _client(chat_deployment)
    for extra, check in [
            ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
            ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
             lambda t: len(t) == 6 and t[:3].isdigit() and t[3] == "-"),
            ({"guided_json": PERSON},
             lambda t: jsonschema.validate(json.loads(t), PERSON) is None)]:
        answer = api.completions.create(model=None, prompt="Answer:", temperature=0.0,  # type: ignore[arg-type]
                                        max_tokens=200, extra_body=extra)
        text = answer.choices[0].text
        assert answer.choices[0].finish_reason == "stop" and check(text), (extra, text)
    # any JSON object: the random model's strings run on to max_tokens, but it opens one
    answer = api.completions.create(model=None, prompt="Answer:", temperature=0.0,  # type: ignore[arg-type]
                                    max_tokens=8,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert answer.choices[0].text.startswith('{"'), answer.choices[0].text


@pytest.mark.parametrize("kwargs, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format", "nonsense"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "yaml"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}},
     "guided_regex", "constrained by response_format"),
    ({"extra_body": {"guided_regex": "(("}}, "guided_regex", "not closed"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}},
     "tool_choice.function.name", "fly"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
])
def test_a_bad_constraint_is_a_400_naming_the_parameter(
        chat_deployment: Deployment, kwargs: dict, param: str, words: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        _client(chat_deployment).chat.completions.create(
            model=None, messages=[{"role": "user", "content": "hi"}], max_tokens=4,  # type: ignore[arg-type]
            **kwargs)
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == param and words in error["message"]
    assert_pools_clean(chat_deployment)
