"""Sample mode and its memory-mapped reader (`keras_tfr.read.mapped`): the mode chosen
(or refused) as documented, recycled buffers that never change a batch the caller holds,
an epoch order that depends on (seed, epoch) alone, checks done once or every epoch, and
shards changed on disk found and checked again."""

from __future__ import annotations

import gc
import logging
import os
import platform
import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from keras_tfr import ArraysToRecords, CorruptRecordError, TFRecordSequenceSource
from keras_tfr.errors import ShardError
from keras_tfr.manifest import MANIFEST_NAME, Manifest
from keras_tfr.read import mapped

# The tf.data pipeline of sample mode, as `fit` reads it: every eager iterator here is
# tf.data's own (the source's tensors straight from the reader: tests/test_eager_iter.py).
pytestmark = pytest.mark.usefixtures("tf_data_iterator")


@pytest.fixture(params=["plain", "lattice"])
def data(tmp_path, request):
    """1,000 samples of 7 float32 (28 bytes: batches are not 64-byte multiples) in records
    of 9 (too small for a lattice: the buffer reader), or of 64 float32 in records of 60
    on a lattice (TensorFlow gathers from the mapped shards)."""
    rng = np.random.default_rng(3)
    width, spr = (7, 9) if request.param == "plain" else (64, 60)
    x = rng.standard_normal((1000, width)).astype(np.float32)
    y = np.arange(1000, dtype=np.int64)
    d = str(tmp_path / "ds")
    m = ArraysToRecords.from_arrays(x, y, d, samples_per_record=spr, min_shards=3, verbose=0)
    assert (m.lattice is not None) == (request.param == "lattice")
    return d, x, y


def _epoch(src):
    return np.concatenate([by.numpy() for _, by in src])


def test_sample_mode_is_the_default_for_local_fixed_data(data, monkeypatch, tmp_path, caplog):
    d, _, _ = data
    monkeypatch.delenv("KERAS_TFR_READER", raising=False)
    assert TFRecordSequenceSource(d, batch_size=10).access == "samples"
    gz = str(tmp_path / "gz")
    ArraysToRecords.from_arrays(np.zeros((20, 3), np.float32), None, gz, compression="GZIP")
    with caplog.at_level(logging.INFO, logger="keras_tfr"):
        src = TFRecordSequenceSource(gz, batch_size=4)
    assert src.access == "blocks"
    assert "GZIP-compressed" in caplog.text
    assert "access='blocks'" in repr(src)


def test_asking_for_samples_where_they_cannot_be_read_names_why(tmp_path, monkeypatch):
    d = str(tmp_path / "gz")
    ArraysToRecords.from_arrays(np.zeros((20, 3), np.float32), None, d, compression="GZIP")
    with pytest.raises(ValueError, match="GZIP-compressed"):
        TFRecordSequenceSource(d, batch_size=4, access="samples")
    monkeypatch.setenv("KERAS_TFR_READER", "mapped")
    with pytest.raises(ValueError, match="GZIP-compressed"):
        TFRecordSequenceSource(d, batch_size=4)
    monkeypatch.setenv("KERAS_TFR_READER", "fast")
    with pytest.raises(ValueError, match="KERAS_TFR_READER"):
        TFRecordSequenceSource(d, batch_size=4)
    for unset in ("", " "):  # set but empty: as unset (block mode, as chosen for GZIP)
        monkeypatch.setenv("KERAS_TFR_READER", unset)
        assert TFRecordSequenceSource(d, batch_size=4).access == "blocks"
    with pytest.raises(ValueError, match="`access`"):
        TFRecordSequenceSource(d, batch_size=4, access="random")


def test_data_much_larger_than_memory_reads_by_sample_in_windows(data, monkeypatch):
    """Data that cannot stay in the page cache is still read by sample, window by window
    (tests/test_windowed.py), not in blocks."""
    d, _, _ = data
    from keras_tfr import source as source_module

    monkeypatch.setattr(os, "sysconf", lambda name: 100 if name == "SC_PHYS_PAGES" else 64)
    assert source_module._memory_bytes() == 6400
    assert source_module.shuffle_window_bytes("auto", 10_000) == 512  # 800 -> 2**9
    assert source_module.shuffle_window_bytes("auto", 3_200) is None
    src = TFRecordSequenceSource(d, batch_size=10)
    assert src.access == "samples"


@pytest.mark.parametrize("shuffle", [False, True])
def test_batches_held_by_the_caller_survive_later_epochs(data, shuffle):
    """Unit buffers are reused once nothing refers to them: a batch the caller keeps
    (tensor or NumPy copy) must keep its values."""
    d, x, _ = data
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


def test_buffers_come_back_only_when_no_view_is_left():
    buffers = mapped._Buffers(4, 8)
    lease = buffers.take(4)
    lease[:] = 7
    view = np.asarray(lease[1:3])  # a plain ndarray view, as TensorFlow would hold
    del lease
    gc.collect()
    other = buffers.take(4)
    assert buffers.allocated == 2, "a buffer with a live view was handed out again"
    assert (view == 7).all()
    del view, other
    gc.collect()
    buffers.take(4)
    assert buffers.allocated == 2, "a free buffer was not reused"


