"""`kvferry bench` end to end against the scripted server: JSON, table, plots, --compare."""

from __future__ import annotations

import json
import re
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
    # every output names the model and the workload, the workload as fields
    assert out.startswith("scripted-model; RandomWorkload(input_len=6, output_len=5")
    assert data["model"] == "scripted-model" and data["models"] == ["scripted-model"]
    assert data["workload"]["kind"] == "RandomWorkload" and data["workload"]["input_len"] == 6


def test_plots_are_titled_from_zero_and_tell_rates_apart(fake_server: FakeServer,
                                                        tmp_path: Path) -> None:
    """The model and workload in words in each title, axes from 0, the achieved rate on the
    x axes, a throughput plot, and in the TTFT-vs-ITL scatter a marker per rate (a legend
    entry per target and rate)."""
    from deploy.loadgen import plots

    config = BenchConfig(num_requests=3, request_rates=(40.0, 80.0), seed=2)
    result = run_benchmark([fake_server.address],
                           RandomWorkload(input_len=4, output_len=4, range_ratio=0.0), config)
    plt = plots._pyplot()
    figures: list = []
    real_close = plt.close
    plt.close = lambda fig: figures.append(fig)  # keep them to look at
    try:
        plots.write_plots(result, tmp_path / "plots")
    finally:
        plt.close = real_close
    rate_fig, throughput_fig, scatter_fig = figures
    words = "scripted-model - random workload: input_len 4, output_len 4"
    for fig in (rate_fig, throughput_fig):
        assert fig._suptitle.get_text().startswith(words)
    for ax in rate_fig.axes + throughput_fig.axes + scatter_fig.axes:
        assert ax.get_ylim()[0] == 0 and ax.get_xlim()[0] == 0
    achieved = sorted(run.metrics.request_throughput for run in result.runs)
    assert sorted(rate_fig.axes[0].lines[0].get_xdata()) == achieved  # not 40 and 80
    assert rate_fig.axes[2].get_xlabel() == "achieved request rate (req/s)"
    assert throughput_fig.axes[0].get_ylabel() == "tokens/s"
    assert list(throughput_fig.axes[0].lines[0].get_ydata()) == [
        run.metrics.output_throughput for run in sorted(
            result.runs, key=lambda r: r.metrics.request_throughput)]
    scatter = scatter_fig.axes[0]
    assert scatter.get_title().startswith(words)
    labels = [t.get_text() for t in scatter.get_legend().get_texts()]
    assert labels == [f"{fake_server.address} @ 40 req/s", f"{fake_server.address} @ 80 req/s"]
    markers = {c.get_paths()[0].vertices.tobytes() for c in scatter.collections}
    assert len(markers) == 2  # one marker shape per rate
    for fig in figures:
        real_close(fig)


@pytest.mark.parametrize("reuse", [False, True], ids=["fresh per rate", "--reuse-prompts"])
def test_compare_sends_the_same_requests_and_each_rate_fresh_ones(
        fake_server: FakeServer, reuse: bool) -> None:
    """Targets are compared on the same requests; a later rate of a sweep sends prompts of
    its own (the second rate hit what the first had cached, and TTFT fell as load
    rose), unless --reuse-prompts. Every run names the model its target serves."""
    config = BenchConfig(num_requests=3, request_rates=(50.0, float("inf")), seed=5,
                         num_warmups=1, reuse_prompts=reuse)
    result = run_benchmark([f"a={fake_server.address}", Target("b", fake_server.address)],
                           RandomWorkload(input_len=4, output_len=3, range_ratio=0.5),
                           config)
    assert [(r.target, r.request_rate) for r in result.runs] == [
        ("a", 50.0), ("a", float("inf")), ("b", 50.0), ("b", float("inf"))]
    assert all(r.metrics.completed == 3 for r in result.runs)
    assert {r.model for r in result.runs} == {"scripted-model"} and \
        result.models == ["scripted-model"]
    assert result.workload_params["kind"] == "RandomWorkload"
    assert result.workload_params["input_len"] == 4
    prompts = [tuple(q.token_ids.ids) for q in fake_server.servicer.requests]
    warmup_a, run_a, warmup_b, run_b = prompts[0], prompts[1:7], prompts[7], prompts[8:]
    assert warmup_a == warmup_b and sorted(run_a) == sorted(run_b)
    assert sorted(run_a[:3]) == sorted(run_b[:3])  # a rate: the same requests everywhere
    assert (sorted(run_a[:3]) == sorted(run_a[3:])) == reuse


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


