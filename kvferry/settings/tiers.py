"""The tiers a worker runs with (`WorkerSettings.tiers`): flags' values, checked. No torch
here: settings import it (`kvferry.cache.tiers.tiered.build_tiered_cache` builds the tiers)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvferry.settings.sizes import parse_pool_size

WRITE_POLICIES = ("write_through", "write_back")
DEFAULT_DISK_CACHE_SIZE = "16GiB"
STORE_SCHEMES = ("redis://", "rediss://", "unix://")
# How long a request waits for the store's answer before going on without its blocks.
DEFAULT_STORE_DEADLINE_S = 0.05
_CGROUP_LIMIT = Path("/sys/fs/cgroup/memory.max")


@dataclass(frozen=True)
class TierSettings:
    """None everywhere: the pool alone (today's prefix cache)."""

    # Host-memory tier: bytes ("4GiB") or a fraction ("0.2") of the memory this process may
    # use (MemAvailable, or the cgroup's limit when lower).
    host_cache_size: str | None = None
    host_write_policy: str = WRITE_POLICIES[0]
    # Disk tier (needs the host tier): a directory worker processes may share (each takes a
    # subdirectory of its own), and each one's cap in bytes.
    disk_cache_dir: str | None = None
    disk_cache_size: str = DEFAULT_DISK_CACHE_SIZE
    # Store tier (needs the host tier): a Redis-protocol server every worker shares,
    # redis://HOST:PORT[/DB] or unix:///PATH.
    store_url: str | None = None
    # A file holding the store's password (a mounted Secret), so it is in no URL, command line
    # or log; a password written into the URL is redacted from the logs.
    store_password_file: str | None = None
    # A store lookup's deadline: past it the request goes on without the store's blocks, and
    # a store that keeps missing it is disabled (then probed) like one that fails.
    store_deadline_s: float = DEFAULT_STORE_DEADLINE_S

    def __post_init__(self) -> None:
        if self.host_write_policy not in WRITE_POLICIES:
            raise ValueError(f"kv_host_write_policy: expected one of {', '.join(WRITE_POLICIES)}"
                             f", got {self.host_write_policy!r}")
        if self.host_cache_size is not None:
            host_cache_bytes(self.host_cache_size)
        if self.disk_cache_dir is not None:
            if self.host_cache_size is None:
                raise ValueError("kv_disk_cache_dir: needs a host tier (--kv-host-cache-size): "
                                 "disk blocks are read through host memory")
            disk_cache_bytes(self)
            refuse_unsafe_disk_dir(Path(self.disk_cache_dir))
        if self.store_url is not None:
            if self.host_cache_size is None:
                raise ValueError("kv_store_url: needs a host tier (--kv-host-cache-size): "
                                 "store blocks are read through host memory")
            if not self.store_url.startswith(STORE_SCHEMES):
                raise ValueError(f"kv_store_url: expected {', '.join(STORE_SCHEMES)}..., got "
                                 f"{redacted_url(self.store_url)!r}")
        if not 0 < self.store_deadline_s <= 10:
            raise ValueError(f"kv_store_deadline_ms: expected more than 0 and at most 10000, "
                             f"got {self.store_deadline_s * 1e3:g}")
        if self.store_password_file is not None:
            if self.store_url is None:
                raise ValueError("kv_store_password_file: needs --kv-store-url")
            if redacted_url(self.store_url) != self.store_url:
                raise ValueError("kv_store_password_file: --kv-store-url carries a password "
                                 "already; give it in one place")
            store_password(self)

    @property
    def is_tiered(self) -> bool:
        return self.host_cache_size is not None


def refuse_unsafe_disk_dir(directory: Path) -> None:
    """ValueError naming --kv-disk-cache-dir when it exists and another user owns it or group
    or others may write to it (checked with the flags, so the CLI refuses it in one line;
    the disk tier checks again when it starts, and makes a missing one 0700)."""
    if not directory.exists():
        return
    from kvferry_kernels.artifact_cache import unsafe_reason  # the on-disk caches' one rule

    reason = unsafe_reason(directory) if directory.is_dir() else "not a directory"
    if reason is not None:
        raise ValueError(f"kv_disk_cache_dir: refusing {directory} ({reason}): give a "
                         "directory only this user can write to")


def store_password(settings: TierSettings) -> str | None:
    """The password in --kv-store-password-file (its trailing newline dropped), or None;
    ValueError naming the flag when the file cannot be read or holds nothing."""
    if settings.store_password_file is None:
        return None
    try:
        password = Path(settings.store_password_file).read_text().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"kv_store_password_file: cannot read {settings.store_password_file}"
                         f": {e}") from None
    if not password:
        raise ValueError(f"kv_store_password_file: {settings.store_password_file} is empty")
    return password


def redacted_url(url: str) -> str:
    """`url` with the password of its user-info part replaced (for logs and messages)."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    userinfo, at, host = netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return f"{scheme}{sep}{userinfo.split(':', 1)[0]}:***@{host}{slash}{path}"


def host_memory_bytes() -> int:
    """Host memory this process may still take: MemAvailable, capped by a cgroup v2 limit
    (SGLang sized its host pool from the machine and got OOM-killed in containers)."""
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        limit = _CGROUP_LIMIT.read_text().strip()
        if limit != "max":
            available = min(available, int(limit))
    except (OSError, ValueError):
        pass
    return available


def host_cache_bytes(value: str) -> int:
    """--kv-host-cache-size in bytes; ValueError naming the flag when unparsable or more
    than the host has available."""
    available = host_memory_bytes()
    size = parse_pool_size(value, available, "kv_host_cache_size")
    if size > available:
        raise ValueError(f"kv_host_cache_size: {size} bytes is more than the {available} "
                         "bytes of host memory available")
    return size


def disk_cache_bytes(settings: TierSettings) -> int:
    """--kv-disk-cache-size in bytes (a fraction: of the free space under the directory)."""
    import shutil

    assert settings.disk_cache_dir is not None
    path = Path(settings.disk_cache_dir)
    while not path.exists() and path != path.parent:
        path = path.parent
    return parse_pool_size(settings.disk_cache_size, shutil.disk_usage(path).free,
                           "kv_disk_cache_size")
