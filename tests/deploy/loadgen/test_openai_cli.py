"""`kvferry bench --backend openai-chat|openai-completions --base-url URL`, and --compare
putting a gRPC target and OpenAI servers in one result: the same requests, one table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.cli import main
from deploy.loadgen import BenchConfig, RandomWorkload, Target, run_benchmark
from deploy.loadgen.targets import parse_target
from tests.deploy.loadgen.conftest import VOCAB_SIZE, FakeServer
from tests.deploy.loadgen.fake_openai import MODEL, FakeOpenAI

BENCH = ["bench", "--num-prompts", "4", "--input-len", "6", "--output-len", "5",
         "--request-rate", "40", "--disable-tqdm", "--seed", "3"]


def test_cli_single_openai_target(openai_server: FakeOpenAI, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    result_file = tmp_path / "out.json"
    code = main([*BENCH, "--backend", "openai-completions", "--base-url",
                 openai_server.base_url, "--vocab-size", "300", "--goodput", "ttft:5000",
                 "--extra-body", '{"top_k": 5}', "--result-file", str(result_file)])
    assert code == 0
    data = json.loads(result_file.read_text())
    assert data["backend"] == "openai-completions" and data["target"] == openai_server.base_url
    assert data["completed"] == 4 and data["failed"] == 0
    assert data["input_lens"] == [6] * 4 and data["output_lens"] == [5] * 4  # from usage
    assert data["cached_prompt_tokens"] == [3] * 4 and data["prefix_cache_hit_rate"] == 0.5
    assert [len(itls) for itls in data["itls"]] == [3] * 4
    assert data["mean_ttft_ms"] >= 39 and data["request_goodput"] > 0
    for body in openai_server.bodies:
        assert len(body["prompt"]) == 6 and all(0 <= t < 300 for t in body["prompt"])
        assert body["max_tokens"] == 5 and body["ignore_eos"] and body["model"] == MODEL
        assert body["top_k"] == 5  # --extra-body
    out = capsys.readouterr().out
    assert "Mean TTFT (ms):" in out
    # an OpenAI server does not report K/V bytes: unknown, not 0.00
    assert "K/V bytes shipped per request:           unknown" in out
    assert out.startswith(f"{MODEL}; RandomWorkload(") and data["model"] == MODEL


def test_compare_grpc_and_openai_servers_on_one_plot(fake_server: FakeServer,
                                                     openai_server: FakeOpenAI,
                                                     tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    """The gRPC target's GetModelInfo gives the vocabulary; the HTTP targets after it get
    the very same prompts, with the same metrics computed the same way."""
    result_file, plot_dir = tmp_path / "compare.json", tmp_path / "plots"
    code = main([*BENCH, "--compare", f"grpc={fake_server.address}",
                 f"completions=openai-completions:{openai_server.base_url}",
                 f"chat=openai-chat:{openai_server.base_url}", "--dataset-name", "jsonl",
                 "--dataset-path", str(_text_prompts(tmp_path)),
                 "--result-file", str(result_file), "--plot-dir", str(plot_dir)])
    assert code == 0
    runs = json.loads(result_file.read_text())["runs"]
    assert [(r["target"], r["backend"]) for r in runs] == [
        ("grpc", "grpc"), ("completions", "openai-completions"), ("chat", "openai-chat")]
    for run in runs:
        assert run["completed"] == 4 and run["output_lens"] == [5] * 4
        assert [len(itls) for itls in run["itls"]] == [3] * 4
        assert run["median_ttft_ms"] >= 39 and run["p99_itl_ms"] >= 69
    sent_grpc = sorted(r.text for r in fake_server.servicer.requests)
    sent_completions = sorted(b["prompt"] for b in openai_server.bodies if "prompt" in b)
    sent_chat = sorted(b["messages"][0]["content"] for b in openai_server.bodies
                       if "messages" in b)
    assert sent_grpc == sent_completions == sent_chat
    assert (plot_dir / "latency_vs_rate.png").exists()
    table = capsys.readouterr().out
    assert "| chat | openai-chat | 40 | 4 | 0 |" in table


def _text_prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"say {w}"}) + "\n"
                            for w in ("one", "two", "three", "four")))
    return path


def test_an_openai_target_after_a_grpc_one_gets_its_vocabulary(
        fake_server: FakeServer, openai_server: FakeOpenAI) -> None:
    config = BenchConfig(num_requests=3, request_rates=(50.0,), seed=5)
    result = run_benchmark([f"g={fake_server.address}",
                            Target("h", base_url=openai_server.base_url,
                                   backend="openai-completions")],
                           RandomWorkload(input_len=4, output_len=3), config)
    assert [r.backend for r in result.runs] == ["grpc", "openai-completions"]
    grpc_prompts = sorted(tuple(q.token_ids.ids) for q in fake_server.servicer.requests)
    http_prompts = sorted(tuple(b["prompt"]) for b in openai_server.bodies)
    assert grpc_prompts == http_prompts
    assert all(t < VOCAB_SIZE for p in http_prompts for t in p)


def test_bad_openai_arguments_exit_2(openai_server: FakeOpenAI,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*BENCH, "--backend", "openai-chat"]) == 2
    assert "needs --base-url" in capsys.readouterr().err
    assert main([*BENCH, "--base-url", openai_server.base_url]) == 2
    assert "--base-url needs --backend" in capsys.readouterr().err
    assert main([*BENCH, "--backend", "openai-completions", "--base-url",
                 openai_server.base_url, "--extra-body", "[1]"]) == 2
    assert "--extra-body: expected a JSON object" in capsys.readouterr().err
    assert openai_server.bodies == []


def test_an_openai_target_counts_with_the_models_tokenizer_unless_told(
        openai_server: FakeOpenAI, capsys: pytest.CaptureFixture[str]) -> None:
    """As vLLM's bench: no --tokenizer needed; --model's (the default model, what `kvferry
    serve` serves without --model) decodes token-id prompts into chat text and gives the
    vocabulary, and the run says so."""
    assert main([*BENCH, "--backend", "openai-chat", "--base-url", openai_server.base_url,
                 "--vocab-size", "100"]) == 0
    err = capsys.readouterr().err
    assert "counting tokens with default's tokenizer" in err and "--tokenizer for another" in err
    assert all(isinstance(b["messages"][0]["content"], str) for b in openai_server.bodies)
    assert main([*BENCH, "--backend", "openai-completions", "--base-url",
                 openai_server.base_url]) == 0  # the vocabulary: the tokenizer's


def test_target_strings_with_backends() -> None:
    assert parse_target("v=openai-chat:http://h:8000/v1") == Target(
        "v", base_url="http://h:8000/v1", backend="openai-chat")
    assert parse_target("h:9", "openai-completions") == Target(
        "h:9", base_url="http://h:9/v1", backend="openai-completions")
    assert parse_target("g=grpc:h:7", "openai-chat") == Target("g", address="h:7")
    assert parse_target("openai-chat:launch:disagg") == Target(
        "disagg-openai-chat", launch="disagg", backend="openai-chat")
    assert parse_target("x=launch:colocated", "openai-completions").backend == (
        "openai-completions")
    for bad in ("http://h:8000/v1", "x=grpc:https://h", "y=openai-chat:"):
        with pytest.raises(ValueError):
            parse_target(bad)
