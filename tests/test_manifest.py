"""The manifest is untrusted input: JSON only, no path escapes, limits before allocation,
and every inconsistency refused with a `ManifestError` that names the field."""

from __future__ import annotations

import copy
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from keras_tfr import ArraysToRecords, TFRecordSequenceSource
from keras_tfr.errors import ManifestError
from keras_tfr.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, parse_size


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    """A real manifest (as a dict) of a small data set, and its directory."""
    d = str(tmp_path_factory.mktemp("m") / "ds")
    x = {"a": np.zeros((40, 3), np.float32), "b": np.zeros((40,), np.uint8)}
    ArraysToRecords.from_arrays(
        x, np.zeros(40, np.int64), d, sample_weight=np.ones(40), samples_per_record=4,
        min_shards=3, verbose=0,
    )  # fmt: skip
    return json.loads(Path(os.path.join(d, MANIFEST_NAME)).read_text()), d


def _load(obj):
    return Manifest.from_json(copy.deepcopy(obj), source="test")


def test_valid_manifest_round_trips(valid):
    obj, d = valid
    m = _load(obj)
    assert m.to_json() == obj
    loaded = Manifest.load(d)
    assert loaded.to_json() == obj and loaded.directory == d
    assert (m.total_samples, m.total_records, len(m.shards)) == (40, 10, 4)


def test_shuffle_seed_round_trips(valid):
    obj = copy.deepcopy(valid[0])
    obj["shuffle_seed"] = 12
    m = _load(obj)
    assert m.shuffle_seed == 12 and m.to_json() == obj


def test_key_order_round_trips_and_defaults_to_sorted(valid):
    obj = copy.deepcopy(valid[0])
    assert obj["key_order"] == {"x": ["a", "b"]}  # as the writer was given them
    obj["key_order"] = {"x": ["b", "a"]}
    m = _load(obj)
    assert m.key_order == {"x": ["b", "a"]} and m.names_in_order("x") == ["b", "a"]
    assert m.to_json() == obj
    del obj["key_order"]  # a data set written before the field
    m = _load(obj)
    assert m.key_order == {} and m.names_in_order("x") == ["a", "b"]
    assert "key_order" not in m.to_json()


def test_save_is_atomic_and_leaves_no_temporary_file(valid, tmp_path):
    obj, _ = valid
    m = _load(obj)
    m.save(str(tmp_path))
    assert os.listdir(tmp_path) == [MANIFEST_NAME]
    assert Manifest.load(str(tmp_path), check_files=False).to_json() == m.to_json()


@pytest.mark.parametrize(
    "name",
    [
        "../outside.tfrecord",
        "..",
        ".",
        "/etc/passwd",
        "sub/shard.tfrecord",
        "C:\\shard.tfrecord",
        "..\\shard.tfrecord",
        "",
        ".hidden",
        "shard\x00.tfrecord",
        "a" * 300,
        MANIFEST_NAME,
        "~/shard",
        "gs://bucket/shard",
    ],
)
def test_shard_paths_cannot_leave_the_directory(valid, name):
    obj = copy.deepcopy(valid[0])
    obj["shards"][0]["file"] = name
    with pytest.raises(ManifestError, match=r"shards\[0\]\.file"):
        _load(obj)


@pytest.mark.parametrize(
    "path, value, match",
    [
        (("format",), "keras-tfr2", "format"),
        (("format_version",), 2, "format_version 2"),
        (("format_version",), "1", "format_version"),
        (("format_version",), True, "format_version"),
        (("structure",), {"x": "tensor"}, "structure"),
        (("structure",), {"q": "array"}, "structure"),
        (("features",), [], "features"),
        (("features", 0, "dtype"), "complex64", "dtype"),
        (("features", 0, "dtype"), "<f4", "dtype"),
        (("features", 0, "shape"), [3, -1], "shape"),
        (("features", 0, "shape"), [1] * 33, "shape"),
        (("features", 0, "shape"), [1 << 40], "shape"),
        (("features", 0, "shape"), [1 << 16, 1 << 16], "exceed"),
        (("features", 0, "name"), "a/b", "name"),
        (("features", 0, "key"), "x/other", "key"),
        (("features", 1, "name"), "a", "twice"),
        (("samples_per_record",), 0, "samples_per_record"),
        (("samples_per_record",), 1 << 60, "samples_per_record"),
        (("samples_per_record",), 1 << 27, "2 GiB"),
        (("record_bytes",), -1, "record_bytes"),
        (("compression",), "LZ4", "compression"),
        (("shards", 0, "samples"), -4, "counts"),
        (("shards", 0, "samples"), 5, "records` is 3; 5 samples"),
        (("shards", 0, "records"), 99, "records"),
        (("shards", 0, "bytes"), 1 << 55, "counts"),
        (("shards", 0, "bytes"), 10, "cannot hold"),
        (("shards", 0, "checksum"), "md5:00", "checksum"),
        (("shards", 1, "file"), None, "file"),
        (("total_samples",), 41, "total_samples"),
        (("user_metadata",), [1], "user_metadata"),
        (("shuffle_seed",), -1, "shuffle_seed"),
        (("shuffle_seed",), "3", "shuffle_seed"),
        (("shuffle_seed",), True, "shuffle_seed"),
        (("shuffle_seed",), 1.5, "shuffle_seed"),
        (("shuffle_seed",), 1 << 63, "shuffle_seed"),
        (("key_order",), ["a", "b"], "key_order` must be an object"),
        (("key_order",), {"y": ["a"]}, "not a dict role"),
        (("key_order", "x"), ["a"], "key_order.x` must list"),
        (("key_order", "x"), ["a", "a"], "key_order.x` must list"),
        (("key_order", "x"), ["a", "c"], "key_order.x` must list"),
        (("key_order", "x"), ["a", "b", "b"], "key_order.x` must list"),
        (("key_order", "x"), "ab", "key_order.x` must list"),
        (("key_order", "x"), ["a", 1], "key_order.x` must list"),
    ],
)
def test_each_bad_field_is_refused_and_named(valid, path, value, match):
    obj = copy.deepcopy(valid[0])
    target = obj
    for key in path[:-1]:
        target = target[key]
    if path[-1] == "name" and path[1] == 1:  # a duplicate: copy feature 0's key
        target.update(name=obj["features"][0]["name"], role=obj["features"][0]["role"])
        target.pop("key")
    else:
        target[path[-1]] = value
    with pytest.raises(ManifestError, match=match):
        _load(obj)


