"""A K/V chunk corrupted in flight is caught by its checksum before any byte is decoded on:
the push is sent again and the request completes with the right tokens, or, once resends are
used up, the request fails with DATA_LOSS. No block leaks either way. On
NIXL the decode worker checks each group where its READ put it. Corruption is
armed per request (kvferry/faults.py) on the shared deployment of each transport."""

from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest

from deploy import client
from deploy.launcher import Deployment
from kvferry.faults import tag
from kvferry.settings import DEFAULT_KV_MAX_RESENDS
from kvferry.v1 import generation_pb2
from tests.conftest import assert_alive, assert_pools_clean, worker_stats

pytestmark = pytest.mark.slow

PROMPT = list(range(30, 130))


def _request(corrupt_pushes: int = 0) -> generation_pb2.GenerateRequest:
    """The prompt with a cache salt of its own (no cached block spares it a push), its
    first `corrupt_pushes` pushes corrupted."""
    request_id = uuid.uuid4().hex + (tag(corrupt_pushes=corrupt_pushes) if corrupt_pushes
                                     else "")
    request = client.make_request(PROMPT, request_id, temperature=0.0, max_tokens=20,
                                  ignore_eos=True)
    request.cache_salt = request_id
    return request


def _corrupt_pushes(deployment: Deployment) -> int:
    return sum(s.num_corrupt_pushes for s in worker_stats(deployment) if s.role == "prefill")


TRANSPORTS = pytest.mark.parametrize("fixture", [
    "qwen3_deployment", "qwen3_nixl_deployment",
    pytest.param("qwen3_ray_deployment", marks=pytest.mark.ray)], ids=["grpc", "nixl", "ray"])


@TRANSPORTS
def test_corrupted_push_is_resent(fixture: str, qwen3_deployment: Deployment,
                                  request: pytest.FixtureRequest) -> None:
    deployment: Deployment = request.getfixturevalue(fixture)
    expected = asyncio.run(client.generate(qwen3_deployment.router_address, _request(), 60))
    before = _corrupt_pushes(deployment)
    got = asyncio.run(client.generate(deployment.router_address, _request(1), 60))
    assert got.token_ids == expected.token_ids
    assert _corrupt_pushes(deployment) - before == 1
    assert_pools_clean(deployment)


@TRANSPORTS
def test_corrupted_push_fails_cleanly_once_resends_are_used_up(
        fixture: str, qwen3_deployment: Deployment, request: pytest.FixtureRequest) -> None:
    deployment: Deployment = request.getfixturevalue(fixture)
    expected = asyncio.run(client.generate(qwen3_deployment.router_address, _request(), 60))
    before = _corrupt_pushes(deployment)
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        asyncio.run(client.generate(deployment.router_address,
                                    _request(DEFAULT_KV_MAX_RESENDS + 1), 60))
    assert exc.value.code() == grpc.StatusCode.DATA_LOSS
    assert "corrupted in flight" in exc.value.details()
    assert _corrupt_pushes(deployment) - before == DEFAULT_KV_MAX_RESENDS + 1
    assert_pools_clean(deployment)
    assert_alive(deployment)
    again = asyncio.run(client.generate(deployment.router_address, _request(), 60))
    assert again.token_ids == expected.token_ids
