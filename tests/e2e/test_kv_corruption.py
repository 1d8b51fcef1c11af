"""A K/V chunk corrupted in flight is caught by its checksum before any byte is decoded on:
the push is sent again and the request completes with the right tokens, or, with resends
disabled, the request fails with DATA_LOSS. No block leaks either way (issue 6, point 3)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from kvferry import client
from kvferry.launcher import Deployment
from tests.conftest import assert_alive, assert_pools_clean

pytestmark = pytest.mark.slow

PROMPT = list(range(30, 130))


def _request():
    return client.make_request(PROMPT, temperature=0.0, max_tokens=20, ignore_eos=True)


def test_corrupted_push_is_resent(qwen3_checkpoint: Path, qwen3_deployment: Deployment,
                                  tmp_path: Path) -> None:
    expected = asyncio.run(client.generate(qwen3_deployment.router_address, _request(), 60))
    with Deployment(model=str(qwen3_checkpoint), log_dir=tmp_path,
                    env={"KVFERRY_FAULT_CORRUPT_PUSHES": "1"}) as deployment:
        got = asyncio.run(client.generate(deployment.router_address, _request(), 60))
        assert got.token_ids == expected.token_ids
        assert "corrupted in flight" in (tmp_path / "prefill-0.log").read_text()
        assert_pools_clean(deployment)


def test_corrupted_push_fails_cleanly_without_resends(qwen3_checkpoint: Path,
                                                      qwen3_deployment: Deployment,
                                                      tmp_path: Path) -> None:
    expected = asyncio.run(client.generate(qwen3_deployment.router_address, _request(), 60))
    with Deployment(model=str(qwen3_checkpoint), log_dir=tmp_path,
                    worker_args=["--kv-max-resends", "0"],
                    env={"KVFERRY_FAULT_CORRUPT_PUSHES": "1"}) as deployment:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            asyncio.run(client.generate(deployment.router_address, _request(), 60))
        assert exc.value.code() == grpc.StatusCode.DATA_LOSS
        assert "corrupted in flight" in exc.value.details()
        assert_pools_clean(deployment)
        assert_alive(deployment)
        again = asyncio.run(client.generate(deployment.router_address, _request(), 60))
        assert again.token_ids == expected.token_ids
