"""Structured logs and reflection: with --log-format json every process writes one
JSON object per line, and the lines about one request carry its id in router, prefill and
decode alike; every server answers gRPC reflection for its services."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from deploy import client
from deploy.launcher import Deployment

pytestmark = pytest.mark.slow


def _records(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def test_json_logs_carry_the_request_id_through_every_process(
        qwen3_2p2d_deployment: Deployment) -> None:
    """On the shared 2p2d deployment, which logs JSON (--log-format json)."""
    deployment = qwen3_2p2d_deployment
    assert deployment.log_format == "json" and deployment.log_dir is not None
    request_id = f"trace-me-{uuid.uuid4().hex[:8]}"
    request = client.make_request(list(range(5, 60)), request_id=request_id,
                                  temperature=0.0, max_tokens=5, ignore_eos=True)
    got = asyncio.run(client.generate(deployment.router_address, request, 60))
    assert len(got.token_ids) == 5
    for role in ("router", "prefill", "decode"):
        logs = {path.stem: _records(path) for path in deployment.log_dir.glob(f"{role}*.log")
                if role != "router" or path.stem == "router"}
        assert logs and all(logs.values()), f"a {role} wrote no JSON lines"
        for records in logs.values():
            assert all({"time", "level", "logger", "message"} <= r.keys() for r in records)
        # Workers know the request as `<id>@<router instance>` (ids are scoped per router).
        mine = [r for records in logs.values() for r in records
                if str(r.get("request_id", "")).partition("@")[0] == request_id]
        assert mine, f"no {role} logged anything with the request id"
        assert all(request_id in str(r["message"]) for r in mine)


@pytest.mark.parametrize("role, service", [
    ("router", "kvferry.v1.GenerationService"), ("prefill", "kvferry.v1.PrefillService"),
    ("decode", "kvferry.v1.DecodeService"), ("decode", "kvferry.v1.KvTransferService")])
def test_every_server_answers_reflection(role: str, service: str,
                                         qwen3_deployment: Deployment) -> None:
    address = (qwen3_deployment.router_address if role == "router"
               else qwen3_deployment.addresses(role)[0])
    with grpc.insecure_channel(address) as chan:
        database = ProtoReflectionDescriptorDatabase(chan)
        services = database.get_services()
        assert service in services and "grpc.health.v1.Health" in services
        described = DescriptorPool(database).FindServiceByName(service)
        assert described.methods  # the full schema is served, not just the name
