"""Which string field of a serialized protobuf message is not valid UTF-8.

protobuf refuses such a message whole ("String field had bad UTF-8") without saying which
field; a public server must answer INVALID_ARGUMENT naming it. This walks the wire format
along the message's descriptor and returns the first offending field's path, in the names a
client wrote: `text`, `sampling.stop[1]`, `messages.messages[0].content` (oneof members are
prefixed with their oneof's name: `input.text`).
"""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


class Malformed(ValueError):
    """Not a protobuf message at all (truncated, bad tag)."""


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(data) or shift > 63:
            raise Malformed("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _is_repeated(field: FieldDescriptor) -> bool:
    if hasattr(field, "is_repeated"):  # protobuf >= 6: `label` is gone
        return bool(field.is_repeated)
    return field.label == FieldDescriptor.LABEL_REPEATED


def _name(field: FieldDescriptor) -> str:
    oneof = field.containing_oneof
    return f"{oneof.name}.{field.name}" if oneof is not None else field.name


def invalid_utf8_field(data: bytes, descriptor: Descriptor, prefix: str = "") -> str | None:
    """The path of the first string field of `data` (a serialized `descriptor` message)
    holding invalid UTF-8, or None. Raises Malformed when `data` does not parse as a
    message."""
    pos, seen = 0, {}
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            _, pos = _varint(data, pos)
            continue
        if wire_type in (_FIXED64, _FIXED32):
            pos += 8 if wire_type == _FIXED64 else 4
            continue
        if wire_type != _LENGTH:
            raise Malformed(f"unsupported wire type {wire_type}")
        length, pos = _varint(data, pos)
        payload, pos = data[pos:pos + length], pos + length
        if pos > len(data):
            raise Malformed("truncated field")
        field = descriptor.fields_by_number.get(number)
        if field is None:
            continue
        path = prefix + _name(field)
        if _is_repeated(field):
            index = seen.get(number, 0)
            seen[number] = index + 1
            path += f"[{index}]"
        if field.type == FieldDescriptor.TYPE_STRING:
            try:
                payload.decode("utf-8")
            except UnicodeDecodeError:
                return path
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            found = invalid_utf8_field(payload, field.message_type, path + ".")
            if found is not None:
                return found
    return None
