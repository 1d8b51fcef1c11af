"""DNS discovery: the router's workers follow what a headless Service name resolves to."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from deploy import client
from deploy.launcher import _spawn
from router.workers.discovery import discover_once, resolve, split_host_port
from router.workers.registry import WorkerSet


def test_workers_follow_the_resolved_addresses() -> None:
    answers = [{"127.0.0.1:1", "127.0.0.1:2"}, {"127.0.0.1:2", "127.0.0.1:3"}]

    async def fake_resolver(host: str, port: int) -> set[str]:
        assert (host, port) == ("decode.kvferry.svc", 50052)
        return answers.pop(0)

    async def scenario() -> list[list[str]]:
        workers = WorkerSet("fp")
        seen = []
        for _ in range(2):
            await discover_once(workers, {"decode": "decode.kvferry.svc:50052"}, fake_resolver)
            seen.append(sorted(w.address for w in workers.workers))
        assert not any(w.is_healthy for w in workers.workers)  # nothing listens there
        await workers.close()
        return seen

    assert asyncio.run(scenario()) == [["127.0.0.1:1", "127.0.0.1:2"],
                                       ["127.0.0.1:2", "127.0.0.1:3"]]


def test_bad_names_are_refused() -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        split_host_port("no-port")
    assert "127.0.0.1:80" in asyncio.run(resolve("127.0.0.1", 80))


@pytest.mark.slow
def test_router_discovers_workers_by_dns(qwen3_checkpoint: Path, tmp_path: Path) -> None:
    procs = []
    try:
        pool = ["--kv-pool-size", "64MiB"]
        prefill = _spawn("prefill", ["prefill-worker", "--model", str(qwen3_checkpoint), *pool],
                         tmp_path, {})
        decode = _spawn("decode", ["decode-worker", "--model", str(qwen3_checkpoint), *pool],
                        tmp_path, {})
        procs += [prefill, decode]
        prefill.wait_ready(120)
        decode.wait_ready(120)
        router = _spawn("router", ["router", "--model", str(qwen3_checkpoint),
                                   "--prefill-dns", f"localhost:{prefill.port}",
                                   "--decode-dns", f"localhost:{decode.port}"], tmp_path, {})
        procs.append(router)
        router.wait_ready(120)
        got = asyncio.run(client.generate(router.address, client.make_request(
            "hello", max_tokens=6, ignore_eos=True), 60))
        assert len(got.token_ids) == 6
        log = (tmp_path / "router.log").read_text()
        assert f"discovered decode worker 127.0.0.1:{decode.port}" in log
    finally:
        for proc in procs:
            proc.popen.terminate()
            proc.popen.wait(30)


def test_a_worker_that_leaves_with_requests_open_is_kept_until_they_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Left: never chosen again, dropped once idle; named again before that: back."""
    from router.workers import registry as worker_set

    asked = []

    async def is_serving(channel: object, *args: object) -> bool:
        asked.append(channel)
        return False

    monkeypatch.setattr(worker_set.worker_client, "is_serving", is_serving)

    async def scenario() -> None:
        workers = WorkerSet("fp")
        await workers.sync_role("decode", {"127.0.0.1:1", "127.0.0.1:2"})
        busy = next(w for w in workers.workers if w.address == "127.0.0.1:1")
        busy.num_in_flight = 1
        await workers.sync_role("decode", {"127.0.0.1:2"})
        assert busy in workers.workers and busy.has_left and not busy.is_healthy
        busy.is_healthy = True
        asked.clear()
        await workers.refresh(busy)
        # a refresh round neither asks a worker that left nor takes it back
        assert not busy.is_healthy and not asked
        await workers.sync_role("decode", {"127.0.0.1:1", "127.0.0.1:2"})
        assert not busy.has_left  # named again: back
        await workers.sync_role("decode", {"127.0.0.1:2"})
        busy.num_in_flight = 0
        await workers.sync_role("decode", {"127.0.0.1:2"})
        assert [w.address for w in workers.workers] == ["127.0.0.1:2"]
        await workers.close()

    asyncio.run(scenario())
