"""bench/bench_waves.py without servers: prefill forwards and the decode steps during each,
read from a trace folder. Its runs on the real model were run by hand
(bench/results/bench_waves_smollm2.json)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.bench_waves import read_events, waves


def test_forwards_after_the_loop_began_and_the_steps_during_each(tmp_path: Path) -> None:
    prefill = [{"ev": "prefill", "t0": 0.5, "t1": 0.9, "ids": ["w"], "tokens": 64},  # warm-up
               {"ev": "prefill", "t0": 1.0, "t1": 1.2, "ids": ["a"], "tokens": 64},
               {"ev": "prefill", "t0": 1.2, "t1": 2.0, "ids": ["b"], "tokens": 448}]
    steps = [{"ev": "step", "s": s, "t0": t, "t1": t + 0.05, "ids": ["a"]}
             for s, t in enumerate([1.25, 1.4, 1.9, 2.1])]
    (tmp_path / "prefill-1.jsonl").write_text("".join(json.dumps(e) + "\n" for e in prefill))
    (tmp_path / "decode-2.jsonl").write_text("\n".join(json.dumps(e) for e in steps) + "\n\n")
    events = read_events(tmp_path)
    assert len(events) == 7
    assert waves(events, since=1.0) == ([64, 448], [0, 3])