def test_epoch_order_depends_only_on_seed_and_epoch(data):
    d, _, _ = data
    a = TFRecordSequenceSource(d, batch_size=10, seed=5)
    epochs = [_epoch(a) for _ in range(3)]
    assert all(np.array_equal(np.sort(e), np.arange(1000)) for e in epochs)
    assert not np.array_equal(epochs[0], epochs[1]), "reshuffled each epoch"
    # Iterators made and dropped unread (Keras makes one at each epoch's end) change nothing.
    b = TFRecordSequenceSource(d, batch_size=10, seed=5)
    for _ in range(4):
        del_it = iter(b)
        del del_it
    assert np.array_equal(_epoch(b), epochs[0])
    # Any epoch, from a fresh source, and from any batch on.
    c = TFRecordSequenceSource(d, batch_size=10, seed=5)
    c.set_epoch(2)
    assert np.array_equal(_epoch(c), epochs[2])
    assert np.array_equal(_epoch(c), TFRecordSequenceSource(d, 10, seed=5).sample_order(3))
    c.set_epoch(1, step=37)
    assert np.array_equal(_epoch(c), epochs[1][370:])
    assert np.array_equal(c.sample_order(0), epochs[0])
    # The order is the same whichever number of reader threads cuts it.
    e = TFRecordSequenceSource(d, batch_size=10, seed=5, num_parallel_reads=1)
    assert np.array_equal(_epoch(e), epochs[0])
    with pytest.raises(ValueError, match="`step`"):
        c.set_epoch(0, step=len(c) + 1)


def test_golden_permutation():
    """Pins the index permutation itself (the split and the shuffle are built on it)."""
    from keras_tfr.read.order import Permutation

    got = Permutation(10, key=(0,))(np.arange(10)).tolist()
    assert sorted(got) == list(range(10))
    assert got == [8, 7, 3, 2, 5, 0, 4, 6, 1, 9]
    for n in (1, 2, 3, 1003, 2**16 + 1, 2**20 + 7):
        assert sorted(Permutation(n, key=(1, 2))(np.arange(n)).tolist()) == list(range(n))
    # Indices of 32 bits are mixed in 32-bit words, wider ones in 64-bit words: both pinned.
    assert Permutation(2**32, key=(3,))(np.arange(3)).tolist() == [
        1474532590,
        1327630323,
        1783390745,
    ]
    n = 2**33 + 5
    wide = Permutation(n, key=(3,))
    assert wide(np.arange(3)).tolist() == [5117345873, 1939829250, 8484897795]
    spread = wide(np.arange(0, n, 2**17))  # in range and without repeats
    assert spread.max() < n and len(np.unique(spread)) == len(spread)


def test_iterators_dropped_mid_epoch_release_threads(data):
    d, _, _ = data
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
    assert len(src._mapped_plan._epochs) <= mapped._EPOCHS_KEPT  # the order caches
    assert threading.active_count() <= threads + 8, "reader threads leaked"
    if fds is not None:
        assert len(os.listdir("/proc/self/fd")) <= fds + 8, "files left open"


def test_nothing_is_read_after_the_last_epoch(data):
    """No read-ahead outlives an iterator: after training, no reader thread is left."""
    d, _, _ = data
    src = TFRecordSequenceSource(d, batch_size=10, seed=0)

    def threads():  # less the process-wide checkers, started once by whichever source is first
        return sum(not t.name.startswith("keras_tfr_check") for t in threading.enumerate())

    before = threads()
    for _ in range(2):
        _epoch(src)
    gc.collect()
    assert not src._mapped_plan._epochs  # each finished epoch let go of its order
    assert not [t for t in threading.enumerate() if t.name == "keras_tfr_read"]
    assert threads() <= before + 2


@pytest.mark.parametrize("drop_remainder", [False, True])
def test_mapped_and_graph_readers_give_the_same_samples(data, monkeypatch, drop_remainder):
    d, x, y = data
    got = {}
    for reader in ("mapped", "graph"):
        monkeypatch.setenv("KERAS_TFR_READER", reader)
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
            tf.TensorSpec([rows, x.shape[1]], tf.float32),
            tf.TensorSpec([rows], tf.int64),
        )
    n = len(got["graph"][1])
    assert n == (1000 // 64 * 64 if drop_remainder else 1000)
    assert np.array_equal(got["mapped"][0].view(np.uint32), x[:n].view(np.uint32))
    assert np.array_equal(got["mapped"][1], y[:n])
    assert got["mapped"][2] == got["graph"][2]


@pytest.mark.parametrize(
    "kwargs, rows",
    [
        # 20 full batches: static, as Keras' pipeline for arrays gives them (`fit(x, y)`)
        (dict(batch_size=50), 50),
        (dict(batch_size=64), None),  # the last batch holds 40
        (dict(batch_size=64, drop_remainder=True), 64),
        (dict(batch_size=100, validation_split=0.2, subset="validation", seed=1), 100),
        (dict(batch_size=64, validation_split=0.2, subset="validation", seed=1), None),
        (dict(batch_size=100, num_workers=2, worker_index=1, drop_remainder=True), 100),
        (dict(batch_size=100, num_workers=2, worker_index=1), 100),  # 5 full batches each
        (dict(batch_size=100, num_workers=3, worker_index=0), None),  # 333, 333, 334
        # 3 full batches, then an empty one (as many steps as the worker with 334): the
        # empty batch makes the dimension unknown (`concatenate` relaxes it, as does the
        # `_pad_batches` guard in `_build_mapped`)
        (dict(batch_size=111, num_workers=3, worker_index=0), None),
        (dict(batch_size=50, access="blocks"), None),  # as tf.data's `rebatch` says
        (dict(batch_size=64, access="blocks", drop_remainder=True), 64),
    ],
)
def test_batch_dimension_is_static_when_every_batch_is_full(data, kwargs, rows):
    d, x, _ = data
    src = TFRecordSequenceSource(d, shuffle=True, **{"seed": 0, **kwargs})
    assert src.element_spec[0].shape.as_list() == [rows, x.shape[1]]
    assert src.element_spec[1].shape.as_list() == [rows]
    got = [(bx.numpy(), by.numpy()) for bx, by in src]
    assert len(got) == len(src)
    if rows is not None:
        assert {len(by) for _, by in got} == {rows}
    # The same samples, bit for bit, as each label names.
    ids = np.concatenate([by for _, by in got])
    assert len(np.unique(ids)) == len(ids)
    assert np.array_equal(
        np.concatenate([bx for bx, _ in got]).view(np.uint32), x[ids].view(np.uint32)
    )


@pytest.mark.parametrize("spr", [9, 60])  # plain layout, lattice
@pytest.mark.parametrize("batch_size, drop_remainder", [(50, False), (64, True), (64, False)])
def test_x_alone_comes_as_one_tensor_whatever_the_batch_dimension(
    tmp_path, spr, batch_size, drop_remainder
):
    x = np.random.default_rng(5).standard_normal((1000, 64)).astype(np.float32)
    d = str(tmp_path / "x")
    ArraysToRecords.from_arrays(x, None, d, samples_per_record=spr, verbose=0)
    src = TFRecordSequenceSource(
        d, batch_size=batch_size, shuffle=False, drop_remainder=drop_remainder
    )
    assert isinstance(src.element_spec, tf.TensorSpec)
    batches = list(src)
    assert all(isinstance(b, tf.Tensor) for b in batches)
    got = np.concatenate([b.numpy() for b in batches])
    assert np.array_equal(got.view(np.uint32), x[: len(got)].view(np.uint32))


@pytest.mark.parametrize("verify, checks", [(None, 1), ("first_read", 1), ("every_epoch", 3)])
def test_each_record_is_checked_once_or_every_epoch(data, monkeypatch, verify, checks):
    """``verify=None``: the argument left out, whose default is "first_read"."""
    d, _, _ = data
    calls = []
    original = mapped.MappedPlan._check_record

    def counting(self, record):
        calls.append(record)
        return original(self, record)

    monkeypatch.setattr(mapped.MappedPlan, "_check_record", counting)
    kwargs = {} if verify is None else {"verify": verify}
    src = TFRecordSequenceSource(d, batch_size=10, seed=0, **kwargs)
    assert src.access == "samples"
    for _ in range(3):
        _epoch(src)
    records = src.manifest.total_records
    assert len(calls) == checks * records
    assert sorted(set(calls)) == list(range(records))


def _flip_in_place(path, pos):
    """Flips one byte without truncating the file (as a disk fault or a stray write)."""
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, pos)
        os.pwrite(fd, bytes([b[0] ^ 0x10]), pos)
    finally:
        os.close(fd)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


