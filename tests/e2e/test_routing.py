"""Router behaviour across workers (issue 5): conditional disaggregation takes the local
path below the threshold and the remote path above it; a prefill worker that dies before
the first token is retried on another, transparently."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy import client
from deploy.launcher import Deployment
from tests.conftest import assert_pools_clean

pytestmark = pytest.mark.slow

THRESHOLD = 32


@pytest.fixture(scope="module")
def two_prefill_deployment(qwen3_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
                           ) -> Iterator[Deployment]:
    deployment = Deployment(model=str(qwen3_checkpoint), num_prefill=2,
                            router_args=["--local-prefill-threshold", str(THRESHOLD)],
                            log_dir=tmp_path_factory.mktemp("routing-logs")).start()
    yield deployment
    deployment.stop()


def _generate(address: str, prompts: list[list[int]]) -> list[client.Completion]:
    requests = [client.make_request(p, temperature=0.0, max_tokens=12, ignore_eos=True)
                for p in prompts]
    return asyncio.run(client.generate_many(address, requests, 120))


def test_conditional_disaggregation_paths(two_prefill_deployment: Deployment,
                                          qwen3_deployment: Deployment) -> None:
    short, long = list(range(40, 40 + THRESHOLD - 1)), list(range(40, 40 + THRESHOLD + 20))
    got = _generate(two_prefill_deployment.router_address, [short, long])
    expected = _generate(qwen3_deployment.router_address, [short, long])
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    local, remote = got
    assert local.finished.timing.kv_transfer_s == 0.0  # prefilled on the decode worker
    assert remote.finished.timing.kv_transfer_s > 0.0  # shipped from a prefill worker
    assert_pools_clean(two_prefill_deployment)


def test_dead_prefill_worker_is_retried_transparently(two_prefill_deployment: Deployment,
                                                      qwen3_deployment: Deployment) -> None:
    victim = next(p for p in two_prefill_deployment.processes if p.name == "prefill-0")
    os.kill(victim.popen.pid, signal.SIGKILL)
    victim.popen.wait(10)
    prompts = [list(range(100 + i, 100 + i + 60)) for i in range(6)]  # all above threshold
    got = _generate(two_prefill_deployment.router_address, prompts)
    expected = _generate(qwen3_deployment.router_address, prompts)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert all(c.finished.timing.kv_transfer_s > 0 for c in got)
    two_prefill_deployment.processes.remove(victim)
    assert_pools_clean(two_prefill_deployment)
