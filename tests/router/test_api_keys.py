"""API keys and tenants (router/identity.py) and the table of open requests
(router/request.py): keys are matched exactly, each names its own tenant, a tenant's
prefix-cache namespace is its own and bounded, and request ids are found only in their
caller's scope."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvferry.cache.prefix import MAX_CACHE_SALT_BYTES, check_cache_salt
from kvferry.errors import InvalidArgument, ResourceExhausted
from router.identity import ApiKeys, read_keys_file, tenant_salt
from router.request import OpenRequests, RouterRequest


def test_a_bearer_key_names_its_tenant_and_nothing_else_does() -> None:
    keys = ApiKeys(["key-of-a-0123456789", "key-of-b-0123456789"])
    a = keys.tenant_of("Bearer key-of-a-0123456789")
    b = keys.tenant_of(b"bearer key-of-b-0123456789")  # gRPC metadata may be bytes
    assert a is not None and b is not None and a != b
    assert keys.tenant_of("Bearer  key-of-a-0123456789 ") == a  # surrounding spaces
    for refused in (None, "", "Bearer", "Bearer key-of-a-012345678", "key-of-a-0123456789",
                    "Basic key-of-a-0123456789", "Bearer key-of-a-0123456789x", b"\xff\xfe"):
        assert keys.tenant_of(refused) is None, refused
    assert "0123456789" not in a  # the tenant's name does not carry the key
    assert not ApiKeys().is_enabled and keys.is_enabled


def test_keys_are_printable_and_files_are_read_line_by_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="api_key"):
        ApiKeys(["has space"])
    path = tmp_path / "keys"
    path.write_text("# tenants\nfirst-key\n\n  second-key  \n")
    assert read_keys_file(path) == ("first-key", "second-key")
    path.write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="api_keys_file: .* holds no key"):
        read_keys_file(path)
    with pytest.raises(ValueError, match="api_keys_file: cannot read"):
        read_keys_file(tmp_path / "missing")


def test_each_tenant_has_its_own_bounded_cache_namespace() -> None:
    assert tenant_salt("", "mine") == "mine"  # no keys: the client's salt as before
    salts = {tenant_salt(t, s) for t in ("key-a", "key-b") for s in ("", "x", "y")}
    assert len(salts) == 6  # tenant and salt both count, and never collide by concatenation
    assert tenant_salt("key-a", "b") != tenant_salt("key-ab", "")
    longest = tenant_salt("key-a", "s" * MAX_CACHE_SALT_BYTES)
    check_cache_salt(longest)  # within what workers accept


def test_ids_live_in_their_callers_scope() -> None:
    table = OpenRequests(max_streams=8)
    mine, theirs = RouterRequest("r@1"), RouterRequest("r@2")
    table.add("tenant-a", "r", mine)
    table.add("tenant-b", "r", theirs)  # the same id elsewhere reveals nothing
    with pytest.raises(InvalidArgument, match="already running"):
        table.add("tenant-a", "r", RouterRequest("r@3"))
    assert table.find("tenant-a", "r") is mine and table.find("tenant-b", "r") is theirs
    assert table.find("tenant-c", "r") is None
    table.remove("tenant-a", "r")
    assert table.find("tenant-a", "r") is None and table.states() == [theirs]


def test_one_cap_counts_every_open_request() -> None:
    table = OpenRequests(max_streams=2)
    table.open_stream()
    table.open_stream()
    with pytest.raises(ResourceExhausted, match="--max-streams"):
        table.open_stream()
    table.close_stream()
    table.open_stream()
    assert table.num_streams == 2


def test_downstream_ids_are_unique_among_running_requests() -> None:
    table = OpenRequests(max_streams=8)
    first = table.downstream_id("r", "inst")
    assert first == "r@inst"  # the plain form while nobody else runs "r"
    table.add("tenant-a", "r", RouterRequest(first))
    second = table.downstream_id("r", "inst")
    assert second not in (first, "") and second.startswith("r@inst.")
    table.add("tenant-b", "r", RouterRequest(second))
    table.remove("tenant-a", "r")
    assert table.downstream_id("r", "inst") == "r@inst"  # free again
