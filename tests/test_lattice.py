"""The lattice layout (`keras_tfr.schema.Lattice`) and the reader that gathers from it
inside TensorFlow (`keras_tfr.read.mapped.lattice_dataset`): where the padding goes, when
the writer uses it, that other readers still read the records, and that the batches are
bit for bit those of the plain layout, in the same order."""

from __future__ import annotations

import itertools
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from keras_tfr import ArraysToRecords, CorruptRecordError, TFRecordSequenceSource
from keras_tfr._crc import crc32c
from keras_tfr.errors import ManifestError
from keras_tfr.format import framing
from keras_tfr.manifest import Manifest
from keras_tfr.schema import (
    BlockEncoder,
    FeatureSpec,
    Lattice,
    decode_example,
    plan_lattice,
)

# `lattice_dataset`, the pipeline `fit` reads: every eager iterator here is tf.data's own
# (the source's tensors straight from the reader: tests/test_eager_iter.py).
pytestmark = pytest.mark.usefixtures("tf_data_iterator")

SPECS = {
    "mnist": [FeatureSpec("x", "", "float32", (28, 28, 1)), FeatureSpec("y", "", "int32", ())],
    "rgb": [FeatureSpec("x", "", "float32", (64, 64, 3)), FeatureSpec("y", "", "int64", (10,))],
    "bytes": [FeatureSpec("x", "", "uint8", (32, 32, 3)), FeatureSpec("y", "", "uint8", ())],
    "dict": [
        FeatureSpec("x", "a", "float16", (6,)),
        FeatureSpec("x", "b", "int32", (5, 5)),
        FeatureSpec("y", "", "float64", (3,)),
    ],
}


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("count", [1, 2, 127, 128, 129, 300])
def test_payloads_and_frames_sit_on_the_lattice(name, count):
    specs = SPECS[name]
    lattice = plan_lattice(specs, 1 << 20)
    assert lattice is not None
    enc = BlockEncoder(specs, lattice)
    offsets, headers, length = enc.fixed_layout(count)
    for s in specs:
        # Frame-relative payload offsets: 64-byte aligned and whole rows of the lattice.
        at = framing.HEADER_BYTES + offsets[s.key]
        assert at % lattice.align(s.key) == 0
        assert s.sample_bytes % lattice.rows[s.key] == 0
    assert framing.frame_size(length) % lattice.period == 0
    # The headers (pads included) and payloads tile the record exactly.
    spans = sorted(
        [(o, o + len(b)) for o, b in headers]
        + [(offsets[s.key], offsets[s.key] + count * s.sample_bytes) for s in specs]
    )
    assert spans[0][0] == 0 and spans[-1][1] == length
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    # Any Example parser reads the records; the pads are extra keys.
    rng = np.random.default_rng(count)
    arrays = {
        s.key: rng.integers(0, 100, (count, *s.shape)).astype(s.dtype)
        for s in sorted(specs, key=lambda s: s.key)
    }
    payloads = [arrays[s.key].tobytes() for s in enc.specs]
    record = b"".join(bytes(p) for p in enc.encode_parts(count, payloads))
    assert len(record) == length
    decoded = decode_example(specs, record)
    for key, arr in arrays.items():
        assert decoded[key].tobytes() == arr.tobytes()
    parsed = tf.io.parse_single_example(
        record, {k: tf.io.FixedLenFeature([], tf.string) for k in arrays}
    )
    for key, arr in arrays.items():
        assert parsed[key].numpy() == arr.tobytes()
    keys = set(tf.train.Example.FromString(record).features.feature)
    pads = {"__pad__", *(f"__pad__/{k}" for k in arrays)}
    assert {"__count__", *arrays} <= keys <= {"__count__", *arrays, *pads}


