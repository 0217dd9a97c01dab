"""`TFRecordSequenceSource.as_numpy_iterator`: NumPy batches straight from the mapped
reader (sample mode) that are, bit for bit, the batches the tf.data pipeline yields, with
the same epochs, resume point, checks and damage handling; tf.data's own iterator in
block mode."""

from __future__ import annotations

import gc
import os
import sys
import threading

import numpy as np
import pytest
import tensorflow as tf
from _readers import check_order

from keras_tfr import ArraysToRecords, CorruptRecordError, TFRecordSequenceSource
from keras_tfr.read import mapped
from keras_tfr.read.numpy_iter import NumpyBatches


@pytest.fixture
def sorted_data(write_sorted):
    """1,003 class-sorted samples (7, 5) float32, int64 labels, float32 weights, in
    records of 37 samples (no lattice)."""
    return write_sorted(37)[:4]


def _as_numpy(batch):
    return tuple(np.asarray(t) for t in batch)


def _same(a, b):
    """Bit for bit (float NaNs and -0.0 included)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_remainder", [False, True])
def test_numpy_batches_are_the_tf_data_batches(sorted_data, shuffle, drop_remainder):
    d, x, y, w = sorted_data
    kwargs = dict(batch_size=64, shuffle=shuffle, seed=3, drop_remainder=drop_remainder)
    a = TFRecordSequenceSource(d, **kwargs)
    b = TFRecordSequenceSource(d, **kwargs)
    assert a.access == "samples"
    for epoch in range(2):
        it = a.as_numpy_iterator()
        assert isinstance(it, NumpyBatches)
        fast = list(it)
        slow = [_as_numpy(t) for t in tf.data.Dataset.__iter__(b)]  # tf.data's iterator
        assert len(fast) == len(slow) == len(a)
        for f, s in zip(fast, slow):
            assert isinstance(f, tuple) and len(f) == 3
            for ft, st in zip(f, s):
                assert type(ft) is np.ndarray
                _same(ft, st)
        at = check_order(fast, a.sample_order(epoch), x, y, w)
        assert at == (len(x) // 64 * 64 if drop_remainder else len(x))


def test_batches_held_by_the_caller_are_never_overwritten(sorted_data):
    d, x, _, _ = sorted_data
    src = TFRecordSequenceSource(d, batch_size=16, seed=0)
    held = list(src.as_numpy_iterator())  # every batch of epoch 0 kept at once
    copies = [b[0].copy() for b in held]
    for _ in range(3):  # later epochs reuse whatever buffers are free
        for _ in src.as_numpy_iterator():
            pass
    for b, c in zip(held, copies):
        _same(b[0], c)
    _same(np.concatenate(copies), x[src.sample_order(0)])


@pytest.mark.parametrize("batch_size", [50, 64])
def test_on_a_lattice_every_array_is_aligned_and_bit_for_bit(write_sorted, batch_size):
    """On a lattice each array starts on a 64-byte boundary (what JAX needs to take it on
    the CPU without a copy): batch 64 cuts each unit's one buffer into aligned views, batch
    50 (50 x 140 bytes is not a multiple of 64) gets a buffer per batch. Every batch is
    still the epoch's samples, bit for bit, and stays intact while later epochs run."""
    d, x, y, w, m = write_sorted(300)
    assert m.lattice is not None
    src = TFRecordSequenceSource(d, batch_size=batch_size, seed=4)
    held = list(src.as_numpy_iterator())
    for batch in held:
        for a in batch:
            assert a.ctypes.data % 64 == 0
    for _ in range(2):
        list(src.as_numpy_iterator())
    assert check_order(held, src.sample_order(0), x, y, w) == len(x)


def test_epochs_and_resume_follow_the_source_clock(sorted_data):
    d, x, _, _ = sorted_data
    src = TFRecordSequenceSource(d, batch_size=100, seed=4)
    unread = src.as_numpy_iterator()  # made and dropped unread: takes no epoch
    del unread
    e0 = np.concatenate([b[0] for b in src.as_numpy_iterator()])
    e1 = np.concatenate([b[0].numpy() for b in tf.data.Dataset.__iter__(src)])  # epoch 1
    e2 = np.concatenate([b[0] for b in src.as_numpy_iterator()])
    for e, got in enumerate([e0, e1, e2]):
        _same(got, x[src.sample_order(e)])
    src.set_epoch(7, step=3)
    resumed = list(src.as_numpy_iterator())
    assert len(resumed) == len(src) - 3
    _same(np.concatenate([b[0] for b in resumed]), x[src.sample_order(7)[300:]])


