"""The router's OpenAI-compatible HTTP API driven by the official `openai` package,
sync and async, streaming and not, chat and completions, against one deployment that serves
gRPC too: greedy text and tokens equal gRPC Generate's, usage is right (cached prompt tokens
on a repeated prompt), each bad parameter is a BadRequestError naming it, a client that goes
away frees every block, and docs/api.md's `curl -N` command streams."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from pathlib import Path

import httpx
import openai
import pytest

from deploy import client
from deploy.launcher import Deployment
from tests.conftest import assert_alive, assert_pools_clean
from tests.e2e.test_metrics import scrape, value
from tests.waiting import until_sync

pytestmark = pytest.mark.slow

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
CONVERSATION = [("system", "Be brief."), ("user", "The quick brown fox")]
MESSAGES = [{"role": role, "content": content} for role, content in CONVERSATION]
PROMPT = "The quick brown fox"
GREEDY = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
HTTP_GREEDY = dict(temperature=0, max_tokens=8,
                   extra_body={"ignore_eos": True, "return_token_ids": True})


@pytest.fixture(scope="module")
def deployment(chat_deployment: Deployment) -> Deployment:
    """The shared chat deployment (gRPC and HTTP, metrics, cached-token details)."""
    return chat_deployment


@pytest.fixture(scope="module")
def grpc_answers(deployment: Deployment) -> dict[str, client.Completion]:
    """What gRPC Generate streams for the chat and the text prompt, greedy."""
    chat, text = asyncio.run(client.generate_many(deployment.router_address, [
        client.make_request(messages=CONVERSATION, **GREEDY),
        client.make_request(PROMPT, **GREEDY)]))
    assert len(chat.token_ids) == len(text.token_ids) == 8
    return {"chat": chat, "text": text}


def _base_url(deployment: Deployment) -> str:
    return f"http://{deployment.http_address}/v1"


def _sync(deployment: Deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=_base_url(deployment), api_key="unused", max_retries=0)


def _extra(choice: object, name: str) -> object:
    return (choice.model_extra or {}).get(name)  # type: ignore[attr-defined]


def _check_usage(usage: object, expected: client.Completion) -> None:
    assert usage.prompt_tokens == expected.finished.usage.prompt_tokens  # type: ignore[attr-defined]
    assert usage.completion_tokens == len(expected.token_ids)  # type: ignore[attr-defined]
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens  # type: ignore[attr-defined]


def _check_stream(chunks: list, expected: client.Completion, is_chat: bool) -> None:
    """Text and token ids of a stream that asked for usage: as gRPC's, usage counting them."""
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    text = "".join((c.choices[0].delta.content or "") if is_chat else c.choices[0].text
                   for c in body)
    token_ids = [t for c in body for t in (_extra(c.choices[0], "token_ids") or [])]
    assert text == expected.text and token_ids == expected.token_ids
    assert body[-1].choices[0].finish_reason == "length"
    _check_usage(last.usage, expected)


def test_sync_client_chat_and_completions_equal_grpc(deployment: Deployment,
                                                     grpc_answers: dict) -> None:
    api = _sync(deployment)
    model = api.models.list().data[0].id
    assert model == "tiny-chat"
    chat = api.chat.completions.create(model=model, messages=MESSAGES, **HTTP_GREEDY)
    expected = grpc_answers["chat"]
    assert chat.choices[0].message.content == expected.text
    assert _extra(chat.choices[0], "token_ids") == expected.token_ids
    assert chat.choices[0].finish_reason == "length"
    _check_usage(chat.usage, expected)
    stream = api.chat.completions.create(model=model, messages=MESSAGES, stream=True,
                                         stream_options={"include_usage": True}, **HTTP_GREEDY)
    _check_stream(list(stream), expected, is_chat=True)

    expected = grpc_answers["text"]
    text = api.completions.create(model=model, prompt=PROMPT, **HTTP_GREEDY)
    assert text.choices[0].text == expected.text
    _check_usage(text.usage, expected)
    by_ids = api.completions.create(model=model, prompt=_prompt_ids(deployment),
                                    **HTTP_GREEDY)
    assert _extra(by_ids.choices[0], "token_ids") == expected.token_ids
    stream = api.completions.create(model=model, prompt=PROMPT, stream=True,
                                    stream_options={"include_usage": True}, **HTTP_GREEDY)
    _check_stream(list(stream), expected, is_chat=False)
    assert_pools_clean(deployment)


def _prompt_ids(deployment: Deployment) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(deployment.model).encode(PROMPT)


