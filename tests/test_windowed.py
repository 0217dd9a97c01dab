"""Sample mode's windowed shuffle (`shuffle_window`): a data set larger than memory read by
sample, window by window, with the split and the mixing of `fit(x, y, shuffle=True)`."""

from __future__ import annotations

import logging
import mmap
import threading
from pathlib import Path

import numpy as np
import pytest

from keras_tfr import ArraysToRecords, TFRecordSequenceSource
from keras_tfr import source as source_module
from keras_tfr.read import mapped
from keras_tfr.read.order import WINDOW_SAMPLES, Permutation, SampleOrder

SHARES = [
    {},
    {"validation_split": 0.2, "subset": "training"},
    {"validation_split": 0.2, "subset": "validation"},
    {"num_workers": 3, "worker_index": 2},
    {"validation_split": 0.3, "subset": "training", "num_workers": 2, "worker_index": 0},
]


@pytest.mark.parametrize("n", [1, 2, 3, 10, 1000, 70_001, (1 << 33) + 5])
def test_permutation_inverse_undoes_it(n):
    p = Permutation(n, key=(3, 4))
    rng = np.random.default_rng(0)
    x = np.arange(n) if n < 100_000 else rng.integers(0, n, 50_000)
    assert np.array_equal(p.inverse(p(x)), x)
    assert np.array_equal(p(p.inverse(x)), x)
    with pytest.raises(IndexError):
        p.inverse(np.array([n]))


def _orders(share, spr, window, batch_size=32, seed=1):
    kw = dict(seed=seed, shuffle=True, batch_size=batch_size, **share)
    windowed = SampleOrder(1003, samples_per_record=spr, window_records=window, **kw)
    return windowed, SampleOrder(1003, **kw)


@pytest.mark.parametrize("share", SHARES)
@pytest.mark.parametrize("spr, window", [(7, 5), (100, 3), (1, 1), (64, 2)])
def test_each_epoch_reads_its_share_once_in_an_order_of_seed_and_epoch(share, spr, window):
    o, plain = _orders(share, spr, window)
    assert o.windowed and o.size == plain.size
    e2 = o.epoch(2)
    assert len(e2) == o.size
    assert np.array_equal(np.sort(e2), np.sort(plain.epoch(2)))  # the same samples
    assert not np.array_equal(e2, o.epoch(3))
    # A function of (seed, epoch): a new order, asked for a piece first (a resumed epoch),
    # gives the same samples at the same positions.
    again, _ = _orders(share, spr, window)
    assert np.array_equal(again.samples(2, 64, 160), e2[64:160])
    assert np.array_equal(
        np.concatenate([again.samples(2, a, a + 96) for a in range(0, o.size, 96)]), e2
    )
    other, _ = _orders(share, spr, window, seed=2)
    assert not np.array_equal(other.epoch(2), e2)