def _replace_flipped(path, pos):
    """Writes the shard anew with one byte flipped and renames it over the old one, as
    writers do (a new inode)."""
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    raw[pos] ^= 0x10
    with open(path + ".new", "wb") as f:
        f.write(raw)
    os.replace(path + ".new", path)


@pytest.mark.parametrize("how", ["in_place", "replaced"])
def test_shard_changed_between_epochs_is_checked_again(data, how):
    d, _, _ = data
    m = Manifest.load(d)
    path = m.shard_path(m.shards[1])
    src = TFRecordSequenceSource(d, batch_size=10, seed=0)
    _epoch(src)  # every record checked once
    frame = m.record_bytes + 16
    if how == "in_place":
        _flip_in_place(path, 2 * frame + 40)
    else:
        _replace_flipped(path, 2 * frame + 40)
    with pytest.raises(CorruptRecordError) as e:
        _epoch(src)
    assert e.value.file == path and e.value.offset == 2 * frame


@pytest.mark.parametrize("access", ["samples", "blocks"])
@pytest.mark.parametrize("n", [5_000, 3_000])
def test_a_data_set_written_again_under_a_source_is_named_so(tmp_path, n, access):
    """`overwrite=True` under a source: its next epoch says the data set was written
    again and to make a new source, not only that a shard is corrupt (with the same
    number of samples, or fewer: shards cut short or gone). Block mode read the new
    shards under the old manifest while their records passed their checks."""
    d = str(tmp_path / "ds")

    def write(tag, count):
        x = np.full((count, 64), tag, np.float32)
        kw = dict(record_size="64KB", overwrite=True, verbose=0)
        ArraysToRecords.from_arrays(x, np.full(count, tag), d, **kw)

    write(1, 5_000)
    src = TFRecordSequenceSource(d, batch_size=500, seed=0, access=access)
    assert src.access == access
    _epoch(src)
    _epoch(src)  # an unchanged manifest: epochs go on
    write(2, n)
    with pytest.raises(CorruptRecordError, match="written again after this source was made"):
        _epoch(src)
    fresh = TFRecordSequenceSource(d, batch_size=500, seed=0, access=access)
    assert sorted(set(np.concatenate([b[1].numpy() for b in fresh]).tolist())) == [2]


@pytest.mark.parametrize("access", ["samples", "blocks"])
def test_a_data_set_whose_manifest_is_gone_under_a_source_is_named_so(tmp_path, access):
    """docs/reliability.md: block mode raises "written again" at the next epoch when
    manifest.json is gone; sample mode when it then finds a damaged record (it reads
    the shards it mapped, and reads them on while they are sound)."""
    d = str(tmp_path / "ds")
    x = np.arange(5_000 * 64, dtype=np.float32).reshape(5_000, 64)
    m = ArraysToRecords.from_arrays(x, np.arange(5_000), d, record_size="64KB", verbose=0)
    src = TFRecordSequenceSource(d, batch_size=500, seed=0, access=access)
    _epoch(src)
    os.remove(os.path.join(d, MANIFEST_NAME))
    if access == "samples":
        _epoch(src)  # the shards are sound: sample mode reads on
        _flip_in_place(m.shard_path(m.shards[0]), 40)
    gone = r"was deleted or written again after this source was made \(its manifest.json is gone\)"
    with pytest.raises(CorruptRecordError, match=gone):
        _epoch(src)


@pytest.mark.parametrize("access", ["samples", "blocks"])
def test_a_data_set_moved_away_under_a_source_is_named_so(tmp_path, access):
    """docs/reliability.md: a data set directory moved (or deleted) under a source is
    said to be gone at the next epoch, not "written again"."""
    d = str(tmp_path / "ds")
    x = np.arange(3_000 * 64, dtype=np.float32).reshape(3_000, 64)
    ArraysToRecords.from_arrays(x, np.arange(3_000), d, record_size="64KB", verbose=0)
    src = TFRecordSequenceSource(d, batch_size=500, seed=0, access=access)
    _epoch(src)
    os.rename(d, str(tmp_path / "elsewhere"))
    with pytest.raises(CorruptRecordError) as caught:
        _epoch(src)
    said = str(caught.value)
    assert "was moved or deleted after this source was made (its directory is gone)" in said
    assert "written again" not in said


