"""Integration: a short decode through the Triton kernels (under TRITON_INTERPRET=1
on a machine without a GPU) gives the same tokens as the torch path."""

from __future__ import annotations

import asyncio

import pytest
import torch

from deploy import client
from deploy.launcher import Deployment
from tests.conftest import assert_pools_clean
from tests.deployments import reconfigured

pytestmark = [pytest.mark.slow, pytest.mark.triton]

INTERPRET = {} if torch.cuda.is_available() else {"TRITON_INTERPRET": "1"}


def test_triton_backend_matches_torch_backend(qwen3_deployment: Deployment) -> None:
    """The shared deployment's decode worker restarted with --attention-backend triton, then
    as it was."""
    prompts = [[5, 6, 7], list(range(20, 57))]
    requests = [client.make_request(p, temperature=0.0, max_tokens=5, ignore_eos=True)
                for p in prompts]

    def run(address: str) -> list[list[int]]:
        return [c.token_ids for c in asyncio.run(client.generate_many(address, requests, 600))]

    expected = run(qwen3_deployment.router_address)
    assert qwen3_deployment.log_dir is not None
    log = qwen3_deployment.log_dir / "decode-0.log"
    log_size = log.stat().st_size
    with reconfigured(qwen3_deployment, ["decode-0"], ["--attention-backend", "triton"],
                      extra_env=INTERPRET):
        got = run(qwen3_deployment.router_address)
        assert_pools_clean(qwen3_deployment)
        assert "backend triton" in log.read_text()[log_size:]
    assert got == expected
    assert all(len(t) == 5 for t in got)
