"""The tiny Llama through tensor-parallel workers (tests/e2e/test_tensor_parallel_workers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.launcher import Deployment
from tests.e2e.test_tensor_parallel_workers import sizes_reported, split_workers
from tests.e2e.test_token_exact import _check_greedy

pytestmark = pytest.mark.slow


def test_llama_split_both_sides_matches_transformers(llama_checkpoint: Path,
                                                     llama_deployment: Deployment) -> None:
    """The tiny Llama (6 query heads, 2 K/V heads: 3 and 1 per rank) split 2 ways on both
    sides."""
    with split_workers(llama_deployment, 2, 2):
        assert sizes_reported(llama_deployment) == {"prefill": 2, "decode": 2}
        _check_greedy(llama_checkpoint, llama_deployment)
