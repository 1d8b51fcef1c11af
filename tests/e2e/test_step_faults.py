"""A decode step that raises: the requests in that step end with INTERNAL, every
other request, running then or arriving later, completes token-exact, and the pools end all
free; a worker whose steps keep failing reports NOT_SERVING, drains and exits. Steps fail by
fault injection armed per request (decode_steps, kvferry/faults.py), on shared deployments."""

from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest

from decode_worker.steps import MAX_CONSECUTIVE_FAILURES
from deploy import client
from deploy.launcher import Deployment
from kvferry.faults import tag
from tests.conftest import assert_alive, assert_pools_clean
from tests.deployments import respawn

pytestmark = pytest.mark.slow

PROMPTS = [[(7 * i + j) % 400 + 1 for j in range(20 + 9 * i)] for i in range(6)]
MAX_TOKENS = 16


def _request(prompt: list[int], faults: str = ""):
    return client.make_request(prompt, uuid.uuid4().hex + faults, temperature=0.0,
                               max_tokens=MAX_TOKENS, ignore_eos=True)


async def _outcomes(address: str, prompts: list[list[int]], faults: list[str] | None = None
                    ) -> list[list[int] | grpc.StatusCode]:
    """Each request's tokens, or its status code if it failed; `faults`: each one's tags."""
    async def one(prompt: list[int], armed: str) -> list[int] | grpc.StatusCode:
        try:
            return (await client.generate(address, _request(prompt, armed), 60)).token_ids
        except grpc.aio.AioRpcError as exc:
            assert "Traceback" not in (exc.details() or "")
            return exc.code()
    return list(await asyncio.gather(*(one(p, a) for p, a in
                                       zip(prompts, faults or [""] * len(prompts)))))


@pytest.fixture(scope="module")
def expected(qwen3_deployment: Deployment) -> list[list[int]]:
    return [asyncio.run(client.generate(qwen3_deployment.router_address, _request(p), 60)
                        ).token_ids for p in PROMPTS]


@pytest.mark.parametrize("fixture", ["qwen3_deployment", "colocated_deployment"],
                         ids=["disaggregated", "colocated"])
def test_one_failed_step_fails_only_its_batch(fixture: str, expected: list[list[int]],
                                              request: pytest.FixtureRequest) -> None:
    """The second of three requests fails its 4th step; those stepped with it fail too."""
    deployment: Deployment = request.getfixturevalue(fixture)
    first = asyncio.run(_outcomes(deployment.router_address, PROMPTS[:3],
                                  ["", tag(decode_steps="4"), ""]))
    failed = [o for o in first if isinstance(o, grpc.StatusCode)]
    assert first[1] == grpc.StatusCode.INTERNAL and set(failed) == {grpc.StatusCode.INTERNAL}
    for got, want in zip(first, expected):
        assert got == want or got == grpc.StatusCode.INTERNAL
    # The worker goes on stepping: everything after the fault completes token-exact.
    assert asyncio.run(_outcomes(deployment.router_address, PROMPTS)) == expected
    assert_pools_clean(deployment)
    assert_alive(deployment)


def test_steps_that_keep_failing_drain_the_worker(qwen3_deployment: Deployment,
                                                  expected: list[list[int]]) -> None:
    """Requests whose every step fails, one after another, on the one decode worker: it
    drains and stops by itself (then it is started again for the tests that follow)."""
    deployment = qwen3_deployment
    decode = next(p for p in deployment.processes if p.name.startswith("decode"))
    assert deployment.log_dir is not None
    log_path = deployment.log_dir / f"{decode.name}.log"
    log_start = log_path.stat().st_size
    try:
        for prompt in PROMPTS[:MAX_CONSECUTIVE_FAILURES]:  # one failed step each
            assert asyncio.run(_outcomes(deployment.router_address, [prompt],
                                         [tag(decode_steps="1-")])) == [
                grpc.StatusCode.INTERNAL]
        assert decode.popen.wait(30) == 0  # drained and stopped by itself
    finally:
        if decode.popen.poll() is None:
            decode.popen.kill()
            decode.popen.wait(10)
        respawn(decode.name, deployment)
    with log_path.open() as log_file:
        log_file.seek(log_start)
        log = log_file.read()  # what this test's worker logged
    assert "reporting NOT_SERVING and draining" in log
    assert "Traceback" not in log  # injected faults are logged in one line each
    # Started again at its address, the worker serves the router's next request exactly.
    assert asyncio.run(_outcomes(deployment.router_address, PROMPTS[:2])) == expected[:2]
