"""Prometheus metrics: the router's request histograms and counters move by exactly
what the requests did, and the workers' pool gauges and K/V byte counters agree."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deploy import client
from deploy.launcher import Deployment
from tests.conftest import assert_pools_clean

pytestmark = pytest.mark.slow

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _port(deployment: Deployment, name: str) -> int:
    port = next(p.metrics_port for p in deployment.processes if p.name == name)
    assert port > 0, f"{name} serves no metrics"
    return port


def test_router_metrics_count_what_happened(qwen3_deployment: Deployment) -> None:
    router = _port(qwen3_deployment, "router")
    before = scrape(router)
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 90)]
    requests = [client.make_request(p, temperature=0.0, max_tokens=6, ignore_eos=True)
                for p in prompts]
    results = asyncio.run(client.generate_many(qwen3_deployment.router_address, requests, 120))
    with pytest.raises(grpc.aio.AioRpcError) as bad:
        asyncio.run(client.generate(qwen3_deployment.router_address,
                                    client.make_request([1, 2], temperature=-1.0), 30))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = scrape(router)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    gaps = sum(len(r.token_times_s) - 1 for r in results)
    assert delta("kvferry_time_to_first_token_seconds_count") == 3
    assert delta("kvferry_e2e_request_latency_seconds_count") == 3
    assert delta("kvferry_time_per_output_token_seconds_count") == 3
    assert delta("kvferry_inter_token_latency_seconds_count") == gaps
    assert delta("kvferry_kv_transfer_time_seconds_count") == 3
    assert delta("kvferry_requests_finished_total", reason="length") == 3
    assert delta("kvferry_request_failures_total", code="INVALID_ARGUMENT") == 1
    assert delta("kvferry_prompt_tokens_total") == sum(len(p) for p in prompts)
    assert delta("kvferry_generation_tokens_total") == 18
    # Client and router agree on TTFT to within the network hop.
    assert delta("kvferry_time_to_first_token_seconds_sum") <= sum(r.ttft_s for r in results)


def test_a_request_of_samples_is_one_request_with_every_sample_s_tokens(
        qwen3_deployment: Deployment) -> None:
    """sampling.n = 3: one request in the latency histograms and the finished count, the three
    samples' tokens in the generation count."""
    router = _port(qwen3_deployment, "router")
    before = scrape(router)
    request = client.make_request(list(range(5, 25)), temperature=0.8, seed=3, n=3,
                                  max_tokens=5, ignore_eos=True)
    samples = asyncio.run(client.generate_samples(qwen3_deployment.router_address, request, 60))
    after = scrape(router)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert [len(s.token_ids) for s in samples] == [5, 5, 5]
    assert delta("kvferry_e2e_request_latency_seconds_count") == 1
    assert delta("kvferry_requests_finished_total", reason="length") == 1
    assert delta("kvferry_prompt_tokens_total") == 20
    assert delta("kvferry_generation_tokens_total") == 15


def test_worker_metrics_pool_and_kv_bytes(qwen3_deployment: Deployment) -> None:
    prefill, decode = _port(qwen3_deployment, "prefill-0"), _port(qwen3_deployment, "decode-0")
    sent0, received0 = scrape(prefill), scrape(decode)
    request = client.make_request(list(range(7, 207)), temperature=0.0, max_tokens=4)
    asyncio.run(client.generate(qwen3_deployment.router_address, request, 60))
    assert_pools_clean(qwen3_deployment)
    sent1, received1 = scrape(prefill), scrape(decode)
    sent = value(sent1, "kvferry_kv_bytes_sent_total") - value(sent0, "kvferry_kv_bytes_sent_total")
    received = (value(received1, "kvferry_kv_bytes_received_total")
                - value(received0, "kvferry_kv_bytes_received_total"))
    assert sent == received > 0
    for samples in (sent1, received1):
        assert value(samples, "kvferry_kv_cache_usage_perc") == 0.0
        assert value(samples, "kvferry_num_requests_running") == 0
        assert value(samples, "kvferry_kv_cache_total_blocks") > 0
    assert value(received1, "kvferry_decode_steps_total") > value(received0,
                                                                  "kvferry_decode_steps_total")
