"""A small, bounds-checked reader of serialized `tf.train.Example` messages.

Used where TensorFlow's parser would be overkill or where input is untrusted (verify,
tools, tests). It never allocates more than the record it is given: every length is
checked against the bytes that remain.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class ProtoError(ValueError):
    pass


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= len(buf):
            raise ProtoError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ProtoError("varint too long")


def _fields(buf: memoryview) -> Iterator[tuple[int, int, Any]]:
    """Yields (field_number, wire_type, value) where value is bytes-view or int."""
    pos = 0
    n = len(buf)
    while pos < n:
        tag, pos = _read_varint(buf, pos)
        field, wire = tag >> 3, tag & 7
        value: memoryview | int  # by wire type: 2 gives a view, the others an int
        if wire == 0:
            value, pos = _read_varint(buf, pos)
        elif wire == 2:
            length, pos = _read_varint(buf, pos)
            if length > n - pos:
                raise ProtoError("length-delimited field runs past the end of the message")
            value = buf[pos : pos + length]
            pos += length
        elif wire == 1:
            if pos + 8 > n:
                raise ProtoError("truncated fixed64")
            value = int.from_bytes(buf[pos : pos + 8], "little")
            pos += 8
        elif wire == 5:
            if pos + 4 > n:
                raise ProtoError("truncated fixed32")
            value = int.from_bytes(buf[pos : pos + 4], "little")
            pos += 4
        else:
            raise ProtoError(f"unsupported wire type {wire}")
        yield field, wire, value


def parse_example_bytes(record: bytes | memoryview) -> dict[str, Any]:
    """Returns key -> first bytes value (memoryview), first int64 (int) or float list.

    Raises:
        ProtoError: the bytes are not a well-formed Example.
    """
    buf = memoryview(record)
    out: dict[str, Any] = {}
    for field, wire, features in _fields(buf):
        if field != 1 or wire != 2:
            continue
        for f2, w2, entry in _fields(features):
            if f2 != 1 or w2 != 2:
                continue
            key = None
            feature = None
            for f3, w3, v in _fields(entry):
                if f3 == 1 and w3 == 2:
                    key = bytes(v).decode("utf-8", errors="replace")
                elif f3 == 2 and w3 == 2:
                    feature = v
            if key is None or feature is None:
                raise ProtoError("map entry without key or value")
            out[key] = _parse_feature(feature)
    return out


def _parse_feature(feature: memoryview) -> Any:
    for kind, wire, lst in _fields(feature):
        if wire != 2:
            continue
        if kind == 1:  # BytesList
            values = [v for f, w, v in _fields(lst) if f == 1 and w == 2]
            return values[0] if len(values) == 1 else values
        if kind == 3:  # Int64List, packed or not
            ints: list[int] = []
            for f, w, v in _fields(lst):
                if f != 1:
                    continue
                if w == 0:
                    ints.append(v)
                elif w == 2:
                    pos = 0
                    while pos < len(v):
                        x, pos = _read_varint(v, pos)
                        ints.append(x)
            ints = [i - (1 << 64) if i >= 1 << 63 else i for i in ints]
            return ints[0] if len(ints) == 1 else ints
        if kind == 2:  # FloatList
            import numpy as np

            floats: list[float] = []
            for f, w, v in _fields(lst):
                if f == 1 and w == 2:
                    floats.extend(np.frombuffer(bytes(v), "<f4").tolist())
                elif f == 1 and w == 5:
                    floats.append(float(np.frombuffer(v.to_bytes(4, "little"), "<f4")[0]))
            return floats
    return None
