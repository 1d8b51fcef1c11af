"""bench/bench_http_front.py: its arguments, the per-repetition ratios, the verdicts, the
report and the JSON (without servers)."""

from __future__ import annotations

import json

import pytest

from bench.bench_http_front import (
    FIGURES,
    Figures,
    format_report,
    parse_args,
    payload,
    ratios,
    summarize,
)


def _figures(ttft_ms: float, itl_ms: float) -> Figures:
    return Figures(ttft_ms, 2 * ttft_ms, itl_ms, 3 * itl_ms, itl_ms, 64.0, 10, 0, 640)


REPS = [{"grpc": _figures(100, 10), "http": _figures(104, 13), "http-ids": _figures(104, 10.5)},
        {"grpc": _figures(120, 12), "http": _figures(120, 15), "http-ids": _figures(120, 13.2)},
        {"grpc": _figures(80, 8), "http": _figures(84, 10), "http-ids": _figures(84, 8.4)}]


def test_arguments() -> None:
    args = parse_args([])
    assert (args.repeats, args.num_prompts, args.request_rate) == (5, 40, 4.0)
    assert args.backend == "openai-completions"
    assert args.fronts == ["grpc", "http", "http-ids"]
    assert parse_args(["--fronts", "grpc,http-ids"]).fronts == ["grpc", "http-ids"]
    for bad in (["--repeats", "0"], ["--fronts", "http,grpc"], ["--fronts", "grpc"],
                ["--fronts", "grpc,http,http"], ["--fronts", "grpc,vllm"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_ratios_are_taken_within_each_repetition() -> None:
    assert ratios(REPS, "http-ids")["p50_ttft_ms"] == pytest.approx([1.04, 1.0, 1.05])
    assert ratios(REPS, "http-ids")["p50_itl_ms"] == pytest.approx([1.05, 1.1, 1.05])
    summary = summarize(REPS)
    assert summary["fronts"]["grpc"]["p50_ttft_ms"] == {"median": 100, "low": 80, "high": 120}
    assert summary["ratios"]["http-ids"]["p50_itl_ms"]["median"] == pytest.approx(1.05)
    assert summary["target"]["http-ids"] == {
        "ratio_below": 1.10, "is_met": True,
        "figures": {"p50_ttft_ms": True, "p50_itl_ms": True}}
    assert summary["target"]["http"]["figures"] == {"p50_ttft_ms": True, "p50_itl_ms": False}
    assert "grpc" not in summary["ratios"] and "grpc" not in summary["target"]


def test_report_and_json() -> None:
    report = format_report(REPS)
    assert report.splitlines()[0] == ("| figure | grpc | http | http-ids | http / grpc "
                                      "| http-ids / grpc |")
    assert "| p50 ttft (ms) | 100.00 [80.00-120.00] | 104.00 [84.00-120.00] |" in report
    assert "target (http-ids / grpc < 1.1 at p50, TTFT and ITL): met" in report
    assert "target (http / grpc < 1.1 at p50, TTFT and ITL): NOT met" in report
    data = json.loads(json.dumps(payload(parse_args([]), "/m/qwen3-tiny", ["--repeats", "3"],
                                         REPS)))
    assert data["command"] == ".venv/bin/python bench/bench_http_front.py --repeats 3"
    assert data["checkpoint"] == "qwen3-tiny" and len(data["repetitions"]) == 3
    assert set(data["summary"]["ratios"]["http"]) == set(FIGURES)
