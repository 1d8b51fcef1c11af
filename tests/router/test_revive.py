"""WorkerSet.revive: a role with workers but none healthy is checked again before a request
fails for want of one; once per burst, and never for a role that has a healthy worker."""

from __future__ import annotations

import asyncio

from router.workers import Worker, WorkerSet


def _set() -> tuple[WorkerSet, list[str]]:
    workers = WorkerSet("fp")
    for address, role in [("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"),
                          ("d2", "decode")]:
        workers.workers.append(Worker(address, role, channel=None))
    checked: list[str] = []

    async def fake_refresh(worker: Worker, timeout_s: float = 2.0,
                           wait_for_ready: bool = False) -> None:
        assert wait_for_ready
        checked.append(worker.address)
        await asyncio.sleep(0.05)
        worker.is_healthy = True

    workers.refresh = fake_refresh  # type: ignore[method-assign]
    return workers, checked


def test_a_burst_shares_one_round_over_the_roles_without_a_healthy_worker() -> None:
    workers, checked = _set()
    for w in workers.workers:
        w.is_healthy = w.address == "d1"  # decode has one; prefill has none
    workers.workers[1].refuse_reason = "fingerprint"  # refused: never revived

    async def burst() -> None:
        await asyncio.gather(*(workers.revive() for _ in range(20)))

    asyncio.run(burst())
    assert checked == ["p1"]
    assert workers.workers[0].is_healthy


def test_nothing_is_checked_when_every_role_has_a_healthy_worker() -> None:
    workers, checked = _set()
    for w in workers.workers:
        w.is_healthy = w.address in ("p2", "d2")
    asyncio.run(workers.revive())
    assert checked == []
