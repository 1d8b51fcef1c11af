"""Tensor-parallel workers over NIXL (tests/e2e/test_tensor_parallel_workers.py): the decode
worker READs whole pages from the prefill worker's staging (kvferry/transfer/nixl/staging.py)
where the prefill side is split, and into staging, then the ranks, where the decode side is.
Greedy tokens equal transformers' for each pair of sizes."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.launcher import Deployment
from tests.deployments import routed
from tests.e2e.test_tensor_parallel_workers import (
    SIZE_IDS,
    SIZES,
    sizes_reported,
    split_workers,
)
from tests.e2e.test_token_exact import _check_greedy

pytestmark = pytest.mark.slow

@pytest.mark.parametrize("sizes", SIZES, ids=SIZE_IDS)
def test_greedy_over_nixl_matches_transformers(sizes: tuple[int, int], qwen3_checkpoint: Path,
                                               qwen3_nixl_deployment: Deployment) -> None:
    """prefill-0 and decode-0 of the shared NIXL deployment split (P, D) ways, behind a
    router of their own (the deployment's router would also use the other pair); its decode
    workers speculate (n-gram drafts) too."""
    deployment = qwen3_nixl_deployment
    with split_workers(deployment, *sizes), \
            routed(deployment, "router-tp-nixl", [], only=["prefill-0", "decode-0"]) as view:
        assert sizes_reported(view) == {"prefill": sizes[0], "decode": sizes[1]}
        _check_greedy(qwen3_checkpoint, view)
        log = (deployment.log_dir / "decode-0.log").read_text()
        assert "nixl K/V transport" in log
