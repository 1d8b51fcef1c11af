"""deploy/netns.py: names that encode their owner, teardown that leaves nothing, stale
leftovers of a killed process removed by the next network. The parts that make namespaces
need root and iproute2; elsewhere they are skipped with that reason (the launcher then falls
back to loopback, covered by tests/e2e/test_network.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from deploy import netns

needs_netns = pytest.mark.skipif(not netns.is_available(),
                                 reason="network namespaces need root and iproute2")


def test_names_encode_the_owner_pid() -> None:
    for pid in (1, 35, 36, 4_194_304):
        assert netns._owner_pid(f"{netns.PREFIX}{netns._base36(pid)}_3h1") == pid
    assert netns._owner_pid("kvfzz") is None  # no separator: not ours
    assert netns._owner_pid("eth0") is None
    assert netns._owner_pid("kvf!!_0") is None


@needs_netns
def test_network_is_reachable_cut_and_destroyed() -> None:
    net = netns.Network.create()
    try:
        address = net.add("decode-0")
        assert address == str(net.subnet.network_address + netns.FIRST_HOST)
        net.cut("decode-0")
        state = subprocess.run(["ip", "-o", "link", "show", net.links["decode-0"].host_veth],
                               capture_output=True, text=True, check=True).stdout
        assert "state DOWN" in state
        net.heal("decode-0")
        assert sorted(net.leftovers()) == sorted(
            [net.bridge, net.links["decode-0"].host_veth, net.links["decode-0"].namespace])
    finally:
        net.destroy()
    assert net.leftovers() == []


@needs_netns
def test_stale_parts_of_a_killed_process_are_removed() -> None:
    code = ("from deploy import netns\n"
            "net = netns.Network.create(); net.add('prefill-0')\n"
            "print(net.tag, net.links['prefill-0'].namespace, flush=True)\n"
            "import signal; signal.pause()\n")  # alive until the test kills it
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        tag, namespace = child.stdout.readline().split()
    finally:
        child.kill()
        child.wait()
    assert namespace in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                       text=True, check=True).stdout
    removed = netns.clean_stale()
    assert {f"{tag}br", f"{tag}h0", namespace} <= set(removed)
    listing = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                             check=True).stdout
    listing += subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                              check=True).stdout
    assert tag not in listing
