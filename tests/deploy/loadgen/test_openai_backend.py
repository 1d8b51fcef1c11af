"""The OpenAI backends (openai-chat, openai-completions): exact records on a virtual clock,
equal to the gRPC backend's for the same script; the request bodies; every failure as a
record; and the same over a real HTTP server (uvicorn, on a clock the server moves)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from deploy.loadgen.metrics import calculate_metrics
from deploy.loadgen.openai_client import (
    Codec,
    OpenAISender,
    aiohttp_post,
    api_root,
    check_workload,
    open_sender,
)
from deploy.loadgen.runner import SendOptions, run_conversations, run_requests
from deploy.loadgen.workload import BenchRequest, Conversation
from tests.deploy.loadgen.conftest import FAIL_TOKEN, FakeStub, LockstepClock, VirtualClock
from tests.deploy.loadgen.fake_openai import MODEL, FakeOpenAI, serve, stop, virtual_post

approx = pytest.approx
REQUESTS = [BenchRequest((1, 2, 3), 5, 3, tag="a"), BenchRequest((FAIL_TOKEN, 2), 5, 2),
            BenchRequest((4, 5, 6, 7), 5, 4)]
WORDS = ["[UNK]", "w1", "w2", "w3", "w4", "hello", "there", "again"]


def _codec(tmp_path: Path) -> Codec:
    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return Codec.load(path)


def _virtual(backend: str, clock: VirtualClock, codec: Codec | None = None
             ) -> tuple[OpenAISender, FakeOpenAI]:
    record = FakeOpenAI()
    return OpenAISender(virtual_post(clock, record), backend, "http://fake/v1", MODEL,
                        codec), record


def test_virtual_clock_records_equal_the_grpc_backends() -> None:
    """The same script through gRPC and through completions: the same records and metrics
    (the empty-text chunk counts, the empty finishing chunk does not); only the failure's
    status and the K/V bytes (gRPC only) differ."""
    clock = VirtualClock()
    sender, record = _virtual("openai-completions", clock)
    http = asyncio.run(run_requests(sender, REQUESTS, [0.5, 1.0, 2.0], clock=clock,
                                    sleep=clock.sleep))
    ok, refused, last = http.records
    assert ok.ttft_s == approx(0.040) and ok.latency_s == approx(0.190)
    assert ok.itls_s == approx((0.050, 0.030, 0.070))
    assert (ok.output_len, ok.prompt_len, ok.cached_prompt_tokens, ok.tag) == (5, 3, 1, "a")
    assert refused.status == "HTTP_400" and "max_tokens" in refused.error
    assert last.prompt_len == 4 and http.duration_s == approx(2.190)

    clock = VirtualClock()
    grpc = asyncio.run(run_requests(FakeStub(clock), REQUESTS, [0.5, 1.0, 2.0], clock=clock,
                                    sleep=clock.sleep))
    for a, b in zip(http.records, grpc.records):
        assert (a.start_s, a.ttft_s, *a.itls_s, a.latency_s) == approx(
            (b.start_s, b.ttft_s, *b.itls_s, b.latency_s))
        assert (a.prompt_len, a.output_len, a.is_success) == (b.prompt_len, b.output_len,
                                                              b.is_success)
    m_http = calculate_metrics(http.records, http.duration_s)
    m_grpc = calculate_metrics(grpc.records, grpc.duration_s)
    for name in ("ttft", "itl", "tpot", "e2el"):
        a, b = m_http.stats(name), m_grpc.stats(name)
        assert (a.mean_ms, a.median_ms, *(v for _, v in a.percentiles_ms)) == approx(
            (b.mean_ms, b.median_ms, *(v for _, v in b.percentiles_ms)))
    assert m_http.failures_by_status == {"HTTP_400": 1}
    assert len(record.bodies) == 3


def test_chat_role_chunk_is_not_the_first_token(tmp_path: Path) -> None:
    clock = VirtualClock()
    sender, record = _virtual("openai-chat", clock, _codec(tmp_path))
    requests = [BenchRequest("hello there", 5), BenchRequest((5, 6, 7), 5, 3)]
    outcome = asyncio.run(run_requests(sender, requests, [0.0, 0.0], clock=clock,
                                       sleep=clock.sleep))
    for r in outcome.records:
        assert r.status == "OK" and len(r.itls_s) == 3 and r.output_len == 5
        assert r.ttft_s == approx(0.040) and r.latency_s == approx(0.190)
    text, ids = outcome.records
    assert (text.prompt_len, text.template_tokens) == (2 + 4, 0)  # the usage: no length asked
    # token ids of a known length (--input-len): the template's tokens apart
    assert (ids.prompt_len, ids.template_tokens) == (3, 4)
    metrics = calculate_metrics(outcome.records, 1.0)
    assert (metrics.total_input, metrics.total_template_tokens) == (9, 4)
    contents = [b["messages"][0]["content"] for b in record.bodies]
    assert sorted(contents) == ["hello there", "hello there again"]  # ids decoded


def test_request_bodies_follow_vllm_bench() -> None:
    clock = VirtualClock()
    sender, record = _virtual("openai-completions", clock)
    asyncio.run(run_requests(sender, [BenchRequest((1, 2), 9, 2), BenchRequest("text", 4)],
                             [0.0, 0.0], SendOptions(temperature=0.5, seed=11), clock=clock,
                             sleep=clock.sleep))
    ids, text = sorted(record.bodies, key=lambda b: isinstance(b["prompt"], str))
    assert ids["prompt"] == [1, 2] and text["prompt"] == "text"
    for body, max_tokens, seed in ((ids, 9, 11), (text, 4, 12)):
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["max_tokens"] == max_tokens
        assert body["model"] == MODEL and body["temperature"] == 0.5 and body["seed"] == seed

    clock = VirtualClock()
    sender, record = _virtual("openai-chat", clock)
    asyncio.run(run_requests(sender, [BenchRequest("hi", 3)], [0.0], clock=clock,
                             sleep=clock.sleep))
    (body,) = record.bodies
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["max_completion_tokens"] == 3 and "max_tokens" not in body


def test_failures_become_records() -> None:
    clock = VirtualClock()
    sender, _ = _virtual("openai-completions", clock)
    requests = [BenchRequest((token, 1), 5, 2) for token in
                (999_998, 999_997, 999_996, 999_995, 999_994)]
    outcome = asyncio.run(run_requests(sender, requests, [0.0] * 5, clock=clock,
                                       sleep=clock.sleep))
    overloaded, dropped, no_done, stream_error, no_usage = outcome.records
    assert (overloaded.status, overloaded.error) == ("HTTP_503", "overloaded")
    assert dropped.status == "INCOMPLETE" and "connection lost" in dropped.error
    assert dropped.output_len == 2 and dropped.ttft_s == approx(0.040)
    assert no_done.status == "INCOMPLETE" and "[DONE]" in no_done.error
    assert (stream_error.status, stream_error.error) == ("STREAM_ERROR",
                                                          "scripted stream error")
    # Without usage: the prompt's own length and one token per content chunk.
    assert no_usage.is_success and (no_usage.prompt_len, no_usage.output_len) == (2, 4)
    m = calculate_metrics(outcome.records, outcome.duration_s)
    assert m.failures_by_status == {"HTTP_503": 1, "INCOMPLETE": 2, "STREAM_ERROR": 1}


def test_multi_turn_tokenizes_each_answer(tmp_path: Path) -> None:
    clock = VirtualClock()
    codec = _codec(tmp_path)
    sender, record = _virtual("openai-completions", clock, codec)
    chat = Conversation(((5, 6), (7,)), output_len=5)
    outcome = asyncio.run(run_conversations(sender, [chat], [0.0], clock=clock,
                                            sleep=clock.sleep))
    assert [r.status for r in outcome.records] == ["OK", "OK"]
    # The answer's text " w1 w2 w3 w4" (chunks joined) tokenized, between the messages.
    assert [b["prompt"] for b in record.bodies] == [[5, 6], [5, 6, 1, 2, 3, 4, 7]]


def test_what_needs_a_tokenizer_is_refused_before_sending() -> None:
    with pytest.raises(ValueError, match="openai-chat sends text"):
        check_workload("openai-chat", REQUESTS, None)
    with pytest.raises(ValueError, match="multi-turn needs --tokenizer"):
        check_workload("openai-completions", [Conversation(((1,),), 2)], None)
    check_workload("openai-completions", REQUESTS, None)
    check_workload("grpc", [Conversation(((1,),), 2)], None)


def test_api_root() -> None:
    assert api_root("http://h:8000") == "http://h:8000/v1"
    assert api_root("http://h:8000/") == "http://h:8000/v1"
    assert api_root("https://h/openai/v1/") == "https://h/openai/v1"
    for bad in ("h:8000", "ftp://h/v1", "http://"):
        with pytest.raises(ValueError):
            api_root(bad)


async def _over_http(base_url: str, backend: str, requests: list[BenchRequest],
                     options: SendOptions | None = None,
                     clock: LockstepClock | None = None) -> list:
    """The records of `requests` sent to a real server: all at once on real time, or one at
    a time on the server's LockstepClock."""
    async with open_sender(base_url, backend) as sender:
        assert sender.model == MODEL  # from GET /v1/models
        outcome = await run_requests(sender, requests, [0.0] * len(requests),
                                     options or SendOptions(),
                                     max_concurrency=None if clock is None else 1,
                                     clock=clock or time.perf_counter)
    return list(outcome.records)


