"""Kill -9 of a decode worker mid-stream. The request migrates (the
router re-prefills prompt + tokens so far on another pair) and the greedy stream completes
with exactly the undisturbed tokens; the surviving workers' pools return to all free."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal

import pytest

from deploy import client
from deploy.launcher import Deployment, Process
from kvferry.faults import tag
from kvferry.rpc import grpc_util
from kvferry.settings import DEFAULT_BLOCK_SIZE
from kvferry.v1 import generation_pb2, generation_pb2_grpc
from tests.conftest import assert_pools_clean, busy_process
from tests.deployments import kill_decode_mid_stream, respawn

pytestmark = pytest.mark.slow


# A constraint that outlasts 300 tokens: the migrated leg's workers replay the first leg's
# tokens into their matchers (kvferry/model/grammar.py) before masking
LONG_JSON = generation_pb2.Constraint(json_schema=json.dumps({
    "type": "array", "items": {"type": "boolean"}, "minItems": 200, "maxItems": 200}))


@pytest.mark.parametrize(("seed", "fixture", "constraint"), [
    (None, "qwen3_2p2d_deployment", None), (11, "qwen3_2p2d_deployment", None),
    (None, "qwen3_nixl_deployment", None), (11, "qwen3_2p2d_deployment", LONG_JSON)],
    ids=["grpc-greedy", "grpc-seeded", "nixl-greedy", "grpc-seeded-constrained"])
def test_decode_worker_killed_mid_stream(seed: int | None, fixture: str,
                                         constraint: generation_pb2.Constraint | None,
                                         qwen3_deployment: Deployment,
                                         request: pytest.FixtureRequest) -> None:
    """On a shared deployment with two decode workers (the killed one is started again)."""
    deployment: Deployment = request.getfixturevalue(fixture)
    prompt = list(range(60, 140))
    sampling: dict[str, object] = ({"temperature": 0.0} if seed is None
                                   else {"temperature": 1.0, "seed": seed})
    sampling.update({"constraint": constraint} if constraint is not None
                    else {"ignore_eos": True})
    generate = client.make_request(prompt, max_tokens=300, **sampling)
    generate.cache_salt = f"test_migration-{fixture}-{seed}-{constraint is not None}"
    undisturbed = asyncio.run(client.generate(qwen3_deployment.router_address, generate, 120))
    router_log = deployment.log_dir / "router.log"
    log_start = router_log.stat().st_size

    # The same request once undisturbed here first: the prefix caches hold its K/V, so the
    # migrated leg's prefill starts from cached blocks.
    warm = asyncio.run(client.generate(deployment.router_address, generate, 120))
    assert warm.token_ids == undisturbed.token_ids
    # Paced (10 ms a step, a per-request fault): the 280 steps after the kill point outlast the
    # stats poll that finds the victim, on any machine.
    generate.request_id = (f"migrate-{fixture}-{seed}-{constraint is not None}"
                           + tag(decode_step_delay_s=0.01))

    got, victim = kill_decode_mid_stream(deployment, generate, 20)
    respawn(victim.name, deployment)
    assert got.token_ids == undisturbed.token_ids
    assert got.text == undisturbed.text
    assert got.finished.usage.completion_tokens == 300
    with router_log.open() as log_file:
        log_file.seek(log_start)
        log = log_file.read()  # this test's part of the shared router's log
    assert "migrating" in log
    assert got.finished.usage.cached_prompt_tokens > 0  # the first leg's
    # The migrated leg (prompt + the tokens streamed before the kill) started from blocks
    # the warm-up left cached: the prompt's 5 full blocks at least.
    legs = re.findall(r"migrated leg prefilled (\d+) context tokens, (\d+) from the "
                      r"prefix cache", log)
    assert legs, "no migrated leg logged"
    assert all(int(context) > len(prompt) for context, _ in legs)
    assert int(legs[0][1]) >= len(prompt) // DEFAULT_BLOCK_SIZE * DEFAULT_BLOCK_SIZE, legs
    assert_pools_clean(deployment)


def test_a_decode_worker_killed_under_load_migrates_every_stream(
        qwen3_2p2d_deployment: Deployment, qwen3_deployment: Deployment) -> None:
    """Eight greedy streams at once over both decode workers; once each has tokens, the
    decode worker holding the most is killed: every stream still completes with exactly its
    undisturbed tokens (those on the victim migrate, the others are untouched)."""
    deployment = qwen3_2p2d_deployment
    # Steps holding them paced (20 ms: 4 s a stream at least), so that every stream still
    # runs when the last has its 5 tokens and the victim's stats are read, on any machine.
    requests = [client.make_request(list(range(20 + 9 * i, 80 + 9 * i)),
                                    f"load{i}" + tag(decode_step_delay_s=0.02),
                                    temperature=0.0, max_tokens=200, ignore_eos=True)
                for i in range(8)]
    for i, one in enumerate(requests):
        one.cache_salt = f"test_migration_under_load-{i}"
    undisturbed = asyncio.run(client.generate_many(qwen3_deployment.router_address, requests,
                                                   300))

    async def run() -> tuple[list[client.Completion], Process]:
        async with grpc_util.channel(deployment.router_address) as chan:
            stub = generation_pb2_grpc.GenerationServiceStub(chan)
            progress = [client.Completion() for _ in requests]
            all_started = asyncio.Event()

            async def follow(i: int) -> client.Completion:
                async for _, latest in client.stream(stub, requests[i], timeout_s=300):
                    progress[i] = latest
                    if all(len(c.token_ids) >= 5 for c in progress):
                        all_started.set()
                return progress[i]

            streams = [asyncio.ensure_future(follow(i)) for i in range(len(requests))]
            await asyncio.wait_for(all_started.wait(), 120)
            victim = await asyncio.to_thread(
                busy_process, deployment, "decode",
                lambda s: s.num_running if s.num_running >= len(requests) // 2 else 0)
            assert victim is not None, "no decode worker held half the streams"
            os.kill(victim.popen.pid, signal.SIGKILL)
            await asyncio.to_thread(victim.popen.wait, 10)
            return list(await asyncio.gather(*streams)), victim

    got, victim = asyncio.run(run())
    respawn(victim.name, deployment)
    assert [c.token_ids for c in got] == [c.token_ids for c in undisturbed]
    assert sum(c.finished.timing.num_migrations for c in got) >= len(requests) // 2
    assert_pools_clean(deployment)
