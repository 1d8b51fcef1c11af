"""Issue 5, acceptance 3: kill -9 of a decode worker mid-stream. The request migrates (the
router re-prefills prompt + tokens so far on another pair) and the greedy stream completes
with exactly the undisturbed tokens; the surviving workers' pools return to all free."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from pathlib import Path

import pytest

from deploy import client
from deploy.launcher import Deployment
from kvferry.rpc import grpc_util
from kvferry.settings import DEFAULT_BLOCK_SIZE
from kvferry.v1 import generation_pb2_grpc
from tests.conftest import DETAILS, assert_pools_clean, busy_process

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("seed", "transport"), [(None, "grpc"), (11, "grpc"), (None, "nixl")])
def test_decode_worker_killed_mid_stream(seed: int | None, transport: str,
                                         qwen3_checkpoint: Path, qwen3_deployment: Deployment,
                                         tmp_path: Path) -> None:
    prompt = list(range(60, 140))
    sampling = {"temperature": 0.0} if seed is None else {"temperature": 1.0, "seed": seed}
    request = client.make_request(prompt, max_tokens=300, ignore_eos=True, **sampling)
    undisturbed = asyncio.run(client.generate(qwen3_deployment.router_address, request, 120))

    with Deployment(model=str(qwen3_checkpoint), num_decode=2, log_dir=tmp_path,
                    worker_args=["--kv-transport", transport], router_args=DETAILS) as deployment:
        # The same request once undisturbed here first: the prefix caches hold its K/V, so
        # the migrated leg's prefill starts from cached blocks (issue 18, acceptance 1).
        warm = asyncio.run(client.generate(deployment.router_address, request, 120))
        assert warm.token_ids == undisturbed.token_ids
        async def run() -> client.Completion:
            async with grpc_util.channel(deployment.router_address) as chan:
                stub = generation_pb2_grpc.GenerationServiceStub(chan)
                completion = client.Completion()
                killed = False
                async for _, latest in client.stream(stub, request, timeout_s=120):
                    completion = latest
                    if not killed and len(completion.token_ids) >= 20:
                        victim = await asyncio.to_thread(busy_process, deployment, "decode")
                        assert victim is not None
                        os.kill(victim.popen.pid, signal.SIGKILL)
                        await asyncio.to_thread(victim.popen.wait, 10)
                        deployment.processes.remove(victim)
                        killed = True
                assert killed
                return completion

        got = asyncio.run(run())
        assert got.token_ids == undisturbed.token_ids
        assert got.text == undisturbed.text
        assert got.finished.usage.completion_tokens == 300
        assert "migrating" in (tmp_path / "router.log").read_text()
        assert got.finished.usage.cached_prompt_tokens > 0  # the first leg's
        # The migrated leg (prompt + the tokens streamed before the kill) started from blocks
        # the warm-up left cached: the prompt's 5 full blocks at least.
        legs = re.findall(r"migrated leg prefilled (\d+) context tokens, (\d+) from the "
                          r"prefix cache", (tmp_path / "router.log").read_text())
        assert legs, "no migrated leg logged"
        assert all(int(context) > len(prompt) for context, _ in legs)
        assert int(legs[0][1]) >= len(prompt) // DEFAULT_BLOCK_SIZE * DEFAULT_BLOCK_SIZE, legs
        assert_pools_clean(deployment)