@pytest.mark.parametrize("model", ["default", "tiny"])
def test_launch_targets_serve_the_model_asked_and_log_to_a_folder(
        model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`launch:` targets serve the real default model unless told (as
    serve does); their servers log to a folder bench names, not to the terminal; an OpenAI
    launch target's tokenizer is the launched model's. The launch itself is not run here."""
    from deploy import default_model
    from deploy.loadgen import cli as bench_cli

    seen = {}

    def fake_run(targets, workload, config, launch):  # noqa: ANN001, ANN202
        seen.update(launch=launch, config=config)
        raise ValueError("stop here")

    monkeypatch.setattr(bench_cli, "run_benchmark", fake_run)
    monkeypatch.setattr(bench_cli, "KVFERRY_HOME", tmp_path)
    argv = ["bench", "--compare", "launch:disagg", "openai-chat:launch:colocated",
            "--num-prompts", "2", "--disable-tqdm"]
    assert main(argv if model == "default" else [*argv, "--model", model]) == 2
    expected = default_model.bench_model(model)
    assert seen["launch"].model == expected
    assert str(seen["config"].tokenizer) == expected
    log_dir = seen["launch"].log_dir
    assert log_dir.parent == tmp_path / "logs" and log_dir.name.startswith("bench-")
    assert f"launched deployments log to {log_dir}" in capsys.readouterr().err


def test_a_keyed_router_is_benchmarked_with_its_key(fake_server: FakeServer, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`--api-key` (or $KVFERRY_API_KEY) goes with every call, GetModelInfo included, as
    `generate` and `chat` send it."""
    common = ["bench", "--address", fake_server.address, "--num-prompts", "2",
              "--input-len", "4", "--output-len", "5", "--disable-tqdm"]
    assert main([*common, "--api-key", "k1"]) == 0
    assert fake_server.servicer.keys == ["Bearer k1"] * 3
    fake_server.servicer.keys.clear()
    monkeypatch.setenv("KVFERRY_API_KEY", "k2")
    assert main(common) == 0
    assert fake_server.servicer.keys == ["Bearer k2"] * 3


def test_a_sweep_table_has_units_and_the_results_are_kept_with_a_seed_hint(
        fake_server: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    """Without --goodput no empty goodput column; every figure's unit in its header; the
    JSON written without --result-file (its path said); the default seed's rerun hint."""
    code = main(["bench", "--address", fake_server.address, "--num-prompts", "3",
                 "--input-len", "4", "--output-len", "4", "--request-rate", "40", "80",
                 "--disable-tqdm"])
    assert code == 0
    captured = capsys.readouterr()
    header = next(line for line in captured.out.splitlines() if line.startswith("| target"))
    assert "rate (req/s)" in header and "p50 TTFT (ms)" in header and "p99 ITL (ms)" in header
    assert "goodput" not in header
    kept = Path(re.search(r"results: (\S+\.json)", captured.err).group(1))  # type: ignore[union-attr]
    assert json.loads(kept.read_text())["config"]["request_rates"] == [40.0, 80.0]
    kept.unlink()
    assert "prompts from --seed 0 (the default)" in captured.err
    assert main(["bench", "--address", fake_server.address, "--num-prompts", "2",
                 "--input-len", "4", "--output-len", "4", "--request-rate", "40", "80",
                 "--disable-tqdm", "--seed", "5", "--goodput", "ttft:1000",
                 "--result-file", "/dev/null"]) == 0
    captured = capsys.readouterr()
    assert "goodput (req/s)" in captured.out and "--seed" not in captured.err


def test_ctrl_c_reports_the_requests_already_finished(fake_server: FakeServer,
                                                      tmp_path: Path) -> None:
    """SIGINT mid-run: the table and the JSON count what had finished, the run says it was
    interrupted, and the exit code is 130."""
    import signal
    import subprocess
    import sys

    from tests.waiting import until_sync

    result_file = tmp_path / "cut.json"
    bench = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "bench", "--address", fake_server.address,
         "--num-prompts", "200", "--input-len", "4", "--output-len", "4", "--request-rate",
         "4", "--disable-tqdm", "--result-file", str(result_file)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    until_sync(lambda: len(fake_server.servicer.requests) >= 4, "a few requests sent")
    bench.send_signal(signal.SIGINT)
    out, err = bench.communicate(timeout=60)
    assert bench.returncode == 130, err[-2000:]
    assert "(interrupted)" in out and "interrupted (Ctrl-C)" in err
    data = json.loads(result_file.read_text())
    assert data["interrupted"] and 1 <= data["completed"] < 200
