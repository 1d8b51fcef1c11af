"""Chat messages at the router: the checkpoint's chat template is applied, and every bad
conversation is refused with InvalidArgument naming the field (no processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from deploy import client
from kvferry.errors import InvalidArgument
from kvferry.model.checkpoint import CHATML_TEMPLATE, SPECIAL_TOKENS, ModelSpec, make_model
from kvferry.model.config import load_model_config
from kvferry.model.sampling import SamplingParams
from router.admission import prompt_ids
from router.request import ChatMessage, GenerateInput
from router.server import _input

CONVERSATION = [("system", "Be brief."), ("user", "The quick brown fox"),
                ("assistant", "jumps."), ("user", "Over what?")]


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("qwen3-chat"),
                      ModelSpec(chat_template=CHATML_TEMPLATE))


def _chat_input(messages: list[tuple[str, str]]) -> GenerateInput:
    return GenerateInput(request_id="", text=None, token_ids=None, params=SamplingParams(),
                         is_max_tokens_set=False,
                         messages=tuple(ChatMessage(role, content) for role, content in messages))


def _refusal(checkpoint: Path, messages: list[tuple[str, str]]) -> InvalidArgument:
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    with pytest.raises(InvalidArgument) as exc:
        prompt_ids(_chat_input(messages), load_model_config(checkpoint), tokenizer)
    return exc.value


def test_template_applied_gives_the_tokenizers_own_ids(chat_checkpoint: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(chat_checkpoint)
    got = prompt_ids(_chat_input(CONVERSATION), load_model_config(chat_checkpoint), tokenizer)
    conversation = [{"role": role, "content": content} for role, content in CONVERSATION]
    expected = tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
    assert got == list(expected)
    text = tokenizer.decode(got)
    assert text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nOver what?<|im_end|>" in text


def test_unknown_role_names_its_index(chat_checkpoint: Path) -> None:
    error = _refusal(chat_checkpoint, [("user", "hi"), ("wizard", "boo")])
    assert error.field == "input.messages[1].role"
    assert "wizard" in str(error)


def test_empty_conversation_is_refused(chat_checkpoint: Path) -> None:
    error = _refusal(chat_checkpoint, [])
    assert error.field == "input.messages"
    assert "empty" in str(error)


def test_model_without_chat_template_is_refused(qwen3_checkpoint: Path) -> None:
    error = _refusal(qwen3_checkpoint, [("user", "hi")])
    assert error.field == "input.messages"
    assert "no chat template" in str(error)


def test_template_error_is_invalid_argument(tmp_path: Path) -> None:
    strict = "{{ raise_exception('only one message') if messages | length > 1 }}" \
             + CHATML_TEMPLATE
    checkpoint = make_model(tmp_path, ModelSpec(chat_template=strict))
    error = _refusal(checkpoint, [("user", "a"), ("user", "b")])
    assert error.field == "input.messages"
    assert "only one message" in str(error)


def test_public_request_becomes_chat_input() -> None:
    inp = _input(client.make_request(messages=CONVERSATION, max_tokens=3))
    assert inp.messages == tuple(ChatMessage(r, c) for r, c in CONVERSATION)
    assert inp.text is None and inp.token_ids is None and inp.is_max_tokens_set
    empty = _input(client.make_request(messages=[]))
    assert empty.messages == ()
    assert _input(client.make_request("hi")).messages is None


def test_make_request_needs_exactly_one_input() -> None:
    with pytest.raises(ValueError):
        client.make_request()
    with pytest.raises(ValueError):
        client.make_request("hi", messages=[("user", "hi")])


def test_chat_checkpoint_differs_only_in_template_and_eos(qwen3_checkpoint: Path,
                                                          chat_checkpoint: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (qwen3_checkpoint / name).read_bytes() == (chat_checkpoint / name).read_bytes()
    assert AutoTokenizer.from_pretrained(qwen3_checkpoint).chat_template is None
    plain = load_model_config(qwen3_checkpoint)
    chat = load_model_config(chat_checkpoint)
    # Same weights, but a chat template and end-of-turn id change what the model answers:
    # the fingerprint covers the tokenizer files and the generation config.
    assert plain.fingerprint != chat.fingerprint
    # End of a turn ends generation: <|im_end|> comes from generation_config.json.
    tokenizer = AutoTokenizer.from_pretrained(chat_checkpoint)
    im_end = tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS[2])
    assert im_end in json.loads((chat_checkpoint / "generation_config.json").read_text())[
        "eos_token_id"]
    assert json.loads((chat_checkpoint / "config.json").read_text())["eos_token_id"] != im_end
    assert set(chat.eos_token_ids) == set(plain.eos_token_ids) | {im_end}
