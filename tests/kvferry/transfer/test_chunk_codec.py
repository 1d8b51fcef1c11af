"""chunk_codec keeps the KvChunk wire format: what it encodes any protobuf parser reads, and
it reads what protobuf serializes, with the payload left in the received buffer."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.transfer.grpc import chunk_codec
from kvferry.v1 import worker_pb2


def _header(**overrides: object) -> worker_pb2.KvChunk:
    fields: dict[str, object] = dict(
        request_id="r-1", num_tokens=77, layer_start=2, layer_end=4, block_start=3,
        num_blocks=5, crc32=0xE3069283,
        layout=worker_pb2.KvLayout(num_layers=4, num_kv_heads=2, head_dim=8, block_size=16,
                                   dtype="float32", model_fingerprint="fp"))
    fields.update(overrides)
    return worker_pb2.KvChunk(**fields)


def _payload(num_bytes: int) -> np.ndarray:
    return np.random.default_rng(num_bytes).integers(0, 256, num_bytes, dtype=np.uint8)


def _same(got: chunk_codec.ReceivedChunk, want: worker_pb2.KvChunk) -> None:
    for field in worker_pb2.KvChunk.DESCRIPTOR.fields:
        if field.name != "data":
            assert getattr(got, field.name) == getattr(want, field.name), field.name
    assert bytes(got.data) == want.data


@pytest.mark.parametrize("num_bytes", [0, 1, 127, 128, 1 << 20])
def test_encoded_chunk_is_a_plain_kvchunk(num_bytes: int) -> None:
    data = _payload(num_bytes)
    raw = chunk_codec.encode(_header(), data)
    parsed = worker_pb2.KvChunk.FromString(raw)
    want = _header(data=data.tobytes())
    assert parsed == want
    _same(chunk_codec.decode(raw), want)


def test_decode_reads_protobufs_own_serialization_without_copying_the_payload() -> None:
    want = _header(data=_payload(4096).tobytes())
    raw = want.SerializeToString()
    got = chunk_codec.decode(raw)
    _same(got, want)
    assert got.data.obj is raw  # a view into the received bytes, not a copy


def test_last_data_field_wins_as_in_protobuf() -> None:
    raw = chunk_codec.encode(_header(), _payload(10)) + chunk_codec.encode(
        worker_pb2.KvChunk(), _payload(20))
    _same(chunk_codec.decode(raw), worker_pb2.KvChunk.FromString(raw))


def test_a_chunk_without_data_has_an_empty_payload() -> None:
    got = chunk_codec.decode(_header().SerializeToString())
    assert got.data.nbytes == 0 and got.request_id == "r-1"


@pytest.mark.parametrize("cut", [1, 5, 100])
def test_truncated_chunk_is_refused(cut: int) -> None:
    raw = chunk_codec.encode(_header(), _payload(300))
    with pytest.raises(DecodeError):
        chunk_codec.decode(raw[:-cut])
    with pytest.raises(DecodeError):
        worker_pb2.KvChunk.FromString(raw[:-cut])


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_decode_never_accepts_what_protobuf_refuses(draw: st.DataObject) -> None:
    raw = bytearray(chunk_codec.encode(_header(), _payload(draw.draw(st.integers(0, 300)))))
    for _ in range(draw.draw(st.integers(0, 4))):
        raw[draw.draw(st.integers(0, len(raw) - 1))] = draw.draw(st.integers(0, 255))
    raw = bytes(raw[: draw.draw(st.integers(0, len(raw)))])
    try:
        got = chunk_codec.decode(raw)
    except DecodeError:
        return
    _same(got, worker_pb2.KvChunk.FromString(raw))  # raises if protobuf refuses it
