"""Feature specs and the record layout: NumPy blocks <-> `tf.train.Example` bytes <-> tensors.

Record layout
-------------
Each TFRecord record is a standard, serialized ``tf.train.Example`` holding a *block* of
consecutive samples:

=====================  ==========================================================
Example feature key    value
=====================  ==========================================================
``__count__``          ``int64_list``: one value, the number of samples in the block
``<key>`` per feature  ``bytes_list``: one value, the block's samples of that feature
                       as contiguous little-endian raw bytes in C order (``bool`` is
                       one byte per value, 0 or 1)
=====================  ==========================================================

A feature's key is its role (``x``, ``y`` or ``sample_weight``) when the role holds a
single array, and ``<role>/<name>`` when the role holds a dict (``name`` is the dict key)
or a list (``name`` is the position). Keys are written in sorted order, so every full
block of a data set serializes to the same number of bytes; only the data set's last
record may hold fewer samples.

The Example is serialized by hand (the wire format of ``example.proto``), not through
per-sample protobuf objects: one join of a precomputed header with each feature's bytes.
Any TFRecord tool can still read the records as ordinary Examples.

Lattice layout
--------------
Data sets of fixed-size features are written on a *lattice* (`Lattice`, recorded in the
manifest): each feature's payload starts at a frame offset that is a multiple of
``lcm(64, rows[key])``, and a full record's frame is a multiple of ``period`` bytes. The
extra bytes are zero-filled ``bytes_list`` entries under the keys ``__pad__/<key>``
(before each feature) and ``__pad__`` (last); parsers that ask for the data set's own
keys never see them. With the shards mapped at multiples of ``period``, sample ``j`` of
every record is then a whole number of ``rows[key]``-byte rows from one 64-byte aligned
address, so TensorFlow can gather samples with `tf.gather` from a single tensor that
aliases the mapped files (see `keras_tfr.read.mapped`).
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # only for annotations: TensorFlow loads when a tf_* function runs
    import tensorflow as tf

__all__ = ["COUNT_KEY", "ROLES", "FeatureSpec", "check_dtype", "decode_example", "encode_block"]

COUNT_KEY = "__count__"
PAD_KEY = "__pad__"  # lattice padding: `__pad__/<key>` before a feature, `__pad__` last
LENGTHS_SUFFIX = "__lengths__"
FEATURE_KINDS = ("fixed", "ragged", "bytes")
ROLES = ("x", "y", "sample_weight")

# dtype name -> itemsize. Little-endian raw bytes for every one of them.
SUPPORTED_DTYPES = {
    "bool": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float16": 2,
    "float32": 4,
    "float64": 8,
}

# Limits that keep an untrusted manifest from asking for absurd allocations.
MAX_RANK = 32
MAX_SAMPLE_BYTES = 1 << 30
MAX_RECORD_BYTES = (1 << 31) - (1 << 20)  # protobuf messages must stay below 2 GiB


def check_dtype(dtype: Any, *, argument: str) -> np.dtype:
    """Returns the NumPy dtype, or raises a `TypeError` that names `argument`."""
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(
            f"Expected `{argument}` to have a numeric or bool dtype. Received: dtype={dtype!r}"
        ) from e
    if dt.name not in SUPPORTED_DTYPES:
        raise TypeError(
            f"Expected `{argument}` to have one of the dtypes {sorted(SUPPORTED_DTYPES)}. "
            f"Received: dtype={dt} ({_dtype_hint(dt)})."
        )
    return dt


def _dtype_hint(dt: np.dtype) -> str:
    """What to do with an unsupported dtype, by its kind."""
    if dt.kind == "f" or "float" in dt.name:  # bfloat16, float8_* (ml_dtypes), float128
        return "cast it to float32 or float16 first"
    if "int" in dt.name:  # int4, uint2 (ml_dtypes)
        return "cast it to int8 or uint8 first"
    if dt.kind in "mM":
        return "convert it to int64 first, a count of its unit: `.astype('int64')`"
    if dt.kind in "OSUV":
        return (
            "object, string and structured arrays are not supported as fixed-size "
            "features; convert numbers to a numeric dtype, and give variable-length "
            "samples or byte strings as a list with `variable_length=`"
        )
    return "complex arrays are not supported; store the real and imaginary parts apart"


@dataclass(frozen=True)
class FeatureSpec:
    """One feature of a data set: its role, name, dtype and per-sample shape.

    Attributes:
        role: ``"x"`` (model input), ``"y"`` (target) or ``"sample_weight"``.
        name: the dict key or list position within the role; ``""`` for a single array.
        dtype: NumPy dtype name, one of `SUPPORTED_DTYPES`.
        shape: the shape of one sample (``()`` for scalars); for a ``"ragged"`` feature the
            shape of one row, after the sample's variable-length first axis.
        kind: ``"fixed"`` (every sample has `shape`), ``"ragged"`` (samples of varying
            length along their first axis) or ``"bytes"`` (one byte string per sample, e.g.
            an encoded PNG; dtype ``uint8``, shape ``()``). A block stores a non-fixed
            feature's samples back to back in ``<key>`` and their lengths (rows, or bytes)
            as little-endian int64 in ``<key>/__lengths__``.
    """

    role: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    kind: str = "fixed"

    @property
    def lengths_key(self) -> str:
        """Example key of a non-fixed feature's per-sample lengths."""
        return f"{self.key}/{LENGTHS_SUFFIX}"

    @property
    def key(self) -> str:
        return self.role if self.name == "" else f"{self.role}/{self.name}"

    @property
    def itemsize(self) -> int:
        return SUPPORTED_DTYPES[self.dtype]

    @property
    def sample_size(self) -> int:
        """Values per sample."""
        return int(math.prod(self.shape))

    @property
    def sample_bytes(self) -> int:
        return self.sample_size * self.itemsize

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype).newbyteorder("<") if self.itemsize > 1 else np.dtype(self.dtype)

    def to_json(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "name": self.name,
            "key": self.key,
            "dtype": self.dtype,
            "shape": list(self.shape),
            **({} if self.kind == "fixed" else {"kind": self.kind}),
        }

    @classmethod
    def from_array(cls, role: str, name: str, array: Any, *, argument: str) -> FeatureSpec:
        kind = getattr(array, "feature_kind", "fixed")  # write.inputs.Variable: ragged / bytes
        if kind != "fixed":
            return cls(role, name, array.dtype.name, tuple(array.row_shape), kind)
        dt = check_dtype(array.dtype, argument=argument)
        shape = tuple(int(d) for d in array.shape)
        if len(shape) == 0:
            raise ValueError(
                f"Expected `{argument}` to be an array whose first axis indexes samples. "
                f"Received: a scalar of dtype {dt}."
            )
        return cls(role=role, name=name, dtype=dt.name, shape=shape[1:])


