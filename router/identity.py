"""Who a public request belongs to: API keys, the tenant each names, and the scope a request's id
lives in.

With API keys (`--api-key`, `--api-keys-file`, `KVFERRY_API_KEY`), every public call (HTTP
`/v1/*`, and every RPC of the gRPC GenerationService) carries `Authorization: Bearer <key>`; a
call without a valid key is refused (HTTP 401, gRPC UNAUTHENTICATED) before its request is
looked at. Each key is a tenant: its requests get a prefix-cache namespace of their own
(`tenant_salt`: derived from the tenant and the client's own `cache_salt`, so two tenants never
share a cached block and neither can probe the other's prompts through `cached_tokens` or
timing), and their request ids live in the tenant's scope, so an Abort or a duplicate id reaches
or reveals only the caller's own requests.

Without keys there are no tenants, and a request id's scope is the connection it arrived on (the
gRPC peer address); an Abort from another connection gets NOT_FOUND, exactly as for an id that
was never used. Channels of one client process may share a connection (gRPC's global subchannel
pool), and so a scope; clients behind one L7 proxy share the proxy's connections. HTTP requests
get ids the server makes up (`chatcmpl-<uuid4>`), which no other client can guess.

Keys are compared by their SHA-256 digest, never logged. A tenant is that whole digest (its
scope; 12 hex digits, 48 bits, would make two of some 16 million keys one tenant); it appears in
logs as `key-<first 12 hex digits of the digest>`, a label that names nothing else. Its salt is an
HMAC-SHA256 keyed by a secret derived from the digest: only a router holding the key can compute
it (every router holding the key computes the same one, so routers sharing workers share a
tenant's cache), and a client of a router without keys, which chooses its `cache_salt` freely,
cannot name another tenant's namespace.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

BEARER = "bearer "
TENANT_SALT_PREFIX = "tenant-"
_SALT_KEY_CONTEXT = b"kvferry tenant salt key v2"  # the salt key is not the digest itself


def _label(digest: bytes) -> str:
    """A tenant's name in logs (never its identity: 48 bits)."""
    return "key-" + digest.hex()[:12]


@dataclass(frozen=True, slots=True)
class Tenant:
    """The tenant one API key names. Its identity is the key's whole SHA-256 digest; `label`
    is for logs only; `salt_key` keys its prefix-cache namespace and is derived from the
    digest, so only whoever holds the key can compute it. repr shows the label alone."""

    digest: bytes = field(repr=False)  # SHA-256 of the key, 32 bytes
    label: str  # `key-<12 hex>`: logs only
    salt_key: bytes = field(repr=False)

    @staticmethod
    def of_digest(digest: bytes) -> Tenant:
        return Tenant(digest, _label(digest),
                      hmac.new(digest, _SALT_KEY_CONTEXT, hashlib.sha256).digest())

    @property
    def scope(self) -> str:
        """Where the tenant's request ids live: the whole digest, never the label."""
        return "key:" + self.digest.hex()


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a public request."""

    tenant: Tenant | None  # the tenant its API key names; None on a router without keys
    scope: str  # where its request id lives: the tenant's with keys, else its connection


ANONYMOUS = Caller(None, "")  # in-process callers and tests: one scope, no tenant


def tenant_salt(tenant: Tenant | None, cache_salt: str) -> str:
    """The prefix-cache namespace of a request: the client's own salt without tenants, else an
    HMAC-SHA256 of the client's salt keyed by the tenant's salt key (`tenant-` and 64 hex
    digits: fixed length, within the workers' salt limit)."""
    if tenant is None:
        return cache_salt
    mac = hmac.new(tenant.salt_key, cache_salt.encode(), hashlib.sha256)
    return TENANT_SALT_PREFIX + mac.hexdigest()


def read_keys_file(path: str | Path) -> tuple[str, ...]:
    """One key per line; blank lines and lines starting with # are skipped."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"api_keys_file: cannot read {path}: {exc}") from exc
    keys = tuple(line.strip() for line in text.splitlines()
                 if line.strip() and not line.lstrip().startswith("#"))
    if not keys:
        raise ValueError(f"api_keys_file: {path} holds no key")
    return keys


def check_key(key: str) -> None:
    """A key is printable ASCII without spaces (it travels in an HTTP header)."""
    if not key or not all(33 <= ord(c) < 127 for c in key):
        raise ValueError("api_key: a key must be non-empty printable ASCII without spaces")


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


class ApiKeys:
    """The router's API keys (none: every caller is anonymous)."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._tenants: dict[bytes, Tenant] = {}
        for key in keys:
            check_key(key)
            digest = _digest(key)
            self._tenants[digest] = Tenant.of_digest(digest)

    @property
    def is_enabled(self) -> bool:
        return bool(self._tenants)

    def tenant_of(self, authorization: str | bytes | None) -> Tenant | None:
        """The tenant of an `Authorization` header's bearer key; None when the header is
        missing, malformed or names no key of this router."""
        if authorization is None:
            return None
        if isinstance(authorization, bytes):
            try:
                authorization = authorization.decode("ascii")
            except UnicodeDecodeError:
                return None
        if authorization[: len(BEARER)].lower() != BEARER:
            return None
        presented = _digest(authorization[len(BEARER):].strip())
        found = None
        for digest, tenant in self._tenants.items():  # every key compared, in constant time
            if hmac.compare_digest(digest, presented):
                found = tenant
        return found
