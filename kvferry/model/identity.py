"""A checkpoint's identity: a fingerprint over every byte the served model depends on.

`checkpoint_fingerprint` hashes config.json, generation_config.json, the tokenizer files, a
sharded checkpoint's index and the full SHA-256 of every weight file, so two checkpoints that
differ anywhere (one weight in the middle of a tensor included) get different fingerprints.
Everything downstream keys on it: the compiled decode packages (weights frozen inside them),
`KvLayout.model_fingerprint` (the router refuses workers of another model), the prefix-cache
seeds.

Hashing every weight byte costs about a second per GB, so each weight file's SHA-256 is
remembered in a small JSON memo, `$KVFERRY_HOME/hashes/sha256.json`, by the file's (device,
inode, size, mtime_ns, ctime_ns): a restart reads the memo instead of rehashing, while any write
to the file (which moves its mtime and ctime; ctime cannot be set back by a user) or a new file
in its place (a new inode) misses and is hashed again. The memo is replaced atomically
(temporary file, fsync, rename); concurrent writers may lose each other's entries, which only
costs a rehash. A memo directory another user owns, or group or others may write, is not used
(one warning; every file is then hashed at every start).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
from pathlib import Path

from kvferry.settings import KVFERRY_HOME
from kvferry_kernels import artifact_cache

log = logging.getLogger(__name__)

HASH_MEMO_DIR = KVFERRY_HOME / "hashes"
_MEMO_FILE = "sha256.json"
_MEMO_MAX_ENTRIES = 1024  # the oldest are dropped past this
FINGERPRINT_HEX_CHARS = 32
# Hashed whole when present: what tokens mean and when generation stops.
METADATA_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                  "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                  "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
                  "chat_template.json", "model.safetensors.index.json")


def checkpoint_fingerprint(checkpoint: Path, memo_dir: Path | None = HASH_MEMO_DIR) -> str:
    """32 hex characters of a SHA-256 over the checkpoint's metadata files and every byte of
    its weight files (each weight file's hash remembered in `memo_dir`; None: no memo)."""
    digest = hashlib.sha256(b"kvferry checkpoint v2\0")
    for name in METADATA_FILES:
        path = checkpoint / name
        if path.is_file():
            digest.update(f"{name}\0{hashlib.sha256(path.read_bytes()).hexdigest()}\0".encode())
    for weights in sorted(checkpoint.glob("*.safetensors")):
        digest.update(f"{weights.name}\0{file_sha256(weights, memo_dir)}\0".encode())
    return digest.hexdigest()[:FINGERPRINT_HEX_CHARS]


def _stat_key(path: Path) -> str:
    info = path.stat()
    return (f"{info.st_dev}:{info.st_ino}:{info.st_size}:{info.st_mtime_ns}"
            f":{info.st_ctime_ns}")


def file_sha256(path: Path, memo_dir: Path | None = HASH_MEMO_DIR) -> str:
    """The SHA-256 of every byte of `path`, hex; read from the memo in `memo_dir` when the file
    is unchanged since it was hashed (see the module docstring), else hashed and remembered."""
    key = _stat_key(path)
    memo_dir = memo_dir if memo_dir is not None and _memo_usable(memo_dir) else None
    memo = _read_memo(memo_dir) if memo_dir is not None else {}
    if key in memo:
        return memo[key]
    sha = artifact_cache.sha256_file(path)
    if memo_dir is not None and _stat_key(path) == key:  # unchanged while it was hashed
        memo[key] = sha
        kept = dict(list(memo.items())[-_MEMO_MAX_ENTRIES:])
        artifact_cache.write_file_atomic(memo_dir / _MEMO_FILE, json.dumps(kept).encode())
    return sha


@functools.cache
def _memo_usable(memo_dir: Path) -> bool:
    """Whether `memo_dir` (made when missing) is private to this user and writable: one
    warning when it is not private, one info line when it cannot be made (a read-only home)."""
    try:
        memo_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        log.info("hash memo: cannot use %s (%s): weight files hashed at every start",
                 memo_dir, exc)
        return False
    reason = artifact_cache.unsafe_reason(memo_dir)
    if reason is not None:
        log.warning("hash memo: refusing %s (%s): weight files hashed at every start",
                    memo_dir, reason)
    return reason is None and os.access(memo_dir, os.W_OK)


def _read_memo(memo_dir: Path) -> dict[str, str]:
    try:
        memo = json.loads((memo_dir / _MEMO_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(memo, dict):
        return {}
    return {k: v for k, v in memo.items() if isinstance(k, str) and isinstance(v, str)}


def served_model_name(model: str, given: str | None = None) -> str:
    """The model id the API reports and expects: `given` (--served-model-name), else the
    checkpoint's own name: a directory's name, a GGUF file's name without `.gguf`, and for a
    GGUF file kvferry converted (KVFERRY_HOME/models/NAME-<32 hex of its hash>), NAME, so
    that the id stays what the user installed, not a cache key; a GGUF name loses its
    quantization tag."""
    if given:
        return given
    path = Path(model)
    if path.suffix.lower() == ".gguf":
        return _without_quant_tag(path.stem)
    converted = re.fullmatch(r"(.+)-[0-9a-f]{32}", path.name)
    if converted and (path / "manifest.json").is_file():
        return _without_quant_tag(converted.group(1))
    return path.name


def _without_quant_tag(name: str) -> str:
    """A GGUF file's name without its quantization tag (`.Q4_1`, `-Q4_K_M`, `.f16`): kvferry
    serves the weights dequantized (float32 on CPU), so the tag would misname them."""
    return re.sub(r"[.-](I?Q\d(_[A-Z0-9]+)*|F16|F32|BF16)$", "", name, flags=re.IGNORECASE)
