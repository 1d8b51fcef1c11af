"""OpenAI request bodies -> the router engine's GenerateInput, parameter names in refusals, and
failures -> OpenAI error objects with their HTTP status (router/http/schema.py,
router/http/errors.py)."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
from pydantic import ValidationError

from kvferry.errors import InvalidArgument, NotFound, ResourceExhausted, Unavailable
from kvferry.model.sampling import DEFAULT_MAX_TOKENS, SamplingParams
from router.http.errors import failure
from router.http.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    body_error,
    served_model_name,
)
from router.request import ChatMessage

USER = [{"role": "user", "content": "hi"}]


def test_chat_body_becomes_messages_and_sampling() -> None:
    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]}],
        "temperature": 0, "top_p": 0.5, "seed": 7, "stop": "END", "max_tokens": 3,
        "max_completion_tokens": 9, "top_k": -1, "ignore_eos": True, "stop_token_ids": [5],
        "cache_salt": "tenant", "unknown_field": {"ignored": True}})
    inp = body.to_input("chatcmpl-1")
    assert inp.messages == (ChatMessage("system", "Be brief."), ChatMessage("user", "a\nb"))
    assert inp.text is None and inp.token_ids is None
    assert inp.request_id == "chatcmpl-1" and inp.cache_salt == "tenant"
    assert inp.is_max_tokens_set
    assert inp.params == SamplingParams(temperature=0.0, top_p=0.5, top_k=0, seed=7,
                                        max_tokens=9, stop=("END",), stop_token_ids=(5,),
                                        ignore_eos=True)
    assert body.param("sampling.max_tokens") == "max_completion_tokens"


def test_unset_parameters_take_the_engines_defaults() -> None:
    inp = ChatCompletionRequest.model_validate({"messages": USER}).to_input("x")
    assert not inp.is_max_tokens_set and inp.params.max_tokens == DEFAULT_MAX_TOKENS
    assert inp.params == SamplingParams()


@pytest.mark.parametrize("prompt,text,token_ids", [
    ("hello", "hello", None),
    (["hello"], "hello", None),
    ([1, 2, 3], None, [1, 2, 3]),
    ([[4, 5]], None, [4, 5]),
])
def test_completion_prompt_is_text_or_token_ids(prompt, text, token_ids) -> None:
    inp = CompletionRequest.model_validate({"prompt": prompt, "stop": ["a", "b"]}).to_input("c")
    assert (inp.text, inp.token_ids, inp.messages) == (text, token_ids, None)
    assert inp.params.stop == ("a", "b")


def test_n_is_the_samples_asked_for() -> None:
    """n goes to the router as sampling.n (validated there against --max-samples)."""
    inp = CompletionRequest.model_validate({"prompt": "a", "n": 3}).to_input("c")
    assert inp.params.n == 3


@pytest.mark.parametrize("body,param", [
    ({"prompt": "a", "top_logprobs": 1}, "top_logprobs"),
    ({"prompt": "a", "best_of": 2}, "best_of"),
    ({"prompt": "a", "min_tokens": 4}, "min_tokens"),
    ({"prompt": "a", "suffix": "b"}, "suffix"),
])
def test_what_is_not_served_is_refused_by_name(body: dict, param: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        CompletionRequest.model_validate(body).to_input("c")
    assert exc.value.field == param


def test_neutral_values_of_unserved_parameters_pass() -> None:
    body = {"prompt": "a", "logprobs": None, "echo": False, "best_of": 1, "n": 1,
            "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
            "min_tokens": 0}
    assert CompletionRequest.model_validate(body).to_input("c").text == "a"


def test_a_non_text_content_part_is_refused_by_name() -> None:
    body = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    with pytest.raises(InvalidArgument) as exc:
        body.to_input("x")
    assert exc.value.field == "messages[0].content[0]"


@pytest.mark.parametrize("field,chat,completion", [
    ("sampling.temperature", "temperature", "temperature"),
    ("sampling.max_tokens", "max_tokens", "max_tokens"),
    ("sampling.stop", "stop", "stop"),
    ("input.messages[1].role", "messages[1].role", "prompt"),
    ("input.messages", "messages", "prompt"),
    ("input", "messages", "prompt"),
    ("input.token_ids", "messages", "prompt"),
    ("cache_salt", "cache_salt", "cache_salt"),
])
def test_kvferry_fields_are_named_as_the_api_names_them(field, chat, completion) -> None:
    assert ChatCompletionRequest.model_validate({"messages": USER}).param(field) == chat
    assert CompletionRequest.model_validate({"prompt": "a"}).param(field) == completion


def _status_and_error(exc: BaseException, body=None) -> tuple[int, dict]:
    answer = failure(exc, "req-1", body)
    return answer.status, json.loads(answer.body)["error"]


def test_failures_become_openai_error_objects() -> None:
    body = ChatCompletionRequest.model_validate({"messages": USER})
    status, error = _status_and_error(InvalidArgument(
        "input.messages[1].role: 'x' is not one of system, developer, user, assistant",
        "input.messages[1].role"), body)
    assert status == 400
    assert error == {"message": "messages[1].role: 'x' is not one of system, developer, user, "
                                "assistant",
                     "type": "invalid_request_error", "param": "messages[1].role",
                     "code": "invalid_argument"}
    status, error = _status_and_error(NotFound("model: 'x' is not served", "model"), body)
    assert (status, error["code"], error["param"]) == (404, "model_not_found", "model")
    assert _status_and_error(ResourceExhausted("full"))[0] == 429
    assert _status_and_error(Unavailable("no decode worker"))[0] == 503
    status, error = _status_and_error(KeyError("secret detail at 10.0.0.7:5000"))
    assert status == 500 and error["type"] == "server_error"
    assert "secret" not in error["message"] and "req-1" in error["message"]
    assert failure(Unavailable("x"), "r", None).code_name == grpc.StatusCode.UNAVAILABLE.name


def test_a_body_of_the_wrong_shape_names_the_parameter() -> None:
    with pytest.raises(ValidationError) as exc:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": 5}]})
    param, message = body_error(exc.value.errors())
    assert param == "messages[0].content" and message.startswith("messages[0].content: ")
    with pytest.raises(ValidationError) as exc:
        CompletionRequest.model_validate({"prompt": "a", "temperature": "hot"})
    assert body_error(exc.value.errors())[0] == "temperature"


def test_the_served_model_name_is_the_checkpoint_directorys(tmp_path: Path) -> None:
    assert served_model_name("/models/qwen3-tiny/") == "qwen3-tiny"
    # the weights are served dequantized: a GGUF name's quantization tag would misname them
    assert served_model_name("/m/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"
    assert served_model_name("/m/Llama-3.2-1B-Instruct-Q4_K_M.gguf") == "Llama-3.2-1B-Instruct"
    assert served_model_name("/m/tiny.f16.gguf") == "tiny"
    assert served_model_name("/models/qwen3-tiny", "my-model") == "my-model"  # the flag's


def test_a_converted_gguf_is_served_under_its_own_name_not_its_cache_key(
        tmp_path: Path) -> None:
    """KVFERRY_HOME/models/NAME-<hash> (a conversion, with its
    manifest) is served as NAME; a folder that only looks like one keeps its name."""
    key = "b179c9523d0e6a0f98a330c7562b6827"
    converted = tmp_path / f"SmolLM2-135M-Instruct.Q4_1-{key}"
    converted.mkdir()
    (converted / "manifest.json").write_text("{}")
    assert served_model_name(str(converted)) == "SmolLM2-135M-Instruct"
    lookalike = tmp_path / f"mine-{key}"
    lookalike.mkdir()
    assert served_model_name(str(lookalike)) == lookalike.name


def test_logprobs_parameters_become_sampling_fields() -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    params = ChatCompletionRequest.model_validate({**chat, "logprobs": True, "top_logprobs": 2}
                                                  ).to_input("x").params
    assert (params.logprobs, params.prompt_logprobs) == (2, None)
    assert ChatCompletionRequest.model_validate({**chat, "logprobs": True}
                                                ).to_input("x").params.logprobs == 0
    assert ChatCompletionRequest.model_validate(chat).to_input("x").params.logprobs is None
    with pytest.raises(InvalidArgument) as exc:  # echo is the text completion's
        ChatCompletionRequest.model_validate({**chat, "echo": True}).to_input("x")
    assert exc.value.field == "echo"
    echoed = CompletionRequest.model_validate({"prompt": "a", "logprobs": 1, "echo": True})
    params = echoed.to_input("c").params
    assert (params.logprobs, params.prompt_logprobs) == (1, 1)
    plain = CompletionRequest.model_validate({"prompt": "a", "echo": True}).to_input("c")
    assert (plain.params.logprobs, plain.params.prompt_logprobs) == (None, None)


def test_penalties_and_biases_become_sampling_fields() -> None:
    params = CompletionRequest.model_validate({
        "prompt": "a", "presence_penalty": 0.5, "frequency_penalty": -0.25,
        "repetition_penalty": 1.2, "logit_bias": {"7": 5, "3": -100}}).to_input("c").params
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
            params.logit_bias) == (0.5, -0.25, 1.2, ((3, -100.0), (7, 5.0)))
    with pytest.raises(InvalidArgument) as exc:
        CompletionRequest.model_validate({"prompt": "a", "logit_bias": {"x": 1}}).to_input("c")
    assert exc.value.field == "logit_bias"


def test_a_batch_of_prompts_is_one_input_each() -> None:
    body = CompletionRequest.model_validate({"prompt": [[1, 2], [3]], "n": 2})
    inputs = body.to_inputs("cmpl-1")
    assert [(i.request_id, i.token_ids, i.params.n) for i in inputs] == [
        ("cmpl-1-0", [1, 2], 2), ("cmpl-1-1", [3], 2)]
    texts = CompletionRequest.model_validate({"prompt": ["a", "b"]}).to_inputs("c")
    assert [i.text for i in texts] == ["a", "b"]
    assert CompletionRequest.model_validate({"prompt": [5, 6]}).to_inputs("c")[0].token_ids == [
        5, 6]


def test_an_unset_max_tokens_is_16_on_completions_and_256_on_chat() -> None:
    from kvferry.model.sampling import DEFAULT_MAX_TOKENS

    text = CompletionRequest.model_validate({"prompt": "a"}).to_input("c")
    assert (text.params.max_tokens, text.is_max_tokens_set) == (16, False)
    chat = ChatCompletionRequest.model_validate({"messages": USER}).to_input("x")
    assert (chat.params.max_tokens, chat.is_max_tokens_set) == (DEFAULT_MAX_TOKENS, False)
    zero = CompletionRequest.model_validate({"prompt": "a", "max_tokens": 0}).to_input("c")
    assert (zero.params.max_tokens, zero.is_max_tokens_set) == (0, True)


def test_an_unset_max_tokens_is_capped_by_the_context_left(qwen3_checkpoint: Path) -> None:
    from kvferry.model.config import load_model_config
    from router import admission

    config = load_model_config(qwen3_checkpoint)
    text = CompletionRequest.model_validate({"prompt": "a"}).to_input("c")
    context = config.max_position_embeddings
    assert admission.resolve_sampling(text, config, 10).max_tokens == 16
    assert admission.resolve_sampling(text, config, context - 5).max_tokens == 5


def test_an_unset_max_tokens_is_clamped_to_the_limit_in_force(qwen3_checkpoint: Path) -> None:
    """A decode pool smaller than the context sets the limit (the router's max_model_len):
    an unset max_tokens takes what is left of it, as vLLM's does of its max_model_len; a
    prompt past it keeps the context's default, for the pool check to refuse by name."""
    from kvferry.model.config import load_model_config
    from router import admission

    config = load_model_config(qwen3_checkpoint)
    chat = ChatCompletionRequest.model_validate({"messages": USER}).to_input("x")
    assert admission.resolve_sampling(chat, config, 100, max_model_len=150).max_tokens == 50
    assert admission.resolve_sampling(chat, config, 200, max_model_len=150).max_tokens == 256
    given = ChatCompletionRequest.model_validate({"messages": USER, "max_tokens": 90}
                                                 ).to_input("x")
    assert admission.resolve_sampling(given, config, 100, max_model_len=150).max_tokens == 90