def test_only_the_last_shard_may_end_in_a_short_record(valid):
    obj = copy.deepcopy(valid[0])
    obj["shards"][0].update(samples=obj["shards"][0]["samples"] - 1)
    obj.pop("total_samples")
    with pytest.raises(ManifestError, match=r"shards\[0\]\.samples` 11 is not a multiple of 4"):
        _load(obj)
    obj = copy.deepcopy(valid[0])
    last = obj["shards"][-1]
    last.update(samples=last["samples"] - 1)
    obj.pop("total_samples")
    assert _load(obj).total_samples == 39


def test_shards_too_many_records_for_their_bytes_are_refused_before_allocation(valid):
    """A hostile manifest must not make the reader allocate per-record arrays of 2**40."""
    obj = copy.deepcopy(valid[0])
    obj["samples_per_record"] = 1
    obj["shards"] = [{**obj["shards"][0], "samples": 1 << 40, "records": 1 << 40}]
    obj.pop("total_samples"), obj.pop("total_records"), obj.pop("total_bytes")
    with pytest.raises(ManifestError, match="cannot hold"):
        _load(obj)


@pytest.mark.parametrize(
    "raw",
    [
        pickle.dumps({"format": "keras-tfr"}),
        b"\xff\xfe{}",
        b"",
        b"{" * 100_000,
        b"[" * 100_000 + b"]" * 100_000,
        b'{"format": "keras-tfr", "format_version": 1' + b"9" * 5000 + b"}",
        b"NaN",
        b"[]",
        b'"keras-tfr"',
        b"null",
    ],
)
def test_non_json_or_non_object_is_a_manifest_error(raw):
    with pytest.raises(ManifestError):
        Manifest.from_json_bytes(raw, source="test")


def test_manifest_file_over_the_limit_is_refused_without_reading_it(tmp_path, monkeypatch):
    path = tmp_path / MANIFEST_NAME
    with open(path, "wb") as f:  # sparse: no disk used
        f.truncate(MAX_MANIFEST_BYTES + 1)
    from keras_tfr import _io

    def no_read(p):
        raise AssertionError(f"read {p} before checking its size")

    monkeypatch.setattr(_io, "read_bytes", no_read)
    with pytest.raises(ManifestError, match="over the"):
        Manifest.load(str(tmp_path))


def test_source_refuses_a_hostile_manifest_before_reading_any_shard(valid, tmp_path):
    obj, _d = valid
    obj = copy.deepcopy(obj)
    obj["shards"][1]["file"] = "../../../../etc/passwd"
    os.makedirs(tmp_path / "evil")
    Path(tmp_path / "evil" / MANIFEST_NAME).write_text(json.dumps(obj))
    with pytest.raises(ManifestError, match="plain file name"):
        TFRecordSequenceSource(str(tmp_path / "evil"), batch_size=4)


@pytest.mark.parametrize(
    "value, expected",
    [("128MB", 128_000_000), ("64KiB", 65536), ("1.5GB", 1_500_000_000), (4096, 4096), ("7", 7)],
)
def test_parse_size(value, expected):
    assert parse_size(value, argument="s") == expected


@pytest.mark.parametrize("value", [0, -1, "0MB", "", "12XB", "MB", True, 1.5, None, [1]])
def test_parse_size_refuses_and_names_the_argument(value):
    with pytest.raises((TypeError, ValueError), match="`shard_size`"):
        parse_size(value, argument="shard_size")


def test_checksum_is_the_crc32c_of_the_records_crc32cs(valid):
    """What docs/reliability.md and the manifest's docstring say the checksum is, computed
    here from the raw shard files without keras-tfr's own code."""
    import struct

    import google_crc32c

    obj, d = valid
    for shard in obj["shards"]:
        data = Path(d, shard["file"]).read_bytes()
        crcs, pos = b"", 0
        while pos < len(data):  # TFRecord framing: length, its CRC, data, its CRC
            (length,) = struct.unpack_from("<Q", data, pos)
            record = data[pos + 12 : pos + 12 + length]
            crcs += struct.pack("<I", google_crc32c.value(record))
            pos += 16 + length
        assert shard["checksum"] == f"crc32c:{google_crc32c.value(crcs):08x}"
        assert shard["checksum"] != f"crc32c:{google_crc32c.value(data):08x}"
