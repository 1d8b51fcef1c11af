"""The host tier end to end on a colocated worker: the case of
tests/e2e/test_kv_tiers.py, in a module of its own so that it runs with the colocated
deployment's other users (tests/suite_order.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.launcher import Deployment
from tests.e2e.test_kv_tiers import HOST, host_round_trip, tiered

pytestmark = pytest.mark.slow


def test_a_prefix_pushed_out_of_the_pool_comes_back_from_host_memory_colocated(
        colocated_deployment: Deployment, qwen3_checkpoint: Path) -> None:
    with tiered(colocated_deployment, ["colocated-0"], HOST,
                "router-tiers-colocated") as deployment:
        host_round_trip(deployment, qwen3_checkpoint)
