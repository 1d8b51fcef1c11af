"""Log probabilities through the public APIs: gRPC Generate's `sampling.logprobs` and
`prompt_logprobs` on a disaggregated deployment (the prefill worker reports the prompt's and
the first token's, the decode worker the rest), a colocated one and one moving K/V over NIXL
(both with n-gram speculation: accepted drafts report their verification rows'), each value
transformers' log-softmax at its position; a prompt found in the prefix cache the second time
is computed again for its prompt logprobs. Over HTTP, the text completion's legacy `logprobs`
with `echo` (what lm-evaluation-harness sends: token-id prompt, max_tokens 1, logprobs 1) and
the chat completion's `logprobs.content` with `top_logprobs`, through the `openai` client, whole
and streamed; bad values are 400s naming the parameter."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from deploy import client
from deploy.launcher import Deployment
from tests.conftest import assert_pools_clean

pytestmark = pytest.mark.slow

PROMPT = [3 + (i * 13) % 190 for i in range(40)]
TOP = 3


def _reference(checkpoint: Path, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax [len(ids), V] (fp32): row i predicts the token after ids[i]."""
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def _check(values: list[float], tokens: list[int], want: torch.Tensor) -> None:
    assert len(values) == len(tokens) == want.shape[0]
    got = torch.tensor(values)
    expected = want[torch.arange(len(tokens)), torch.tensor(tokens)]
    assert torch.allclose(got, expected, atol=1e-3), (got - expected).abs().max()


@pytest.mark.parametrize("fixture", ["qwen3_deployment", "colocated_deployment",
                                     "qwen3_nixl_deployment"])
def test_grpc_logprobs_are_transformers_log_softmax(fixture: str, qwen3_checkpoint: Path,
                                                    request: pytest.FixtureRequest) -> None:
    deployment: Deployment = request.getfixturevalue(fixture)
    generate = client.make_request(PROMPT, temperature=0.0, max_tokens=16, ignore_eos=True,
                                   logprobs=TOP, prompt_logprobs=2)
    generate.cache_salt = f"logprobs-{fixture}"
    want = None
    for _ in range(2):  # the second time its blocks are cached: computed again all the same
        got = asyncio.run(client.generate(deployment.router_address, generate, 120))
        if want is None:
            want = _reference(qwen3_checkpoint, PROMPT + got.token_ids)
        assert len(got.token_ids) == 16
        _check([lp.logprob for lp in got.prompt_logprobs], PROMPT[1:], want[:len(PROMPT) - 1])
        _check([lp.logprob for lp in got.logprobs], got.token_ids, want[len(PROMPT) - 1:-1])
        assert all(len(lp.top_token_ids) == 2 for lp in got.prompt_logprobs)
        for lp, row in zip(got.logprobs, want[len(PROMPT) - 1:]):
            assert list(lp.top_token_ids) == torch.topk(row, TOP).indices.tolist()
    assert_pools_clean(deployment)


def _url(deployment: Deployment) -> str:
    return f"http://{deployment.http_address}/v1"


def test_echoed_prompt_logprobs_as_lm_eval_asks(chat_checkpoint: Path,
                                                chat_deployment: Deployment) -> None:
    """A token-id prompt, echo, logprobs 1, max_tokens 1, temperature 0 (lm-evaluation-
    harness's loglikelihood request): the text is the prompt's and the token's, and the
    logprobs cover both, the first prompt token's None, each value transformers'."""
    body = {"prompt": [PROMPT], "echo": True, "logprobs": 1, "max_tokens": 1,
            "temperature": 0, "seed": 1234, "return_token_ids": True}
    answer = httpx.post(f"{_url(chat_deployment)}/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    (choice,) = answer.json()["choices"]
    logprobs = choice["logprobs"]
    tokens = logprobs["tokens"]
    assert len(tokens) == len(PROMPT) + 1 and logprobs["token_logprobs"][0] is None
    assert logprobs["top_logprobs"][0] is None
    assert choice["text"].startswith(_tokenizer(chat_checkpoint).decode(PROMPT))
    assert logprobs["text_offset"] == [len("".join(tokens[:i])) for i in range(len(tokens))]
    ids = PROMPT + choice["token_ids"]
    want = _reference(chat_checkpoint, ids)
    _check(logprobs["token_logprobs"][1:], ids[1:], want[:-1])
    for value, top in zip(logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:]):
        assert value in top.values() and max(top.values()) >= value  # top-1, and the token