@pytest.mark.parametrize("share", SHARES)
def test_each_window_reads_only_its_own_records(share):
    o, _ = _orders(share, spr=10, window=8, batch_size=1)
    ids = o.epoch(0)
    window = o.window_of(0, np.arange(o.size))
    assert window[0] == 0 and (np.diff(window) >= 0).all()
    assert len(np.unique(window)) > 5
    for k in np.unique(window):
        records = o.window_records_of(0, int(k))
        assert set((ids[window == k] // 10).tolist()) <= set(records.tolist())
    # Every record in exactly one window.
    n_windows = -(-o.records // 8)
    all_records = np.concatenate([o.window_records_of(0, k) for k in range(n_windows)])
    assert np.array_equal(np.sort(all_records), np.arange(o.records))


def test_a_window_covering_the_data_is_the_plain_order_and_a_window_is_capped():
    o, plain = _orders({}, spr=7, window=1000)
    assert not o.windowed
    assert np.array_equal(o.epoch(1), plain.epoch(1))
    unshuffled = SampleOrder(
        1003, seed=1, shuffle=False, batch_size=8, samples_per_record=7, window_records=2
    )
    assert not unshuffled.windowed
    big = SampleOrder(
        8 * WINDOW_SAMPLES,
        seed=0,
        shuffle=True,
        batch_size=8,
        samples_per_record=1,
        window_records=10**9,
    )
    assert big.window_records == WINDOW_SAMPLES
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert "at most 4,194,304 samples" in " ".join(readme.split())
    assert WINDOW_SAMPLES == 4_194_304


@pytest.fixture(scope="module")
def sorted_small_records(tmp_path_factory):
    """10 classes x 2,000 samples sorted by class, in 16 KB records (313 of them);
    x's first column is the sample's written index."""
    d = str(tmp_path_factory.mktemp("windowed") / "ds")
    n = 20_000
    x = np.zeros((n, 60), np.float32)
    x[:, 0] = np.arange(n)
    x[:, 1:] = np.repeat(np.arange(10, dtype=np.float32), 2000)[:, None]
    y = np.repeat(np.arange(10, dtype=np.int64), 2000)
    ArraysToRecords.from_arrays(x, y, d, record_size="16KB", verbose=0)
    return d, x, y


def _check_batches(batches, x, y, expected_ids):
    got = np.concatenate([b[0][:, 0] for b in batches]).astype(np.int64)
    assert np.array_equal(got, expected_ids)
    for bx, by in batches:  # bit for bit, features and labels together
        ids = bx[:, 0].astype(np.int64)
        assert np.array_equal(bx, x[ids]) and np.array_equal(by, y[ids])


def test_a_windowed_source_reads_every_sample_once_in_its_order(sorted_small_records):
    d, x, y = sorted_small_records
    src = TFRecordSequenceSource(d, batch_size=256, seed=5, shuffle_window="1MB")
    assert src.access == "samples" and src._order.windowed
    for epoch in range(2):
        order = src.sample_order(epoch)
        assert np.array_equal(np.sort(order), np.arange(len(x)))
        batches = [(a.numpy(), b.numpy()) for a, b in src]  # tf.data's iterator... or not
        _check_batches(batches, x, y, order)
    assert not np.array_equal(src.sample_order(0), src.sample_order(1))
    _check_batches(list(src.as_numpy_iterator()), x, y, src.sample_order(2))
    # Resumed from a batch, as `BackupAndRestore` does it.
    src.set_epoch(1, step=7)
    _check_batches(list(src.as_numpy_iterator()), x, y, src.sample_order(1)[7 * 256 :])


def test_windowed_source_through_tf_data_and_fit(sorted_small_records):
    import keras

    d, x, y = sorted_small_records
    src = TFRecordSequenceSource(d, batch_size=500, seed=5, shuffle_window="512KB")
    assert src._order.windowed
    # A transformed source runs the tf.data pipeline (TensorFlow gathers the batches).
    batches = [(a.numpy(), b.numpy()) for a, b in src.map(lambda a, b: (a, b))]
    _check_batches(batches, x, y, src.sample_order(0))
    steps = []

    class Steps(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            steps.append(batch)

    model = keras.Sequential([keras.Input((60,)), keras.layers.Dense(10)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(src, epochs=2, verbose=0, callbacks=[Steps()])
    assert np.isfinite(history.history["loss"]).all()
    assert len(steps) == 2 * len(src) == 2 * 40


def test_windows_mix_class_sorted_data_and_the_split_is_unchanged(sorted_small_records):
    d, _, y = sorted_small_records
    kw = dict(batch_size=256, seed=0, validation_split=0.1)
    train = TFRecordSequenceSource(d, subset="training", shuffle_window="2MB", **kw)
    assert train._order.windowed and train._order.window_records < train._order.records // 2
    val = TFRecordSequenceSource(d, subset="validation", shuffle_window="2MB", **kw)
    plain_val = TFRecordSequenceSource(d, subset="validation", shuffle_window=None, **kw)
    assert np.array_equal(np.sort(val.sample_order(0)), np.sort(plain_val.sample_order(0)))
    shares = np.bincount(y[val.sample_order(0)], minlength=10) / val.num_samples
    assert np.abs(shares - 0.1).max() <= 0.03
    skewed = full = 0
    for epoch in range(3):
        ids = train.sample_order(epoch)
        for b in range(len(ids) // 256):
            counts = np.bincount(y[ids[b * 256 : (b + 1) * 256]], minlength=10)
            full += 1
            skewed += counts.max() > 0.2 * 256
    assert skewed <= 0.05 * full, (skewed, full)
    # The windows matter: windows of one record (64 samples) give batches of 4 records.
    narrow = TFRecordSequenceSource(d, batch_size=256, seed=0, shuffle_window="16KB")
    assert narrow._order.window_records == 1
    ids = narrow.sample_order(0)
    batches = ids[: len(ids) // 256 * 256].reshape(-1, 256)
    skewed = [np.bincount(y[b], minlength=10).max() > 0.2 * 256 for b in batches]
    assert np.mean(skewed) > 0.9


def _spy_advice(monkeypatch, src):
    """Logs, in order, each `MappedPlan.advise` call of ``src`` (``("ahead" | "drop",
    records)``) and each unit it gathers (``("unit", i, lo, hi)``, after its gather).
    Only ``src``'s: the threads of an iterator another test left open may still read."""
    log = []
    plan = src._mapped_plan
    advise, unit = mapped.MappedPlan.advise, mapped.Epoch.unit

    def spy_advise(self, records, advice):
        if self is plan:
            kind = "ahead" if advice == mapped._MADV_WILLNEED else "drop"
            log.append((kind, np.sort(records).tolist()))
        return advise(self, records, advice)

    def spy_unit(self, i):
        out = unit(self, i)
        if self.plan is plan:
            log.append(("unit", i, *self.span(i)))
        return out

    monkeypatch.setattr(mapped.MappedPlan, "advise", spy_advise)
    monkeypatch.setattr(mapped.Epoch, "unit", spy_unit)
    return log


def _check_read_ahead_and_dropped(log, pieces, lag_rows):
    """``pieces``: per piece (window or record) its records and its stream positions
    ``[start, end)``. Each piece is read ahead once, before any unit reads it, and dropped
    once: never while a unit that reads it may still be gathering (every unit up to its
    end has been gathered, the readers working in order), and at the latest when the
    first unit starting ``lag_rows`` past its end is gathered (the rest when the epoch
    ends)."""
    owner = {r: k for k, (records, _, _) in enumerate(pieces) for r in records}
    ahead_at, drop_at = {}, {}
    for t, entry in enumerate(log):
        if entry[0] != "unit":
            seen = ahead_at if entry[0] == "ahead" else drop_at
            for k in {owner[r] for r in entry[1]}:
                assert k not in seen, (entry[0], k)  # once
                seen[k] = t
    units = [(t, e[2], e[3]) for t, e in enumerate(log) if e[0] == "unit"]
    assert sorted(ahead_at) == sorted(drop_at) == list(range(len(pieces)))
    for k, (_records, start, end) in enumerate(pieces):
        assert all(t > ahead_at[k] for t, lo, hi in units if lo < end and hi > start)
        assert all(t < drop_at[k] for t, lo, hi in units if lo < end)  # all gathered
        due = [t for t, lo, _ in units if lo >= end + lag_rows]
        if due:
            assert drop_at[k] < due[0]


def test_windows_are_read_ahead_and_dropped_once_read(sorted_small_records, monkeypatch):
    d, _, _ = sorted_small_records
    # Units of 4 batches, their order computed one unit at a time (on large data a window
    # spans many units: here the whole epoch would be one).
    monkeypatch.setattr(mapped, "_UNIT_BYTES", 256 << 10)
    monkeypatch.setattr(mapped, "_ORDER_ROWS", 1024)
    src = TFRecordSequenceSource(d, batch_size=256, seed=0, shuffle_window="256KB")
    order = src._order
    log = _spy_advice(monkeypatch, src)
    list(src.as_numpy_iterator())
    _, starts = order._epoch_windows(0)
    pieces = [
        (order.window_records_of(0, k).tolist(), int(starts[k]), int(starts[k + 1]))
        for k in range(order.window_count)
    ]
    assert len(pieces) > 4 and src._mapped_plan.unit_rows == 1024
    # Dropped as soon as the readers' units in flight are past it.
    _check_read_ahead_and_dropped(log, pieces, src._mapped_plan.readers * 1024)
    # ... not all at the end: most of the windows while the epoch is read.
    last_unit = max(t for t, e in enumerate(log) if e[0] == "unit")
    drops = [t for t, e in enumerate(log) if e[0] == "drop"]
    assert len([t for t in drops if t < last_unit]) >= len(pieces) // 2


def test_auto_windows_data_larger_than_half_of_memory(sorted_small_records, monkeypatch, caplog):
    d, _, _ = sorted_small_records
    total = TFRecordSequenceSource(d, batch_size=64)._manifest.total_bytes
    monkeypatch.setattr(source_module, "_memory_bytes", lambda: 4 * total)
    assert not TFRecordSequenceSource(d, batch_size=64)._order.windowed
    monkeypatch.setattr(source_module, "_memory_bytes", lambda: total)
    with caplog.at_level(logging.INFO, logger="keras_tfr"):
        src = TFRecordSequenceSource(d, batch_size=64, seed=0)
    assert src.access == "samples" and src._order.windowed
    window = 1 << ((total // 8).bit_length() - 1)  # an eighth of memory, a power of two
    assert window <= total // 8 < 2 * window
    assert src._order.window_records == window // src._manifest.record_bytes
    assert "shuffled in windows" in caplog.text and "larger than half of the memory" in caplog.text
    assert not TFRecordSequenceSource(d, batch_size=64, shuffle_window=None)._order.windowed
    assert not TFRecordSequenceSource(d, batch_size=64, shuffle=False)._order.windowed


@pytest.mark.parametrize("version", [1, 2])
def test_a_containers_memory_limit_counts_as_the_memory(tmp_path, monkeypatch, version):
    proc = tmp_path / "cgroup"
    root = tmp_path / "fs"
    if version == 2:
        proc.write_text("0::/job/7\n")
        (root / "job" / "7").mkdir(parents=True)
        limit_file = root / "job" / "7" / "memory.max"
    else:
        proc.write_text("5:cpu,cpuacct:/job/7\n4:memory:/job/7\n")
        (root / "memory" / "job" / "7").mkdir(parents=True)
        limit_file = root / "memory" / "job" / "7" / "memory.limit_in_bytes"
    limit_file.write_text("2147483648\n")
    assert source_module.cgroup_memory_limit(str(proc), str(root)) == 2 << 30
    # A container's namespace shows its own cgroup as the root.
    hidden = tmp_path / "hidden"
    hidden.write_text(proc.read_text().replace("/job/7", "/elsewhere"))
    top = limit_file.parent.parent.parent / limit_file.name
    top.write_text("1073741824\n")
    assert source_module.cgroup_memory_limit(str(hidden), str(root)) == 1 << 30
    top.unlink()
    limit_file.write_text("max\n")  # v2's "no limit"
    assert source_module.cgroup_memory_limit(str(proc), str(root)) == 0
    assert source_module.cgroup_memory_limit(str(tmp_path / "missing"), str(root)) == 0
    # The lower of the machine's memory and the cgroup's limit.
    monkeypatch.setattr(source_module, "cgroup_memory_limit", lambda: 1 << 30)
    assert source_module._memory_bytes() == 1 << 30
    monkeypatch.setattr(source_module, "cgroup_memory_limit", lambda: 1 << 62)
    assert 0 < source_module._memory_bytes() < 1 << 62


@pytest.mark.parametrize("share", [s for s in SHARES if "validation_split" in s])
@pytest.mark.parametrize("chunk", [50, 1 << 20])
@pytest.mark.parametrize("kept", [True, False])
def test_unshuffled_with_windows_reads_a_subset_in_written_order(share, chunk, kept, monkeypatch):
    """Unshuffled, a split's subset is read in written order, the samples the split's
    permutation picked; where windows are asked for, that read is a scan (its records
    read ahead and dropped), not random reads from disk. A subset of up to
    `WINDOW_SAMPLES` samples is worked out once and kept; a larger one step by step."""
    from keras_tfr.read import order as order_module

    monkeypatch.setattr(order_module, "_COUNT_CHUNK", chunk)  # records looked at per step
    if not kept:
        monkeypatch.setattr(order_module, "WINDOW_SAMPLES", 100)
    kw = dict(seed=1, shuffle=False, batch_size=32, **share)
    o = SampleOrder(10_003, samples_per_record=7, window_records=5, **kw)
    plain = SampleOrder(10_003, **kw)
    assert o.in_written_order and o.scan and not o.windowed
    assert plain.in_written_order and not plain.scan
    e = o.epoch(0)
    assert (np.diff(e) > 0).all() and np.array_equal(e, plain.epoch(0))
    picked = plain.subset_samples(np.arange(plain.size, dtype=np.int64))
    assert np.array_equal(e, np.sort(picked))
    pieces = [o.samples(0, a, a + 64) for a in range(0, o.size, 64)]
    assert np.array_equal(np.concatenate(pieces), e)
    assert (o._written is not None) == kept
    monkeypatch.undo()
    whole = SampleOrder(10_003, samples_per_record=7, window_records=10**6, **kw)
    assert whole.in_written_order and not whole.scan
    # Without a split, unshuffled is the written order already.
    no_split = {k: v for k, v in share.items() if k in ("num_workers", "worker_index")}
    kw = dict(seed=1, shuffle=False, batch_size=32, **no_split)
    o = SampleOrder(10_003, samples_per_record=7, window_records=5, **kw)
    assert not o.in_written_order and not o.scan and (np.diff(o.epoch(0)) == 1).all()


def test_an_unshuffled_validation_subset_of_windowed_data_is_a_scan(sorted_small_records):
    d, x, y = sorted_small_records
    kw = dict(batch_size=256, seed=0, validation_split=0.1, subset="validation", shuffle=False)
    val = TFRecordSequenceSource(d, shuffle_window="1MB", **kw)
    plain = TFRecordSequenceSource(d, shuffle_window=None, **kw)
    order = val.sample_order(0)
    assert np.array_equal(order, np.sort(plain.sample_order(0)))
    _check_batches(list(val.as_numpy_iterator()), x, y, order)


@pytest.mark.parametrize("verify, passes", [("first_read", 1), ("every_epoch", 2)])
def test_windows_check_each_record_once_or_every_epoch(
    sorted_small_records, monkeypatch, verify, passes
):
    d, x, y = sorted_small_records
    checked = []
    real = mapped.MappedPlan._check_record

    def spy(self, record):
        checked.append(record)
        return real(self, record)

    monkeypatch.setattr(mapped.MappedPlan, "_check_record", spy)
    src = TFRecordSequenceSource(d, batch_size=256, seed=0, shuffle_window="1MB", verify=verify)
    for epoch in range(2):
        _check_batches(list(src.as_numpy_iterator()), x, y, src.sample_order(epoch))
    records = src._manifest.total_records
    assert sorted(checked) == sorted(list(range(records)) * passes)


def test_a_scan_reads_records_ahead_and_drops_them_once_read(sorted_small_records, monkeypatch):
    """An unshuffled subset of windowed data (a validation subset) touches every record:
    its records are read ahead in order and dropped once the scan is past them."""
    d, x, y = sorted_small_records
    monkeypatch.setattr(mapped, "_UNIT_BYTES", 256 << 10)
    monkeypatch.setattr(mapped, "_ORDER_ROWS", 1024)
    kw = dict(batch_size=256, seed=0, validation_split=0.5, subset="validation", shuffle=False)
    src = TFRecordSequenceSource(d, shuffle_window="256KB", **kw)
    order = src._order
    assert order.in_written_order and order.scan
    log = _spy_advice(monkeypatch, src)
    _check_batches(list(src.as_numpy_iterator()), x, y, src.sample_order(0))
    # Units and order steps cut by the subset's density (a half): 2 batches.
    plan = src._mapped_plan
    assert plan.unit_rows == plan.order_rows == 512
    before = order._records_before()
    pieces = [([r], int(before[r]), int(before[r + 1])) for r in range(plan.total_records)]
    _check_read_ahead_and_dropped(log, pieces, plan.readers * 512)


@pytest.mark.parametrize("reader", ["numpy", "tf.data"])
def test_a_sparse_scan_keeps_few_records_mapped(sorted_small_records, monkeypatch, reader):
    """A 5 % validation subset of windowed data is spread over every record. Its units
    and order steps are cut by its density, so the records between the read-ahead and
    the drop behind (those the scan may have mapped) are a few units' worth, not the
    whole data set (uncut, one unit of 33 batches spanned all 313 records)."""
    d, x, y = sorted_small_records
    monkeypatch.setattr(mapped, "_UNIT_BYTES", 256 << 10)
    monkeypatch.setattr(mapped, "_ORDER_ROWS", 1024)
    monkeypatch.setattr(mapped, "_LATTICE_UNIT_ROWS", 1024)
    kw = dict(batch_size=32, seed=0, validation_split=0.05, subset="validation", shuffle=False)
    src = TFRecordSequenceSource(d, shuffle_window="256KB", num_parallel_reads=2, **kw)
    assert src._order.scan and src._order.size == 1000
    plan = src._mapped_plan
    assert plan.unit_rows == plan.lattice_unit_rows == 32  # 33 batches x 0.05: one
    held: set[int] = set()
    most = [0]
    real = mapped.MappedPlan.advise

    def spy(self, records, advice):
        if self is plan:  # not another test's iterator left open
            (held.update if advice == mapped._MADV_WILLNEED else held.difference_update)(
                records.tolist()
            )
            most[0] = max(most[0], len(held))
        return real(self, records, advice)

    monkeypatch.setattr(mapped.MappedPlan, "advise", spy)
    if reader == "numpy":
        batches = list(src.as_numpy_iterator())
    else:
        batches = [(a.numpy(), b.numpy()) for a, b in src.map(lambda a, b: (a, b))]
    _check_batches(batches, x, y, src.sample_order(0))
    records = src._manifest.total_records
    # Between the drop and the read-ahead, in units of 32 positions (about 20 written
    # samples per subset sample, 64 per record: 10 records a unit): the lag behind (the
    # 2 readers' units, and 4 more where TensorFlow gathers), the units submitted ahead
    # (the readers' and one), two order steps read ahead; a half more for the split's
    # unevenness. Uncut, the units spanned every record.
    units = (2 if reader == "numpy" else 6) + 3 + 2
    assert most[0] <= units * 10 * 3 // 2 < records


def test_records_dropped_are_rounded_out_to_what_a_fault_maps(sorted_small_records, monkeypatch):
    """`_MADV_DONTNEED` covers whole `_MAP_AROUND` blocks of the file around each record
    (a fault maps a large folio, neighbours included), within the file's mapping;
    `_MADV_WILLNEED` the records alone. Adjacent records go in one call."""
    d, _, _ = sorted_small_records
    src = TFRecordSequenceSource(d, batch_size=256, seed=0, shuffle_window="256KB")
    plan = src._mapped_plan
    region = plan.region()
    calls = []

    me = threading.get_ident()
    real = mapped._libc()

    class Libc:
        def madvise(self, addr, length, advice):
            if threading.get_ident() != me:  # another test's iterator left open
                return real.madvise(addr, length, advice)
            calls.append((addr, addr + length, advice))
            return 0

    monkeypatch.setattr(mapped, "_libc", Libc)
    block = 64 << 10
    monkeypatch.setattr(mapped, "_MAP_AROUND", block)
    last = plan.total_records - 1
    records = np.array([last, 5, 6, 40])  # 5 and 6 adjacent; the last ends its file
    frames = []
    for r in records.tolist():
        first = region.base + int(region.starts[plan.shard_of[r]])
        size = int(region.sizes[plan.shard_of[r]])
        lo = first + int(plan.index_in_shard[r]) * plan.full.frame
        frames.append((first, first + size, lo, min(lo + plan.full.frame, first + size)))
    plan.advise(records, mapped._MADV_WILLNEED)
    page = mmap.PAGESIZE
    assert [c[:2] for c in calls] == [
        (frames[1][2] - frames[1][2] % page, frames[2][3]),  # 5 and 6 in one call
        (frames[3][2] - frames[3][2] % page, frames[3][3]),
        (frames[0][2] - frames[0][2] % page, frames[0][3]),
    ]
    calls.clear()
    plan.advise(records, mapped._MADV_DONTNEED)
    assert all(c[2] == mapped._MADV_DONTNEED for c in calls) and len(calls) <= 3
    for first, end, lo, hi in frames:
        (a, b) = next((a, b) for a, b, _ in calls if a <= lo and hi <= b)  # covered
        assert first <= a and b <= end  # within the file's mapping
        assert (a - first) % block == 0 and ((b - first) % block == 0 or b == end)
        assert a > lo - block and (b < hi + block)  # rounded out, no further


def test_an_iterator_closed_mid_epoch_drops_what_it_read_ahead(sorted_small_records, monkeypatch):
    d, _, _ = sorted_small_records
    monkeypatch.setattr(mapped, "_UNIT_BYTES", 256 << 10)
    monkeypatch.setattr(mapped, "_ORDER_ROWS", 1024)
    src = TFRecordSequenceSource(d, batch_size=256, seed=0, shuffle_window="256KB")
    log = _spy_advice(monkeypatch, src)
    it = src.as_numpy_iterator()
    for _ in range(6):
        next(it)
    ahead = sorted(r for e in log if e[0] == "ahead" for r in e[1])
    assert 0 < len(ahead) < src._manifest.total_records  # not the whole epoch
    it.close()
    dropped = sorted(r for e in log if e[0] == "drop" for r in e[1])
    assert dropped == sorted(r for e in log if e[0] == "ahead" for r in e[1])


def test_tf_data_drops_each_window_once_and_the_last_when_the_next_epoch_starts(
    sorted_small_records, monkeypatch
):
    """Where TensorFlow gathers (the lattice's tf.data pipeline, what `fit` reads under
    TensorFlow), windows are dropped as units are handed out, and what an epoch kept
    (TensorFlow may still gather from its last units) when the next iterator starts."""
    d, x, y = sorted_small_records
    monkeypatch.setattr(mapped, "_UNIT_BYTES", 256 << 10)
    monkeypatch.setattr(mapped, "_LATTICE_UNIT_ROWS", 1024)
    monkeypatch.setattr(mapped, "_ORDER_ROWS", 1024)
    src = TFRecordSequenceSource(d, batch_size=256, seed=0, shuffle_window="256KB")
    order = src._order
    assert src._mapped_plan.lattice_unit_rows == 1024
    log = _spy_advice(monkeypatch, src)
    windows = [sorted(order.window_records_of(0, k).tolist()) for k in range(order.window_count)]

    def records(kind, entries):
        return sorted(r for e in entries if e[0] == kind for r in e[1])

    batches = [(a.numpy(), b.numpy()) for a, b in src.map(lambda a, b: (a, b))]  # epoch 0
    _check_batches(batches, x, y, src.sample_order(0))
    assert records("ahead", log) == sorted(r for w in windows for r in w)  # each once
    dropped = records("drop", log)
    assert len(set(dropped)) == len(dropped)  # at most once
    assert len(dropped) >= len(windows) // 2 * len(windows[0])  # most while reading
    left = sorted(set(records("ahead", log)) - set(dropped))
    assert left  # TensorFlow may still gather from the last units: kept until ...
    seen = len(log)
    it = iter(src.map(lambda a, b: (a, b)))  # epoch 1
    next(it)
    assert left == sorted(set(records("drop", log[seen:])) & set(left))  # ... it starts
    del it  # its threads stop reading
