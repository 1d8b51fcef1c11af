"""Issue 9, load: a short soak (bench/soak.py) against the test deployment. Concurrent clients
with mixed lengths, cancels and aborts for ~20 s after a warm-up: no unexpected error, every
pool all free at the end, no process grew its resident memory by 10% or more after warm-up.
The full, minutes-long run and its figures are in docs/reliability.md."""

from __future__ import annotations

import pytest

from bench.soak import run_soak
from deploy.launcher import Deployment
from tests.conftest import assert_alive

pytestmark = pytest.mark.slow


def test_short_soak(qwen3_deployment: Deployment) -> None:
    report = run_soak(qwen3_deployment, warmup_s=8.0, duration_s=20.0, concurrency=8, seed=3)
    soak = report.soak
    assert soak.unexpected == []
    assert report.warmup.unexpected == []
    assert soak.num_completed > 0 and soak.num_cancelled > 0 and soak.num_aborted > 0
    assert report.pools_free, report.pool_problems
    assert_alive(qwen3_deployment)
    grown = [(m.name, f"{m.growth:.1%}") for m in report.memory if m.growth >= 0.10]
    assert grown == [], f"RSS grew after warm-up: {grown}"