def bool_bytes(array: Any) -> np.ndarray:
    """A C-contiguous ``uint8`` array of ``array``'s truth values, each 0 or 1.

    NumPy takes any nonzero byte of a bool array for True (``np.frombuffer(b, bool)``,
    ``u8.view(bool)``), and TensorFlow keeps such a byte as it is: written as it is, a
    byte 2 would read back as 2 through a bitcast and as 1 through a cast."""
    arr = np.asarray(array)
    if arr.dtype == np.bool_:
        return np.not_equal(arr.view(np.uint8), 0, order="C").view(np.uint8)
    return np.ascontiguousarray(arr, dtype=np.bool_).view(np.uint8)


def to_le_bytes(array: np.ndarray, spec: FeatureSpec) -> np.ndarray:
    """Returns a C-contiguous little-endian view or copy of `array` in `spec`'s dtype."""
    arr = np.asarray(array)
    if spec.dtype == "bool":
        return bool_bytes(arr)
    target = spec.np_dtype
    if arr.dtype != target:
        arr = arr.astype(target)
    return np.ascontiguousarray(arr)


# ---------------------------------------------------------------- protobuf wire format


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _len_field(field: int, payload_len: int) -> bytes:
    return _varint((field << 3) | 2) + _varint(payload_len)


def _bytes_entry_header(key: str, nbytes: int) -> tuple[bytes, int]:
    """Header of a Features map entry `key` -> BytesList([<nbytes bytes>]), and its total size."""
    kb = key.encode("utf-8")
    key_field = _len_field(1, len(kb)) + kb
    bytes_list = _len_field(1, nbytes)  # BytesList.value[0], payload follows
    bytes_list_len = len(bytes_list) + nbytes
    feature = _len_field(1, bytes_list_len) + bytes_list  # Feature.bytes_list
    feature_len = len(_len_field(1, bytes_list_len)) + bytes_list_len
    value_field_hdr = _len_field(2, feature_len)
    entry_len = len(key_field) + len(value_field_hdr) + feature_len
    header = _len_field(1, entry_len) + key_field + value_field_hdr + feature
    return header, len(_len_field(1, entry_len)) + entry_len


