"""Load: a short soak (bench/soak.py) on the shared deployment, before any other
test. Concurrent clients with mixed lengths, cancels and aborts for ~20 s after a warm-up:
no unexpected error, every pool all free at the end, no process grew its resident memory by
10% or more after warm-up. The full, minutes-long run and its figures are in
docs/reliability.md.
First on the shared deployment (FIRST_ON_SHARED: tests/suite_order.py), so that what earlier
tests left behind is not counted as the soak's growth: when the CPU decode path kept a dense
K/V stage (decode_worker/kv_stage.py, now only where attention cannot read pages in place),
earlier tests' prompts of thousands of tokens made the soak's batch of 8 rows double it after
the warm-up measurement (decode-0 +13.6% in one CI run)."""

from __future__ import annotations

import pytest

from bench.soak import run_soak
from deploy.launcher import Deployment
from tests.conftest import assert_alive

pytestmark = pytest.mark.slow
FIRST_ON_SHARED = True  # tests/suite_order.py


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