@pytest.mark.parametrize("verify", ["first_read", "every_epoch"])
def test_shard_replaced_by_a_copy_of_another_is_refused(data, caplog, verify):
    """Every record of the copy passes its CRC and layout checks; the shard's checksum
    (its records' CRCs, against the manifest's) does not."""
    d, x, _ = data
    m = Manifest.load(d)
    assert m.shards[0].bytes == m.shards[1].bytes
    path = m.shard_path(m.shards[1])
    src = TFRecordSequenceSource(d, batch_size=10, seed=0, verify=verify)
    skip = TFRecordSequenceSource(d, batch_size=10, seed=0, verify=verify, on_corrupt="skip")
    _epoch(src), _epoch(skip)
    shutil.copyfile(m.shard_path(m.shards[0]), path + ".new")
    os.replace(path + ".new", path)  # as writers replace a file: a new inode
    with pytest.raises(CorruptRecordError, match="no longer holds the records") as e:
        _epoch(src)
    assert e.value.file == path and e.value.offset == 0
    assert m.shards[1].checksum in e.value.message
    with caplog.at_level(logging.WARNING, logger="keras_tfr"):
        batches = [(bx.numpy(), by.numpy()) for bx, by in skip]
    ys = np.concatenate([by for _, by in batches])
    # Skip mode: the shard's records are dropped, the sample count kept.
    assert len(ys) == 1000 and skip.corrupt_records == m.shards[1].records
    first = m.shards[0].samples
    replaced = set(range(first, first + m.shards[1].samples))
    assert not replaced & set(ys.tolist()), "no sample of the replaced shard is handed out"
    for bx, by in batches:  # every sample handed out is the written one
        np.testing.assert_array_equal(bx, x[by])
    # Block mode reads the copy (its records pass their CRCs), as docs/reliability.md
    # says; `verify` names the shard.
    blocks = _epoch(TFRecordSequenceSource(d, batch_size=10, seed=0, access="blocks"))
    assert len(blocks) == 1000 and not replaced & set(blocks.tolist())
    from keras_tfr.verifier import verify

    assert m.shards[1].file in verify(d).summary()


def test_shard_truncated_between_epochs_is_named_not_a_crash(data):
    """A shard cut short while mapped: records past its end are never touched."""
    d, _, _ = data
    m = Manifest.load(d)
    path = m.shard_path(m.shards[2])
    src = TFRecordSequenceSource(d, batch_size=10, seed=0, on_corrupt="skip")
    raising = TFRecordSequenceSource(d, batch_size=10, seed=0)
    _epoch(src), _epoch(raising)
    frame = m.record_bytes + 16
    os.truncate(path, 3 * frame + 5)
    with pytest.raises(CorruptRecordError, match="truncated") as e:
        _epoch(raising)
    assert e.value.file == path
    ys = _epoch(src)  # skip mode: the rest of the shard is dropped, the step count kept
    assert len(ys) == 1000
    lost = m.shards[2].records - 3
    assert src.corrupt_records == lost


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


def test_iterator_checkpoints_need_block_mode(data, tmp_path):
    """Documented limit: TensorFlow cannot checkpoint sample mode's iterator (its state is
    `set_epoch`'s); block mode's can be saved and restored."""
    d, _, _ = data
    it = iter(TFRecordSequenceSource(d, batch_size=10, seed=0))
    next(it)
    with pytest.raises(tf.errors.OpError, match="set_epoch"):
        tf.train.Checkpoint(iterator=it).save(str(tmp_path / "samples"))
    src = TFRecordSequenceSource(d, batch_size=10, shuffle=False, access="blocks")
    it = iter(src)
    next(it)
    path = tf.train.Checkpoint(iterator=it).save(str(tmp_path / "blocks"))
    expected = next(it)[1].numpy()
    it2 = iter(src)
    tf.train.Checkpoint(iterator=it2).restore(path)
    assert np.array_equal(next(it2)[1].numpy(), expected)


@pytest.mark.parametrize("access", ["samples", "blocks"])
def test_replace_directory_reads_the_other_data_set(data, tmp_path, access):
    d, _, _ = data
    other = str(tmp_path / "other")
    ArraysToRecords.from_arrays(np.ones((30, 7), np.float32), np.arange(5000, 5030), other)
    src = TFRecordSequenceSource(d, batch_size=10, shuffle=False, access=access)
    moved = src.replace(directory=other)
    assert moved.num_samples == 30 and len(moved) == 3
    assert sorted(_epoch(moved).tolist()) == list(range(5000, 5030))
    assert repr(other) in repr(moved)
    assert src.replace(batch_size=20).manifest is src.manifest  # same data: no re-read


_MALLOC_SCRIPT = """
import resource, sys
import numpy as np
import tensorflow as tf
from keras_tfr import TFRecordSequenceSource

def faults():
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(200):
        a = np.ones(1 << 18)  # 2 MB, freed at once: heap memory is reused
        del a
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0

faults()
src = TFRecordSequenceSource(sys.argv[1], batch_size=16, seed=0)
assert src.access == "samples"
after_build = faults()
sum(len(b[0]) for b in tf.data.Dataset.__iter__(src))  # tf.data's iterator
sum(len(b[0]) for b in src)  # the source's own (tensors straight from the reader)
print(after_build, faults())
"""


