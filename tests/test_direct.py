"""The direct reader (`keras_tfr._direct`): reused buffers never change a batch the
caller still holds, iterators dropped mid-epoch release their threads and files, the
seeded order does not depend on thread timing or on the epoch read ahead, and the reader
is chosen (or refused) as documented."""

from __future__ import annotations

import gc
import os
import platform
import sys
import threading

import numpy as np
import pytest
import tensorflow as tf

from keras_tfr import ArraysToRecords, TFRecordSequenceSource, _direct


@pytest.fixture
def data(tmp_path):
    """1,000 samples of 7 float32 (28 bytes: batches are not 64-byte multiples)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1000, 7)).astype(np.float32)
    y = np.arange(1000, dtype=np.int64)
    d = str(tmp_path / "ds")
    ArraysToRecords.from_arrays(x, y, d, samples_per_record=9, min_shards=3, verbose=0)
    return d, x, y


def _epochs(src, n):
    out = []
    for _ in range(n):
        out.append(np.concatenate([by.numpy() for _, by in src]))
    return out


def test_direct_reader_is_the_default_for_local_fixed_data(data, monkeypatch):
    d, _, _ = data
    monkeypatch.delenv("KERAS_TFR_READER", raising=False)
    assert TFRecordSequenceSource(d, batch_size=10)._direct_ok(
        sorted(TFRecordSequenceSource(d, batch_size=10).manifest.features, key=lambda s: s.key)
    )


def test_forcing_the_direct_reader_where_it_cannot_read_names_why(tmp_path, monkeypatch):
    d = str(tmp_path / "gz")
    ArraysToRecords.from_arrays(
        np.zeros((20, 3), np.float32), None, d, compression="GZIP", verbose=0
    )
    monkeypatch.setenv("KERAS_TFR_READER", "direct")
    with pytest.raises(ValueError, match="GZIP-compressed"):
        TFRecordSequenceSource(d, batch_size=4)
    monkeypatch.setenv("KERAS_TFR_READER", "fast")
    with pytest.raises(ValueError, match="KERAS_TFR_READER"):
        TFRecordSequenceSource(d, batch_size=4)


@pytest.mark.parametrize("views", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_batches_held_by_the_caller_survive_later_epochs(data, monkeypatch, shuffle, views):
    """Batch buffers are reused once TensorFlow drops its last tensor of them: a batch the
    caller keeps (tensor or NumPy view) must keep its values."""
    d, x, _ = data
    monkeypatch.setenv("KERAS_TFR_READER", "direct")
    if views:  # batches handed over as views of the unit buffers
        monkeypatch.setattr(_direct, "_VIEW_BYTES", 0)
    src = TFRecordSequenceSource(d, batch_size=10, shuffle=shuffle, seed=1)
    kept = [(bx, by, bx.numpy(), by.numpy()) for bx, by in src]
    for _ in range(3):  # later epochs run through the same buffers
        for _batch in src:
            pass
    gc.collect()
    for bx, by, nx, ny in kept:
        assert np.array_equal(bx.numpy(), x[by.numpy()])
        assert np.array_equal(nx, x[ny])
    seen = np.sort(np.concatenate([k[3] for k in kept]))
    assert np.array_equal(seen, np.arange(1000))


def test_seeded_order_is_the_same_with_and_without_the_epoch_read_ahead(data, monkeypatch):
    """The next epoch is prepared while one ends; its order must not depend on that."""
    d, _, _ = data
    monkeypatch.setenv("KERAS_TFR_READER", "direct")
    a = _epochs(TFRecordSequenceSource(d, batch_size=10, seed=5), 3)
    # The same epochs, each from a source whose read-ahead was dropped unused.
    b = []
    for k in range(3):
        src = TFRecordSequenceSource(d, batch_size=10, seed=5)
        for _ in range(k):
            it = iter(src)
            for _ in range(len(src)):
                next(it)
            del it
        b.append(np.concatenate([by.numpy() for _, by in src]))
    for ea, eb in zip(a, b):
        assert np.array_equal(ea, eb)
    assert not np.array_equal(a[0], a[1]), "reshuffled each epoch"
    assert all(np.array_equal(np.sort(e), np.arange(1000)) for e in a)


def test_iterators_dropped_mid_epoch_release_threads_and_files(data, monkeypatch):
    d, _, _ = data
    monkeypatch.setenv("KERAS_TFR_READER", "direct")
    src = TFRecordSequenceSource(d, batch_size=10, seed=0)
    next(iter(src))  # warm up TensorFlow's own thread pools
    gc.collect()
    threads = threading.active_count()
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    for _ in range(25):
        it = iter(src)
        next(it)
        del it
    gc.collect()
    assert not _direct._registry or len(_direct._registry) <= 1
    assert threading.active_count() <= threads + 8, "reader threads leaked"
    if fds is not None:
        assert len(os.listdir("/proc/self/fd")) <= fds + 8, "shard files left open"


@pytest.mark.parametrize("drop_remainder", [False, True])
def test_direct_and_graph_readers_give_the_same_samples(data, monkeypatch, drop_remainder):
    d, x, y = data
    got = {}
    for reader in ("direct-views", "direct", "graph"):
        monkeypatch.setenv("KERAS_TFR_READER", reader.split("-")[0])
        monkeypatch.setattr(_direct, "_VIEW_BYTES", 0 if reader == "direct-views" else 2 << 20)
        src = TFRecordSequenceSource(d, batch_size=64, shuffle=False, drop_remainder=drop_remainder)
        batches = list(src)
        assert len(batches) == len(src)
        got[reader] = (
            np.concatenate([b[0].numpy() for b in batches]),
            np.concatenate([b[1].numpy() for b in batches]),
            [int(b[1].shape[0]) for b in batches],
        )
        rows = 64 if drop_remainder else None
        assert src.element_spec == (
            tf.TensorSpec([rows, 7], tf.float32),
            tf.TensorSpec([rows], tf.int64),
        )
    n = len(got["graph"][1])
    assert n == (1000 // 64 * 64 if drop_remainder else 1000)
    for reader in ("direct-views", "direct"):
        assert np.array_equal(got[reader][0].view(np.uint32), x[:n].view(np.uint32))
        assert np.array_equal(got[reader][1], y[:n])
        assert got[reader][2] == got["graph"][2]


@pytest.mark.parametrize("hardware", [True, False])
def test_crc32c_over_parts_equals_the_crc_of_the_joined_bytes(monkeypatch, hardware):
    """The copy-free CRC (ctypes on the library google-crc32c ships) and its fallback."""
    import google_crc32c

    from keras_tfr import _crc

    if not hardware:
        monkeypatch.setattr(_crc, "_extend", None)
    elif sys.platform.startswith("linux") and platform.machine() == "x86_64":
        assert _crc.hardware(), "the Linux wheel of google-crc32c ships libcrc32c"
    data = np.random.default_rng(0).integers(0, 256, 100_003, dtype=np.uint8)
    arr = data.reshape(-1, 1)[:, 0]
    parts = [b"head", memoryview(data.tobytes())[:777], data[777:5000], arr[5000:], b""]
    joined = b"head" + data.tobytes()
    assert _crc.crc32c(parts) == google_crc32c.value(joined)
    assert _crc.crc32c([joined[:9]], _crc.crc32c([])) == google_crc32c.value(joined[:9])
    assert _crc.crc32c([b"123456789"]) == 0xE3069283  # the CRC-32C check value


def test_iterator_checkpoints_need_the_graph_reader(data, monkeypatch, tmp_path):
    """Documented limit: TensorFlow cannot checkpoint the direct reader's iterator; the
    graph reader's can be saved and restored."""
    d, _, _ = data
    monkeypatch.setenv("KERAS_TFR_READER", "direct")
    it = iter(TFRecordSequenceSource(d, batch_size=10, seed=0))
    next(it)
    with pytest.raises(tf.errors.UnimplementedError, match="does not support checkpointing"):
        tf.train.Checkpoint(iterator=it).save(str(tmp_path / "direct"))
    monkeypatch.setenv("KERAS_TFR_READER", "graph")
    src = TFRecordSequenceSource(d, batch_size=10, shuffle=False)
    it = iter(src)
    next(it)
    path = tf.train.Checkpoint(iterator=it).save(str(tmp_path / "graph"))
    expected = next(it)[1].numpy()
    it2 = iter(src)
    tf.train.Checkpoint(iterator=it2).restore(path)
    assert np.array_equal(next(it2)[1].numpy(), expected)
