"""bench/bench_http_attacks.py: its arguments, the per-repetition ratios, the verdicts, the
report and the JSON without servers; and one tiny run against a real deployment (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.bench_http_attacks import (
    ATTACKS,
    PHASES,
    Phase,
    format_report,
    main,
    parse_args,
    payload,
    ratios,
    summarize,
)
from deploy.launcher import Deployment


def _phase(p99_itl_ms: float) -> Phase:
    return Phase(p99_itl_ms / 4, p99_itl_ms, 500, 8, 0, 1.0, {"connections_closed": 3})


REPS = [{"alone": _phase(10), "header": _phase(11), "half-open": _phase(20),
         "messages": _phase(12)},
        {"alone": _phase(12), "header": _phase(12), "half-open": _phase(12),
         "messages": _phase(15)},
        {"alone": _phase(8), "header": _phase(8.8), "half-open": _phase(16),
         "messages": _phase(8)}]


def test_arguments() -> None:
    args = parse_args([])
    assert (args.repeats, args.half_open, args.attack_bodies, args.header_mib) == (3, 1000, 2,
                                                                                   128)
    assert args.attack is None
    for bad in (["--repeats", "0"], ["--duration-s", "0"], ["--attack", "nope"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_ratios_summary_and_report() -> None:
    assert ratios(REPS, "header") == pytest.approx([1.1, 1.0, 1.1])
    summary = summarize(REPS)
    assert summary["ratios"]["half-open"]["median"] == pytest.approx(2.0)
    assert summary["target"]["header"] == {"ratio_below": 1.5, "is_met": True}
    assert summary["target"]["half-open"]["is_met"] is False
    assert summary["phases"]["alone"]["p99_itl_ms"] == {"median": 10, "low": 8, "high": 12}
    report = format_report(REPS)
    assert "| header | 2.75 [2.20-3.00] | 11.00 [8.80-12.00] | 1.00 [1.00-1.00] | " \
           "1.100 [1.000-1.100] |" in report
    assert "target (half-open: p99 ITL / alone < 1.5): NOT met" in report
    data = json.loads(json.dumps(payload(parse_args([]), "/m/qwen3-tiny", ["--repeats", "3"],
                                         REPS)))
    assert data["command"] == ".venv/bin/python bench/bench_http_attacks.py --repeats 3"
    assert len(data["repetitions"]) == 3 and set(data["repetitions"][0]) == set(PHASES)


@pytest.mark.slow
def test_a_tiny_run_reports_every_phase(chat_deployment: Deployment, tmp_path: Path) -> None:
    """Against the shared deployment with an HTTP front (its router survives the attacks:
    the tests that follow use it)."""
    out = tmp_path / "attacks.json"
    code = main(["--repeats", "1", "--duration-s", "1", "--half-open", "20", "--header-mib", "4",
                 "--attack-bodies", "1", "--output-len", "8", "--out", str(out),
                 "--log-dir", str(tmp_path / "logs")], running=chat_deployment)
    assert code == 0
    data = json.loads(out.read_text())
    (rep,) = data["repetitions"]
    assert set(rep) == set(PHASES)
    assert all(rep[phase]["completed"] > 0 and rep[phase]["failed"] == 0 for phase in PHASES)
    assert rep["header"]["attack"]["connections_closed"] > 0  # cut off at the header cap
    assert rep["messages"]["attack"].get("status_400", 0) > 0  # refused by the message cap
    assert set(data["summary"]["ratios"]) == set(ATTACKS)
