"""Tensor-parallel workers as Ray actors, each side split its way
(tests/e2e/test_tensor_parallel_workers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvferry.faults import FAULTS_ENV, PER_REQUEST
from tests.conftest import ORACLE_DTYPE
from tests.e2e.test_tensor_parallel_workers import SIZE_IDS, SIZES, sizes_reported
from tests.e2e.test_token_exact import _check_greedy

pytestmark = [pytest.mark.slow, pytest.mark.ray]


@pytest.mark.parametrize("sizes", SIZES, ids=SIZE_IDS)
def test_greedy_over_ray_matches_transformers(sizes: tuple[int, int], qwen3_checkpoint: Path,
                                              ray_session: None) -> None:
    """Workers as Ray actors (pages through Ray's object store), each side split its way:
    a deployment of its own per pair of sizes."""
    from deploy.ray_launcher import RayDeployment

    deployment = RayDeployment(
        model=str(qwen3_checkpoint), env={FAULTS_ENV: PER_REQUEST}, worker_args=ORACLE_DTYPE,
        prefill_tensor_parallel_size=sizes[0], decode_tensor_parallel_size=sizes[1]).start()
    try:
        assert sizes_reported(deployment) == {"prefill": sizes[0], "decode": sizes[1]}
        _check_greedy(qwen3_checkpoint, deployment)
    finally:
        deployment.stop()
