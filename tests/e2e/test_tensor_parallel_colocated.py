"""A colocated worker (prefill and decode in one step loop) split 2 ways
(tests/e2e/test_tensor_parallel_workers.py): the shared colocated deployment's worker, which
also chunks prompts and speculates, restarted split; the oracle's prompts give
transformers' greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.launcher import Deployment
from tests.conftest import worker_stats
from tests.deployments import reconfigured, until_router_takes
from tests.e2e.test_tensor_parallel_workers import tp_flag
from tests.e2e.test_token_exact import _check_greedy

pytestmark = pytest.mark.slow


def test_a_split_colocated_worker_matches_transformers(qwen3_checkpoint: Path,
                                                       colocated_deployment: Deployment
                                                       ) -> None:
    deployment = colocated_deployment
    with reconfigured(deployment, ["colocated-0"], tp_flag(2)):
        until_router_takes(deployment, ["colocated-0"])
        assert {s.tensor_parallel_size for s in worker_stats(deployment)} == {2}
        _check_greedy(qwen3_checkpoint, deployment)
