"""Block mode (`access="blocks"`, tf.data's `TFRecordDataset`): GZIP and ZLIB shards read
back bit for bit, a damaged record named with its shard and byte offset (of the
uncompressed stream for compressed shards), and epochs whose order is a function of
``(seed, epoch)`` alone, resumable with `set_epoch(epoch, step)`."""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from keras_tfr import ArraysToRecords, CorruptRecordError, TFRecordSequenceSource
from keras_tfr.format import framing
from keras_tfr.manifest import Manifest

N = 120  # samples; y is each sample's index
SPR = 4  # samples per record: 30 records
SHARDS = 3  # of 10 records each


@pytest.fixture(autouse=True)
def _default_reader(monkeypatch):
    """The access mode is the source's own choice (or its `access=`), not the env's."""
    monkeypatch.delenv("KERAS_TFR_READER", raising=False)


def _arrays():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((N, 3, 2)).astype(np.float32)
    # Bit patterns a lossy path would change: -0.0, NaN with a payload, a subnormal.
    x.reshape(-1)[:3] = np.array([0x80000000, 0x7FC01234, 0x00000001], np.uint32).view(np.float32)
    y = np.arange(N, dtype=np.int64)
    return x, y


def _write(tmp_path, compression=None, name="ds"):
    x, y = _arrays()
    d = str(tmp_path / name)
    ArraysToRecords.from_arrays(
        x, y, d, samples_per_record=SPR, min_shards=SHARDS, compression=compression, verbose=0
    )
    m = Manifest.load(d)
    assert m.compression == compression
    assert [s.records for s in m.shards] == [N // SPR // SHARDS] * SHARDS
    return d, x, y, m


def _batches(it):
    return [tuple(t.numpy() for t in batch) for batch in it]


def _labels(batches):
    return np.concatenate([by for _, by in batches])


def _check_samples(batches, x):
    """Every sample that came through is the written one, byte for byte (y its index)."""
    for bx, by in batches:
        assert bx.dtype == x.dtype
        assert bx.tobytes() == x[by].tobytes(), "wrong data passed on as good"


# ------------------------------------------------------------------ compressed shards


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_compressed_shards_read_in_blocks_bit_for_bit(tmp_path, compression):
    d, x, y, m = _write(tmp_path, compression)
    with open(m.shard_path(m.shards[0]), "rb") as f:
        head = f.read(2)
    # The shards really are compressed: gzip's magic number, or a zlib header.
    if compression == "GZIP":
        assert head == b"\x1f\x8b"
    else:
        assert head[0] & 0x0F == 8 and int.from_bytes(head, "big") % 31 == 0
    src = TFRecordSequenceSource(d, batch_size=16, shuffle=False)
    assert src.access == "blocks"
    got = _batches(src)
    assert len(got) == len(src) == -(-N // 16)
    gx = np.concatenate([bx for bx, _ in got])
    gy = _labels(got)
    assert gx.dtype == x.dtype and gy.dtype == y.dtype
    assert gx.shape == x.shape and gy.shape == y.shape
    assert gx.tobytes() == x.tobytes()
    assert gy.tobytes() == y.tobytes()


def _decompress(raw, compression):
    return gzip.decompress(raw) if compression == "GZIP" else zlib.decompress(raw)


def _compress(raw, compression):
    return gzip.compress(raw) if compression == "GZIP" else zlib.compress(raw)


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
@pytest.mark.parametrize("shard, record", [(0, 0), (1, 6), (2, 9)])
def test_damaged_record_in_a_compressed_shard_names_file_and_uncompressed_offset(
    tmp_path, compression, shard, record
):
    d, x, _, m = _write(tmp_path, compression)
    path = m.shard_path(m.shards[shard])
    # Opened first: a recompressed shard may differ in size, which opening would refuse.
    src = TFRecordSequenceSource(d, batch_size=8, shuffle=False)
    assert src.access == "blocks"
    frame = framing.frame_size(m.record_bytes)
    raw = bytearray(_decompress(Path(path).read_bytes(), compression))
    assert len(raw) == m.shards[shard].records * frame
    raw[record * frame + framing.HEADER_BYTES + 20] ^= 0x10  # inside the record's data
    Path(path).write_bytes(_compress(bytes(raw), compression))
    good = []
    with pytest.raises(CorruptRecordError) as e:
        for batch in src:
            good.append(tuple(t.numpy() for t in batch))
    assert not isinstance(e.value, tf.errors.DataLossError)
    assert e.value.file == path
    # "For GZIP/ZLIB shards the offset counts bytes of the uncompressed stream."
    assert e.value.offset == record * frame
    assert f"(record {record} " in e.value.message
    _check_samples(good, x)
    # Nothing of the damaged record, nor of a record after it, was handed out.
    first_bad = sum(s.records for s in m.shards[:shard]) + record
    assert not (np.concatenate([by for _, by in good] or [[]]) >= first_bad * SPR).any()


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("shard, record", [(0, 3), (2, 9)])
def test_damaged_record_read_in_blocks_names_file_and_offset(tmp_path, shard, record, shuffle):
    d, x, _, m = _write(tmp_path)
    path = m.shard_path(m.shards[shard])
    src = TFRecordSequenceSource(d, batch_size=8, shuffle=shuffle, seed=1, access="blocks")
    assert src.access == "blocks"
    frame = framing.frame_size(m.record_bytes)
    assert frame == m.record_bytes + 16
    raw = bytearray(Path(path).read_bytes())
    raw[record * frame + framing.HEADER_BYTES + 20] ^= 0x10  # same size: opening passes
    Path(path).write_bytes(raw)
    good = []
    with pytest.raises(CorruptRecordError) as e:
        for batch in TFRecordSequenceSource(d, batch_size=8, shuffle=shuffle, access="blocks"):
            good.append(tuple(t.numpy() for t in batch))
    assert e.value.file == path and e.value.offset == record * frame
    _check_samples(good, x)
    with pytest.raises(CorruptRecordError) as e:  # the source opened before the damage
        _batches(src)
    assert e.value.file == path and e.value.offset == record * frame


# ------------------------------------------------------------------ epochs


@pytest.fixture
def epochs_data(tmp_path):
    d, x, _, _ = _write(tmp_path)
    return d, x


def _blocks(d, **kw):
    src = TFRecordSequenceSource(d, batch_size=8, seed=11, access="blocks", **kw)
    assert src.access == "blocks"
    return src


def test_block_mode_reshuffles_every_epoch_and_reads_every_sample_once(epochs_data):
    d, x = epochs_data
    src = _blocks(d)
    epochs = [_batches(src) for _ in range(2)]
    for batches in epochs:
        assert len(batches) == len(src)
        assert np.array_equal(np.sort(_labels(batches)), np.arange(N))
        _check_samples(batches, x)
    assert not np.array_equal(_labels(epochs[0]), _labels(epochs[1])), "reshuffled each epoch"
    assert not np.array_equal(_labels(epochs[0]), np.arange(N)), "shuffled at all"


@pytest.mark.parametrize(
    "kw, expected",
    [
        (dict(seed=11), True),
        (dict(seed=None), False),  # shuffled without a seed: the fastest order
        (dict(seed=None, shuffle=False), True),
        (dict(seed=None, deterministic=True), True),
        (dict(seed=11, deterministic=False), False),
    ],
)
def test_block_mode_deterministic_default(epochs_data, monkeypatch, kw, expected):
    """The docstring: ``deterministic`` defaults to True unless ``shuffle=True`` without a
    ``seed``; given, it is what the reader's parallel maps use."""
    from keras_tfr.read import graph

    seen = []
    original = graph.GraphReader.__init__

    def spy(self, *args, **kwargs):
        seen.append(kwargs["deterministic"])
        original(self, *args, **kwargs)

    monkeypatch.setattr(graph.GraphReader, "__init__", spy)
    d, _ = epochs_data
    src = TFRecordSequenceSource(d, batch_size=8, access="blocks", **kw)
    assert sum(len(by) for _, by in src) == N
    assert seen and set(seen) == {expected}, seen


def test_block_mode_epoch_order_depends_only_on_seed_and_epoch(epochs_data):
    d, _ = epochs_data
    a = _blocks(d)
    first, second = _labels(_batches(a)), _labels(_batches(a))
    # Iterators made and dropped unread (Keras makes one at each epoch's end) take no epoch.
    b = _blocks(d)
    for _ in range(3):
        it = iter(b)
        del it
    assert np.array_equal(_labels(_batches(b)), first)
    for _ in range(2):
        it = iter(b)
        del it
    assert np.array_equal(_labels(_batches(b)), second)
    # An iterator that starts reading is the next epoch, however little of it is read.
    c = _blocks(d)
    it = iter(c)
    next(it)
    del it
    assert np.array_equal(_labels(_batches(c)), second)
    # A different seed reads another order.
    other = TFRecordSequenceSource(d, batch_size=8, seed=12, access="blocks")
    assert not np.array_equal(_labels(_batches(other)), first)


def test_block_mode_set_epoch_resumes_from_a_batch(epochs_data):
    d, x = epochs_data
    ref = _blocks(d)
    ref.set_epoch(1)
    epoch1 = _batches(ref)
    a = _blocks(d)
    _batches(a)
    assert np.array_equal(_labels(_batches(a)), _labels(epoch1)), "set_epoch(1) is epoch 1"
    b = _blocks(d)
    b.set_epoch(1, step=2)
    resumed = _batches(b)
    assert len(resumed) == len(epoch1) - 2
    for (gx, gy), (ex, ey) in zip(resumed, epoch1[2:]):
        assert np.array_equal(gy, ey)
        assert gx.tobytes() == ex.tobytes()
    _check_samples(resumed, x)
    # The iterator after it is the next epoch, from its first batch.
    c = _blocks(d)
    c.set_epoch(2)
    assert np.array_equal(_labels(_batches(b)), _labels(_batches(c)))


@pytest.mark.parametrize("on_corrupt", ["raise", "skip"])
def test_a_block_mode_source_is_collected_once_dropped(tmp_path, on_corrupt):
    """A block-mode source (and each `with_batch_size` copy, one per keras-tuner trial)
    is garbage once dropped: its pipeline's functions, which TensorFlow keeps, held the
    source itself (about 2.5 MB a source for the process's life)."""
    import gc
    import weakref

    d = _write(tmp_path)[0]
    base = TFRecordSequenceSource(d, 16, seed=0, access="blocks", on_corrupt=on_corrupt)
    refs = []
    for k in range(3):
        copy = base.with_batch_size(8 + k)
        next(iter(copy))
        next(copy.as_numpy_iterator())
        refs.append(weakref.ref(copy))
        del copy
    refs.append(weakref.ref(base))
    del base
    gc.collect()
    assert [r() is None for r in refs] == [True] * 4