@pytest.mark.parametrize("backend", ["openai-completions", "openai-chat"])
def test_over_a_real_http_server(backend: str) -> None:
    """The virtual clock's records over a real server, one stream at a time: the server moves
    a shared clock by each scripted gap as it sends the chunk."""
    if backend == "openai-chat":
        requests = [BenchRequest(f"{w} hello", 5) for w in ("go", "400", "503", "drop")]
    else:
        requests = [BenchRequest((t, 1), 5, 2) for t in (1, FAIL_TOKEN, 999_998, 999_997)]
    clock = LockstepClock()
    served = serve(clock)
    try:
        ok, bad, busy, dropped = asyncio.run(_over_http(served.record.base_url, backend,
                                                        requests, clock=clock))
    finally:
        stop(served)
    # Scripted chunks at +40, +90, +120 (2 tokens), +190 ms; refusals take no time.
    assert ok.status == "OK" and ok.output_len == 5 and ok.start_s == 0.0
    assert ok.ttft_s == approx(0.040) and ok.itls_s == approx((0.050, 0.030, 0.070))
    assert ok.latency_s == approx(0.190)
    assert (bad.status, busy.status) == ("HTTP_400", "HTTP_503")
    assert "max_tokens" in bad.error
    assert dropped.status == "INCOMPLETE" and dropped.output_len == 2
    assert dropped.ttft_s == approx(0.040) and dropped.itls_s == approx((0.050,))
    assert [r.start_s for r in (bad, busy, dropped)] == approx([0.190] * 3)
    assert all(h["x-request-id"].startswith("bench-") for h in served.record.headers)


def test_unreachable_and_deadline(openai_server: FakeOpenAI) -> None:
    (slow,) = asyncio.run(_over_http(openai_server.base_url, "openai-completions",
                                     [BenchRequest((1,), 5, 1)], SendOptions(timeout_s=0.06)))
    assert slow.status == "DEADLINE_EXCEEDED" and slow.output_len <= 1

    async def unreachable() -> str:
        async with aiohttp.ClientSession() as session:
            sender = OpenAISender(aiohttp_post(session), "openai-completions",
                                  "http://127.0.0.1:9/v1", MODEL)
            outcome = await run_requests(sender, [BenchRequest((1,), 5, 1)], [0.0])
        return outcome.records[0].status

    assert asyncio.run(unreachable()) == "UNAVAILABLE"
