"""Traces join across processes: with KVFERRY_TRACE_DIR set, every update a
client receives has the router's relay event, every relayed decode token has a decode step
that carried its request, and the decode worker's steps, deliveries and stream writes are
all there. No timing is asserted: only that the records exist and line up."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import pytest

from deploy.launcher import Deployment
from deploy.loadgen import BenchConfig, RandomWorkload
from deploy.loadgen.bench import run_target
from kvferry import trace
from tests.conftest import assert_pools_clean
from tests.waiting import until_sync

pytestmark = pytest.mark.slow

MAX_TOKENS = 8


def _load(folder: Path) -> dict[str, list[dict]]:
    by_role: dict[str, list[dict]] = {}
    for path in folder.glob("*.jsonl"):
        role = path.name.split("-")[0]
        by_role.setdefault(role, []).extend(
            json.loads(line) for line in path.read_text().splitlines())
    return by_role


def _written(events: dict[str, list[dict]]) -> Counter[str]:
    """Tokens per downstream request id in the decode worker's stream writes (a write carries
    every token queued for a request since the last one: several under load)."""
    written: Counter[str] = Counter()
    for e in events.get("decode", []):
        if e["ev"] == "write":
            for request_id, num_tokens in zip(e["ids"], e["n"], strict=True):
                written[request_id] += num_tokens
    return written


def test_client_router_and_decode_records_join(chat_deployment: Deployment,
                                               tmp_path: Path) -> None:
    """On the shared chat deployment, which traces into its log folder from its start (other
    tests' requests are in the same files: only this test's six are checked)."""
    deployment = chat_deployment
    folder = deployment.trace_dir  # type: ignore[attr-defined]
    requests = RandomWorkload(input_len=40, output_len=MAX_TOKENS).build(6, 512, 0)
    config = BenchConfig(num_requests=6, request_rates=(20.0,), vocab_size=512)
    trace.switch("client", folder)
    try:
        runs = asyncio.run(run_target("traced", deployment.router_address, requests, config))
    finally:
        trace.switch("client", None)
    assert all(r.is_success and r.output_len == MAX_TOKENS for r in runs[0].records)
    # The pytest process traces only here: the client's records are this test's requests.
    ids = {e["id"] for e in _load(folder)["client"] if e["ev"] == "arrivals"}
    events: dict[str, list[dict]] = {}

    def all_written() -> bool:
        """Every stream write of this test's requests is in the files (the worker may log
        its last write a moment after the client has the last token)."""
        nonlocal events
        events = _load(folder)
        downs = [e["down"] for e in events.get("router", [])
                 if e["ev"] == "relay" and e["id"] in ids]
        written = _written(events)
        return bool(downs) and all(written[down] == MAX_TOKENS - 1 for down in downs)

    until_sync(all_written, "the decode worker logged every write of the traced requests")
    assert_pools_clean(deployment)
    assert {"client", "router", "decode", "prefill"} <= set(events)
    arrivals = {e["id"]: e for e in events["client"] if e["ev"] == "arrivals"}
    relays = [e for e in events["router"] if e["ev"] == "relay" and e["id"] in ids]
    assert len(arrivals) == 6
    per_request = Counter(e["id"] for e in relays)
    for request_id, seen in arrivals.items():
        assert seen["phase"] == request_id.rsplit("-", 1)[0]
        assert len(seen["t"]) == per_request[request_id]  # one relay per update received
        assert sum(seen["n"]) == MAX_TOKENS
        assert sorted(seen["t"]) == seen["t"]
    downstream = {e["id"]: e["down"] for e in relays}
    steps = [e for e in events["decode"] if e["ev"] == "step"
             and set(e["ids"]) & set(downstream.values())]
    in_steps = Counter(i for e in steps for i in e["ids"])
    for request_id, down in downstream.items():
        # the first token comes from the prefill worker; each later one from one decode step
        assert in_steps[down] == MAX_TOKENS - 1, request_id
    assert all(e["t1"] >= e["t0"] and e["cpu"] >= 0 for e in steps)
    delivered = {e["s"] for e in events["decode"] if e["ev"] == "deliver"}
    assert {e["s"] for e in steps} <= delivered
    assert any(e["ev"] == "kv" for e in events["decode"])  # the pushes' chunks, gRPC
    # The CPU decode reads the pool's pages in place: no joining request's K/V is copied.
    assert [e for e in events["decode"] if e["ev"] == "stage"] == []
    assert any(e["ev"] == "prefill" for e in events["prefill"])
