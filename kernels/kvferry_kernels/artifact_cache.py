"""Crash-safe, verified on-disk caches, shared by every cache kvferry keeps: the C attention
library (`kvferry_kernels/cpu_attention.py`), the compiled decode packages and "auto" choice
records (`kvferry/model/compiled.py`) and GGUF conversions (`kvferry/model/gguf.py`). It lives
in kvferry_kernels/, the lowest layer, because the kernel's own cache uses it and
kvferry_kernels/ imports nothing above itself.

Entries: an entry is a directory `<cache>/<name>/` holding the artifact's files and
`manifest.json` (each file's size and SHA-256). It is built in a private scratch directory
beside it; every file, the manifest and the directory are fsynced, then the scratch directory is
renamed to the entry's name in one step and the parent fsynced. A reader therefore sees no entry
or a complete one, across a crash or a race between processes. Builders in one cache directory
take turns (a lock on the directory): workers started together on a cold cache build an entry
once; where the lock does not hold (a file system without flock), the loser of the rename drops
its copy and uses the winner's. Before anything is loaded the entry is checked against its
manifest, every byte hashed; an entry that fails (a truncated or stub file, a hash that does not
match, a file the manifest does not name, no readable manifest) is moved aside and built again,
with one warning naming it. Nothing is ever loaded from an entry that did not verify.

Permissions (refuse, then build privately): a cache directory owned by another user, or
writable by group or others, could hold a file someone else planted under the predictable name.
Such a directory is neither read nor written: one warning names it, and the process builds into
a fresh private temporary directory (mode 0700, removed at exit) instead, so it still starts
and nothing it loads came from the refused directory.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
# /proc/cpuinfo flags that name a vector or matrix ISA native code may be compiled for.
_ISA_FLAG_PREFIXES = ("avx", "sse", "ssse", "fma", "f16c", "amx", "bmi", "vnni", "asimd",
                      "sve", "sme", "fp16", "bf16", "i8mm", "dotprod", "neon")


class Cached(NamedTuple):
    path: Path  # the verified entry directory
    is_hit: bool  # found in the cache (False: built by this call)


def sha256_file(path: Path) -> str:
    """The SHA-256 of every byte of `path`, hex."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def unsafe_reason(directory: Path) -> str | None:
    """Why `directory` may not hold a cache (another user owns it, or group or others may write
    to it), or None when only this user can change what is in it."""
    info = directory.stat()
    if info.st_uid != os.geteuid():
        return f"owned by uid {info.st_uid}, not by this process's uid {os.geteuid()}"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by group or others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def private_temp_dir(prefix: str) -> Path:
    """A fresh directory only this user can use (mode 0700), removed when the process exits."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def cache_root(directory: Path | None, log: logging.Logger, prefix: str) -> Path:
    """Where to keep entries: `directory` (made with mode 0700 when missing) when it is safe;
    when it is not, one warning naming it and a private temporary directory instead (also the
    answer when `directory` is None)."""
    if directory is None:
        return private_temp_dir(prefix)
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    reason = unsafe_reason(directory)
    if reason is None:
        return directory
    private = private_temp_dir(prefix)
    log.warning("cache: refusing %s (%s): building into private %s instead", directory, reason,
                private)
    return private


def verify(entry: Path) -> str | None:
    """Why `entry` does not match its manifest, or None when every file does, byte for byte."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
        files: dict[str, dict[str, object]] = manifest["files"]
        if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
            return "manifest of an unknown format"
        present = sorted(p.relative_to(entry).as_posix() for p in entry.rglob("*")
                         if not p.is_dir() and p != entry / MANIFEST)
        if present != sorted(files):
            return f"files {present} differ from the manifest's {sorted(files)}"
        for name, want in files.items():
            path = entry / name
            if path.is_symlink() or not path.is_file():
                return f"{name} is not a plain file"
            if path.stat().st_size != want["size_bytes"]:
                return f"{name} has {path.stat().st_size} bytes, the manifest {want['size_bytes']}"
            if sha256_file(path) != want["sha256"]:
                return f"{name}'s SHA-256 does not match the manifest"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"no readable manifest: {exc}"
    return None


