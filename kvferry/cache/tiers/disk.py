"""The disk tier: cached blocks as files under `--kv-disk-cache-dir`, found again after a
restart.

Layout: `<dir>/<layout hash>/<n>/<key[:1] hex>/<key hex>.kvb`, one value per file (the codec's
header, then the block). Worker processes on one machine may share `<dir>`: each takes the
first directory `<n>` whose `LOCK` (`fcntl.flock`) no live process holds, so a restarted
worker finds a directory full of blocks, and since keys name contents, a block is right for
any worker of the same layout.

A write goes to `tmp/` and is renamed into place: a file is visible whole or not at all, and
a process killed mid-write leaves bytes only in `tmp/`, swept at the next start. The index
(key -> file, least recently used first) lives on the event loop; a restart rebuilds it from
a scan (file size checked; contents verified when read). A read checks the header and both
CRCs; a block that fails is deleted and reported, never served (the tiered cache then checks
its values as a pushed chunk's: finite, and scales within bounds).

Privacy (the rule of the other on-disk caches, `kernels/kvferry_kernels/artifact_cache.py`, but
refused rather than worked around: a K/V cache in a temporary directory is no cache): K/V
reads back as prompt text, so `<dir>` must be owned by this user and writable by no one else,
or the worker refuses to start (ValueError naming it). Every directory under it is made 0700
and every file 0600, whatever the umask (explicit modes, then chmod); an existing
subdirectory owned by another user, or a symlink, is refused too. Files are opened with
O_NOFOLLOW, and a file not owned by this user, or that others may read or write, is deleted
at the scan and refused at a read.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import stat
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch

from kvferry.cache.allocator import IntegrityReport
from kvferry.cache.prefix import KEY_BYTES, CacheEvents, Tier
from kvferry.cache.stats import TierState
from kvferry.cache.tiers import codec
from kvferry.settings.tiers import refuse_unsafe_disk_dir

log = logging.getLogger("kvferry.tiers")

SUFFIX = ".kvb"


class DiskFull(OSError):
    """The disk (or the injected cap) has no room for a block."""


class DiskTier:
    """Block files under one locked directory; index and LRU on the event loop, file I/O on
    the tiered cache's threads."""

    tier = Tier.DISK

    def __init__(self, root: Path, capacity_bytes: int, layout: bytes, payload_nbytes: int,
                 events: CacheEvents, full_after_bytes: int = 0,
                 write_delay_s: float = 0.0) -> None:
        self.layout = layout
        self.payload_nbytes = payload_nbytes
        self.file_nbytes = codec.HEADER_BYTES + payload_nbytes
        self.capacity_blocks = capacity_bytes // self.file_nbytes
        if self.capacity_blocks < 1:
            raise ValueError(f"kv_disk_cache_size: {capacity_bytes} bytes holds no "
                             f"{self.file_nbytes}-byte block")
        self.events = events
        self.state = TierState.ENABLED
        self._full_after_bytes = full_after_bytes  # fault: ENOSPC after this many bytes
        self._write_delay_s = write_delay_s  # fault: pause between the bytes and the rename
        self._written_bytes = 0
        refuse_unsafe_root(root)
        self.dir, self._lock = _lock_a_directory(root / layout.hex())
        self._tmp = self.dir / "tmp"
        shutil.rmtree(self._tmp, ignore_errors=True)  # a killed writer's partial files
        private_dir(self._tmp)
        self._files: OrderedDict[bytes, None] = OrderedDict()  # visible; LRU first
        self._pins: dict[bytes, int] = {}  # being read: never evicted meanwhile
        self._writing: set[bytes] = set()
        self.num_evictions = self.num_corrupt = self.num_dropped_writes = 0
        self._scan()

    def _scan(self) -> None:
        """The index from the files there (oldest use first); wrong sizes are deleted."""
        found: list[tuple[float, bytes]] = []
        for sub in self.dir.iterdir():
            if sub.is_dir():
                private_dir(sub)  # ours, 0700 (an older build's 0755 too); else refused
        for path in self.dir.glob(f"*/*{SUFFIX}"):
            try:
                key = bytes.fromhex(path.stem)
                info = path.lstat()
            except (ValueError, OSError):
                continue
            if (len(key) != KEY_BYTES or info.st_size != self.file_nbytes
                    or _file_problem(info) is not None):
                path.unlink(missing_ok=True)  # not ours, or readable by others: never served
                continue
            found.append((info.st_mtime, key))
        for _, key in sorted(found)[-self.capacity_blocks:]:
            self._files[key] = None
        for _, key in sorted(found)[:-self.capacity_blocks]:
            self.path(key).unlink(missing_ok=True)
        if self._files:
            log.info("disk K/V tier %s: %d blocks found", self.dir, len(self._files))

    def path(self, key: bytes) -> Path:
        return self.dir / key[:1].hex() / f"{key.hex()}{SUFFIX}"

    @property
    def is_readable(self) -> bool:
        return self.state is not TierState.DISABLED

    def keys(self) -> list[bytes]:
        return list(self._files) if self.is_readable else []

    def leading(self, keys: Sequence[bytes]) -> int:
        if not self.is_readable:
            return 0
        count = 0
        for key in keys:
            if key not in self._files:
                break
            count += 1
        return count

    def pin(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._pins[key] = self._pins.get(key, 0) + 1
            self._files.move_to_end(key)

    def unpin(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            count = self._pins.pop(key)
            if count > 1:
                self._pins[key] = count - 1

    # ---- reads (a tier thread) ----------------------------------------------------------
    def read_into(self, key: bytes, slot: torch.Tensor) -> None:
        """Read and verify `key`'s block into a host slot; BadValue or OSError if not."""
        view = codec.as_bytes(slot)
        fd = os.open(self.path(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with open(fd, "rb") as f:
            problem = _file_problem(os.fstat(fd))
            if problem is not None:
                raise codec.BadValue(f"refused: {problem}")
            expected = codec.parse_header(f.read(codec.HEADER_BYTES), self.layout, key,
                                          self.payload_nbytes)
            if f.readinto(view) != self.payload_nbytes:
                raise codec.BadValue("file shorter than its header says")
            codec.check_payload(view, expected)
            os.utime(fd)  # recently used, across restarts too

    def drop_bad(self, key: bytes, error: Exception) -> None:
        """Event loop: a block failed its read; delete it, report it removed."""
        self.num_corrupt += 1
        log.warning("disk K/V tier: block %s dropped (%s); it is recomputed", key.hex(), error)
        self._files.pop(key, None)
        self.path(key).unlink(missing_ok=True)
        self.events.add([], [key], Tier.DISK)

    # ---- writes -------------------------------------------------------------------------
    def reserve(self, keys: Sequence[bytes]) -> tuple[list[bytes], list[bytes]]:
        """Event loop: the keys to write (those it lacks), and the files to delete first to
        make room (least recently used, not being read), already out of the index."""
        if self.state is not TierState.ENABLED:
            return [], []
        todo = [k for k in dict.fromkeys(keys) if k not in self._files and k not in self._writing]
        evicted: list[bytes] = []
        room = self.capacity_blocks - len(self._files) - len(self._writing)
        for key in list(self._files):
            if room >= len(todo):
                break
            if key not in self._pins:
                del self._files[key]
                evicted.append(key)
                room += 1
        if room < len(todo):
            self.num_dropped_writes += len(todo) - room
            todo = todo[:max(room, 0)]
        self._writing.update(todo)
        self.num_evictions += len(evicted)
        self.events.add([], evicted, Tier.DISK)
        return todo, evicted

    def write(self, keys: Sequence[bytes], slots: Sequence[torch.Tensor],
              evicted: Sequence[bytes]) -> tuple[int, OSError | None]:
        """A tier thread: delete `evicted`, then write each block to `tmp/` and rename it into
        place. Returns how many were written, in order, and the error that stopped the rest
        (DiskFull when out of room)."""
        for key in evicted:
            self.path(key).unlink(missing_ok=True)
        for done, (key, slot) in enumerate(zip(keys, slots)):
            payload = codec.as_bytes(slot)
            if self._full_after_bytes and (self._written_bytes + self.file_nbytes
                                           > self._full_after_bytes):
                return done, DiskFull(errno.ENOSPC, "no space left (injected)")
            tmp = self._tmp / f"{key.hex()}.{os.getpid()}.{time.monotonic_ns()}"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o600)
                with open(fd, "wb") as f:
                    os.fchmod(fd, 0o600)  # whatever the umask
                    f.write(codec.header(self.layout, key, payload))
                    f.write(payload)
                if self._write_delay_s:
                    time.sleep(self._write_delay_s)  # fault: the window a kill -9 hits
                final = self.path(key)
                private_dir(final.parent)
                os.replace(tmp, final)
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    return done, DiskFull(exc.errno, str(exc))
                return done, exc
            self._written_bytes += self.file_nbytes
        return len(keys), None

    def commit(self, keys: Sequence[bytes], num_written: int, error: BaseException | None
               ) -> None:
        """Event loop: the first `num_written` of `keys` are on disk; a failure changes the
        tier's state (full: read-only; anything else: disabled), with one warning."""
        stored = list(keys[:num_written])
        self._writing.difference_update(keys)
        for key in stored:
            self._files[key] = None
        self.events.add(stored, [], Tier.DISK)
        if isinstance(error, DiskFull) and self.state is TierState.ENABLED:
            self.state = TierState.READ_ONLY
            log.warning("disk K/V tier %s is full: it serves the %d blocks it holds and takes "
                        "no more", self.dir, len(self._files))
        elif error is not None and self.state is not TierState.DISABLED:
            self.state = TierState.DISABLED
            log.warning("disk K/V tier %s disabled after an I/O error: %r", self.dir, error)
        self.num_dropped_writes += len(keys) - num_written

    def check_integrity(self) -> IntegrityReport:
        """The index equals the files on disk (none missing, none unindexed)."""
        on_disk = {bytes.fromhex(p.stem) for p in self.dir.glob(f"*/*{SUFFIX}")}
        if self.is_readable and on_disk != set(self._files) | self._writing & on_disk:
            return IntegrityReport(False, f"disk tier: {len(on_disk)} files, "
                                   f"{len(self._files)} indexed")
        return IntegrityReport(True, "")

    def close(self) -> None:
        self._lock.close()  # releases the flock


def refuse_unsafe_root(root: Path) -> None:
    """`--kv-disk-cache-dir` made (0700, with any missing parents) when missing; ValueError
    naming it when another user owns it or group or others may write to it (what K/V it
    would hold reads back as prompts, and a file planted there would be served)."""
    missing = []
    path = root
    while not os.path.lexists(path) and path != path.parent:
        missing.append(path)
        path = path.parent
    for path in reversed(missing):
        private_dir(path)
    refuse_unsafe_disk_dir(root)


def private_dir(path: Path) -> None:
    """`path` a directory of this user's, mode 0700 (made so, whatever the umask, or set so
    when it exists); ValueError naming it when it is a symlink or another user's."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise ValueError(f"kv_disk_cache_dir: refusing {path} (a symlink, not a directory, or "
                         f"owned by uid {info.st_uid}, not {os.geteuid()})")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)


def _file_problem(info: os.stat_result) -> str | None:
    """Why a block file may not be served: not a plain file, another user's, or open to
    group or others (written by someone else, or read by them)."""
    if not stat.S_ISREG(info.st_mode):
        return "not a plain file"
    if info.st_uid != os.geteuid():
        return f"owned by uid {info.st_uid}"
    if stat.S_IMODE(info.st_mode) & 0o077:
        return f"mode {stat.S_IMODE(info.st_mode):o}, open to group or others"
    return None


def _lock_a_directory(base: Path):
    """The first `<base>/<n>` whose LOCK this process can take, and the open LOCK file."""
    private_dir(base)
    for n in range(1024):
        path = base / str(n)
        private_dir(path)
        fd = os.open(path / "LOCK", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600)
        os.fchmod(fd, 0o600)
        lock = open(fd, "a")  # noqa: SIM115 - held for the process's life
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        return path, lock
    raise ValueError(f"kv_disk_cache_dir: 1024 workers already hold directories under {base}")
