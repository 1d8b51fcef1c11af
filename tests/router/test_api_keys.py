"""API keys and tenants (router/identity.py) and the table of open requests
(router/request.py): keys are matched exactly, each names its own tenant, a tenant's
prefix-cache namespace is its own and bounded, and request ids are found only in their
caller's scope."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from kvferry.cache.prefix import MAX_CACHE_SALT_BYTES, check_cache_salt
from kvferry.errors import InvalidArgument, ResourceExhausted
from router import identity
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
    assert "0123456789" not in a.label  # the tenant's name does not carry the key
    assert "0123456789" not in repr(a) and a.digest.hex() not in repr(a)  # the label alone
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


def _tenant(key: str):  # noqa: ANN202 - identity.Tenant
    tenant = ApiKeys([key]).tenant_of(f"Bearer {key}")
    assert tenant is not None
    return tenant


def test_each_tenant_has_its_own_bounded_cache_namespace() -> None:
    assert tenant_salt(None, "mine") == "mine"  # no keys: the client's salt as before
    a, b = _tenant("key-of-a-0123456789"), _tenant("key-of-b-0123456789")
    salts = {tenant_salt(t, s) for t in (a, b) for s in ("", "x", "y")}
    assert len(salts) == 6  # tenant and salt both count
    longest = tenant_salt(a, "s" * MAX_CACHE_SALT_BYTES)
    check_cache_salt(longest)  # within what workers accept
    # every router holding the key computes the same namespace (routers sharing workers)
    assert tenant_salt(_tenant("key-of-a-0123456789"), "x") == tenant_salt(a, "x")


def _label_derived_salt(label: str, cache_salt: str) -> str:
    """The salt before issue 61: a digest of the tenant's public label and the client's salt,
    which a router without keys (whose clients choose their cache_salt) could compute."""
    digest = hashlib.blake2b(digest_size=16, person=b"kvferry-tenant1")
    for part in (label, cache_salt):
        data = part.encode()
        digest.update(len(data).to_bytes(4, "little") + data)
    return identity.TENANT_SALT_PREFIX + digest.hexdigest()


def test_a_salt_needs_the_key_not_its_label() -> None:
    """The salt is an HMAC keyed by a secret derived from the key's digest: the label (all a
    keyless router or a log reader knows) reproduces neither the old nor the new salt."""
    a = _tenant("key-of-a-0123456789")
    salt = tenant_salt(a, "x")
    assert salt != _label_derived_salt(a.label, "x")
    # the label is the digest's first 6 bytes: the rest is what a keyless router lacks
    guessed = identity.Tenant.of_digest(bytes.fromhex(a.label[4:]).ljust(32, b"\0"))
    assert tenant_salt(guessed, "x") != salt
    assert a.salt_key != a.digest and len(a.digest) == 32


def test_keys_whose_labels_collide_are_still_two_tenants(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """48-bit labels collide around 16M keys: the identity (scope) and the salt use the whole
    digest, so two keys with one label stay apart; only the logs' name is shared."""
    monkeypatch.setattr(identity, "_label", lambda digest: "key-000000000000")
    keys = ApiKeys(["first-key-0123456789", "second-key-0123456789"])
    first = keys.tenant_of("Bearer first-key-0123456789")
    second = keys.tenant_of("Bearer second-key-0123456789")
    assert first is not None and second is not None
    assert first.label == second.label == "key-000000000000"
    assert first != second and first.scope != second.scope
    assert tenant_salt(first, "") != tenant_salt(second, "")
    assert tenant_salt(first, "x") != tenant_salt(second, "x")


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
