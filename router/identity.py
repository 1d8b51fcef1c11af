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

Keys are compared by their SHA-256 digest, never logged; a tenant appears in logs as `key-<first
12 hex digits of that digest>`.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

BEARER = "bearer "
TENANT_SALT_PREFIX = "tenant-"


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a public request."""

    tenant: str  # the tenant its API key names; "" on a router without keys
    scope: str  # where its request id lives: the tenant with keys, else its connection


ANONYMOUS = Caller("", "")  # in-process callers and tests: one scope, no tenant


def tenant_salt(tenant: str, cache_salt: str) -> str:
    """The prefix-cache namespace of a request: the client's own salt without tenants, else a
    digest of tenant and salt (fixed length, so it stays within the workers' salt limit)."""
    if not tenant:
        return cache_salt
    digest = hashlib.blake2b(digest_size=16, person=b"kvferry-tenant1")
    for part in (tenant, cache_salt):
        data = part.encode()
        digest.update(len(data).to_bytes(4, "little") + data)
    return TENANT_SALT_PREFIX + digest.hexdigest()


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
        self._tenants: dict[bytes, str] = {}
        for key in keys:
            check_key(key)
            digest = _digest(key)
            self._tenants[digest] = "key-" + digest.hex()[:12]

    @property
    def is_enabled(self) -> bool:
        return bool(self._tenants)

    def tenant_of(self, authorization: str | bytes | None) -> str | None:
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
