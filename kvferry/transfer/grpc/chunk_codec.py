"""KvChunk on the wire with fewer copies of its payload than protobuf's Python runtime makes.

A 1 MiB `KvChunk` built and serialized the ordinary way copies its `data` three times on the
sending side (ndarray to bytes, bytes into the message, the message into its serialization)
and twice on the receiving side (parsing, then reading `.data`). These two functions keep the
protobuf wire format exactly (any KvChunk parser reads what `encode` writes, and `decode`
reads any KvChunk serialization) but copy the payload once on each side: `encode` appends the
`data` field to the serialized header, `decode` returns the payload as a view into the
received buffer.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from kvferry.v1 import worker_pb2

KV_TRANSFER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["KvTransferService"].full_name
PUSH_KV_METHOD = f"/{KV_TRANSFER_SERVICE}/PushKv"

_DATA_FIELD = worker_pb2.KvChunk.DESCRIPTOR.fields_by_name["data"].number
_LENGTH_DELIMITED = 2
_DATA_KEY = (_DATA_FIELD << 3) | _LENGTH_DELIMITED


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode(header: worker_pb2.KvChunk, data: np.ndarray | bytes) -> bytes:
    """The serialization of `header` with `data` as its `data` field (header.data unset)."""
    return b"".join((header.SerializeToString(), _varint_bytes(_DATA_KEY),
                     _varint_bytes(memoryview(data).nbytes), data))


def _varint(raw: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(raw) or shift > 63:
            raise DecodeError("truncated or overlong varint")
        byte = raw[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            return value, pos
        shift += 7


class ReceivedChunk:
    """A parsed KvChunk whose `data` is a read-only view into the received bytes; every
    other field reads through to the parsed header."""

    __slots__ = ("data", "_header")

    def __init__(self, header: worker_pb2.KvChunk, data: memoryview) -> None:
        self._header = header
        self.data = data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._header, name)


def decode(raw: bytes) -> ReceivedChunk:
    """Parse a KvChunk serialization, leaving its payload where it is. Malformed input
    raises protobuf's DecodeError, as `KvChunk.FromString` would."""
    view = memoryview(raw)
    header_parts = []
    data = view[0:0]
    pos = 0
    while pos < len(raw):
        start = pos
        key, pos = _varint(raw, pos)
        wire_type = key & 7
        if wire_type == 0:
            _, pos = _varint(raw, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == _LENGTH_DELIMITED:
            length, pos = _varint(raw, pos)
            if key == _DATA_KEY and pos + length <= len(raw):
                data = view[pos: pos + length]  # the last occurrence wins, as in protobuf
                pos += length
                continue
            pos += length
        else:
            raise DecodeError(f"unsupported wire type {wire_type}")
        if pos > len(raw):
            raise DecodeError("truncated field")
        header_parts.append(view[start:pos])
    return ReceivedChunk(worker_pb2.KvChunk.FromString(b"".join(header_parts)), data)
