"""A K/V chunk corrupted in flight is caught by its checksum before any byte is decoded on:
the push is sent again and the request completes with the right tokens, or, with resends
disabled, the request fails with DATA_LOSS. No block leaks either way (issue 6, point 3). On
NIXL the decode worker checks each group where its READ put it (issue 19)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from deploy import client
from deploy.launcher import Deployment
from tests.conftest import NIXL, assert_alive, assert_pools_clean, worker_stats

pytestmark = pytest.mark.slow

PROMPT = list(range(30, 130))


def _request():
    return client.make_request(PROMPT, temperature=0.0, max_tokens=20, ignore_eos=True)


def _corrupt_pushes(deployment: Deployment) -> int:
    return sum(s.num_corrupt_pushes for s in worker_stats(deployment) if s.role == "prefill")


def _deployment(transport: str, checkpoint: Path, log_dir: Path, request: pytest.FixtureRequest,
                **kwargs: object) -> Deployment:
    env = {"KVFERRY_FAULT_CORRUPT_PUSHES": "1"}
    if transport == "grpc":
        return Deployment(model=str(checkpoint), log_dir=log_dir, env=env, **kwargs)
    if transport == "nixl":  # the first group's announced checksum does not match its pages
        worker_args = [*NIXL, *kwargs.pop("worker_args", [])]  # type: ignore[misc]
        return Deployment(model=str(checkpoint), log_dir=log_dir, env=env,
                          worker_args=worker_args, **kwargs)
    from deploy.ray_launcher import RayDeployment

    request.getfixturevalue("ray_session")
    return RayDeployment(model=str(checkpoint), env=env, **kwargs)


TRANSPORTS = pytest.mark.parametrize("transport", ["grpc", "nixl", pytest.param(
    "ray", marks=pytest.mark.ray)])


@TRANSPORTS
def test_corrupted_push_is_resent(transport: str, qwen3_checkpoint: Path,
                                  qwen3_deployment: Deployment, tmp_path: Path,
                                  request: pytest.FixtureRequest) -> None:
    expected = asyncio.run(client.generate(qwen3_deployment.router_address, _request(), 60))
    with _deployment(transport, qwen3_checkpoint, tmp_path, request) as deployment:
        got = asyncio.run(client.generate(deployment.router_address, _request(), 60))
        assert got.token_ids == expected.token_ids
        assert _corrupt_pushes(deployment) == 1
        assert_pools_clean(deployment)


@TRANSPORTS
def test_corrupted_push_fails_cleanly_without_resends(transport: str, qwen3_checkpoint: Path,
                                                      qwen3_deployment: Deployment,
                                                      tmp_path: Path,
                                                      request: pytest.FixtureRequest) -> None:
    expected = asyncio.run(client.generate(qwen3_deployment.router_address, _request(), 60))
    with _deployment(transport, qwen3_checkpoint, tmp_path, request,
                     worker_args=["--kv-max-resends", "0"]) as deployment:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            asyncio.run(client.generate(deployment.router_address, _request(), 60))
        assert exc.value.code() == grpc.StatusCode.DATA_LOSS
        assert "corrupted in flight" in exc.value.details()
        assert _corrupt_pushes(deployment) == 1
        assert_pools_clean(deployment)
        assert_alive(deployment)
        again = asyncio.run(client.generate(deployment.router_address, _request(), 60))
        assert again.token_ids == expected.token_ids
