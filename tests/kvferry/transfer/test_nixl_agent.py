"""A NIXL agent's life (kvferry/transfer/nixl/agent.py): a process that used NIXL exits with
status 0, whether or not it closed its agents, also where rdma-core is installed (CI installs
it, as on RDMA nodes: then a second libnl-route copy used to crash the exit); a close stops
the agent's threads, deregisters its memory, refuses later use, and may be called again."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from decode_worker.kv_receiver import KvReceiver
from kvferry.cache.layout import KvLayout
from kvferry.cache.pool import KvPool
from kvferry.transfer.nixl import agent as nixl_agent
from kvferry.transfer.nixl import pages as nixl_pages
from kvferry.transfer.nixl.receive import NixlPuller
from kvferry.transfer.nixl.send import NixlKvSender

REPO = Path(__file__).resolve().parents[3]

# Two agents in one process, as a sender and a puller: register, load the peer, one READ.
# argv[1]: "raw" registers with the agents directly, "register" through nixl_agent (so a
# close deregisters), "close" also closes both agents (one twice) before the exit.
CHILD = """
import sys
import torch
from kvferry.transfer.nixl import agent as nixl_agent
from kvferry.transfer.nixl import pages as nixl_pages
mode = sys.argv[1]
src = torch.arange(1 << 16, dtype=torch.float32)
dst = torch.zeros(1 << 16, dtype=torch.float32)
sender, puller = nixl_pages.make_agent("exit-src"), nixl_pages.make_agent("exit-dst")
for agent, tensor in ((sender, src), (puller, dst)):
    if mode == "raw":
        agent.register_memory(tensor)
    else:
        nixl_agent.register(agent, tensor)
peer = nixl_pages.add_peer(puller, sender.get_agent_metadata())
state = nixl_pages.read(puller, puller.get_xfer_descs(dst), sender.get_xfer_descs(src), peer,
                        30.0)
print("read", state, bool(torch.equal(src, dst)))
print("libnl-route copies", len({line.split()[-1] for line in open("/proc/self/maps")
                                  if "libnl-route" in line}))
if mode == "close":
    for agent in (puller, sender, sender):
        nixl_agent.close(agent)
print("end", flush=True)
"""


def _child(mode: str) -> subprocess.CompletedProcess[str]:
    # Not this process's UCX_MODULES (set once it made an agent): the child must set its own.
    env = {key: value for key, value in os.environ.items() if key != "UCX_MODULES"}
    return subprocess.run([sys.executable, "-c", CHILD, mode], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("mode", ["raw", "register", "close"])
def test_a_process_that_used_nixl_exits_cleanly(mode: str) -> None:
    """raw and register leave their agents to the atexit hook (newest first)."""
    result = _child(mode)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert "read DONE True" in result.stdout and "end" in result.stdout
    assert "libnl-route copies 1" in result.stdout  # never the system's beside the wheel's


def _pool() -> KvPool:
    return KvPool(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, num_blocks=4,
                  dtype=torch.float32)


def test_close_stops_the_threads_and_refuses_later_use() -> None:
    before = nixl_pages.thread_ids()
    agent = nixl_pages.make_agent("close-test")
    nixl_agent.register(agent, _pool().cache)
    assert nixl_agent.is_open(agent) and len(nixl_pages.thread_ids() - before) >= 1
    started = nixl_pages.thread_ids() - before
    nixl_agent.close(agent)
    assert not nixl_agent.is_open(agent)
    assert len(nixl_pages.thread_ids() - before) < len(started)  # its progress thread ended
    nixl_agent.close(agent)  # idempotent
    with pytest.raises(RuntimeError, match="close-test.* is closed"):
        agent.get_agent_metadata()


def test_owners_close_the_agents_they_made() -> None:
    pool = _pool()
    puller = NixlPuller(KvReceiver(KvLayout.of_pool(pool, "fp"), pool, {}, lambda _: None))
    sender = NixlKvSender()
    sender.register(_pool())
    for _ in range(2):  # idempotent
        puller.close()
        asyncio.run(sender.close())
    assert not nixl_agent.is_open(puller.agent) and not nixl_agent.is_open(sender.agent)


def test_an_operators_ucx_modules_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_MODULES", "*")
    nixl_agent.prepare_ucx()
    assert os.environ["UCX_MODULES"] == "*"
    monkeypatch.delenv("UCX_MODULES")
    monkeypatch.setattr(nixl_agent, "has_efa_device", lambda: True)
    nixl_agent.prepare_ucx()  # an EFA node keeps UCX's efa module
    assert "UCX_MODULES" not in os.environ
    monkeypatch.setattr(nixl_agent, "has_efa_device", lambda: False)
    nixl_agent.prepare_ucx()
    assert os.environ["UCX_MODULES"] == nixl_agent.WITHOUT_EFA