def test_validation_subsets_split_the_same_way(sorted_data):
    d, _, y, _ = sorted_data
    kw = dict(batch_size=50, validation_split=0.2, seed=2)
    train = TFRecordSequenceSource(d, subset="training", **kw)
    val = TFRecordSequenceSource(d, subset="validation", **kw)
    ty = np.concatenate([b[1] for b in train.as_numpy_iterator()])
    vy = np.concatenate([b[1] for b in val.as_numpy_iterator()])
    assert len(vy) == int(0.2 * len(y)) and len(ty) + len(vy) == len(y)
    _same(np.sort(np.concatenate([ty, vy])), np.sort(y))
    val.set_epoch(0)
    _same(vy, np.concatenate([b[1].numpy() for b in val]))


def test_padding_batches_of_a_worker_share_are_empty(tmp_path):
    x = np.arange(50 * 3, dtype=np.float32).reshape(50, 3)
    d = str(tmp_path / "ds")
    ArraysToRecords.from_arrays(x, None, d, samples_per_record=10, verbose=0)
    shares = [
        TFRecordSequenceSource(d, batch_size=8, num_workers=3, worker_index=i, seed=0)
        for i in range(3)
    ]
    steps = {len(s) for s in shares}
    assert len(steps) == 1
    seen = []
    for s in shares:
        fast = list(s.as_numpy_iterator())
        s.set_epoch(0)
        slow = [np.asarray(b) for b in s]
        assert len(fast) == len(slow) == len(s)
        for f, t in zip(fast, slow):
            _same(f, t)
        seen.append(np.concatenate(fast))
    _same(np.sort(np.concatenate(seen)[:, 0]), x[:, 0])


