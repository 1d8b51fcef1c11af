"""bench/bench_prefix_cache.py: its arguments, the paired ratios against the targets, the
report and JSON, skipped policies (all without servers), and one --quick run of one of its
four deployments (multi-turn chats, headroom routing) on the tiny model (slow: it starts
real processes; one deployment, about 30 s, where all four take about 100 s)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench import bench_prefix_cache as bench
from bench.bench_prefix_cache import (
    FULL,
    QUICK,
    Figures,
    Setup,
    format_report,
    parse_args,
    payload,
    ratio,
    ratios,
    run_all,
)

REPO = Path(__file__).resolve().parents[2]


def _figures(ttft_ms: float, kv_bytes: float, failed: int = 0) -> Figures:
    return Figures(ttft_ms, 2 * ttft_ms, 0.5, kv_bytes, 0.0, 8, failed)


def test_defaults_and_quick_mode() -> None:
    args = parse_args([])
    assert args.repeats == 3 and args.policies == ["prefix", "headroom"]
    assert args.runs == ["cache-on", "cache-off", "prefix-routing", "headroom-routing",
                         "headroom-no-cache"]
    assert all(getattr(args, name) == value for name, value in FULL.items())
    assert (args.prefix_len, args.num_prefixes) == (1000, 4)  # the shared prefixes
    assert args.worker_args == ["--kv-pool-size", "64MiB"]  # every worker's cache is bounded
    assert parse_args(["--quick"]).worker_args == []  # --quick: the workers' own pool size
    quick = parse_args(["--quick", "--prefix-len", "32"])
    assert quick.prefix_len == 32  # a flag given wins over --quick's value
    assert all(getattr(quick, n) == v for n, v in QUICK.items() if n != "prefix_len")


@pytest.mark.parametrize("argv", [["--policies", "prefix"], ["--policies", "a,a"],
                                  ["--repeats", "0"], ["--runs", "cache-on,nope"],
                                  ["--runs", ""]])
def test_bad_input_exits_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2


def test_ratios_pair_runs_of_the_same_repetition() -> None:
    runs = {"cache-on": [_figures(10, 100), _figures(20, 100), _figures(10, 100)],
            "cache-off": [_figures(40, 100), _figures(50, 100), _figures(20, 100)],
            "prefix-routing": [_figures(10, 100), _figures(10, 0)],
            "headroom-routing": [_figures(12, 600), _figures(9, 800)]}
    ttft, kv, routed_ttft, kv_no_cache, ttft_no_cache = ratios(["prefix", "headroom"])
    assert (kv_no_cache.numerator, kv_no_cache.denominator) == ("headroom-no-cache",
                                                                "prefix-routing")
    assert ttft_no_cache.is_strict and kv_no_cache.target == 5.0
    assert ttft.values(runs) == [4.0, 2.5, 2.0]  # off / on, repetition by repetition
    assert kv.values(runs) == [6.0, math.inf]  # nothing shipped with prefix routing: inf
    assert routed_ttft.values(runs) == [1.2, 0.9]
    assert not ttft.is_met(2.5) and ttft.is_met(3.0)
    assert not routed_ttft.is_met(1.0) and routed_ttft.is_met(1.05)  # strictly lower
    assert math.isnan(ratio(0.0, 0.0))
    args = parse_args(["--repeats", "3"])
    table = format_report(args, runs)
    assert "2.50 [2.00-4.00]  target >= 3x" in table and "NOT met" in table
    assert "target > 1 (lower)" in table
    assert "cache-off" in table and "40.0 [20.0-50.0]" in table  # TTFT p50 medians, ms


def test_payload_has_no_absolute_paths_and_no_bare_inf() -> None:
    args = parse_args(["--quick", "--out", "/root/x.json", "--log-dir", "/root/logs"])
    runs = {"prefix-routing": [_figures(10, 0)], "headroom-routing": [_figures(12, 600)]}
    data = payload(args, "/root/.cache/kvferry/models/qwen3-tiny", runs, ["a note"])
    text = json.dumps(data, allow_nan=False)  # fails on a bare inf or nan
    assert "/root" not in text and data["checkpoint"] == "qwen3-tiny"
    assert data["model"] == "tiny" and data["notes"] == ["a note"]
    kv = data["ratios"]["K/V bytes shipped per request, headroom-routing / prefix-routing"]
    assert kv == {"target": ">= 5x", "values": ["inf"], "median": "inf", "is_met": True}
    assert data["ratios"]["median TTFT, cache off / on"]["median"] is None  # not run
    assert data["runs"]["headroom-routing"][0]["kv_bytes_shipped"] == 600


def test_runs_interleave_and_skip_unknown_policies(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    seen: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = []

    def fake_run_once(setup: Setup, model: str, args, log_dir: Path) -> Figures:
        seen.append((setup.name, setup.worker_args, setup.router_args))
        return _figures(10, 100)

    monkeypatch.setattr(bench, "run_once", fake_run_once)
    monkeypatch.setattr(bench, "POLICIES", ("headroom", "round_robin"))
    args = parse_args(["--repeats", "2", "--policies", "prefix,headroom"])
    runs = run_all(args, "/m", tmp_path)
    names = ["cache-on", "cache-off", "headroom-routing", "headroom-no-cache"]
    assert [name for name, _, _ in seen] == names * 2
    assert seen[1][1] == ("--no-prefix-caching",) and seen[0][1] == ()
    assert seen[2][2] == ("--local-prefill-threshold", "128", "--policy", "headroom")
    assert seen[3][1] == ("--no-prefix-caching",) and seen[3][2] == seen[2][2]
    assert set(runs) == set(names)
    assert "not measured" in format_report(args, runs)


@pytest.mark.slow
def test_quick_run_on_the_tiny_model(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    result = subprocess.run(
        # Threshold 0: every turn is prefilled on a prefill worker and pushed (the quick
        # prompts are shorter than the default threshold, which would keep them local).
        [sys.executable, "bench/bench_prefix_cache.py", "--quick", "--runs", "headroom-routing",
         "--local-prefill-threshold", "0", "--out", str(out), "--log-dir", str(tmp_path / "logs")],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(out.read_text())
    assert list(data["runs"]) == ["headroom-routing"]
    chats = data["runs"]["headroom-routing"][0]
    num_requests = QUICK["conversations"] * QUICK["num_turns"]  # every turn is a request
    assert (chats["num_completed"], chats["num_failed"]) == (num_requests, 0)
    assert 0.0 <= chats["hit_rate"] <= 1.0 and chats["kv_bytes_shipped"] > 0
    assert 0 < chats["ttft_p50_ms"] <= chats["ttft_p99_ms"]
    assert "not measured" in result.stdout  # the other half of each pair did not run
    logs = list((tmp_path / "logs").glob("r0/headroom-routing/*.log"))
    assert len(logs) == 5 and not any("Traceback" in log.read_text() for log in logs)