def test_async_client_streams_and_whole_answers_at_once(deployment: Deployment,
                                                        grpc_answers: dict) -> None:
    async def run() -> tuple:
        async with openai.AsyncOpenAI(base_url=_base_url(deployment), api_key="unused",
                                      max_retries=0) as api:
            async def chunks(stream_call) -> list:
                return [chunk async for chunk in await stream_call]

            usage = {"stream": True, "stream_options": {"include_usage": True}}
            return await asyncio.gather(
                api.chat.completions.create(model="tiny-chat", messages=MESSAGES,
                                            **HTTP_GREEDY),
                chunks(api.chat.completions.create(model="tiny-chat", messages=MESSAGES,
                                                   **usage, **HTTP_GREEDY)),
                api.completions.create(model="tiny-chat", prompt=PROMPT, **HTTP_GREEDY),
                chunks(api.completions.create(model="tiny-chat", prompt=PROMPT, **usage,
                                              **HTTP_GREEDY)))

    chat, chat_chunks, text, text_chunks = asyncio.run(run())
    assert chat.choices[0].message.content == grpc_answers["chat"].text
    _check_usage(chat.usage, grpc_answers["chat"])
    _check_stream(chat_chunks, grpc_answers["chat"], is_chat=True)
    assert text.choices[0].text == grpc_answers["text"].text
    _check_stream(text_chunks, grpc_answers["text"], is_chat=False)
    assert_pools_clean(deployment)


def test_a_repeated_prompt_reports_cached_prompt_tokens(deployment: Deployment) -> None:
    api = _sync(deployment)
    prompt = "A prompt long enough to fill a few blocks of sixteen tokens: " * 4
    first, second = (api.completions.create(model="tiny-chat", prompt=prompt, max_tokens=2,
                                            temperature=0) for _ in range(2))
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 32
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < second.usage.prompt_tokens and cached % 16 == 0
    assert second.choices[0].text == first.choices[0].text


CHAT_ERRORS = [
    ({"temperature": -1}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": 100_000}, "max_tokens"),  # past the context
    ({"top_p": 2}, "top_p"),
    ({"n": 17}, "n"),  # past --max-samples
    ({"n": 0}, "n"),
    ({"stop": [""]}, "stop"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"logit_bias": {"0": 101}}, "logit_bias"),
    ({"extra_body": {"top_k": -5}}, "top_k"),
    ({"extra_body": {"top_k": 2**31}}, "top_k"),  # past the vocabulary (and int32)
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"messages": [*MESSAGES, {"role": "narrator", "content": "boo"}]}, "messages[2].role"),
    ({"messages": []}, "messages"),
    ({"temperature": -1, "stream": True}, "temperature"),
]


@pytest.mark.parametrize("kwargs,param", CHAT_ERRORS, ids=[p + (" stream" if "stream" in k
                                                              else "") for k, p in CHAT_ERRORS])
