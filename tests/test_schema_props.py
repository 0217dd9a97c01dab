"""Property tests (hypothesis): block encode/decode of every dtype and shape, in NumPy and
in TensorFlow, bit for bit; and the manifest and record parsers on arbitrary input raise
only their own errors."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from keras_tfr.errors import ManifestError
from keras_tfr.manifest import Manifest
from keras_tfr.schema import (
    COUNT_KEY,
    SUPPORTED_DTYPES,
    FeatureSpec,
    decode_example,
    encode_block,
    tf_decode_feature,
)

DTYPES = sorted(SUPPORTED_DTYPES)
SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _bits(a: np.ndarray) -> bytes:
    """Bit pattern, so NaNs with payloads and -0.0 compare exactly."""
    return np.ascontiguousarray(a).tobytes()


@st.composite
def features(draw, max_features=3):
    """(specs, arrays by key, count): features with distinct keys, any dtype and shape."""
    count = draw(st.integers(1, 6))
    n = draw(st.integers(1, max_features))
    roles = draw(st.lists(st.sampled_from(["x", "y", "sample_weight"]), min_size=n, max_size=n))
    specs, arrays = [], {}
    for i, role in enumerate(roles):
        name = draw(st.sampled_from(["", f"f{i}", str(i), "é"]))
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(1, 4), max_size=3)))
        spec = FeatureSpec(role=role, name=name, dtype=dtype, shape=shape)
        assume(spec.key not in arrays)
        dt = np.dtype(dtype)
        arr = draw(hnp.arrays(dt, (count, *shape), elements=_elements(dt)))
        specs.append(spec)
        arrays[spec.key] = arr
    return specs, arrays, count


def _elements(dt):
    if dt.kind == "f":
        return st.floats(width=dt.itemsize * 8, allow_nan=True, allow_infinity=True)
    return None  # hypothesis' default covers the full range of ints and bools


@SETTINGS
@given(features())
def test_numpy_encode_decode_round_trips_bit_for_bit(case):
    specs, arrays, count = case
    record = encode_block(specs, arrays)
    decoded = decode_example(specs, record)
    assert set(decoded) == set(arrays)
    for spec in specs:
        out, ref = decoded[spec.key], arrays[spec.key]
        assert out.dtype == ref.dtype and out.shape == (count, *spec.shape)
        assert _bits(out) == _bits(ref)


@SETTINGS
@given(features(max_features=1))
def test_records_have_the_same_size_for_the_same_count(case):
    """The reader computes shard offsets from `record_bytes`: full records never vary."""
    specs, arrays, _count = case
    zeros = {k: np.zeros_like(v) for k, v in arrays.items()}
    assert len(encode_block(specs, arrays)) == len(encode_block(specs, zeros))


@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(features(max_features=2), st.integers(0, 3))
def test_tensorflow_decode_matches_numpy_bit_for_bit(case, pad):
    """Records of `count` samples in blocks of `count + pad`: the short-block path too."""
    import tensorflow as tf

    specs, arrays, count = case
    block = count + pad
    # Two records: the full one, and one with the samples in reverse order.
    reverse = {k: v[::-1] for k, v in arrays.items()}
    serialized = tf.constant([encode_block(specs, arrays), encode_block(specs, reverse)])
    feature_spec = {s.key: tf.io.FixedLenFeature([], tf.string) for s in specs}
    feature_spec[COUNT_KEY] = tf.io.FixedLenFeature([], tf.int64)
    parsed = tf.io.parse_example(serialized, feature_spec)
    assert parsed[COUNT_KEY].numpy().tolist() == [count, count]
    for spec in specs:
        out = tf_decode_feature(parsed[spec.key], spec, block).numpy()
        assert out.shape == (2 * block, *spec.shape)
        assert out.dtype == np.dtype(spec.dtype)
        assert _bits(out[:count]) == _bits(arrays[spec.key])
        assert _bits(out[block : block + count]) == _bits(reverse[spec.key])


@SETTINGS
@given(st.binary(max_size=300))
def test_decode_example_on_arbitrary_bytes_raises_only_value_error(raw):
    specs = [FeatureSpec("x", "", "float32", (2,))]
    try:
        out = decode_example(specs, raw)
    except ValueError:
        return
    assert out["x"].shape[1:] == (2,)


# ------------------------------------------------------------------ manifest parser

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.sampled_from(["keras-tfr", "x", "y", "array", "dict", "float32", "crc32c:00000000"]),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=20,
)


def _valid_manifest() -> dict:
    features = [
        {"role": "x", "name": "", "key": "x", "dtype": "float32", "shape": [3]},
        {"role": "y", "name": "", "key": "y", "dtype": "int64", "shape": []},
    ]
    return {
        "format": "keras-tfr",
        "format_version": 1,
        "writer_version": "0",
        "created": "",
        "structure": {"x": "array", "y": "array"},
        "features": features,
        "samples_per_record": 4,
        "record_bytes": 100,
        "compression": None,
        "total_samples": 10,
        "total_records": 3,
        "total_bytes": 500,
        "shards": [
            {"file": "shard-00000.tfrecord", "samples": 8, "records": 2, "bytes": 300,
             "checksum": "crc32c:0000abcd"},
            {"file": "shard-00001.tfrecord", "samples": 2, "records": 1, "bytes": 200,
             "checksum": "crc32c:ffffffff"},
        ],
    }  # fmt: skip


def test_the_base_manifest_of_the_mutations_is_valid():
    m = Manifest.from_json(_valid_manifest())
    assert (m.total_samples, m.total_records, m.total_bytes) == (10, 3, 500)


def _parse_only_raises_manifest_error(obj):
    try:
        m = Manifest.from_json(obj, source="fuzz")
    except ManifestError:
        return None
    assert isinstance(m, Manifest)
    assert all("/" not in s.file and s.file not in (".", "..") for s in m.shards)
    return m


@SETTINGS
@given(JSON)
def test_arbitrary_json_raises_only_manifest_error(obj):
    _parse_only_raises_manifest_error(obj)
    raw = json.dumps(obj).encode()
    try:
        Manifest.from_json_bytes(raw, source="fuzz")
    except ManifestError:
        pass


@st.composite
def mutated_manifests(draw):
    """A valid manifest with one to three values replaced by arbitrary JSON or deleted."""
    obj = _valid_manifest()
    for _ in range(draw(st.integers(1, 3))):
        target = obj
        while True:  # walk down to a random container
            keys = list(target) if isinstance(target, dict) else list(range(len(target)))
            if not keys:
                break
            key = draw(st.sampled_from(keys))
            child = target[key]
            if isinstance(child, (dict, list)) and child and draw(st.booleans()):
                target = child
                continue
            if isinstance(target, dict) and draw(st.integers(0, 4)) == 0:
                del target[key]
            else:
                target[key] = draw(JSON)
            break
    return obj


@settings(deadline=None, max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_manifests())
def test_mutated_manifests_raise_only_manifest_error(obj):
    original = copy.deepcopy(obj)
    m = _parse_only_raises_manifest_error(obj)
    assert obj == original, "the parser does not modify its input"
    if m is not None:
        # Whatever passed is self-consistent: the totals add up and only the last
        # shard may end in a short record.
        spr = m.samples_per_record
        assert all(s.records == -(-s.samples // spr) for s in m.shards)
        assert all(s.samples % spr == 0 for s in m.shards[:-1])


@SETTINGS
@given(st.binary(max_size=400))
def test_arbitrary_bytes_raise_only_manifest_error(raw):
    try:
        Manifest.from_json_bytes(raw, source="fuzz")
    except ManifestError:
        pass


@pytest.mark.parametrize("depth", [10, 1000, 50_000])
def test_deeply_nested_json_is_a_manifest_error(depth):
    raw = b'{"format": "keras-tfr", "format_version": ' + b"[" * depth + b"]" * depth + b"}"
    with pytest.raises(ManifestError):
        Manifest.from_json_bytes(raw)
