"""Network namespaces for test deployments: each component on its own address, as on its own
host, so that a link can be cut.

Layout of one `Network` (every name starts with the deployment's tag, `kvf<pid>_<seq>` with
the pid in base 36, so stale leftovers of a dead process can be found and removed):

    root namespace:  bridge <tag>br, 10.213.X.1/24   <- the launcher and tests talk from here
                        |-- veth <tag>h0 <-> eth0 in namespace <tag>-prefill-0, 10.213.X.10
                        |-- veth <tag>h1 <-> eth0 in namespace <tag>-decode-0,  10.213.X.11
                        '-- ...

`cut` sets a component's root-side veth down: the bridge stops forwarding to it and packets
vanish in both directions, with no RST and no FIN (a partition, not a crash). `heal` sets it
up again. Needs root and iproute2 (`is_available` probes once per process); the launcher
falls back to loopback where it is missing.
"""

from __future__ import annotations

import functools
import ipaddress
import itertools
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import NamedTuple

log = logging.getLogger("kvferry")

PREFIX = "kvf"
SUBNET_BASE = "10.213"  # 10.213.X.0/24, X picked per network among those not in use
FIRST_HOST = 10  # components get .10, .11, ...; .1 is the bridge (the root namespace)
_sequence = itertools.count()


class Link(NamedTuple):
    namespace: str
    host_veth: str  # the root-side end, on the bridge: what cut/heal switch
    address: str


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


class NetnsError(RuntimeError):
    """An `ip` command failed."""


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, rem = divmod(n, 36)
        out = digits[rem] + out
        if n == 0:
            return out


@functools.cache
def is_available() -> bool:
    """Root, iproute2, and namespaces and bridges can really be made here (probed once)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    probe = f"{PREFIX}{_base36(os.getpid())}_probe"
    try:
        _ip("netns", "add", probe)
        _ip("netns", "del", probe)
        _ip("link", "add", probe[:15], "type", "bridge")
        _ip("link", "del", probe[:15])
    except (NetnsError, OSError, subprocess.TimeoutExpired) as exc:
        log.info("network namespaces unavailable: %s", exc)
        for args in (("netns", "del", probe), ("link", "del", probe[:15])):
            subprocess.run(["ip", *args], capture_output=True, check=False)
        return False
    return True


def _owner_pid(name: str) -> int | None:
    """The pid encoded in one of our names, `kvf<pid base 36>_...`; None if not ours."""
    if not name.startswith(PREFIX) or "_" not in name:
        return None
    try:
        return int(name[len(PREFIX):name.index("_")], 36)
    except ValueError:
        return None


def _is_dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def clean_stale() -> list[str]:
    """Remove namespaces, veths and bridges left by processes that no longer exist."""
    removed = []
    namespaces = [line.split()[0] for line in _ip("netns", "list").splitlines() if line]
    links = [line.split(":")[1].strip().split("@")[0]
             for line in _ip("-o", "link", "show").splitlines()]
    for kind, names in (("netns", namespaces), ("link", links)):
        for name in names:
            pid = _owner_pid(name)
            if pid is not None and _is_dead(pid):
                # A veth goes with its peer or namespace: a second delete may find it gone.
                subprocess.run(["ip", kind, "del", name], capture_output=True, check=False)
                removed.append(name)
    if removed:
        log.warning("removed stale network namespaces and links: %s", " ".join(removed))
    return removed


def _free_subnet(start: int) -> int:
    """X of a 10.213.X.0/24 that no address in the root namespace uses yet."""
    used = _ip("-o", "-4", "addr", "show")
    for offset in range(254):
        x = (start + offset) % 254 + 1
        if f" {SUBNET_BASE}.{x}." not in used:
            return x
    raise NetnsError(f"no free /24 under {SUBNET_BASE}.0.0/16")


@dataclass
class Network:
    """A bridge and one namespace per component. Create with `Network.create()`, always end
    with `destroy()` (it is safe after any partial failure)."""

    tag: str
    subnet: ipaddress.IPv4Network
    links: dict[str, Link] = field(default_factory=dict)  # by component name

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    @property
    def gateway(self) -> str:
        return str(self.subnet.network_address + 1)

    @staticmethod
    def create() -> Network:
        clean_stale()
        pid, seq = os.getpid(), next(_sequence)
        x = _free_subnet(pid + seq)
        net = Network(f"{PREFIX}{_base36(pid)}_{_base36(seq)}",
                      ipaddress.IPv4Network(f"{SUBNET_BASE}.{x}.0/24"))
        try:
            _ip("link", "add", net.bridge, "type", "bridge")
            _ip("addr", "add", f"{net.gateway}/24", "dev", net.bridge)
            _ip("link", "set", net.bridge, "up")
        except BaseException:
            net.destroy()
            raise
        return net

    def add(self, name: str) -> str:
        """A namespace for component `name`, linked to the bridge; returns its address."""
        index = len(self.links)
        link = Link(f"{self.tag}-{name}", f"{self.tag}h{_base36(index)}",
                    str(self.subnet.network_address + FIRST_HOST + index))
        self.links[name] = link  # before creating anything: destroy() must see it
        peer = f"{self.tag}n{_base36(index)}"
        ns = link.namespace
        _ip("netns", "add", ns)
        _ip("link", "add", link.host_veth, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", ns)
        _ip("link", "set", link.host_veth, "master", self.bridge, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "link", "set", peer, "name", "eth0")
        _ip("-n", ns, "addr", "add", f"{link.address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "route", "add", "default", "via", self.gateway)
        return link.address

    def exec_prefix(self, name: str) -> list[str]:
        """Command prefix that runs a program inside `name`'s namespace (ip execs it: the
        pid is the program's own)."""
        return ["ip", "netns", "exec", self.links[name].namespace]

    def cut(self, name: str) -> None:
        _ip("link", "set", self.links[name].host_veth, "down")

    def heal(self, name: str) -> None:
        _ip("link", "set", self.links[name].host_veth, "up")

    def destroy(self) -> None:
        """Remove every veth, namespace and the bridge; carries on past failures (a part that
        was never made), logging them."""
        for link in self.links.values():
            for kind, name in (("link", link.host_veth), ("netns", link.namespace)):
                done = subprocess.run(["ip", kind, "del", name], capture_output=True,
                                      text=True, check=False)
                if done.returncode != 0 and "not" not in done.stderr.lower():
                    log.warning("ip %s del %s: %s", kind, name, done.stderr.strip())
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)

    def leftovers(self) -> list[str]:
        """Names of this network's parts that still exist (empty after destroy())."""
        ours = {self.bridge} | {name for link in self.links.values()
                                for name in (link.namespace, link.host_veth)}
        namespaces = {line.split()[0] for line in _ip("netns", "list").splitlines() if line}
        links = {line.split(":")[1].strip().split("@")[0]
                 for line in _ip("-o", "link", "show").splitlines()}
        return sorted(ours & (namespaces | links))
