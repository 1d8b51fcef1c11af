"""WorkerSet.revive: a role with workers but none healthy is checked again before a request
fails for want of one; once per burst, and never for a role that has a healthy worker."""

from __future__ import annotations

import asyncio

from router.workers.registry import WorkerSet
from router.workers.worker import Worker
from tests.waiting import until, within


class _Checks:
    """The fake health check: records each worker checked; a check answers (healthy) only
    once the test opens `answer`, so a round stays under way as long as the test needs."""

    def __init__(self) -> None:
        self.checked: list[str] = []
        self.answer = asyncio.Event()

    async def refresh(self, worker: Worker, timeout_s: float = 2.0,
                      wait_for_ready: bool = False) -> None:
        assert wait_for_ready
        self.checked.append(worker.address)
        await self.answer.wait()
        worker.is_healthy = True


def _set(checks: _Checks) -> WorkerSet:
    workers = WorkerSet("fp")
    for address, role in [("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"),
                          ("d2", "decode")]:
        workers.workers.append(Worker(address, role, channel=None))
    workers.refresh = checks.refresh  # type: ignore[method-assign]
    return workers


def test_a_burst_shares_one_round_over_the_roles_without_a_healthy_worker() -> None:
    async def burst() -> None:
        checks = _Checks()
        workers = _set(checks)
        for w in workers.workers:
            w.is_healthy = w.address == "d1"  # decode has one; prefill has none
        workers.workers[1].refuse_reason = "fingerprint"  # refused: never revived
        callers = [asyncio.ensure_future(workers.revive()) for _ in range(20)]
        # The round's check starts on the loop after every caller of the burst has run.
        await until(lambda: checks.checked, "the round's health check started")
        assert not any(c.done() for c in callers)  # all 20 wait on the one round
        checks.answer.set()
        await within(asyncio.gather(*callers), "the burst's revive calls")
        assert checks.checked == ["p1"]
        assert workers.workers[0].is_healthy

    asyncio.run(burst())


def test_nothing_is_checked_when_every_role_has_a_healthy_worker() -> None:
    async def revive() -> list[str]:
        checks = _Checks()
        workers = _set(checks)
        for w in workers.workers:
            w.is_healthy = w.address in ("p2", "d2")
        await within(workers.revive(), "revive")
        return checks.checked

    assert asyncio.run(revive()) == []
