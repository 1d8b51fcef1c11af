"""What a deployment of tensor-parallel workers listens on (docs/security.md, "Ports"): no
process (router, workers, their ranks) listens on a wildcard address, the ranks' only ports
are gloo's on loopback (no rendezvous port: a file store), and a stranger who connects with
no credentials to every internal port of the workers and their ranks, sending garbage and a
TCPStore handshake, changes nothing the ranks compute."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from deploy import client
from deploy.launcher import Deployment, Process
from tests.conftest import assert_alive, assert_pools_clean
from tests.deployments import rank_pids
from tests.e2e.test_tensor_parallel_workers import sizes_reported, split_workers
from tests.e2e.test_token_exact import MAX_TOKENS, _hf_model, _prompts, _reference
from tests.listening import Listener, children, listeners, strangers

pytestmark = pytest.mark.slow

NUM_PROMPTS = 6  # of the token-exact oracle's: 1 to 300 tokens


def _descendants(pid: int) -> list[int]:
    """A process and its descendants."""
    found = [pid]
    for child in children(pid):
        found += _descendants(child)
    return found


def _family(deployment: Deployment, proc: Process) -> list[int]:
    """A process, its descendants, and a split worker's ranks with theirs (the suite's
    zygote forks the ranks: they are not the worker's children)."""
    found = _descendants(proc.popen.pid)
    for rank in rank_pids(deployment, proc) if proc.name.startswith(("prefill", "decode")) \
            else []:
        found += _descendants(rank)
    return found


def _public_ports(proc: Process) -> set[int]:
    """The ports a process is documented to serve: gRPC, metrics, the router's HTTP."""
    return {p for p in (proc.port, proc.metrics_port, proc.http_port) if p}


def _internal(deployment: Deployment) -> list[Listener]:
    """Every listener of the workers and their ranks that is no documented public port."""
    found = []
    for proc in deployment.processes:
        if proc.name.startswith(("prefill", "decode")):
            public = _public_ports(proc)
            found += [f for f in listeners(_family(deployment, proc)) if f.port not in public]
    return found


def test_no_wildcard_listener_and_strangers_change_no_rank(
        qwen3_checkpoint: Path, qwen3_deployment: Deployment) -> None:
    with split_workers(qwen3_deployment, 2, 2):
        assert sizes_reported(qwen3_deployment) == {"prefill": 2, "decode": 2}
        pids = [pid for proc in qwen3_deployment.processes
                for pid in _family(qwen3_deployment, proc)]
        found = listeners(pids)
        assert [f for f in found if f.is_wildcard] == []
        internal = _internal(qwen3_deployment)
        # each split worker's gloo listener, and its rank's: on loopback, nothing else
        assert len(internal) >= 4, internal
        assert {f.address for f in internal} == {"127.0.0.1"}, internal
        ranks = sorted(pids)
        assert strangers(internal) == []
        assert sorted(pid for proc in qwen3_deployment.processes
                      for pid in _family(qwen3_deployment, proc)) == ranks  # none restarted
        assert all(Path(f"/proc/{pid}").exists() for pid in ranks)  # and none left
        prompts = _prompts(_hf_model(qwen3_checkpoint).config.vocab_size)[:NUM_PROMPTS]
        limits = [MAX_TOKENS[i % len(MAX_TOKENS)] for i in range(len(prompts))]
        requests = [client.make_request(p, temperature=0.0, max_tokens=m)
                    for p, m in zip(prompts, limits)]
        got = asyncio.run(client.generate_many(qwen3_deployment.router_address, requests, 300))
        for prompt, limit, completion in zip(prompts, limits, got):
            assert completion.token_ids == _reference(qwen3_checkpoint, prompt, limit), \
                len(prompt)
        assert_pools_clean(qwen3_deployment)
        assert_alive(qwen3_deployment)
