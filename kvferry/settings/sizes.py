"""Sizes given on the command line: "256MiB", "2GB", bytes, or a fraction of some memory."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*([0-9.]+)\s*(B|KB|KiB|MB|MiB|GB|GiB|TB|TiB)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "kib": 2**10, "mb": 10**6, "mib": 2**20, "gb": 10**9, "gib": 2**30,
          "tb": 10**12, "tib": 2**40}


def is_fraction(value: str) -> bool:
    """A bare number up to 1: a fraction of some memory, not bytes (see parse_pool_size)."""
    match = _SIZE.match(value)
    return bool(match) and match.group(2) is None and float(match.group(1)) <= 1.0


AUTO = "auto"  # --kv-pool-size: sized from the device (kvferry/cache/pool_budget.py)


def check_pool_size(value: str) -> None:
    """ValueError naming --kv-pool-size unless it is auto, bytes or a fraction."""
    if value != AUTO:
        parse_pool_size(value, total_memory_bytes=1)


def parse_pool_size(value: str, total_memory_bytes: int, name: str = "kv_pool_size") -> int:
    """"256MiB", "2GB", "1048576" (bytes) or a fraction "0.3" of device memory -> bytes;
    errors name the setting `name`."""
    match = _SIZE.match(value)
    if not match:
        raise ValueError(f"{name}: cannot parse {value!r}")
    number, unit = float(match.group(1)), match.group(2)
    if is_fraction(value):
        if number <= 0:
            raise ValueError(f"{name}: fraction must be > 0, got {value!r}")
        return int(number * total_memory_bytes)
    size = int(number * _UNITS[(unit or "b").lower()])
    if size <= 0:
        raise ValueError(f"{name}: must be > 0, got {value!r}")
    return size
