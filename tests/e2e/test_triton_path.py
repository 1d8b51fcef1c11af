"""Issue 3 integration: a short decode through the Triton kernels (under TRITON_INTERPRET=1
on a machine without a GPU) gives the same tokens as the torch path."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from deploy import client
from deploy.launcher import Deployment
from tests.conftest import assert_pools_clean

pytestmark = [pytest.mark.slow, pytest.mark.triton]

INTERPRET = {} if torch.cuda.is_available() else {"TRITON_INTERPRET": "1"}


def test_triton_backend_matches_torch_backend(qwen3_checkpoint: Path,
                                              qwen3_deployment: Deployment,
                                              tmp_path: Path) -> None:
    prompts = [[5, 6, 7], list(range(20, 57))]
    requests = [client.make_request(p, temperature=0.0, max_tokens=5, ignore_eos=True)
                for p in prompts]

    def run(address: str) -> list[list[int]]:
        return [c.token_ids for c in asyncio.run(client.generate_many(address, requests, 600))]

    with Deployment(model=str(qwen3_checkpoint), attention_backend="triton",
                    log_dir=tmp_path, env=INTERPRET) as triton_deployment:
        got = run(triton_deployment.router_address)
        assert_pools_clean(triton_deployment)
        log = (tmp_path / "decode-0.log").read_text()
        assert "backend triton" in log
    expected = run(qwen3_deployment.router_address)
    assert got == expected
    assert all(len(t) == 5 for t in got)
