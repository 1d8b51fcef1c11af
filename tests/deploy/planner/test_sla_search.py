"""`kvferry plan --sla`: the SLA's parsing and checking, the layouts tried, the search's
direction, and the command line's answers to good and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.cli import main
from deploy.loadgen.metrics import RequestRecord
from deploy.planner.profile import PrefillPoint
from deploy.planner.search import Sla, goodput, layouts, search
from deploy.planner.simulator import Layout
from deploy.planner.workloads import load_workload
from tests.deploy.planner.synthetic import make_cost, make_profile


def test_an_sla_parses_and_prints_back() -> None:
    sla = Sla.parse("ttft-p90=500,itl-p99=50")
    assert [(t.name, t.percentile, t.ms) for t in sla.targets] == [("ttft", 90, 500),
                                                                    ("itl", 99, 50)]
    assert str(sla) == "ttft-p90=500,itl-p99=50"


@pytest.mark.parametrize("text", ["ttft=500", "tpot-p90=5", "ttft-p0=5", "ttft-p90=0",
                                  "ttft-p90=1,ttft-p50=2", ""])
def test_a_bad_sla_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="sla"):
        Sla.parse(text)


def _rec(ttft: float, itls: tuple[float, ...], status: str = "OK") -> RequestRecord:
    return RequestRecord(10, len(itls) + 1, 0.0, ttft, itls, ttft + sum(itls), status)


def test_the_sla_reads_percentiles_and_attainment_reads_requests() -> None:
    sla = Sla.parse("ttft-p50=100,itl-p50=10")
    records = [_rec(0.05, (0.005,) * 4), _rec(0.2, (0.005,) * 4), _rec(0.08, (0.02,) * 4)]
    assert dict((t.name, v) for t, v in sla.values(records)) == pytest.approx(
        {"ttft": 80.0, "itl": 5.0})
    assert sla.is_met(records)
    assert sla.attainment(records) == pytest.approx(1 / 3)  # only the first meets both
    assert not sla.is_met([*records, _rec(0.0, (), "UNAVAILABLE")])


def test_layouts_are_every_split_within_the_budget() -> None:
    found = layouts(3, thresholds=(0, 64))
    assert [str(x) for x in found] == [
        "1 colocated", "2 colocated", "3 colocated", "1P+1D", "1P+1D, local prefill < 64",
        "1P+2D", "1P+2D, local prefill < 64", "2P+1D", "2P+1D, local prefill < 64"]
    with pytest.raises(ValueError, match="max_workers"):
        layouts(0)


def test_goodput_grows_with_workers_and_zero_when_out_of_reach() -> None:
    cost = make_cost()
    requests, _ = load_workload("256:32", 200)
    sla = Sla.parse("ttft-p90=200,itl-p90=100")
    one = goodput(cost, Layout(1, 1), requests, sla, 0.1, 1000)
    two = goodput(cost, Layout(2, 1), requests, sla, 0.1, 1000)
    assert 0 < one < two
    assert goodput(cost, Layout(1, 1), requests, Sla.parse("ttft-p90=1"), 0.1, 1000) == 0


def test_the_split_follows_the_work() -> None:
    """Long prompts with short answers want prefill workers; short prompts with long answers
    at a tight ITL want decode workers."""
    cost = make_cost()
    candidates = [Layout(1, 2), Layout(2, 1)]
    prefill_heavy, _ = load_workload("2000:4", 200)
    best = search(cost, prefill_heavy, Sla.parse("ttft-p90=2000,itl-p90=100"), candidates)
    assert str(best[0].layout) == "2P+1D"
    decode_heavy, _ = load_workload("32:200", 100)  # 400-token answers choose the same, 4x slower
    best = search(cost, decode_heavy, Sla.parse("ttft-p90=500,itl-p90=12"), candidates)
    assert str(best[0].layout) == "1P+2D"
    assert best[0].goodput > best[1].goodput


def test_with_a_rate_the_fewest_workers_that_meet_it_win() -> None:
    cost = make_cost()
    requests, _ = load_workload("256:32", 200)
    sla = Sla.parse("ttft-p90=300,itl-p90=100")
    outcomes = search(cost, requests, sla, layouts(3), rate=1.0)
    assert outcomes[0].layout.num_workers == 1 and outcomes[0].goodput >= 1.0
    assert outcomes[0].rate == 1.0


def test_a_trace_keeps_its_arrivals(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps({"arrival_s": t, "prompt_len": 10, "output_len": 5})
                              for t in (5.0, 5.5, 7.0)) + "\n")
    requests, rate = load_workload(str(path), 100)
    assert rate == pytest.approx(1.0)  # 2 gaps over 2 s
    assert [r.arrival_s for r in requests] == pytest.approx([0.0, 0.5, 2.0])


@pytest.mark.parametrize("text, says", [("100", "IN:OUT"), ("100:0", "IN:OUT"),
                                        ("1:2:-1", "WEIGHT")])
def test_a_bad_mix_is_refused(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        load_workload(text, 10)


@pytest.fixture
def profile_file(tmp_path: Path) -> Path:
    return make_profile().save(tmp_path / "profile.json")


def test_plan_recommends_a_layout(profile_file: Path, capsys: pytest.CaptureFixture) -> None:
    code = main(["plan", "--sla", "ttft-p90=300,itl-p90=50", "--workload", "256:32",
                 "--profile", str(profile_file), "--max-workers", "2",
                 "--num-requests", "100"])
    out = capsys.readouterr().out
    assert code == 0
    assert "recommendation:" in out and "1P+1D" in out and "2 colocated" in out


@pytest.mark.parametrize("argv, says", [
    (["--sla", "ttft=5", "--workload", "10:10"], "sla: expected NAME-pNN=MS"),
    (["--sla", "ttft-p90=5"], "give --sla and --workload together"),
    (["--sla", "ttft-p90=5", "--workload", "nope"], "workload: expected IN:OUT"),
    (["--sla", "ttft-p90=5", "--workload", "10:10", "--max-workers", "0"], "max_workers"),
    (["--sla", "ttft-p90=5", "--workload", "10:10", "--local-prefill-thresholds", "x"],
     "local_prefill_thresholds"),
])
def test_plan_says_what_is_wrong_in_one_line(profile_file: Path, argv: list[str], says: str,
                                             capsys: pytest.CaptureFixture) -> None:
    code = main(["plan", "--profile", str(profile_file), *argv])
    err = capsys.readouterr().err
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1


def test_plan_without_a_profile_says_how_to_make_one(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    code = main(["plan", "--sla", "ttft-p90=5", "--workload", "10:10",
                 "--profile", str(tmp_path / "none.json")])
    assert code == 2 and "none.json" in capsys.readouterr().err


def test_a_profile_with_one_prefill_point_still_fits() -> None:
    profile = make_profile(prefill=(PrefillPoint(64, 64 * 64, 0.01),))
    cost = make_cost(prefill=profile.prefill)
    assert cost.prefill_s(64, 64 * 64) == pytest.approx(0.01)