def test_damaged_record_raises_corrupt_record_error_or_is_skipped(tmp_path):
    x = np.arange(400 * 4, dtype=np.float32).reshape(400, 4)
    d = str(tmp_path / "ds")
    ArraysToRecords.from_arrays(x, None, d, samples_per_record=20, verbose=0)
    shard = sorted(f for f in os.listdir(d) if f.endswith(".tfrecord"))[0]
    path = os.path.join(d, shard)
    with open(path, "r+b") as f:  # a payload byte of the second record
        specs = sorted(TFRecordSequenceSource(d).manifest.features, key=lambda s: s.key)
        f.seek(mapped.frame_bytes(specs, 20) + 100)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(CorruptRecordError, match="CRC") as info:
        for _ in TFRecordSequenceSource(d, batch_size=16, seed=0).as_numpy_iterator():
            pass
    assert info.value.file == path
    skip = TFRecordSequenceSource(d, batch_size=16, seed=0, on_corrupt="skip")
    got = np.concatenate(list(skip.as_numpy_iterator()))
    assert len(got) == 400 and skip.corrupt_records == 1
    lost = set(range(20, 40))
    assert not lost & set((got[:, 0] // 4).astype(int).tolist())


def test_iterators_dropped_or_closed_mid_epoch_stop_their_threads(sorted_data):
    d, _, _, _ = sorted_data
    src = TFRecordSequenceSource(d, batch_size=10, seed=0)
    next(src.as_numpy_iterator())
    gc.collect()
    before = threading.active_count()
    for _ in range(20):
        it = src.as_numpy_iterator()
        next(it)
        del it
    closed = src.as_numpy_iterator()
    next(closed)
    closed.close()
    with pytest.raises(StopIteration):
        next(closed)
    gc.collect()
    assert threading.active_count() <= before + 2, "reader threads leaked"


def test_block_mode_gives_tf_datas_numpy_batches(sorted_data):
    d, x, _, _ = sorted_data
    src = TFRecordSequenceSource(d, batch_size=64, shuffle=False, access="blocks")
    it = src.as_numpy_iterator()
    assert not isinstance(it, NumpyBatches)
    got = np.concatenate([b[0] for b in it])
    _same(got, x)


@pytest.mark.parametrize("order_rows", [1, 150, 10_000])
def test_order_computed_in_groups_of_units_is_the_same_order(sorted_data, monkeypatch, order_rows):
    """The reader computes each epoch's order for several units at once; whatever the
    group size, both readers give the epoch's `sample_order`, resumed runs included."""
    d, x, y, _ = sorted_data
    monkeypatch.setattr(mapped, "_UNIT_BYTES", 64 * 40 * 4)  # a unit is one batch of 64
    monkeypatch.setattr(mapped, "_ORDER_ROWS", order_rows)
    src = TFRecordSequenceSource(d, batch_size=64, seed=9, validation_split=0.1, subset="training")
    assert src._mapped_plan.unit_rows == 64
    for e in range(2):
        got = np.concatenate([b[0] for b in src.as_numpy_iterator()])
        _same(got, x[src.sample_order(e)])
    _same(
        np.concatenate([b[1].numpy() for b in tf.data.Dataset.__iter__(src)]),
        y[src.sample_order(2)],
    )
    src.set_epoch(5, step=4)
    got = np.concatenate([b[0] for b in src.as_numpy_iterator()])
    _same(got, x[src.sample_order(5)[4 * 64 :]])


_HEAP_SCRIPT = """
import resource, sys
from keras_tfr import TFRecordSequenceSource

src = TFRecordSequenceSource(sys.argv[1], batch_size=256, seed=0)
assert src.access == "samples"
faults = []
for _ in range(6):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for x, y in src.as_numpy_iterator():
        x.sum()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(*faults)
"""


@pytest.mark.subprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_numpy_batches_reuse_freed_memory(tmp_path, run_script):
    """Every NumPy batch is a new array (800 KB here); once epochs are warm, they come
    from memory freed by earlier batches, not from fresh pages. Without the heap set-up
    (`numpy_iter._reuse_freed_batches`) glibc trimmed or unmapped most freed batches:
    2,000 to 4,600 page faults per epoch against under 10."""
    n = 8192
    d = str(tmp_path / "ds")
    x = np.random.default_rng(0).random((n, 28, 28, 1), dtype=np.float32)
    ArraysToRecords.from_arrays(x, np.arange(n, dtype=np.int32) % 10, d, verbose=0)
    faults = [int(v) for v in run_script(_HEAP_SCRIPT, d).split()[-6:]]
    batch_pages = (n // 256) * (256 * 28 * 28 * 4 // 4096)  # pages of one epoch's x
    # The fewest of epochs 3-6: the kernel may unmap some of the just-written shards'
    # page-cache pages once (a few thousand refaults seen in one epoch under a busy
    # suite), which says nothing about the heap.
    assert min(faults[2:]) < batch_pages // 10, faults


@pytest.mark.parametrize("how", ["numpy", "python loop"])
def test_tiny_batches_come_in_units_of_a_bounded_number_of_batches(tmp_path, monkeypatch, how):
    # Units were sized by bytes only: 300,000 samples of 1 byte in batches of 1 made one
    # unit of 300,000 arrays before the first batch (a million took 15.7 s and 395 MB).
    from keras_tfr.read import mapped

    n = 300_000
    x = (np.arange(n) % 251).astype(np.uint8)
    d = str(tmp_path / "ds")
    ArraysToRecords.from_arrays(x, x, d, verbose=0)
    made = []
    original = mapped.MappedPlan.gather_batches

    def counted(self, ids, aligned=False):
        out = original(self, ids, aligned)
        made.append(len(out))  # batches, each a list of arrays (one per feature)
        return out

    monkeypatch.setattr(mapped.MappedPlan, "gather_batches", counted)
    src = TFRecordSequenceSource(d, batch_size=1, seed=0)
    first = next(src.as_numpy_iterator() if how == "numpy" else iter(src))
    assert np.asarray(first[0]).tolist() == x[src.sample_order(0)[:1]].tolist()
    assert made and max(made) <= mapped._UNIT_BATCHES < n


@pytest.mark.parametrize(
    "access, how",
    [("samples", "numpy"), ("samples", "tensors"), ("blocks", "tensors"), ("blocks", "numpy")],
)
def test_one_iterator_read_by_several_threads_hands_out_each_batch_once(sorted_data, access, how):
    """As tf.data's iterator does: the threads that shared a sample-mode iterator each
    took an epoch and replaced the others' (batches lost or repeated, or
    `CancelledError`); block mode's raised "the iterator has not been initialized" in the
    threads that asked first."""
    d, _, y, _ = sorted_data
    for _ in range(2):  # a race: twice
        src = TFRecordSequenceSource(d, batch_size=16, seed=0, access=access)
        it = src.as_numpy_iterator() if how == "numpy" else iter(src)
        got, errors = [], []

        def read(it=it, got=got, errors=errors):
            try:
                for batch in it:
                    got.append(np.asarray(batch[1]))
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")

        threads = [threading.Thread(target=read) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert len(got) == len(src)
        assert sorted(np.concatenate(got).tolist()) == sorted(y.tolist())