@pytest.mark.subprocess
@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
def test_a_sample_mode_source_leaves_malloc_reusing_memory(tmp_path, run_script):
    """Building and reading a sample-mode source leaves glibc's mmap threshold dynamic:
    built at the top level, TensorFlow's generator data set fixes it at 128 KB for the
    whole process, and then every 2 MB array costs 512 fresh page faults."""
    d = str(tmp_path / "ds")
    ArraysToRecords.from_arrays(np.zeros((100, 4), np.float32), d, verbose=0)
    after_build, after_read = (int(v) for v in run_script(_MALLOC_SCRIPT, d).split()[-2:])
    fixed = 200 * 512  # what a fixed 128 KB threshold costs
    assert after_build < fixed // 10 and after_read < fixed // 10, (after_build, after_read)


_EXIT_SCRIPT = """
import sys, time
import tensorflow as tf
from keras_tfr import TFRecordSequenceSource
from keras_tfr.read import mapped

def slow(fn):  # a slow disk: a unit is surely in flight at exit
    def call(*args, **kwargs):
        time.sleep(0.2)
        return fn(*args, **kwargs)

    return call


for name in ("gather", "gather_batches", "rows"):  # every reader's per-unit call
    setattr(mapped.MappedPlan, name, slow(getattr(mapped.MappedPlan, name)))
src = TFRecordSequenceSource(sys.argv[1], batch_size=256, seed=0)
assert src.access == "samples"
it = tf.data.Dataset.__iter__(src)  # tf.data's iterator
next(it)  # TensorFlow's threads now gather the next units
mine = iter(src)  # the source's own: tensors straight from the reader
next(mine)  # its reader threads now gather the next units
if sys.argv[2] == "error":
    try:
        raise RuntimeError("an error whose traceback keeps the iterator alive")
    except RuntimeError as e:
        kept = e
print("exiting")
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("how", ["plain", "error"])
def test_a_program_exits_cleanly_with_an_iterator_open(tmp_path, run_script, how):
    """Iterators still open when the program ends (tf.data's and the source's own): the
    interpreter destroying one while TensorFlow's threads were calling into Python hung
    the process (the calls wait for the GIL), and unmapping the shards under a running
    gather crashed it (SIGSEGV)."""
    n = 16384
    d = str(tmp_path / "ds")
    x = np.random.default_rng(0).random((n, 28, 28, 1), dtype=np.float32)
    ArraysToRecords.from_arrays(x, np.arange(n, dtype=np.int32) % 10, d, verbose=0)
    for _ in range(2):
        assert run_script(_EXIT_SCRIPT, d, how, timeout=60).split()[-1] == "exiting"


def _prefetch_depths(ds) -> list[int]:
    """The buffer size of every `prefetch` in a data set's graph (-1: AUTOTUNE).

    Reads the serialized graph (`_as_serialized_graph`, the graph tf.data itself saves and
    sends to the tf.data service): TensorFlow has no public way to look inside a pipeline.
    """
    graph = tf.compat.v1.GraphDef()
    ignore = tf.data.experimental.ExternalStatePolicy.IGNORE
    graph.ParseFromString(ds._as_serialized_graph(external_state_policy=ignore).numpy())
    nodes = {n.name: n for n in graph.node}
    depths = []
    for node in graph.node:
        if node.op == "PrefetchDataset":
            const = nodes[node.input[1].split(":")[0]]
            depths.append(int(tf.make_ndarray(const.attr["value"].tensor)))
    return depths


def _gather_ops(ds) -> list[str]:
    """The op of every `map` whose function is the reader's batch gather (`gather`)."""
    graph = tf.compat.v1.GraphDef()
    ignore = tf.data.experimental.ExternalStatePolicy.IGNORE
    graph.ParseFromString(ds._as_serialized_graph(external_state_policy=ignore).numpy())
    return [
        n.op
        for n in graph.node
        if n.op in ("MapDataset", "ParallelMapDatasetV2") and "gather" in n.attr["f"].func.name
    ]


@pytest.mark.parametrize("batch_size", [200, 15_000, 16_000])  # 53 KB to 4.2 MB batches
def test_batches_are_gathered_one_at_a_time(tmp_path, batch_size):
    """Gathers in parallel left `fit`'s step less of the CPU: 15-20 % slower on 12.5 MB
    batches, 2.4 % on 0.8 MB ones (docs/benchmarks.md). The gather is a plain `map`, run
    read by the prefetch, whatever the batches' size."""
    d = str(tmp_path / "ds")
    x = np.arange(50 * 64, dtype=np.float32).reshape(50, 64)
    ArraysToRecords.from_arrays(x, np.arange(50, dtype=np.int64), d, verbose=0)
    src = TFRecordSequenceSource(d, batch_size=batch_size, shuffle=False)
    assert src.access == "samples"
    assert _gather_ops(src) == ["MapDataset"]
    (xb, yb), *_ = list(tf.data.Dataset.__iter__(src))
    np.testing.assert_array_equal(xb.numpy(), x)
    np.testing.assert_array_equal(yb.numpy(), np.arange(50))


@pytest.mark.parametrize(
    ("batch_size", "depth"),
    [(1, 32), (200, 32), (2_000, 3), (15_000, 2), (1_000_000, 2)],  # 264 B a sample
)
def test_sample_mode_prefetches_a_bounded_number_of_batches(tmp_path, batch_size, depth):
    """AUTOTUNE grows a prefetch buffer as long as an epoch runs (up to half the RAM), so
    a larger data set held more batches; sample mode prefetches 2 MB of batches (2 to 32)."""
    d = str(tmp_path / "ds")
    x = np.zeros((50, 64), np.float32)
    ArraysToRecords.from_arrays(x, np.arange(50, dtype=np.int64), d, verbose=0)
    src = TFRecordSequenceSource(d, batch_size=batch_size)
    assert src.access == "samples"
    assert _prefetch_depths(src) == [depth]
    blocks = TFRecordSequenceSource(d, batch_size=batch_size, access="blocks")
    assert -1 in _prefetch_depths(blocks)  # block mode keeps AUTOTUNE (bursty pools)


