"""`kvferry bench` end to end against the scripted server: JSON, table, plots, --compare."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.cli import main
from deploy.loadgen import BenchConfig, RandomWorkload, Target, run_benchmark
from deploy.loadgen.targets import parse_target
from tests.deploy.loadgen.conftest import VOCAB_SIZE, FakeServer

VLLM_KEYS = [
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "max_output_tokens_per_s", "max_concurrent_requests", "input_lens", "output_lens",
    "ttfts", "itls", "latencies", "start_times", "errors",
    *(f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
      for stat in ("mean", "median", "std", "p90", "p95", "p99")),
]


def test_cli_single_target(fake_server: FakeServer, tmp_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    result_file, plot_dir = tmp_path / "out.json", tmp_path / "plots"
    code = main(["bench", "--address", fake_server.address, "--num-prompts", "4",
                 "--input-len", "6", "--output-len", "5", "--request-rate", "40",
                 "--goodput", "ttft:1000", "tpot:1000", "--disable-tqdm", "--seed", "3",
                 "--result-file", str(result_file), "--plot-dir", str(plot_dir)])
    assert code == 0
    data = json.loads(result_file.read_text())
    for key in VLLM_KEYS:
        assert key in data, key
    assert data["completed"] == 4 and data["failed"] == 0
    assert data["input_lens"] == [6] * 4 and data["output_lens"] == [5] * 4
    assert data["request_goodput"] > 0 and data["mean_ttft_ms"] >= 39
    assert [len(itls) for itls in data["itls"]] == [3] * 4
    assert data["config"]["request_rates"] == [40.0] and len(data["runs"]) == 1
    # Every prompt is token ids within the served vocabulary, with max_tokens + ignore_eos.
    for request in fake_server.servicer.requests:
        assert len(request.token_ids.ids) == 6
        assert all(0 <= t < VOCAB_SIZE for t in request.token_ids.ids)
        assert request.sampling.max_tokens == 5 and request.sampling.ignore_eos
    for name in ("latency_vs_rate.png", "ttft_vs_itl.png"):
        assert (plot_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "Mean TTFT (ms):" in out and "Request goodput (req/s):" in out


def test_compare_and_sweep_send_the_same_requests(fake_server: FakeServer) -> None:
    config = BenchConfig(num_requests=3, request_rates=(50.0, float("inf")), seed=5,
                         num_warmups=1)
    result = run_benchmark([f"a={fake_server.address}", Target("b", fake_server.address)],
                           RandomWorkload(input_len=4, output_len=3, range_ratio=0.5),
                           config)
    assert [(r.target, r.request_rate) for r in result.runs] == [
        ("a", 50.0), ("a", float("inf")), ("b", 50.0), ("b", float("inf"))]
    assert all(r.metrics.completed == 3 for r in result.runs)
    prompts = [tuple(q.token_ids.ids) for q in fake_server.servicer.requests]
    warmup_a, run_a, warmup_b, run_b = prompts[0], prompts[1:7], prompts[7], prompts[8:]
    assert warmup_a == warmup_b and sorted(run_a) == sorted(run_b)
    assert sorted(run_a[:3]) == sorted(run_a[3:])  # each rate: the same requests


def test_failures_are_counted_by_status(fake_server: FakeServer, tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt_token_ids": [999999, 1]}\n{"prompt_token_ids": [1, 2]}\n')
    result_file = tmp_path / "out.json"
    code = main(["bench", "--compare", f"x={fake_server.address}", "--dataset-name", "jsonl",
                 "--dataset-path", str(path), "--num-prompts", "2", "--disable-tqdm",
                 "--result-file", str(result_file)])
    assert code == 1  # some request failed
    data = json.loads(result_file.read_text())
    assert data["failed"] == 1 and data["failures_by_status"] == {"RESOURCE_EXHAUSTED": 1}
    assert sorted(data["statuses"]) == ["OK", "RESOURCE_EXHAUSTED"]
    assert "scripted refusal" in data["errors"]


def test_target_strings() -> None:
    assert parse_target("127.0.0.1:5") == Target("127.0.0.1:5", address="127.0.0.1:5")
    assert parse_target("d=host:7") == Target("d", address="host:7")
    assert parse_target("launch:colocated") == Target("colocated", launch="colocated")
    assert parse_target("base=launch:disagg") == Target("base", launch="disagg")
    for bad in ("nohost", "x=launch:other", "=a:1", "host:port"):
        with pytest.raises(ValueError):
            parse_target(bad)


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--goodput", "speed:1", "--disable-tqdm"]) == 2
    assert main(["bench", "--dataset-name", "sharegpt"]) == 2
    assert "dataset-path" in capsys.readouterr().err


def test_cli_multi_turn_reports_hit_rates(fake_server: FakeServer, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    result_file = tmp_path / "out.json"
    code = main(["bench", "--address", fake_server.address, "--dataset-name", "multi-turn",
                 "--num-prompts", "2", "--num-turns", "3", "--input-len", "10",
                 "--turn-len", "4", "--output-len", "5", "--request-rate", "inf",
                 "--disable-tqdm", "--result-file", str(result_file)])
    assert code == 0
    data = json.loads(result_file.read_text())
    assert data["completed"] == 6 and data["failed"] == 0
    # Turn k: 10 + (k - 1) x (5 answer + 4 message) tokens; per conversation, turn by turn.
    assert data["input_lens"] == [10, 19, 28] * 2
    assert data["tags"] == ["turn-1", "turn-2", "turn-3"] * 2
    assert data["cached_prompt_tokens"] == [5, 9, 14] * 2  # the scripted half
    assert data["prefix_cache_hit_rate"] == pytest.approx(56 / 114)
    assert data["mean_kv_bytes_shipped"] == pytest.approx(10 * (114 - 56) / 6)
    assert data["mean_kv_bytes_not_shipped"] == pytest.approx(10 * 56 / 6)
    prompts = {tuple(r.token_ids.ids) for r in fake_server.servicer.requests}
    assert len(prompts) == 6
    out = capsys.readouterr().out
    assert "Prefix cache hit rate (%):" in out and "K/V bytes shipped per request:" in out