def _int64_entry(key: str, value: int) -> bytes:
    kb = key.encode("utf-8")
    key_field = _len_field(1, len(kb)) + kb
    packed = _varint(value & 0xFFFFFFFFFFFFFFFF)
    int64_list = _len_field(1, len(packed)) + packed  # Int64List.value, packed
    feature = _len_field(3, len(int64_list)) + int64_list  # Feature.int64_list
    entry = key_field + _len_field(2, len(feature)) + feature
    return _len_field(1, len(entry)) + entry


@dataclass(frozen=True)
class Lattice:
    """Where a lattice data set's samples sit (see the module's "Lattice layout").

    Attributes:
        period: a full record's frame size is a multiple of it (a multiple of 64 and of
            every ``rows`` value); shards are mapped at multiples of it.
        rows: per feature key, the row size in bytes: a divisor of the feature's sample
            size, so a sample is ``sample_bytes // rows`` consecutive rows.
    """

    period: int
    rows: dict[str, int]

    def align(self, key: str) -> int:
        """Every payload of feature ``key`` starts at a frame offset multiple of this."""
        return math.lcm(_PAYLOAD_ALIGN, self.rows[key])

    def to_json(self) -> dict[str, Any]:
        return {"period": self.period, "rows": dict(self.rows)}

    @classmethod
    def from_json(cls, obj: Any) -> Lattice:
        """Raises ValueError on a malformed ``lattice`` manifest field."""
        if not isinstance(obj, dict) or not isinstance(obj.get("rows"), dict):
            raise ValueError("`lattice` must be an object with `period` and `rows`")
        period, rows = obj.get("period"), obj["rows"]
        if not (isinstance(period, int) and 0 < period <= _MAX_PERIOD and period % 64 == 0):
            raise ValueError(f"`lattice` is out of range: {obj!r:.200}")
        for k, v in rows.items():
            if not (isinstance(k, str) and isinstance(v, int) and v > 0 and period % v == 0):
                raise ValueError(f"`lattice` is out of range: {obj!r:.200}")
        return cls(period=period, rows=dict(rows))

    def fits(self, specs: list[FeatureSpec]) -> bool:
        """Whether this lattice describes these features (keys and row sizes)."""
        return set(self.rows) == {s.key for s in specs} and all(
            s.kind == "fixed" and s.sample_bytes % self.rows[s.key] == 0 for s in specs
        )


_PAYLOAD_ALIGN = 64  # TensorFlow adopts a buffer without a copy at this alignment
_MAX_ROW = 4096  # a lattice row: at most a page, so a large sample is a few rows
_MIN_ROW = 256  # smaller rows only when they are a whole sample (gathers stay cheap)
_MAX_PERIOD = 1 << 20


def plan_lattice(specs: list[FeatureSpec], record_bytes: int) -> Lattice | None:
    """The lattice for records of about ``record_bytes``, or None where it costs too much:
    a feature that is not fixed-size, a sample size without a divisor between 256 and 4096
    bytes (a large prime, say), or a period above 1/16 of a record (the writer also
    refuses a lattice whose actual padding passes 1/16, `keras_tfr.write.plan`)."""
    if not specs or any(s.kind != "fixed" or s.sample_bytes <= 0 for s in specs):
        return None
    rows = {}
    for s in specs:
        sb = s.sample_bytes
        row = max(d for d in range(1, min(sb, _MAX_ROW) + 1) if sb % d == 0)
        if row != sb and row < _MIN_ROW:
            return None
        rows[s.key] = row
    period = math.lcm(_PAYLOAD_ALIGN, *rows.values())
    # The last pad alone can take a period; the writer checks the padding it gets.
    if period > _MAX_PERIOD or period * 16 > max(record_bytes, 1):
        return None
    return Lattice(period=period, rows=rows)


@functools.lru_cache(maxsize=1024)
def _pad_entry(key: str, size: int) -> bytes | None:
    """A zero-filled bytes entry of exactly ``size`` bytes, or None when no payload length
    gives that size (the varint lengths grow by steps)."""
    for overhead in range(len(key) + 6, len(key) + 24):
        n = size - overhead
        if n < 0:
            return None
        header, total = _bytes_entry_header(key, n)
        if total == size:
            return header + bytes(n)
    return None


