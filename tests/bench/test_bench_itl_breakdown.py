"""bench/bench_itl_breakdown.py without servers: the per-token stages joined from a written
trace folder, the quantiles and the table. Its run on the real model was run by hand
(bench/results/bench_itl_breakdown_smollm2.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import bench_itl_breakdown as bench
from bench.bench_itl_breakdown import (
    across,
    format_table,
    load_writes,
    quantile,
    summarize,
    token_stages,
)
from deploy.loadgen.trace_load import load


def _write(path: Path, events: list[dict]) -> None:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))


def _folder(tmp_path: Path, merged: bool = False) -> Path:
    """One request "bench-itl-inf-0" (downstream "d0") of 4 tokens: token 0 from prefill,
    tokens 1-3 from steps 1-3 of 50 ms each, 10 ms apart; each token delivered 1 ms after
    its step, handed to gRPC 0.5 ms later, read by the router 2 ms later, relayed in 3 ms
    and arriving 1 ms after. `merged`: tokens 2 and 3 come in one update."""
    steps, delivers, writes, relays, arrivals = [], [], [], [], [0.0]
    relays.append({"ev": "relay", "id": "bench-itl-inf-0", "down": "d0", "n": 1,
                   "t_in": -0.004, "t_out": -0.001})
    for s in (1, 2, 3):
        t0 = 0.010 + (s - 1) * 0.060
        t1 = t0 + 0.050
        steps.append({"ev": "step", "s": s, "t0": t0, "t1": t1, "ids": ["d0"],
                      "cpu": 0.040, "pcpu": 0.045, "p0": 0.0, "p1": 0.0})
        delivers.append({"ev": "deliver", "t": t1 + 0.001, "s": s})
        writes.append({"ev": "write", "t0": t1 + 0.0015, "t1": t1 + 0.0016, "ids": ["d0"],
                       "n": [1]})
        if merged and s == 2:
            continue
        relays.append({"ev": "relay", "id": "bench-itl-inf-0", "down": "d0",
                       "n": 2 if merged and s == 3 else 1,
                       "t_in": t1 + 0.0035, "t_out": t1 + 0.0065})
        arrivals.append(t1 + 0.0075)
    _write(tmp_path / "decode-10.jsonl", steps + delivers + writes)
    _write(tmp_path / "router-11.jsonl", relays)
    _write(tmp_path / "client-12.jsonl", [
        {"ev": "arrivals", "id": "bench-itl-inf-0", "tag": "", "phase": "bench-itl-inf",
         "t": arrivals, "n": [1] * len(arrivals)},
        {"ev": "arrivals", "id": "bench-warmup-inf-0", "tag": "", "phase": "bench-warmup-inf",
         "t": [0.0, 1.0, 2.0], "n": [1, 1, 1]}])
    return tmp_path


def test_token_stages_split_each_token(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    tokens = token_stages(load(folder), load_writes(folder), "bench-itl-inf")
    assert [t.k for t in tokens] == [2, 3]  # token 1 joins the batch: not steady state
    for t in tokens:
        v = t.values
        assert v["step"] == pytest.approx(0.050)
        assert v["between"] == pytest.approx(0.010)
        assert (v["step_cpu"], v["step_gil"]) == pytest.approx((0.040, 0.005))
        assert v["step_desched"] == pytest.approx(0.005)
        assert v["loop_hop"] == pytest.approx(0.001)
        assert v["to_write"] == pytest.approx(0.0005)
        assert v["to_router"] == pytest.approx(0.002)
        assert v["relay"] == pytest.approx(0.003)
        assert v["to_client"] == pytest.approx(0.001)
        assert v["latency"] == pytest.approx(0.0075)
        assert v["cycle"] == pytest.approx(v["step"] + v["between"])
        assert v["itl"] == pytest.approx(0.060)
        assert v["other_cpu"] == pytest.approx(0.005)


def test_a_merged_update_is_skipped(tmp_path: Path) -> None:
    folder = _folder(tmp_path, merged=True)
    assert token_stages(load(folder), load_writes(folder), "bench-itl-inf") == []


def test_quantiles_summary_and_table() -> None:
    assert quantile([3.0, 1.0, 2.0, 4.0, 5.0], 0.5) == 3.0
    assert quantile([0.0, 10.0], 0.1) == pytest.approx(1.0)
    values = {stage: 0.001 for stage in bench.STAGES}
    runs = [summarize([bench.TokenStages("r", 2, {**values, "itl": itl, "step": step})])
            for itl, step in ((0.090, 0.060), (0.100, 0.050), (0.080, 0.055))]
    assert runs[0]["itl"] == pytest.approx((90.0, 90.0, 90.0))
    agg = across(runs)
    assert agg["itl"] == pytest.approx((80.0, 90.0, 100.0))
    assert agg["step"] == pytest.approx((50.0, 55.0, 60.0))
    table = format_table(runs)
    assert "client ITL" in table and "across reps" in table
    assert "step / ITL 0.61" in table


def test_defaults() -> None:
    args = bench.parse_args([])
    assert (args.model, args.repeats, args.input_len, args.output_len) == ("tiny", 3, 64, 128)
    with pytest.raises(SystemExit):
        bench.parse_args(["--warmups", "0"])


def test_processes_table() -> None:
    def run(decode_s: float) -> dict:
        return {"processes": {
            "serve": {"cpus": "0-1", "cpu_s": 0.0, "threads": {}},
            "decode": {"cpus": "1", "cpu_s": decode_s,
                       "threads": {"decode-step_0": decode_s - 1, "python": 1.0}}}}
    table = bench.format_processes([run(30.0), run(34.0), run(32.0)], num_tokens=400)
    assert "serve" not in table
    assert "decode     1" in table and "32.00 [30.00-34.00]" in table
    assert "80.00" in table and "decode-step_0 29.0" in table
