"""One cached block as a value outside the process (a disk file, a store value): a 64-byte
header, then the block's bytes as the host tier holds them (`[layers, 2, *page]`, the pool's
dtype or its quantized pages with their scales, C order).

| bytes | field |
| --- | --- |
| 0-7 | magic `KVFB`, format version, 0, header length (u16) |
| 8-15 | layout hash: what the payload's bytes mean (pool shape, dtypes, block size) |
| 16-31 | block key (its prefix, `kvferry.cache.prefix`) |
| 32-47 | payload length (u64), CRC-32C of the payload, CRC-32C of bytes 0-43 |
| 48-63 | reserved, zero |

A value is served only when every field matches what the reader expects and both CRCs hold:
a torn, truncated, foreign or flipped value is refused, never turned into K/V.
"""

from __future__ import annotations

import hashlib
import struct
from typing import NamedTuple

import crc32c
import torch

from kvferry.cache import prefix
from kvferry.cache.pool import KvPool
from kvferry.cache.prefix import KEY_BYTES

MAGIC = b"KVFB"
VERSION = 1
HEADER_BYTES = 64
_HEAD = struct.Struct("<4sBBH8s16sQI")  # bytes 0-43, then the header's CRC at 44
assert _HEAD.size == 44


class BadValue(ValueError):
    """A value that fails a check: it must be dropped and recomputed."""


class Header(NamedTuple):
    layout_hash: bytes
    key: bytes
    payload_nbytes: int
    payload_crc: int


def layout_hash(pool: KvPool) -> bytes:
    """8 bytes naming how a block's bytes are laid out in `pool` and how they were computed
    (`prefix.KV_FORMAT_VERSION`; not which model: the keys name that)."""
    parts = (tuple(pool.cache.shape[:2]), tuple(pool.page_shape), str(pool.cache.dtype),
             str(pool.dtype), pool.kv_cache_dtype, pool.block_size, prefix.KV_FORMAT_VERSION)
    return hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()


def header(layout: bytes, key: bytes, payload: memoryview) -> bytes:
    """The header of `payload` (a block's bytes) stored under `key`."""
    if len(key) != KEY_BYTES or len(layout) != 8:
        raise ValueError("a block key is 16 bytes and a layout hash 8")
    head = _HEAD.pack(MAGIC, VERSION, 0, HEADER_BYTES, layout, key, payload.nbytes,
                      crc32c.crc32c(payload))
    return (head + struct.pack("<I", crc32c.crc32c(head))).ljust(HEADER_BYTES, b"\0")


def parse_header(data: bytes, layout: bytes, key: bytes, payload_nbytes: int) -> Header:
    """The header's fields, checked against what the reader expects; BadValue otherwise."""
    if len(data) < HEADER_BYTES:
        raise BadValue(f"header is {len(data)} bytes")
    head = data[:_HEAD.size]
    (crc,) = struct.unpack_from("<I", data, _HEAD.size)
    if crc32c.crc32c(head) != crc:
        raise BadValue("header checksum mismatch")
    magic, version, _, size, got_layout, got_key, nbytes, payload_crc = _HEAD.unpack(head)
    if magic != MAGIC or version != VERSION or size != HEADER_BYTES:
        raise BadValue(f"not a version-{VERSION} block value")
    if got_layout != layout:
        raise BadValue("written for another K/V layout")
    if got_key != key:
        raise BadValue("holds another block's key")
    if nbytes != payload_nbytes:
        raise BadValue(f"payload of {nbytes} bytes, expected {payload_nbytes}")
    return Header(got_layout, got_key, nbytes, payload_crc)


def check_payload(payload: memoryview, expected: Header) -> None:
    if crc32c.crc32c(payload) != expected.payload_crc:
        raise BadValue("payload checksum mismatch")


def as_bytes(slot: torch.Tensor) -> memoryview:
    """A host slot's bytes, without a copy (the slot is contiguous)."""
    return memoryview(slot.view(torch.uint8).numpy()).cast("B")