def lookup(entry: Path, log: logging.Logger) -> bool:
    """Whether a verified entry is there. One that fails verification is moved aside and
    deleted, with one warning naming it (the caller builds it again)."""
    if not os.path.lexists(entry):
        return False
    reason = verify(entry)
    if reason is None:
        return True
    log.warning("cache: %s failed verification (%s); building it again", entry, reason)
    discard(entry)
    return False


def discard(entry: Path) -> None:
    """Remove `entry` (renamed aside first, so no reader finds it half-deleted)."""
    trash = entry.with_name(f".{entry.name}.bad-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(entry, trash)
    except FileNotFoundError:
        return  # another process discarded it first
    if trash.is_dir() and not trash.is_symlink():
        shutil.rmtree(trash, ignore_errors=True)
    else:
        trash.unlink(missing_ok=True)


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's contents (a directory: its entries) to disk."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seal(scratch: Path) -> None:
    """Fsync every file under `scratch`, write its manifest, fsync the manifest and the
    directories: after this, `scratch` verifies and survives a crash once renamed."""
    files: dict[str, dict[str, object]] = {}
    for path in sorted(scratch.rglob("*")):
        if path.is_file() and path != scratch / MANIFEST:
            fsync_path(path)
            files[path.relative_to(scratch).as_posix()] = {
                "size_bytes": path.stat().st_size, "sha256": sha256_file(path)}
    manifest = scratch / MANIFEST
    manifest.write_text(json.dumps({"format": MANIFEST_FORMAT, "files": files}, indent=1))
    fsync_path(manifest)
    for directory in [*(p for p in scratch.rglob("*") if p.is_dir()), scratch]:
        fsync_path(directory)


def publish(scratch: Path, entry: Path, log: logging.Logger) -> None:
    """Seal `scratch` and rename it to `entry`. When another process renamed its own entry
    there first, theirs is kept (if it verifies) and `scratch` dropped."""
    try:
        seal(scratch)
        for _ in range(2):
            try:
                os.rename(scratch, entry)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
                    raise
                if lookup(entry, log):  # the winner's verified copy
                    return
                continue  # theirs was bad and is gone: rename ours
            fsync_path(entry.parent)
            return
        raise OSError(f"cache: could not publish {entry}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def get_or_build(entry: Path, build: Callable[[Path], None], log: logging.Logger) -> Cached:
    """The verified entry at `entry`, built first when missing or bad: `build(scratch)` writes
    the artifact's files into an empty private directory, which is then published. Builds in
    one cache directory take turns (a lock on the directory, released by the OS if the
    builder dies): a process that finds the entry missing waits for a build under way and
    loads what it published, so workers starting together on a cold cache compile once, not
    once each. A `build` must not build another entry of the same directory."""
    if lookup(entry, log):
        return Cached(entry, True)
    entry.parent.mkdir(parents=True, exist_ok=True)
    with _building(entry):
        if lookup(entry, log):  # built by the process that held the lock before us
            return Cached(entry, True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{entry.name}.tmp-", dir=entry.parent))
        try:
            build(scratch)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        publish(scratch, entry, log)
    return Cached(entry, False)


@contextlib.contextmanager
def _building(entry: Path) -> Iterator[None]:
    """Held while `entry` is looked up again and built: an exclusive flock on its directory
    (no lock file left in the cache; each open gets its own lock, threads of one process
    too)."""
    fd = os.open(entry.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def write_file_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data`: a temporary file beside it, fsynced, renamed, the directory
    fsynced (a reader or a crash sees the old bytes or the new ones, never a mix)."""
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.partial")
    try:
        with partial.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    fsync_path(path.parent)


def native_target(device: torch.device) -> str:
    """What natively compiled code is specific to: the CPU's vector ISA (as torch and
    /proc/cpuinfo see it) and, on CUDA, the device's name and compute capability."""
    parts = [torch.backends.cpu.get_cpu_capability(), cpu_isa_flags()]
    if device.type == "cuda":
        parts += [torch.cuda.get_device_name(device), str(torch.cuda.get_device_capability(device))]
    return "\0".join(parts)


@functools.cache
def cpu_isa_flags() -> str:
    """The vector and matrix ISA flags of this machine's CPU (/proc/cpuinfo), sorted: what
    natively compiled code may use, so a cache shared by machines keeps one build per kind."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    flags: set[str] = set()
    for line in info.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(f for f in line.partition(":")[2].split()
                         if f.startswith(_ISA_FLAG_PREFIXES))
    return " ".join(sorted(flags))