def _tokenizer(checkpoint: Path):  # noqa: ANN202 - a transformers tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


def test_chat_logprobs_whole_and_streamed(chat_checkpoint: Path,
                                          chat_deployment: Deployment) -> None:
    api = openai.OpenAI(base_url=_url(chat_deployment), api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "The quick brown fox"}]
    common = dict(model="tiny-chat", messages=messages, temperature=0, max_tokens=8,
                  logprobs=True, top_logprobs=2,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
    whole = api.chat.completions.create(**common)  # type: ignore[call-overload]
    content = whole.choices[0].logprobs.content
    token_ids = (whole.choices[0].model_extra or {})["token_ids"]
    assert len(content) == len(token_ids) == 8
    assert all(len(entry.top_logprobs) == 2 for entry in content)
    assert "".join(entry.token for entry in content) == whole.choices[0].message.content
    assert all(bytes(entry.bytes) == entry.token.encode() for entry in content)
    streamed = [entry for chunk in api.chat.completions.create(stream=True, **common)
                if chunk.choices and chunk.choices[0].logprobs is not None
                for entry in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    prompt_ids = _chat_prompt(chat_checkpoint, messages)
    want = _reference(chat_checkpoint, prompt_ids + token_ids)
    _check([e.logprob for e in content], token_ids, want[len(prompt_ids) - 1:-1])


def _chat_prompt(checkpoint: Path, messages: list[dict[str, str]]) -> list[int]:
    tokenizer = _tokenizer(checkpoint)
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                              tokenize=True, return_dict=False))


@pytest.mark.parametrize(("endpoint", "body", "param"), [
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logprobs": -1, "echo": True}, "logprobs"),
])
def test_a_bad_logprobs_value_is_a_bad_request_naming_it(
        endpoint: str, body: dict, param: str, chat_deployment: Deployment) -> None:
    prompt = ({"messages": [{"role": "user", "content": "hi"}]} if endpoint.startswith("chat")
              else {"prompt": "hi"})
    answer = httpx.post(f"{_url(chat_deployment)}/{endpoint}", json={**prompt, **body},
                        timeout=60)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


def test_a_batch_of_prompts_answers_each_as_alone(chat_deployment: Deployment) -> None:
    """Two token-id prompts and n = 2, with echo and logprobs (lm-evaluation-harness's
    batched loglikelihood request), whole and streamed: choice i * 2 + j is prompt i's sample
    j, each what the prompt asked alone gets; usage counts both prompts once."""
    prompts = [PROMPT, PROMPT[::-1][:25]]
    common = {"echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0, "n": 2,
              "return_token_ids": True, "ignore_eos": True}
    url = f"{_url(chat_deployment)}/completions"
    alone = [httpx.post(url, json={**common, "prompt": p}, timeout=120).json() for p in prompts]
    batch = httpx.post(url, json={**common, "prompt": prompts}, timeout=120).json()
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
    for i, answer in enumerate(alone):
        for j, choice in enumerate(answer["choices"]):
            got = batch["choices"][i * 2 + j]
            assert (got["text"], got["token_ids"]) == (choice["text"], choice["token_ids"])
            assert got["logprobs"]["token_logprobs"][1:] == pytest.approx(
                choice["logprobs"]["token_logprobs"][1:], abs=1e-5)
    assert batch["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    assert batch["usage"]["completion_tokens"] == 4 * 3
    texts = [""] * 4
    with httpx.stream("POST", url, json={**common, "prompt": prompts, "stream": True},
                      timeout=120) as streamed:
        for line in streamed.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    texts[choice["index"]] += choice["text"]
    assert texts == [c["text"] for c in batch["choices"]]
    assert_pools_clean(chat_deployment)
