"""Finding the string field with invalid UTF-8 in a serialized message, which protobuf
refuses whole without naming it."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from kvferry.rpc.proto_utf8 import Malformed, invalid_utf8_field
from kvferry.v1 import generation_pb2

BAD = "\ufffd".encode()[:2] + b"\xff"  # not UTF-8
DESCRIPTOR = generation_pb2.GenerateRequest.DESCRIPTOR


def _spoil(request: generation_pb2.GenerateRequest, marker: str) -> bytes:
    """Serialize, then replace the UTF-8 of `marker` (same length) with invalid bytes."""
    data = request.SerializeToString()
    good = marker.encode()
    assert len(good) == len(BAD) and data.count(good) == 1
    return data.replace(good, BAD)


@pytest.mark.parametrize("build, field", [
    (lambda m: generation_pb2.GenerateRequest(request_id=m), "request_id"),
    (lambda m: generation_pb2.GenerateRequest(text="ok " + m), "input.text"),
    (lambda m: generation_pb2.GenerateRequest(
        text="hi", sampling=generation_pb2.SamplingParams(stop=["a", "b", m])),
     "sampling.stop[2]"),
    (lambda m: generation_pb2.GenerateRequest(messages=generation_pb2.ChatMessages(messages=[
        generation_pb2.ChatMessage(role="user", content="fine"),
        generation_pb2.ChatMessage(role=m, content="x")])),
     "input.messages.messages[1].role"),
])
def test_names_the_field(build, field: str) -> None:
    data = _spoil(build("Q!Z"), "Q!Z")
    with pytest.raises(DecodeError):
        generation_pb2.GenerateRequest.FromString(data)
    assert invalid_utf8_field(data, DESCRIPTOR) == field


@given(st.text(max_size=40), st.lists(st.text(max_size=8), max_size=4),
       st.lists(st.integers(0, 2**31 - 1), max_size=5), st.integers(0, 2**64 - 1))
def test_valid_messages_have_no_invalid_field(text: str, stop: list[str], ids: list[int],
                                              seed: int) -> None:
    for request in (generation_pb2.GenerateRequest(
                        request_id=text, text=text,
                        sampling=generation_pb2.SamplingParams(stop=stop, seed=seed)),
                    generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=ids))):
        assert invalid_utf8_field(request.SerializeToString(), DESCRIPTOR) is None


def test_truncated_input_is_malformed() -> None:
    data = generation_pb2.GenerateRequest(text="hello").SerializeToString()
    with pytest.raises(Malformed):
        invalid_utf8_field(data[:-2], DESCRIPTOR)