def test_lattice_is_refused_where_it_costs_too_much():
    # A sample size with no divisor between 256 and 4096 bytes (3137 is prime).
    assert plan_lattice([FeatureSpec("x", "", "uint8", (3137,))], 1 << 20) is None
    # Variable-length features.
    assert plan_lattice([FeatureSpec("x", "", "int32", (), "ragged")], 1 << 20) is None
    # Records too small for the padding (a period of 4096 bytes in 16 KB records).
    assert plan_lattice([FeatureSpec("x", "", "uint8", (4096,))], 16 << 10) is None
    assert plan_lattice([FeatureSpec("x", "", "uint8", (4096,))], 1 << 20) is not None
    # Large samples are several rows of at most 4 KB.
    lat = plan_lattice([FeatureSpec("x", "", "float32", (64, 64, 3))], 1 << 20)
    assert lat is not None and lat.rows == {"x": 4096}


def _write(directory, x, y, **kw):
    kw.setdefault("verbose", 0)
    return ArraysToRecords.from_arrays(x, y, str(directory), **kw)


@pytest.fixture
def pair(tmp_path):
    """1,003 class-sorted samples written twice: on the lattice and in the plain layout."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1003, 12, 12)).astype(np.float32)
    y = np.repeat(np.arange(10, dtype=np.int32), 101)[:1003]
    kw = {"record_size": "64KB", "min_shards": 3}
    lat = _write(tmp_path / "lattice", x, y, **kw)
    plain = _write(tmp_path / "plain", x, y, lattice=False, **kw)
    assert lat.lattice is not None and plain.lattice is None
    assert len(lat.shards) >= 3 and len(plain.shards) >= 3
    return str(tmp_path / "lattice"), str(tmp_path / "plain"), x, y


def _batches(source):
    return [tuple(t.numpy() for t in batch) for batch in source]


@pytest.mark.parametrize(
    "kw",
    [
        {"shuffle": True, "seed": 4},
        {"shuffle": False},
        {"shuffle": True, "seed": 4, "drop_remainder": True},
        {"shuffle": True, "seed": 4, "validation_split": 0.1, "subset": "validation"},
        {"shuffle": True, "seed": 4, "validation_split": 0.1, "subset": "training"},
        {"shuffle": True, "seed": 4, "num_workers": 3, "worker_index": 1},
    ],
)
def test_lattice_batches_are_the_plain_layouts_bit_for_bit(pair, kw):
    lat, plain, x, y = pair
    a = TFRecordSequenceSource(lat, batch_size=64, **kw)
    b = TFRecordSequenceSource(plain, batch_size=64, **kw)
    assert a._manifest.lattice is not None and a._access == "samples"
    for epoch in range(2):
        got, want = _batches(a), _batches(b)
        assert len(got) == len(want) == len(a)
        for (gx, gy), (wx, wy) in zip(got, want):
            assert gx.dtype == np.float32 and gx.shape[1:] == (12, 12)
            assert gx.tobytes() == wx.tobytes() and gy.tobytes() == wy.tobytes()
        # And they are the written samples, in the source's documented order.
        ids = a.sample_order(epoch)
        gx = np.concatenate([g[0] for g in got])
        assert gx.tobytes() == x[ids[: len(gx)]].tobytes()
        assert np.concatenate([g[1] for g in got]).tobytes() == y[ids[: len(gx)]].tobytes()
    # Mid-epoch starts (what `BackupAndRestore` uses) land on the same batches.
    step = min(3, len(a) - 1)
    a.set_epoch(1, step=step)
    b.set_epoch(1, step=step)
    got, want = _batches(a), _batches(b)
    assert len(got) == len(want) == len(a) - step
    for (gx, gy), (wx, wy) in zip(got, want):
        assert gx.tobytes() == wx.tobytes() and gy.tobytes() == wy.tobytes()
    # The NumPy iterator reads the lattice data set the same way.
    a.set_epoch(0)
    again = _batches(TFRecordSequenceSource(plain, batch_size=64, **kw))
    for (gx, gy), (wx, wy) in zip(a.as_numpy_iterator(), again, strict=True):
        assert gx.tobytes() == wx.tobytes() and gy.tobytes() == wy.tobytes()


def test_block_mode_reads_a_lattice_data_set(pair):
    lat, _, x, y = pair
    src = TFRecordSequenceSource(lat, batch_size=50, access="blocks", shuffle=False)
    xs, ys = zip(*_batches(src))
    assert np.concatenate(xs).tobytes() == x.tobytes()
    assert np.concatenate(ys).tobytes() == y.tobytes()


def test_a_short_last_record_as_long_as_a_full_one(tmp_path):
    """With float32 (8,) and int64 labels in records of 92, a record of 91 samples pads
    to a full record's length: block mode tells them apart by the count field."""
    specs = [FeatureSpec("x", "", "float32", (8,)), FeatureSpec("y", "", "int64", ())]
    enc = BlockEncoder(specs, plan_lattice(specs, 1 << 20))
    assert enc.fixed_layout(91)[2] == enc.fixed_layout(92)[2]
    x = np.arange((92 * 3 + 91) * 8, dtype=np.float32).reshape(-1, 8)
    y = np.arange(len(x), dtype=np.int64)
    m = _write(tmp_path / "ds", x, y, samples_per_record=92)
    assert m.lattice is not None and m.total_samples % 92 == 91
    for access in ("blocks", "samples"):
        src = TFRecordSequenceSource(
            str(tmp_path / "ds"), batch_size=100, access=access, shuffle=False
        )
        xs, ys = zip(*_batches(src))
        assert np.concatenate(xs).tobytes() == x.tobytes(), access
        assert np.concatenate(ys).tobytes() == y.tobytes(), access