class BlockEncoder:
    """Serializes blocks of samples into Example bytes with precomputed headers.

    With a `Lattice`, zero-filled pad entries align each feature's payload and the
    frame's size (the module's "Lattice layout").

    Example:
        >>> enc = BlockEncoder([FeatureSpec("x", "", "float32", (2,))])
        >>> rec = enc.encode(3, [np.zeros((3, 2), np.float32).tobytes()])
    """

    def __init__(self, specs: list[FeatureSpec], lattice: Lattice | None = None):
        self.specs = sorted(specs, key=lambda s: s.key)
        if lattice is not None and not lattice.fits(self.specs):
            raise ValueError(f"the lattice {lattice} does not fit the features {self.specs}")
        self.lattice = lattice
        self._cache: dict[int, tuple[bytes, list[bytes], bytes, bytes]] = {}

    def _headers(self, count: int) -> tuple[bytes, list[bytes], bytes, bytes]:
        """``(Example header, per-feature headers, count entry, last pad)`` of a record
        of ``count`` samples; a feature's header starts with its pad entry, if any."""
        cached = self._cache.get(count)
        if cached is not None:
            return cached
        count_entry = _int64_entry(COUNT_KEY, count)
        plain = [_bytes_entry_header(s.key, count * s.sample_bytes) for s in self.specs]
        total = len(count_entry) + sum(size for _, size in plain)
        entries = [header for header, _ in plain]
        tail = b""
        if self.lattice is not None:
            entries, tail, total = self._lattice_headers(count, count_entry, plain)
        example_header = _len_field(1, total)  # Example.features
        result = (example_header, entries, count_entry, tail)
        if len(self._cache) < 4:
            self._cache[count] = result
        return result

    def _lattice_headers(
        self, count: int, count_entry: bytes, plain: list[tuple[bytes, int]]
    ) -> tuple[list[bytes], bytes, int]:
        """Pads each feature's payload to its alignment and the frame to the period.

        The Example's length field comes first and its size depends on the pads: tried
        with each varint size until the sizes agree (at a varint boundary the pads can
        flip the size back and forth: the last pad then grows by a period).
        """
        from keras_tfr.format import framing

        lattice = self.lattice
        assert lattice is not None
        # The pads only add bytes: the length field is at least the unpadded one's size.
        least = len(_varint(len(count_entry) + sum(size for _, size in plain)))
        for extra, length_bytes in itertools.product((0, 1, 2), range(least, 6)):
            pos = framing.HEADER_BYTES + 1 + length_bytes + len(count_entry)
            entries = []
            for spec, (header, size) in zip(self.specs, plain):
                align = lattice.align(spec.key)
                pad = b""
                need = (-(pos + len(header))) % align
                while need:
                    got = _pad_entry(f"{PAD_KEY}/{spec.key}", need)
                    if got is not None:
                        pad = got
                        break
                    need += align
                entries.append(pad + header)
                pos += len(pad) + size
            tail = b""
            need = (-(pos + framing.FOOTER_BYTES)) % lattice.period + extra * lattice.period
            while need:
                got = _pad_entry(PAD_KEY, need)
                if got is not None:
                    tail = got
                    break
                need += lattice.period
            pos += len(tail)
            total = pos - (framing.HEADER_BYTES + 1 + length_bytes)
            if len(_varint(total)) == length_bytes:
                return entries, tail, total
        raise AssertionError("unreachable: a varint of a record length takes 1-5 bytes")

    def fixed_layout(self, count: int) -> tuple[dict[str, int], list[tuple[int, bytes]], int]:
        """Where each feature's bytes sit in a record of `count` samples (fixed kinds only).

        Returns:
            ``(offsets, headers, length)``: the payload offset per feature key; every
            non-payload segment as ``(offset, expected bytes)``; the record's length.
            Records of one data set share this layout, so a reader can cut features out by
            offset after checking the header segments.
        """
        example_header, entries, count_entry, tail = self._headers(count)
        offsets: dict[str, int] = {}
        headers: list[tuple[int, bytes]] = [(0, example_header + count_entry)]
        pos = len(example_header) + len(count_entry)
        for spec, header in zip(self.specs, entries):
            headers.append((pos, header))
            pos += len(header)
            offsets[spec.key] = pos
            pos += count * spec.sample_bytes
        if tail:
            headers.append((pos, tail))
            pos += len(tail)
        return offsets, headers, pos

    def encode(self, count: int, payloads: list[Any]) -> bytes:
        """`payloads[i]` holds `count` samples of `self.specs[i]` as raw bytes (buffer);
        for a non-fixed spec, a pair ``(values, lengths)`` of buffers."""
        if any(s.kind != "fixed" for s in self.specs):
            return self._encode_variable(count, payloads)
        return b"".join(self.encode_parts(count, payloads))

    def encode_parts(self, count: int, payloads: list[Any]) -> list[Any]:
        """The record of `encode` (fixed kinds only) as its parts, in order: small header
        ``bytes`` and the payload buffers themselves, not copied."""
        example_header, entries, count_entry, tail = self._headers(count)
        parts: list[Any] = [example_header + count_entry]
        for header, payload in zip(entries, payloads):
            parts.append(header)
            parts.append(payload)
        if tail:
            parts.append(tail)
        return parts

    def _encode_variable(self, count: int, payloads: list[Any]) -> bytes:
        # Headers depend on each block's payload sizes: computed per block.
        count_entry = _int64_entry(COUNT_KEY, count)
        parts: list[Any] = []
        total = len(count_entry)
        for spec, payload in zip(self.specs, payloads):
            if spec.kind == "fixed":
                items = [(spec.key, payload)]
            else:
                items = [(spec.key, payload[0]), (spec.lengths_key, payload[1])]
            for key, p in items:
                header, size = _bytes_entry_header(key, memoryview(p).nbytes)
                parts.append(header)
                parts.append(p)
                total += size
        return b"".join([_len_field(1, total), count_entry, *parts])