def test_a_bad_chat_parameter_is_a_bad_request_naming_it(deployment: Deployment, kwargs: dict,
                                                          param: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        _sync(deployment).chat.completions.create(**{"model": "tiny-chat",
                                                     "messages": MESSAGES, **kwargs})
    assert exc.value.param == param, exc.value.message
    assert param.split("[")[0] in exc.value.message


def test_n_choices_equal_grpc_samples_whole_and_streamed(deployment: Deployment) -> None:
    """n = 3, seeded: the body's choices and the stream's (interleaved, each opening with
    its role and closing with its finish_reason, usage once at the end) are gRPC's samples."""
    sampling = {"max_tokens": 8, "temperature": 1.0, "seed": 77}
    samples = asyncio.run(client.generate_samples(deployment.router_address, client.make_request(
        messages=CONVERSATION, n=3, ignore_eos=True, **sampling)))
    extra = {"ignore_eos": True, "return_token_ids": True}
    body = _sync(deployment).chat.completions.create(
        model="tiny-chat", messages=MESSAGES, n=3, extra_body=extra, **sampling)
    assert [c.index for c in body.choices] == [0, 1, 2]
    assert [_extra(c, "token_ids") for c in body.choices] == [s.token_ids for s in samples]
    assert [c.message.content for c in body.choices] == [s.text for s in samples]
    assert body.usage.completion_tokens == 3 * 8
    assert body.usage.prompt_tokens == samples[0].finished.usage.prompt_tokens
    chunks = list(_sync(deployment).chat.completions.create(
        model="tiny-chat", messages=MESSAGES, n=3, stream=True,
        stream_options={"include_usage": True}, extra_body=extra, **sampling))
    *events, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 3 * 8
    for i, sample in enumerate(samples):
        mine = [c.choices[0] for c in events if c.choices[0].index == i]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == sample.text
        assert [t for c in mine for t in (_extra(c, "token_ids") or [])] == sample.token_ids
        assert [c.finish_reason for c in mine][-1] == "length"
        assert all(c.finish_reason is None for c in mine[:-1])
    assert len({tuple(s.token_ids) for s in samples}) > 1
    assert_pools_clean(deployment)


@pytest.mark.parametrize("prompt", ["", [10**9]], ids=["empty", "outside the vocabulary"])
def test_a_bad_prompt_is_a_bad_request_naming_it(deployment: Deployment, prompt) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        _sync(deployment).completions.create(model="tiny-chat", prompt=prompt)
    assert exc.value.param == "prompt" and "prompt" in exc.value.message


def test_another_model_is_not_found_and_health_models_and_size_cap(
        deployment: Deployment) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        _sync(deployment).chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert exc.value.param == "model" and exc.value.code == "model_not_found"
    base = f"http://{deployment.http_address}"
    assert httpx.get(f"{base}/health").status_code == 200
    big = httpx.post(f"{base}/v1/completions", content=b'{"prompt": "' + b"a" * (5 << 20)
                     + b'"}', headers={"Content-Type": "application/json"}, timeout=30)
    assert big.status_code == 413
    assert_alive(deployment)
    assert_pools_clean(deployment)


def _cancelled(deployment: Deployment) -> float:
    samples = scrape(deployment.processes[-1].metrics_port)
    return value(samples, "kvferry_request_failures_total", code="CANCELLED")


def test_a_client_that_goes_away_frees_every_block(deployment: Deployment) -> None:
    """A stream closed after a few chunks, and a whole answer abandoned by a client timeout:
    each request is cancelled on the workers (counted CANCELLED, never finished), so every
    block comes back well before 3,000 tokens could have been generated."""
    before = _cancelled(deployment)
    long = dict(model="tiny-chat", messages=MESSAGES, max_tokens=3000,
                extra_body={"ignore_eos": True})
    stream = _sync(deployment).chat.completions.create(stream=True, **long)
    for _, chunk in zip(range(4), stream):
        assert chunk.choices
    stream.close()
    with pytest.raises(openai.APITimeoutError):
        _sync(deployment).with_options(timeout=1.0).chat.completions.create(**long)
    assert_pools_clean(deployment, timeout_s=5)
    # counted when the router's leg ends, which may be just after the workers freed the blocks
    until_sync(lambda: _cancelled(deployment) - before >= 2, "both requests counted CANCELLED")
    assert _cancelled(deployment) - before == 2


def _documented_curl() -> str:
    blocks = re.findall(r"```bash\n(curl -N .*?)```", API_DOC.read_text(), re.S)
    assert len(blocks) == 1, "docs/api.md: one `curl -N` example"
    return blocks[0]


def test_curl_streams_as_the_api_page_documents_it(deployment: Deployment) -> None:
    command = _documented_curl()
    body = json.loads(re.search(r"-d '(.*)'", command, re.S).group(1))
    expected = asyncio.run(client.generate(deployment.router_address, client.make_request(
        messages=[(m["role"], m["content"]) for m in body["messages"]],
        temperature=float(body["temperature"]), max_tokens=body["max_tokens"])))
    out = subprocess.run(["bash", "-c", command.replace("127.0.0.1:8000",
                                                        deployment.http_address)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    events = [line.removeprefix("data: ") for line in out.stdout.splitlines() if line]
    assert all(line.startswith("data: ") for line in out.stdout.splitlines() if line)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == expected.text
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == len(expected.token_ids)


def test_the_limit_in_force_is_reported_and_clamps_an_unset_max_tokens(
        qwen3_checkpoint: Path, qwen3_deployment: Deployment) -> None:
    """A decode pool of 12 blocks (192 tokens) behind a router of its own: /v1/models and
    GetModelInfo report 192, not the model's context, and a prompt of 150 tokens without
    max_tokens (256 by default) gets the 42 left rather than a refusal about a max_tokens it
    never sent."""
    from kvferry.cache.layout import KvShape
    from kvferry.model.config import load_model_config
    from tests.deployments import reconfigured, routed

    config = load_model_config(qwen3_checkpoint)
    per_block = KvShape(config.num_layers, config.num_kv_heads, config.head_dim,
                        "float32").bytes_per_block(16)
    with (reconfigured(qwen3_deployment, ["decode-0"], ["--kv-pool-size", str(12 * per_block)]),
          routed(qwen3_deployment, "router-small-pool", [], is_http=True) as view):
        api = _sync(view)

        def reported() -> int:
            card = api.models.list().data[0]
            return (card.model_extra or {})["max_model_len"]

        until_sync(lambda: reported() == 12 * 16, "the router knows the decode pool")
        info = asyncio.run(_model_info(view.router_address))
        assert info.max_context_tokens == 12 * 16 < config.max_position_embeddings
        request = client.make_request([5 + i % 100 for i in range(150)], temperature=0.0,
                                      ignore_eos=True)  # no max_tokens: 256 by default
        got = asyncio.run(client.generate(view.router_address, request, 120))
        assert got.finished is not None and len(got.token_ids) == 12 * 16 - 150
        assert_pools_clean(qwen3_deployment)


async def _model_info(address: str) -> object:
    from kvferry.rpc import grpc_util

    async with grpc_util.channel(address) as chan:
        return await client.model_info(chan)


def test_metrics_are_served_on_the_api_port(deployment: Deployment) -> None:
    """GET /metrics on the HTTP port (as vLLM's API port serves them): the router's own
    series, the same as its --metrics-port, a request counted."""
    _sync(deployment).completions.create(model="tiny-chat", prompt=PROMPT, **HTTP_GREEDY)
    answer = httpx.get(f"http://{deployment.http_address}/metrics", timeout=30)
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    assert "kvferry_time_to_first_token_seconds_bucket" in answer.text
    router = next(p for p in deployment.processes if p.name == "router")
    assert value(scrape(router.metrics_port), "kvferry_generation_tokens_total") > 0
    assert "kvferry_generation_tokens_total" in answer.text