@pytest.mark.parametrize("shape", [(7, 5), (64, 64, 3)])
def test_lattice_rows_are_where_the_samples_start(tmp_path, shape):
    """`MappedPlan.rows` (per-record row bases plus a multiply-add) names, for every
    sample, the rows that hold it: each sample's first row is its byte offset in the
    region divided by the row size, and the rows read back are its bytes. A short last
    record, samples of one row and of 12 rows, three features."""
    n = 1003
    rng = np.random.default_rng(0)
    x = {
        "a": rng.standard_normal((n, *shape)).astype(np.float32),
        "b": np.arange(n * 3, dtype=np.int64).reshape(n, 3),
    }
    y = np.arange(n, dtype=np.int32) % 10
    d = str(tmp_path / "ds")
    ArraysToRecords.from_arrays(x, y, d, verbose=0)
    plan = TFRecordSequenceSource(d, batch_size=32, seed=0)._mapped_plan
    assert plan.lattice is not None and plan.total_samples % plan.spr  # a short last record
    ids = rng.permutation(n)
    region = np.frombuffer(memoryview(plan.region().buffer), dtype=np.uint8)
    expected = {"x/a": x["a"], "x/b": x["b"], "y": y}
    for spec, g, sb, rows, offsets in zip(
        plan.specs, plan.lattice_rows, plan.sample_bytes, plan.rows(ids), plan.offsets(ids)
    ):
        k = sb // g
        assert np.array_equal(rows.reshape(n, k)[:, 0] * g, offsets), spec.key
        got = region[: len(region) // g * g].reshape(-1, g)[rows].reshape(n, sb)
        assert got.tobytes() == expected[spec.key][ids].tobytes(), spec.key


def test_lattice_false_and_compression_write_the_plain_layout(tmp_path):
    x = np.zeros((600, 256), np.float32)
    assert _write(tmp_path / "a", x, None).lattice is not None
    assert _write(tmp_path / "b", x, None, lattice=False).lattice is None
    assert _write(tmp_path / "c", x, None, compression="GZIP").lattice is None
    # Small records: the padding would pass 1/16 of a record.
    assert _write(tmp_path / "d", x, None, samples_per_record=2).lattice is None
    with pytest.raises(TypeError, match="lattice"):
        _write(tmp_path / "e", x, None, lattice="yes")


def test_manifest_keeps_and_checks_the_lattice(pair):
    lat, _, _, _ = pair
    m = Manifest.load(lat)
    with open(os.path.join(lat, "manifest.json")) as f:
        obj = json.load(f)
    assert obj["lattice"] == m.lattice.to_json()
    assert Lattice.from_json(obj["lattice"]) == m.lattice
    for bad in (
        {"period": 100, "rows": {"x": 4, "y": 4}},  # not a multiple of 64
        {"period": 64, "rows": {"x": 48, "y": 4}},  # 48 does not divide 64
        {"period": 64, "rows": {"x": 64}},  # a feature missing
        "64",
    ):
        obj2 = dict(obj, lattice=bad)
        with pytest.raises(ManifestError, match="lattice"):
            Manifest.from_json(obj2, source="test")


def test_damaged_lattice_record_is_named_or_skipped(pair):
    lat, _, x, _ = pair
    m = Manifest.load(lat)
    path = m.shard_path(m.shards[1])
    frame = framing.frame_size(m.record_bytes)
    with open(path, "r+b") as f:  # a byte of record 2's payload
        f.seek(2 * frame + frame // 2)
        b = f.read(1)
        f.seek(2 * frame + frame // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    src = TFRecordSequenceSource(lat, batch_size=64, shuffle=True, seed=1)
    with pytest.raises(
        CorruptRecordError, match=f"{os.path.basename(path)}.*byte offset {2 * frame}"
    ):
        _batches(src)
    skip = TFRecordSequenceSource(lat, batch_size=64, shuffle=True, seed=1, on_corrupt="skip")
    got = _batches(skip)
    assert len(got) == len(skip)
    assert sum(len(g[0]) for g in got) == len(x)
    # No sample of the damaged record is handed out.
    first = m.shards[0].samples + 2 * m.samples_per_record
    damaged = x[first : first + m.samples_per_record]
    seen = np.concatenate([g[0] for g in got]).reshape(len(x), -1)
    rows = {r.tobytes() for r in seen}
    assert not any(d.tobytes() in rows for d in damaged.reshape(len(damaged), -1))
    assert skip.corrupt_records == 1


def _rewrite_pad_byte(path, frame, record, m, key, count):
    """Sets a zero byte of pad entry ``key`` of ``record`` (of ``count`` samples) to 1 and
    writes a new data CRC, so that the TFRecord frame is sound again; returns the byte's
    offset in the file and the record's data length."""
    offsets, headers, length = BlockEncoder(m.features, m.lattice).fixed_layout(count)
    assert framing.frame_size(length) <= frame
    field = bytes([len(key)]) + key.encode() + b"\x12"  # the key, then the Feature's tag
    (where,) = [o + b.index(field) + len(field) for o, b in headers if field in b]
    data_start = record * frame + framing.HEADER_BYTES
    with open(path, "r+b") as f:
        f.seek(data_start)
        data = bytearray(f.read(length))
        pad = data.index(0, where)  # the pad's payload: zeros, after its length fields
        payloads = [(offsets[s.key], s.sample_bytes * count) for s in m.features]
        assert data[pad] == 0 and not any(o <= pad < o + n for o, n in payloads)
        data[pad] = 1
        f.seek(data_start)
        f.write(data)
        f.write(framing.masked_bytes(crc32c([bytes(data)])))
    return data_start + pad, length


@pytest.mark.parametrize("access", ["samples", "blocks"])
@pytest.mark.parametrize("which", ["full", "last"])
@pytest.mark.parametrize("key", ["__pad__/x", "__pad__/y", "__pad__"])
def test_a_padding_byte_under_a_valid_crc_is_named_or_skipped(pair, key, which, access):
    """Both readers check every non-payload byte of a record, the lattice's padding
    included (README.md), not only the frame's CRC: in a full record and in the data
    set's short last record (which block mode reads through `parse_example`)."""
    lat, _, x, _ = pair
    m = Manifest.load(lat)
    assert m.lattice is not None
    spr = m.samples_per_record
    frame = framing.frame_size(m.record_bytes)
    if which == "full":
        shard, record, count = m.shards[1], 2, spr
        first = m.shards[0].samples + 2 * spr
    else:
        shard = m.shards[-1]
        record = shard.records - 1
        first = (m.total_records - 1) * spr
        count = m.total_samples - first
        assert 0 < count < spr, "the fixture's last record is short"
    path = m.shard_path(shard)
    with open(path, "rb") as f:
        before = f.read()
    at, length = _rewrite_pad_byte(path, frame, record, m, key, count)
    with open(path, "rb") as f:
        after = f.read()
    assert len(after) == len(before)
    changed = np.flatnonzero(np.frombuffer(before, np.uint8) != np.frombuffer(after, np.uint8))
    crc_at = record * frame + framing.HEADER_BYTES + length
    assert changed[0] == at and set(changed[1:]) <= set(range(crc_at, crc_at + 4))
    # The frame is sound: TensorFlow's reader checks every CRC and reads every record,
    # and the data set's own keys parse as before.
    records = list(tf.data.TFRecordDataset(path))
    assert len(records) == shard.records
    assert records[record].numpy() == after[record * frame + framing.HEADER_BYTES : crc_at]
    spec = {s.key: tf.io.FixedLenFeature([], tf.string) for s in m.features}
    parsed = tf.io.parse_single_example(records[record], spec)
    damaged = x[first : first + count]
    assert parsed["x"].numpy() == damaged.tobytes()

    src = TFRecordSequenceSource(lat, batch_size=64, shuffle=True, seed=1, access=access)
    with pytest.raises(CorruptRecordError, match="does not have the layout") as e:
        _batches(src)
    assert e.value.file == path and e.value.offset == record * frame
    skip = TFRecordSequenceSource(
        lat, batch_size=64, shuffle=True, seed=1, on_corrupt="skip", access=access
    )
    got = _batches(skip)
    assert len(got) == len(skip)
    if access == "samples":  # the damaged record's places are filled with other samples
        assert sum(len(g[0]) for g in got) == len(x)
    assert skip.corrupt_records == 1
    seen = {r.tobytes() for r in np.concatenate([g[0] for g in got]).reshape(-1, 144)}
    assert not any(d.tobytes() in seen for d in damaged.reshape(len(damaged), -1))


def test_lattice_reader_copies_no_data_set_into_memory(tmp_path, run_script):
    """The tensors TensorFlow gathers from alias the mapped shards: reading a 256 MB data
    set grows private memory by far less than its size."""
    x = np.lib.format.open_memmap(str(tmp_path / "x.npy"), "w+", np.float32, (65536, 1024))
    x[:] = 1.0
    x.flush()
    del x
    script = """
import sys, numpy as np
from keras_tfr import ArraysToRecords, TFRecordSequenceSource
x = np.load(sys.argv[1], mmap_mode="r")
m = ArraysToRecords.from_arrays(x, None, sys.argv[2], verbose=0)
assert m.lattice is not None
def anon():
    with open("/proc/self/status") as f:
        return int(next(l for l in f if l.startswith("RssAnon")).split()[1]) // 1024
import tensorflow as tf
src = TFRecordSequenceSource(sys.argv[2], batch_size=256, shuffle=True, seed=0)
for make in (tf.data.Dataset.__iter__, iter):  # tf.data's iterator, the source's own
    it = make(src); next(it)
    before = anon()
    n = sum(int(b.shape[0]) for b in it) + 256
    print(n, anon() - before)
"""
    if not os.path.exists("/proc/self/status"):
        pytest.skip("needs /proc (Linux)")
    out = run_script(script, str(tmp_path / "x.npy"), str(tmp_path / "ds")).split()
    for n, grew in (out[-4:-2], out[-2:]):
        assert int(n) == 65536
        assert int(grew) < 96, f"private memory grew by {grew} MB reading 256 MB"


def test_an_iterator_outlives_its_source(pair, run_script):
    """The gather tensors keep the mapping alive: dropping the source (and collecting it)
    under an open iterator does not unmap what the iterator reads."""
    lat, _, x, _ = pair
    script = """
import gc, sys, numpy as np
import tensorflow as tf
from keras_tfr import TFRecordSequenceSource
for k, make in enumerate((tf.data.Dataset.__iter__, iter)):  # tf.data's, the source's own
    src = TFRecordSequenceSource(sys.argv[1], batch_size=64, shuffle=False)
    it = make(src)
    first = next(it)[0].numpy()
    del src
    gc.collect()
    rest = [b[0].numpy() for b in it]
    np.save(f"{sys.argv[2]}{k}.npy", np.concatenate([first, *rest]))
"""
    out = os.path.join(os.path.dirname(lat), "out")
    run_script(script, lat, out)
    for k in range(2):
        assert np.load(f"{out}{k}.npy").tobytes() == x.tobytes()


def test_without_dlpack_the_lattice_is_gathered_in_python(pair, monkeypatch, caplog):
    """Where TensorFlow cannot alias the mapping, the source says so and reads the same
    batches through the Python gather."""
    from keras_tfr.read import mapped

    lat, plain, _, _ = pair

    def refuse(self):
        raise BufferError("no DLPack here")

    monkeypatch.setattr(mapped.MappedPlan, "lattice_tensors", refuse)
    with caplog.at_level("WARNING", logger="keras_tfr"):
        got = _batches(TFRecordSequenceSource(lat, batch_size=64, seed=2))
    assert "cannot gather from the mapped shards" in caplog.text
    assert "BufferError: no DLPack here" in caplog.text
    want = _batches(TFRecordSequenceSource(plain, batch_size=64, seed=2))
    assert len(got) == len(want)
    for (gx, gy), (wx, wy) in zip(got, want):
        assert gx.tobytes() == wx.tobytes() and gy.tobytes() == wy.tobytes()


def test_every_dtype_reads_back_through_the_lattice(tmp_path):
    """Typed tensors where a row is whole items; uint8 rows and a bitcast for `bool` and
    where it is not (float64 x 625 = 5,000 bytes: rows of 2,500 bytes)."""
    rng = np.random.default_rng(7)
    n = 700
    x = {
        "f16": rng.standard_normal((n, 50)).astype(np.float16),
        "f64": rng.standard_normal((n, 625)),
        "i8": rng.integers(-128, 128, (n, 500)).astype(np.int8),
        "u16": rng.integers(0, 65535, (n, 10, 10)).astype(np.uint16),
        "b": rng.random((n, 250)) < 0.5,
    }
    y = rng.integers(0, 10, n).astype(np.int64)
    m = _write(tmp_path / "ds", x, y)
    assert m.lattice is not None and m.lattice.rows["x/f64"] == 2500
    src = TFRecordSequenceSource(str(tmp_path / "ds"), batch_size=128, shuffle=False)
    assert src.access == "samples"
    got = _batches_dict(src)
    for key, arr in x.items():
        assert got[0][key].dtype == arr.dtype
        assert got[0][key].tobytes() == arr.tobytes(), key
    assert got[1].tobytes() == y.tobytes()


def _batches_dict(source):
    xs, ys = [], []
    for bx, by in source:
        xs.append({k: v.numpy() for k, v in bx.items()})
        ys.append(by.numpy())
    return {k: np.concatenate([b[k] for b in xs]) for k in xs[0]}, np.concatenate(ys)
