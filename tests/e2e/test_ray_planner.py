"""The live planner scaling a Ray deployment while it serves: a workload that shifts from
short prompts with long answers to long prompts with short answers moves the split towards
decode, then towards prefill, a step at a time and without going back, and no request
fails or changes its tokens while workers are added and drained away.

The planner plans from a synthetic profile (tests/deploy/planner/synthetic.py) in which each
phase has one right split, so what is tested is the loop on a real deployment: the router's
metrics scraped, the observation, the decision, actors started and handed to the router,
actors taken off the router, drained and ended.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from deploy import client
from deploy.planner.live import Bounds, Decision, Planner
from deploy.planner.loop import PlannerMetrics, run_ray_planner
from deploy.planner.profile import CostModel
from deploy.planner.search import Sla
from deploy.planner.simulator import Layout
from tests.conftest import assert_pools_clean
from tests.deploy.planner.synthetic import (
    SHIFT_LENGTHS,
    SHIFT_RATES,
    SHIFT_SLA,
    shifting_profile,
    turns,
)

pytestmark = [pytest.mark.slow, pytest.mark.ray]

INTERVAL_S = 3.0
MAX_INTERVALS = 10  # a phase must reach its split and hold it within this many decisions
HOLD = 3  # decisions in a row at the phase's split that end it


async def _phase(address: str, prompts: list[list[int]], max_tokens: int, rate: float,
                 is_done: Callable[[], bool], max_s: float) -> list[asyncio.Task]:
    """Requests at `rate` a second, evenly spaced, until `is_done()` or `max_s`."""
    loop = asyncio.get_running_loop()
    start, sent = loop.time(), []
    while not is_done() and loop.time() - start < max_s:
        prompt = prompts[len(sent) % len(prompts)]
        sent.append(asyncio.ensure_future(client.generate(address, client.make_request(
            prompt, temperature=0.0, max_tokens=max_tokens, ignore_eos=True), 120)))
        await asyncio.sleep(max(0.0, start + len(sent) / rate - loop.time()))
    return sent


def test_the_planner_moves_the_split_with_the_workload(qwen3_checkpoint: Path,
                                                        ray_session: None) -> None:
    from deploy.ray_launcher import RayDeployment

    rng = random.Random(0)
    prompts = [[[rng.randrange(3, 500) for _ in range(length)] for _ in range(3)]
               for length, _ in SHIFT_LENGTHS]
    wanted = (Layout(1, 3), Layout(3, 1))
    # The profile is synthetic on purpose (what it predicts decides the right split), so
    # the planner must not correct it towards what the tiny model measures.
    planner = Planner(CostModel(shifting_profile()), Sla.parse(SHIFT_SLA),
                      Bounds(max_prefill=3, max_decode=3, max_workers=4), patience=2,
                      correction_weight=0.0)
    deployment = RayDeployment(model=str(qwen3_checkpoint), num_prefill=2, num_decode=2,
                               router_args=["--metrics-port", "0"],
                               worker_args=["--kv-pool-size", "32MiB"]).start()
    decisions: list[tuple[int, Decision]] = []  # (phase, decision)
    phase = [0]
    stop = threading.Event()
    planner_thread = threading.Thread(target=run_ray_planner, args=(
        planner, deployment, INTERVAL_S, stop, PlannerMetrics(CollectorRegistry()),
        lambda d: decisions.append((phase[0], d))), daemon=True)
    try:
        planner_thread.start()

        def held(layout: Layout) -> Callable[[], bool]:
            def done() -> bool:
                mine = [d.layout for p, d in decisions if p == phase[0]]
                return len(mine) >= HOLD and set(mine[-HOLD:]) == {layout}
            return done

        async def run() -> list[list[asyncio.Task]]:
            sent = []
            for index, ((_, max_tokens), rate, layout) in enumerate(
                    zip(SHIFT_LENGTHS, SHIFT_RATES, wanted)):
                phase[0] = index
                sent.append(await _phase(deployment.router_address, prompts[index], max_tokens,
                                         rate, held(layout), MAX_INTERVALS * INTERVAL_S * 2))
            await asyncio.gather(*(t for tasks in sent for t in tasks), return_exceptions=True)
            return sent

        sent = asyncio.run(run())
        stop.set()
        planner_thread.join(120)
        counts = (len(deployment.addresses("prefill")), len(deployment.addresses("decode")))
        assert_pools_clean(deployment)
    finally:
        stop.set()
        deployment.stop()

    # Every request, including those in flight while workers left, finished whole, and the
    # same prompt always gave the same tokens.
    for index, tasks in enumerate(sent):
        assert tasks, f"phase {index} sent nothing"
        errors = [t.exception() for t in tasks if t.exception() is not None]
        assert not errors, f"phase {index}: {len(errors)} of {len(tasks)} failed: {errors[:3]}"
        by_prompt: dict[int, set[tuple[int, ...]]] = {}
        for n, task in enumerate(tasks):
            tokens = tuple(task.result().token_ids)
            assert len(tokens) == SHIFT_LENGTHS[index][1]
            by_prompt.setdefault(n % len(prompts[index]), set()).add(tokens)
        assert all(len(seen) == 1 for seen in by_prompt.values()), by_prompt

    # Each phase reached its split, within the bound, and settled there; one step per role
    # per interval; prefill went down then up, decode up then down, no more turns.
    layouts = [Layout(2, 2)] + [d.layout for _, d in decisions]
    for index, layout in enumerate(wanted):
        mine = [d.layout for p, d in decisions if p == index]
        assert len(mine) <= MAX_INTERVALS and mine[-HOLD:] == [layout] * HOLD, (index, layouts)
    assert counts == (3, 1), counts  # what runs is what was decided
    for a, b in zip(layouts, layouts[1:]):
        assert abs(a.num_prefill - b.num_prefill) <= 1 and abs(a.num_decode - b.num_decode) <= 1
        assert b.num_workers <= 4
    assert turns([x.num_prefill for x in layouts]) <= 1, layouts
    assert turns([x.num_decode for x in layouts]) <= 1, layouts
    assert all(d.reason for _, d in decisions)
