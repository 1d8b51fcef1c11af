"""`kvferry serve --kv-transport ray --planner-sla ...` as a user runs it: the live planner in
serve's driver scales its own Ray deployment while it serves, and a SIGTERM stops it all.

Its own module, using no shared fixture: serve starts a Ray instance of its own, so this runs
before the suite's shared one (tests/suite_order.py)."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from deploy import client
from tests.deploy.planner.synthetic import make_profile
from tests.deployments import start_serve

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def test_serve_scales_its_ray_deployment_to_the_bounds(qwen3_checkpoint: Path,
                                                       tmp_path: Path) -> None:
    """Started with 1 decode worker and --planner-min-decode 2, the planner adds one as soon
    as an interval has seen requests; generation goes on through it. The profile is trusted as
    it is (--planner-latency-correction 0): what this tiny model measures on a busy machine
    against the synthetic profile would otherwise decide the logged reason (CI saw TTFT
    corrected x10 and "no layout meets" instead of the smallest layout meeting)."""
    profile = make_profile().save(tmp_path / "synthetic.json")
    errors = (tmp_path / "serve.err").open("w+")
    serve, address = start_serve(
        ["--model", str(qwen3_checkpoint), "--kv-transport", "ray", "--port", "0",
         "--http-port", "off", "--kv-pool-size", "32MiB",
         "--planner-sla", "ttft-p90=500,itl-p90=15", "--planner-profile", str(profile),
         "--planner-interval-s", "1", "--planner-patience", "1", "--planner-min-decode", "2",
         "--planner-max-workers", "3", "--planner-latency-correction", "0"], errors)
    try:
        request = client.make_request("hello", temperature=0.0, max_tokens=6, ignore_eos=True)
        first = asyncio.run(client.generate(address, request, 60))
        deadline = time.monotonic() + 120
        log = ""
        while "scale_up 1P+1D -> 1P+2D" not in log and time.monotonic() < deadline:
            got = asyncio.run(client.generate(address, request, 60))
            assert got.token_ids == first.token_ids
            errors.seek(0)
            log = errors.read()
        assert "scale_up 1P+1D -> 1P+2D" in log, log[-3000:]
        after = asyncio.run(client.generate(address, request, 60))
        assert after.token_ids == first.token_ids and len(after.token_ids) == 6
    finally:
        serve.send_signal(signal.SIGTERM)
        code = serve.wait(timeout=120)
    assert code == 0
    errors.seek(0)
    log = errors.read()
    assert "1P+2D is the smallest layout meeting ttft-p90=500,itl-p90=15" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
