"""Text UTF-8 cannot encode (JSON's lone surrogates), seeds outside [0, 2^63) and top_k past
the vocabulary, through the real router engine's validation behind the real HTTP front (no
workers: each is refused before any is asked): 400 naming the parameter, no traceback logged.
The gRPC front's uint64 seed is refused the same way."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from contextlib import aclosing

import httpx
import pytest

from kvferry.errors import InvalidArgument
from kvferry.model.config import ModelConfig
from kvferry.settings import SecuritySettings
from kvferry.v1 import generation_pb2
from router.engine import Router
from router.http.front import HttpFront
from router.server import _input
from router.workers.registry import WorkerSet

VOCAB = 512
CONFIG = ModelConfig(
    path="/models/tiny", architecture="Qwen3ForCausalLM", vocab_size=VOCAB, hidden_size=64,
    intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=32,
    rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=True,
    has_qk_norm=True, attention_bias=False, mlp_bias=False, eos_token_ids=(1,),
    fingerprint="fp")
LONE = "a\ud800b"
USER = [{"role": "user", "content": "hi"}]

CASES = [
    ("/v1/completions", {"prompt": LONE}, "prompt"),
    ("/v1/completions", {"prompt": [LONE]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop": LONE}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": ["ok", LONE]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "cache_salt": LONE}, "cache_salt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONE}]},
     "messages[0].content"),
    ("/v1/chat/completions",
     {"messages": [*USER, {"role": "user", "content": [{"type": "text", "text": LONE}]}]},
     "messages[1].content"),
    ("/v1/chat/completions", {"messages": [{"role": LONE, "content": "hi"}]},
     "messages[0].role"),
    ("/v1/completions", {"prompt": [1, 2], "seed": -1}, "seed"),
    ("/v1/completions", {"prompt": [1, 2], "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": [1, 2], "seed": 2**63}, "seed"),
    ("/v1/chat/completions", {"messages": USER, "seed": -1}, "seed"),
    ("/v1/completions", {"prompt": [1, 2], "top_k": 2**31}, "top_k"),
    ("/v1/completions", {"prompt": [1, 2], "top_k": VOCAB + 1}, "top_k"),
    ("/v1/completions", {"prompt": [1, 2], "top_k": -2}, "top_k"),
]


class FakeTokenizer:
    """Two tokens for any text or conversation."""

    chat_template = "fake"

    def encode(self, text: str) -> list[int]:
        return [1, 2]

    def apply_chat_template(self, conversation: list[dict], **kwargs: object) -> list[int]:
        return [1, 2]


def _router() -> Router:
    return Router(CONFIG, tokenizer=FakeTokenizer(), workers=WorkerSet("fp"))


@pytest.mark.parametrize("path,body,param", CASES,
                         ids=[f"{p.split('/')[-1]}-{param}-{i}"
                              for i, (p, _, param) in enumerate(CASES)])
def test_http_bad_text_and_numbers_are_400_naming_the_parameter(
        path: str, body: dict, param: str, caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> httpx.Response:
        front = HttpFront(_router(), "/models/tiny", "127.0.0.1", 0, SecuritySettings(),
                          False, None, 1.0)
        await front.start()
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{front.port}") as client:
                # ASCII JSON: the surrogate as the escape \ud800, valid JSON a client may send.
                return await client.post(path, content=json.dumps(body),
                                         headers={"content-type": "application/json"})
        finally:
            await front.stop()

    with caplog.at_level(logging.WARNING):
        response = asyncio.run(main())
    error = response.json()["error"]
    assert response.status_code == 400, error
    assert error["param"] == param and error["code"] == "invalid_argument"
    assert error["message"].startswith(param), error["message"]
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


def test_a_surrogate_is_refused_before_the_tokenizer_sees_it() -> None:
    class Unreachable:
        def encode(self, text: str) -> list[int]:
            raise AssertionError("the tokenizer must not be called")

    async def main() -> None:
        router = Router(CONFIG, tokenizer=Unreachable(), workers=WorkerSet("fp"))
        bad = dataclasses.replace(_input(generation_pb2.GenerateRequest(text="hi")), text=LONE)
        with pytest.raises(InvalidArgument) as exc:
            async for _ in router.generate(bad, None):
                pass
        assert exc.value.field == "input.text" and "surrogate" in str(exc.value)

    asyncio.run(main())


@pytest.mark.parametrize("seed,is_refused", [(0, False), (2**63 - 1, False), (2**63, True),
                                             (2**64 - 1, True)])
def test_grpc_uint64_seed_at_or_above_2_63_is_refused(seed: int, is_refused: bool) -> None:
    request = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[1, 2]))
    request.sampling.seed = seed
    request.sampling.top_k = VOCAB  # the whole vocabulary: allowed, as 0 is

    async def main() -> InvalidArgument | None:
        router = _router()
        try:
            async with aclosing(router.generate(_input(request), None)) as events:
                await anext(events)  # past validation: the request id comes first
        except InvalidArgument as exc:
            return exc
        return None

    error = asyncio.run(main())
    if is_refused:
        assert error is not None and error.field == "sampling.seed", error
    else:
        assert error is None
