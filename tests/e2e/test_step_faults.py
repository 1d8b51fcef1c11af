"""A decode step that raises (issue 16): the requests in that step end with INTERNAL, every
other request, running then or arriving later, completes token-exact, and the pools end all
free; a worker whose steps keep failing reports NOT_SERVING, drains and exits. Steps fail by
fault injection (KVFERRY_FAULT_DECODE_STEPS, decode_worker/steps.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from decode_worker.step_faults import FAULT_ENV
from decode_worker.steps import MAX_CONSECUTIVE_FAILURES
from deploy import client
from deploy.launcher import Deployment
from tests.conftest import assert_alive, assert_pools_clean

pytestmark = pytest.mark.slow

PROMPTS = [[(7 * i + j) % 400 + 1 for j in range(20 + 9 * i)] for i in range(6)]
MAX_TOKENS = 16


def _request(prompt: list[int]):
    return client.make_request(prompt, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


async def _outcomes(address: str, prompts: list[list[int]]) -> list[list[int] | grpc.StatusCode]:
    """Each request's tokens, or its status code if it failed."""
    async def one(prompt: list[int]) -> list[int] | grpc.StatusCode:
        try:
            return (await client.generate(address, _request(prompt), 60)).token_ids
        except grpc.aio.AioRpcError as exc:
            assert "Traceback" not in (exc.details() or "")
            return exc.code()
    return list(await asyncio.gather(*(one(p) for p in prompts)))


@pytest.fixture(scope="module")
def expected(qwen3_deployment: Deployment) -> list[list[int]]:
    return [asyncio.run(client.generate(qwen3_deployment.router_address, _request(p), 60)
                        ).token_ids for p in PROMPTS]


@pytest.mark.parametrize("is_colocated", [False, True], ids=["disaggregated", "colocated"])
def test_one_failed_step_fails_only_its_batch(is_colocated: bool, qwen3_checkpoint: Path,
                                              expected: list[list[int]], tmp_path: Path) -> None:
    with Deployment(model=str(qwen3_checkpoint), log_dir=tmp_path, is_colocated=is_colocated,
                    env={FAULT_ENV: "4"}) as deployment:
        first = asyncio.run(_outcomes(deployment.router_address, PROMPTS[:3]))
        failed = [o for o in first if isinstance(o, grpc.StatusCode)]
        assert failed and set(failed) == {grpc.StatusCode.INTERNAL}, first
        for got, want in zip(first, expected):
            assert got == want or got == grpc.StatusCode.INTERNAL
        # The worker goes on stepping: everything after the fault completes token-exact.
        assert asyncio.run(_outcomes(deployment.router_address, PROMPTS)) == expected
        assert_pools_clean(deployment)
        assert_alive(deployment)


def test_steps_that_keep_failing_drain_the_worker(qwen3_checkpoint: Path,
                                                  tmp_path: Path) -> None:
    with Deployment(model=str(qwen3_checkpoint), log_dir=tmp_path,
                    env={FAULT_ENV: "1-"}) as deployment:
        decode = next(p for p in deployment.processes if p.name.startswith("decode"))
        for prompt in PROMPTS[:MAX_CONSECUTIVE_FAILURES]:  # one failed step each
            assert asyncio.run(_outcomes(deployment.router_address, [prompt])) == [
                grpc.StatusCode.INTERNAL]
        assert decode.popen.wait(30) == 0  # drained and stopped by itself
        log = next(tmp_path.glob("decode*.log")).read_text()
        assert "reporting NOT_SERVING and draining" in log
        assert "Traceback" not in log  # injected faults are logged in one line each
