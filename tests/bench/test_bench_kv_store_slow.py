"""bench/bench_kv_store_slow.py without servers: its defaults, the figures it takes from
TTFTs, and the report (ratios within each repetition, median and range). Its run was run by
hand (the figures are in docs/performance.md)."""

from __future__ import annotations

import pytest

from bench import bench_kv_store_slow as bench
from bench.bench_kv_store_slow import Figures, figures, format_report, summary


def test_defaults_stay_quick() -> None:
    args = bench.parse_args([])
    assert (args.model, args.repeats, args.requests) == ("tiny", 3, 24)
    assert args.deadline_ms < args.delay_ms < args.waiting_deadline_ms


def test_figures_and_report() -> None:
    got = figures([0.010, 0.020, 0.030, 0.040, 1.0])
    assert got.ttft_p50_ms == pytest.approx(30.0) and got.ttft_p99_ms > 900
    runs = {"none": [Figures(20, 30), Figures(22, 33), Figures(18, 27)],
            "slow": [Figures(20, 60), Figures(22, 33), Figures(27, 27)],
            "waiting": [Figures(600, 650), Figures(660, 660), Figures(540, 540)]}
    args = bench.parse_args([])
    report = format_report(runs, args, ["disabled", "disabled"])
    assert "ttft_p50_ms slow / none: 1.00 [1.00-1.50]" in report
    assert "ttft_p99_ms slow / none: 1.00 [1.00-2.00]" in report
    assert "ttft_p50_ms waiting / none: 30.00 [30.00-30.00]" in report
    assert "disabled, disabled" in report
    assert summary(runs)["slow/none"]["ttft_p99_ms"].high == pytest.approx(2.0)