def encode_block(specs: list[FeatureSpec], arrays: dict[str, np.ndarray]) -> bytes:
    """Encodes one block given per-key arrays (a convenience for tests and tools)."""
    enc = BlockEncoder(specs)
    count = None
    payloads = []
    for spec in enc.specs:
        arr = to_le_bytes(arrays[spec.key], spec)
        count = arr.shape[0] if count is None else count
        payloads.append(arr.data.cast("B"))
    return enc.encode(int(count or 0), payloads)


def decode_example(specs: list[FeatureSpec], record: bytes) -> dict[str, np.ndarray]:
    """Decodes one record into per-key NumPy arrays (slow path: verify, tests, tools).

    Raises:
        ValueError: the record is not an Example of this schema.
    """
    from keras_tfr._proto import parse_example_bytes

    fields = parse_example_bytes(record)
    if COUNT_KEY not in fields or not isinstance(fields[COUNT_KEY], int):
        raise ValueError(f"record has no `{COUNT_KEY}` int64 feature")
    count = fields[COUNT_KEY]
    out = {}
    for spec in specs:
        raw = fields.get(spec.key)
        if spec.kind != "fixed":
            out[spec.key] = _decode_variable(spec, raw, fields.get(spec.lengths_key), count)
            continue
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise ValueError(f"record has no bytes feature `{spec.key}`")
        if len(raw) != count * spec.sample_bytes:
            raise ValueError(
                f"feature `{spec.key}` holds {len(raw)} bytes; {count} samples of "
                f"shape {spec.shape} and dtype {spec.dtype} need {count * spec.sample_bytes}"
            )
        arr = np.frombuffer(raw, dtype=np.uint8 if spec.dtype == "bool" else spec.np_dtype)
        if spec.dtype == "bool":
            arr = arr.astype(np.bool_)
        else:
            arr = arr.astype(np.dtype(spec.dtype), copy=False)
        out[spec.key] = arr.reshape((count, *spec.shape))
    return out


def variable_lengths(spec: FeatureSpec, raw: Any, lengths: Any, count: int) -> np.ndarray:
    """Checks a non-fixed feature's payload against its lengths; returns the lengths.

    Raises:
        ValueError: the lengths are missing, negative or do not add up to the payload.
    """
    if isinstance(raw, list) and not raw:
        raw = b""  # an Example's empty BytesList
    if not isinstance(raw, (bytes, bytearray, memoryview)) or not isinstance(
        lengths, (bytes, bytearray, memoryview)
    ):
        raise ValueError(f"record has no bytes features `{spec.key}` and `{spec.lengths_key}`")
    if len(lengths) != 8 * count:
        raise ValueError(
            f"feature `{spec.lengths_key}` holds {len(lengths)} bytes, not {8 * count}"
        )
    n = np.frombuffer(lengths, "<i8")
    row = spec.sample_bytes
    if (n < 0).any() or int(n.sum()) * row != len(raw):
        raise ValueError(
            f"feature `{spec.key}` holds {len(raw)} bytes; the lengths in "
            f"`{spec.lengths_key}` need {int(n.sum()) * row}"
        )
    return n