TRUNCATE_CHILD = """
import os, sys
import numpy as np

how, where, shard, cut = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if how == "np.memmap":  # the peer: the same memory map, without keras-tfr
    a = np.load(where, mmap_mode="r")
    first = float(a[:64].sum())
    os.truncate(where, cut)
    print(float(a[-64:].sum()))
else:
    from keras_tfr import TFRecordSequenceSource
    from keras_tfr.read import mapped

    # Units of 4 batches, so that most of the epoch is still to be read when the shard is
    # cut: the readers run only a few units ahead.
    mapped._UNIT_BYTES = 4 * 64 * 1024
    mapped._LATTICE_UNIT_ROWS = 256
    if how.startswith("tf.data"):  # the pipeline `fit` runs
        TFRecordSequenceSource._tensor_direct = lambda self: False
    src = TFRecordSequenceSource(where, batch_size=64, seed=0)
    it = iter(src.as_numpy_iterator() if how == "numpy" else src)
    next(it)
    os.truncate(shard, cut)  # in place, as `open(path, "w")` or `cp` over it would
    print(sum(1 for _ in it))
print("finished")
"""


@pytest.mark.subprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGBUS as Linux sends it")
@pytest.mark.parametrize("how", ["np.memmap", "tensors", "tf.data", "tf.data-buffers", "numpy"])
def test_shard_truncated_in_place_mid_epoch_ends_the_process_as_for_np_memmap(tmp_path, how):
    """What docs/reliability.md says of a shard truncated *in place* while an epoch reads
    it: the process gets SIGBUS, as it does with `np.memmap`; nothing else is damaged, and
    the next source names the truncated shard."""
    import hashlib
    import signal
    import subprocess

    x = np.random.default_rng(4).standard_normal((16_000, 256)).astype(np.float32)
    if how == "np.memmap":
        where = shard = str(tmp_path / "x.npy")
        np.save(where, x)
        cut = 4096
    else:
        where = str(tmp_path / "ds")
        lattice = how != "tf.data-buffers" and how != "numpy"
        m = ArraysToRecords.from_arrays(x, None, where, min_shards=4, lattice=lattice, verbose=0)
        assert (m.lattice is not None) == lattice
        shard = m.shard_path(m.shards[2])
        cut = m.record_bytes + 16 + 5  # one whole record, then 5 bytes of the next
        others = {
            p: hashlib.sha256(Path(p).read_bytes()).hexdigest()
            for p in (m.shard_path(s) for s in m.shards)
            if p != shard
        }
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run(
        [sys.executable, "-c", TRUNCATE_CHILD, how, where, shard, str(cut)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == -signal.SIGBUS, (out.returncode, out.stderr[-3000:])
    assert "finished" not in out.stdout
    assert os.path.getsize(shard) == cut
    if how == "np.memmap":
        return
    # The other shards are as written, and a new source refuses the data set, naming the
    # shard that was cut and its size.
    for p, digest in others.items():
        assert hashlib.sha256(Path(p).read_bytes()).hexdigest() == digest, p
    name = os.path.basename(shard)
    with pytest.raises(ShardError, match=f"{name}: {cut} bytes, the manifest records"):
        TFRecordSequenceSource(where, batch_size=64, seed=0)


def test_units_and_prefetch_are_as_the_readme_says(tmp_path, monkeypatch):
    """README, sample mode: on a lattice Python works out units of 8,192 samples or more
    (one call each), batches are gathered one at a time, and 2 MB of batches (2 to 32)
    are prefetched."""
    from keras_tfr import source as source_module

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    text = " ".join(readme.split())
    assert "each unit of 8,192 samples or more" in text and mapped._LATTICE_UNIT_ROWS == 8192
    assert "Batches are gathered one at a time, in a plain `map` the prefetch reads" in text
    assert "2 MB of batches (2 to 32 batches) are prefetched" in text
    assert source_module._PREFETCH_BYTES == 2 << 20
    assert source_module._PREFETCH_BATCHES == (2, 32)
    assert "checked by up to 8 threads at once" in text and mapped._CHECK_THREADS == 8

    n = 20_000
    x = np.random.default_rng(1).standard_normal((n, 64)).astype(np.float32)
    d = str(tmp_path / "ds")
    m = ArraysToRecords.from_arrays(x, None, d, min_shards=2, verbose=0)
    assert m.lattice is not None
    calls = []
    original = mapped.Epoch.row_block
    monkeypatch.setattr(
        mapped.Epoch, "row_block", lambda self, i: calls.append(i) or original(self, i)
    )
    for batch_size in (8, 64, 4096):
        src = TFRecordSequenceSource(d, batch_size=batch_size, seed=0)
        calls.clear()
        assert sum(len(b) for b in src) == n
        rows = src._mapped_plan.lattice_unit_rows
        assert rows >= 8192 or rows >= n
        # Units of `rows`; the rest is cut in two: its whole batches, then the partial one.
        whole, rest = divmod(n, rows)
        units = whole + int(rest >= batch_size) + int(rest % batch_size > 0)
        assert len(calls) == units and units <= -(-n // 8192) + 1, "one Python call per unit"
        batch_bytes = batch_size * 64 * 4
        assert src._prefetch_batches() == max(2, min(32, (2 << 20) // batch_bytes))


def _spy_checks(monkeypatch, problem_in_helper: str | None = None):
    """Records which thread checks each record; with ``problem_in_helper``, every record a
    helper thread checks is reported damaged with that problem."""
    calls: list[tuple[int, str]] = []
    lock = threading.Lock()
    original = mapped.MappedPlan._check_record

    def spy(self, record):
        name = threading.current_thread().name
        with lock:
            calls.append((record, name))
        time.sleep(0.002)  # as a disk would: the reader cannot check them all alone first
        if problem_in_helper is not None and name == "keras_tfr_check":
            return problem_in_helper
        return original(self, record)

    monkeypatch.setattr(mapped.MappedPlan, "_check_record", spy)
    return calls


def _many_records(tmp_path):
    x = np.random.default_rng(4).standard_normal((800, 16)).astype(np.float32)
    y = np.arange(800, dtype=np.int64)
    d = str(tmp_path / "many")
    m = ArraysToRecords.from_arrays(x, y, d, samples_per_record=4, verbose=0)
    assert m.total_records == 200
    return d, x, y


def test_first_checks_are_shared_with_helper_threads_each_record_once(tmp_path, monkeypatch):
    """A unit that touches many unchecked records has them checked by a pool of threads
    beside the reader (reads from a cold page cache wait on the disk in parallel), each
    record once, before any of its samples is handed out."""
    d, x, _ = _many_records(tmp_path)
    calls = _spy_checks(monkeypatch)
    src = TFRecordSequenceSource(d, batch_size=800, shuffle=True, seed=0)  # one unit
    (bx, by), *_ = list(src.as_numpy_iterator())
    np.testing.assert_array_equal(bx, x[by])
    records = sorted(r for r, _ in calls)
    assert records == list(range(200))  # each once
    helpers = {name for _, name in calls} - {threading.current_thread().name}
    assert "keras_tfr_check" in helpers
    assert len([1 for _, name in calls if name == "keras_tfr_check"]) >= mapped._CLAIM
    list(src.as_numpy_iterator())  # the next epoch: nothing checked again
    assert len(calls) == 200


@pytest.mark.parametrize("on_corrupt", ["raise", "skip"])
def test_damage_found_by_a_helper_thread_reaches_the_caller(tmp_path, monkeypatch, on_corrupt):
    d, _, _ = _many_records(tmp_path)
    calls = _spy_checks(monkeypatch, problem_in_helper="damaged (found by a helper)")
    kw = {"max_corrupt_records": 0} if on_corrupt == "skip" else {}
    src = TFRecordSequenceSource(d, batch_size=800, seed=0, on_corrupt=on_corrupt, **kw)
    with pytest.raises(
        CorruptRecordError, match=r"damaged \(found by a helper\)|more than max_corrupt_records=0"
    ):
        list(src.as_numpy_iterator())
    assert any(name == "keras_tfr_check" for _, name in calls)


def _mappings_of(path: str) -> int:
    """How many mappings of ``path`` this process has (lines of /proc/self/maps)."""
    real = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.rstrip().endswith(real))


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux's /proc")
def test_sources_over_the_same_shards_share_one_mapping(data):
    """The training and validation subsets (and re-batched copies) map each shard once:
    each mapping counts in RSS, so two made a 2 GB data set show as 4 GB."""
    d, _, y = data
    m = Manifest.load(d)
    kw = {"seed": 0, "validation_split": 0.2}
    train = TFRecordSequenceSource(d, batch_size=10, subset="training", **kw)
    val = TFRecordSequenceSource(d, batch_size=10, subset="validation", **kw)
    wider = train.with_batch_size(32)
    got = [_epoch(s) for s in (train, val, wider)]
    assert sorted(np.concatenate(got[:2]).tolist()) == y.tolist()
    regions = {id(s._mapped_plan.region()) for s in (train, val, wider)}
    assert len(regions) == 1
    for shard in m.shards:
        assert _mappings_of(m.shard_path(shard)) == 1


@pytest.mark.parametrize("how", ["in_place", "replaced"])
def test_a_shard_changed_is_checked_again_by_every_source_sharing_it(data, how):
    """One source's epoch start maps a changed shard again; every other source over it
    checks it again too, at its next epoch or (mid-epoch) at its next unit."""
    d, _, _ = data
    m = Manifest.load(d)
    path = m.shard_path(m.shards[1])
    first = TFRecordSequenceSource(d, batch_size=10, seed=0)
    second = TFRecordSequenceSource(d, batch_size=10, seed=1)
    _epoch(first), _epoch(second)  # every record checked by each
    frame = m.record_bytes + 16
    if how == "in_place":
        _flip_in_place(path, 2 * frame + 40)
    else:
        _replace_flipped(path, 2 * frame + 40)
    with pytest.raises(CorruptRecordError):
        _epoch(first)  # maps the shard again (the shared region), checks it
    with pytest.raises(CorruptRecordError) as e:
        _epoch(second)  # its own checks were of the old file
    assert e.value.file == path and e.value.offset == 2 * frame


def test_a_source_mid_epoch_checks_a_shard_another_source_mapped_again(tmp_path):
    """Mid-epoch, the Python reader looks at the shared region's remap count before each
    unit: records of a shard mapped again by another source are checked before use."""
    x = np.random.default_rng(7).standard_normal((4000, 16)).astype(np.float32)
    d = str(tmp_path / "ds")
    m = ArraysToRecords.from_arrays(x, None, d, samples_per_record=20, min_shards=4, verbose=0)
    path = m.shard_path(m.shards[0])
    reading = TFRecordSequenceSource(d, batch_size=100, shuffle=False)
    starter = TFRecordSequenceSource(d, batch_size=100, shuffle=False)
    it = reading.as_numpy_iterator()
    next(it)  # mid-epoch: the first unit's records checked
    _replace_flipped(path, 5 * (m.record_bytes + 16) + 40)
    with pytest.raises(CorruptRecordError):
        list(starter.as_numpy_iterator())  # its epoch start maps shard 0 again
    assert reading._mapped_plan.region().remaps == 1
    plan = reading._mapped_plan
    ids = np.arange(5 * m.samples_per_record, 6 * m.samples_per_record)
    with pytest.raises(ValueError, match="CRC"):
        plan.good_samples(ids, 0, 99)  # the next unit of `reading` touching record 5


def test_a_dropped_source_unmaps_its_shards_though_checking_threads_helped(tmp_path):
    # The process's checking threads outlive every source; each kept its last job (a
    # bound method of the plan) while it waited for the next, and with it the mapping:
    # the dropped source's pages stayed in the RSS, a deleted shard's disk space taken.
    import weakref

    d = str(tmp_path / "ds")
    x = np.arange(640 * 4, dtype=np.float32).reshape(640, 4)
    ArraysToRecords.from_arrays(x, np.arange(640), d, samples_per_record=10, verbose=0)
    src = TFRecordSequenceSource(d, batch_size=64, seed=0)
    assert len(src._manifest.shards) and src._manifest.total_records == 64  # 7 helpers
    got = np.concatenate([b[0] for b in src.as_numpy_iterator()])
    assert np.array_equal(np.sort(got[:, 0]), x[:, 0])
    helped = {t.ident for t in threading.enumerate() if t.name == "keras_tfr_check"}
    assert helped, "the checks ran on the shared checking threads"
    region = weakref.ref(src._mapped_plan.region())
    del src, got
    gc.collect()  # the source, which takes its functions out of TensorFlow's list
    gc.collect()  # then they, and the plan they refer to
    assert region() is None
    with open("/proc/self/maps") as maps:
        assert not [line for line in maps if d in line]


@pytest.mark.parametrize("read_first", [True, False])
def test_a_copy_made_from_a_manifest_since_written_again_refuses_the_new_shards(
    tmp_path, read_first
):
    # A copy (`replace`) keeps its source's manifest. Once another source had mapped the
    # shards written again (same names and sizes), the copy trusted that mapping: its
    # records pass their own checks, and it read the new data under the old manifest.
    d = str(tmp_path / "ds")

    def write(tag):
        x = np.full((2000, 16), float(tag), np.float32)
        y = np.full(2000, tag, np.int64)
        ArraysToRecords.from_arrays(
            x, y, d, shard_size="64KB", record_size="8KB", verbose=0, overwrite=True
        )

    def labels(src):
        return {int(v) for b in src.as_numpy_iterator() for v in b[1]}

    write(1)
    old = TFRecordSequenceSource(d, batch_size=500, seed=0)
    if read_first:
        assert labels(old) == {1}
    write(2)
    if read_first:  # another source maps the new shards first
        assert labels(TFRecordSequenceSource(d, batch_size=500, seed=0)) == {2}
    stale = old.replace(validation_split=0.1, subset="validation")
    with pytest.raises(CorruptRecordError, match="no longer holds the records its manifest"):
        labels(stale)


@pytest.mark.parametrize("lattice", [True, False])
def test_running_out_of_memory_maps_is_an_error_that_says_so(tmp_path, monkeypatch, lattice):
    # Linux allows a process vm.max_map_count maps (65,530 by default); sample mode takes
    # one per shard. Out of them, shards were counted as damaged ("cannot be memory-mapped
    # (Cannot allocate memory)") and the next error was "can't start new thread".
    import ctypes
    import errno
    import mmap as mmap_module

    d = str(tmp_path / "ds")
    x = np.arange(400, dtype=np.float32).reshape(100, 4)
    ArraysToRecords.from_arrays(x, np.arange(100), d, lattice=lattice, verbose=0)
    real = mapped._libc()

    class OutOfMaps:
        def __getattr__(self, name):
            return getattr(real, name)

        def mmap(self, addr, length, prot, flags, fd, offset):
            if fd >= 0 and flags & mmap_module.MAP_SHARED:
                ctypes.set_errno(errno.ENOMEM)
                return ctypes.c_void_p(-1).value
            return real.mmap(addr, length, prot, flags, fd, offset)

    monkeypatch.setattr(mapped, "_libc", lambda: OutOfMaps())
    with pytest.raises(OSError, match=r"out of memory maps .*access='blocks'") as info:
        src = TFRecordSequenceSource(d, batch_size=10, seed=0, access="samples")
        next(src.as_numpy_iterator())
    assert info.value.errno == errno.ENOMEM
    assert "shard-00000.tfrecord" in str(info.value)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages as Linux maps them")
@pytest.mark.parametrize(
    ("width", "samples", "window", "huge"),
    [
        (64, 16000, None, True),  # 256-byte samples: shards of 1 MB in slots of 2 MB
        (196, 1000, None, False),  # 784 bytes (16 x 49): slots of 98 MB for 0.2 MB shards
        (64, 16000, "1MB", False),  # read in windows: a touch would map its whole 2 MB
    ],
)
def test_shards_start_on_huge_page_boundaries_where_that_costs_little(
    tmp_path, width, samples, window, huge
):
    """The kernel maps a huge page of the page cache whole (one TLB entry for 2 MB) only
    where the mapping starts on a 2 MB boundary. Shards are placed so where that costs at
    most twice the address space, and not for reading in windows: each sample touched
    would map its whole 2 MB, and the pages kept mapped grew with the data."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((samples, width)).astype(np.float32)
    y = np.arange(samples, dtype=np.int64)
    d = str(tmp_path / "ds")
    m = ArraysToRecords.from_arrays(x, y, d, samples_per_record=128, min_shards=4, verbose=0)
    assert m.lattice is not None and len(m.shards) >= 4
    src = TFRecordSequenceSource(d, batch_size=100, shuffle=False)
    if window is not None:
        src = TFRecordSequenceSource(d, batch_size=100, shuffle=True, shuffle_window=window)
        assert src._order.windowed
    region = src._mapped_plan.region()
    assert region.huge is huge
    piece = 2 << 20
    aligned = region.base % piece == 0 and all(int(s) % piece == 0 for s in region.starts)
    assert aligned is huge
    xs, ys = zip(*src.as_numpy_iterator())
    order = np.argsort(np.concatenate(ys))
    assert np.concatenate(xs)[order].tobytes() == x.tobytes()
    assert np.array_equal(np.concatenate(ys)[order], y)
    xs, ys = zip(*((a.numpy(), b.numpy()) for a, b in src))  # TensorFlow's gather
    order = np.argsort(np.concatenate(ys))
    assert np.concatenate(xs)[order].tobytes() == x.tobytes()