def _decode_variable(spec: FeatureSpec, raw: Any, lengths: Any, count: int) -> np.ndarray:
    """A 1-D object array: per sample an array of shape ``(length, *shape)``, or bytes."""
    n = variable_lengths(spec, raw, lengths, count)
    out = np.empty(count, dtype=object)
    buf = bytes(raw)
    ends = np.cumsum(n) * spec.sample_bytes
    start = 0
    for i, end in enumerate(ends.tolist()):
        if spec.kind == "bytes":
            out[i] = buf[start:end]
        else:
            if spec.dtype == "bool":
                a = np.frombuffer(buf[start:end], np.uint8).astype(bool)
            else:
                a = np.frombuffer(buf[start:end], spec.np_dtype)
                a = a.astype(np.dtype(spec.dtype), copy=False)
            out[i] = a.reshape((-1, *spec.shape))
        start = end
    return out


# ------------------------------------------------------------------------ tf decoding


def check_host_byte_order() -> None:
    if sys.byteorder != "little":
        raise RuntimeError(
            "keras-tfr decodes records with zero-copy bitcasts, which assume a little-endian "
            f"host. This host is {sys.byteorder}-endian."
        )


def tf_decode_feature(raw_bytes: tf.Tensor, spec: FeatureSpec, block_samples: int) -> tf.Tensor:
    """Decodes a [k] string tensor of block payloads into [k * block_samples, *shape].

    One `decode_raw` into uint8 (padding a short last block with zeros), then a reshape
    and a zero-copy `bitcast` to the feature's dtype: `decode_raw` itself supports neither
    bool, uint32, uint64 nor (with padding) float16.
    """
    import tensorflow as tf

    nbytes = block_samples * spec.sample_bytes
    u8 = tf.io.decode_raw(raw_bytes, tf.uint8, fixed_length=max(nbytes, 1))
    return tf_bytes_to_feature(u8, spec)


def tf_bytes_to_feature(u8: tf.Tensor, spec: FeatureSpec) -> tf.Tensor:
    """[k, n * sample_bytes] uint8 -> [k * n, *shape] in the feature's dtype (a reshape and
    a zero-copy bitcast; bool is one byte, 0 or 1)."""
    import tensorflow as tf

    if spec.itemsize == 1:
        x = tf.reshape(u8, [-1, *spec.shape])
        if spec.dtype == "bool":
            return tf.cast(x, tf.bool)
        if spec.dtype == "int8":
            return tf.bitcast(x, tf.int8)
        return x
    x = tf.reshape(u8, [-1, *spec.shape, spec.itemsize])
    return tf.bitcast(x, tf.as_dtype(spec.dtype))


def tf_decode_variable(
    raw_bytes: tf.Tensor, raw_lengths: tf.Tensor, spec: FeatureSpec
) -> tf.Tensor | tf.RaggedTensor:
    """Decodes a [k] string tensor of non-fixed block payloads and their lengths.

    Returns a `tf.RaggedTensor` ``[n, None, *shape]`` for a ``"ragged"`` feature, or a
    ``[n]`` string tensor for a ``"bytes"`` feature, ``n`` being the samples of the k
    blocks (short blocks hold no padding here). One join of the k payloads, one
    `decode_raw` and a zero-copy `bitcast`; strings are cut with one `substr`.
    """
    import tensorflow as tf

    lengths = tf.io.decode_raw(tf.strings.reduce_join(raw_lengths), tf.int64)
    joined = tf.strings.reduce_join(raw_bytes)
    if spec.kind == "bytes":
        offsets = tf.cumsum(lengths, exclusive=True)
        return tf.strings.substr(joined, offsets, lengths)
    u8 = tf.io.decode_raw(joined, tf.uint8)
    if spec.itemsize == 1:
        values = tf.reshape(u8, [-1, *spec.shape])
        if spec.dtype == "bool":
            values = tf.cast(values, tf.bool)
        elif spec.dtype == "int8":
            values = tf.bitcast(values, tf.int8)
    else:
        values = tf.reshape(u8, [-1, *spec.shape, spec.itemsize])
        values = tf.bitcast(values, tf.as_dtype(spec.dtype))
    return tf.RaggedTensor.from_row_lengths(values, lengths, validate=False)
