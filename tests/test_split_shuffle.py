"""The split and the shuffle mean what they mean for NumPy inputs to `fit`: by sample, on
small data sets, on class-sorted arrays, in both subsets and in every epoch."""

from __future__ import annotations

import numpy as np
import pytest

from keras_tfr import ArraysToRecords, TFRecordSequenceSource


def _ys(src):
    return np.concatenate([b[1].numpy() for b in src])


@pytest.mark.parametrize("n, split", [(2, 0.5), (3, 0.1), (1003, 0.2), (2000, 0.25)])
def test_small_data_sets_split_by_sample_with_default_settings(tmp_path, n, split):
    """Written with defaults, 1,003 samples are one record; the split is by sample."""
    x = np.random.default_rng(0).standard_normal((n, 7, 5)).astype(np.float32)
    y = np.arange(n, dtype=np.int64)
    d = str(tmp_path / "ds")
    ArraysToRecords.from_arrays(x, y, d, verbose=0)
    kw = dict(batch_size=32, seed=3, validation_split=split)
    tr = TFRecordSequenceSource(d, subset="training", **kw)
    va = TFRecordSequenceSource(d, subset="validation", shuffle=False, **kw)
    n_val = max(1, int(split * n))
    assert va.num_samples == n_val and tr.num_samples == n - n_val
    ytr, yva = _ys(tr), _ys(va)
    assert len(ytr) == n - n_val and len(yva) == n_val
    assert set(ytr.tolist()).isdisjoint(yva.tolist())
    assert sorted(np.concatenate([ytr, yva]).tolist()) == list(range(n))
    for b in tr:  # the data travel with their indices
        assert np.array_equal(b[0].numpy(), x[b[1].numpy()])
    # Seeded: the same seed gives the same subsets; another seed other ones.
    assert np.array_equal(
        np.sort(_ys(TFRecordSequenceSource(d, subset="validation", **kw))), np.sort(yva)
    )
    if n > 10:
        other = TFRecordSequenceSource(d, subset="validation", **{**kw, "seed": 4})
        assert not np.array_equal(np.sort(_ys(other)), np.sort(yva))


@pytest.mark.parametrize("n, split", [(1001, 0.1), (999, 0.2), (1000, 0.1)])
def test_keras_fit_on_arrays_validates_on_the_last_rows_the_readme_says(n, split):
    """README: `fit(x, y, validation_split=v)` validates on the last
    ``n - int(n * (1 - v))`` rows of the arrays, where a source draws
    ``int(v * n)`` samples across the data set (above)."""
    import keras

    x = np.arange(n, dtype=np.float32)[:, None]
    seen = []

    class Record(keras.layers.Layer):
        def call(self, inputs, training=None):
            if not training:
                seen.append(keras.ops.convert_to_numpy(inputs)[:, 0])
            return inputs

    model = keras.Sequential([keras.Input((1,)), Record(), keras.layers.Dense(1)])
    model.compile("sgd", "mse", run_eagerly=True)
    model.fit(x, x[:, 0], batch_size=64, epochs=1, validation_split=split, verbose=0)
    rows = np.sort(np.concatenate(seen)).astype(np.int64)
    k = n - int(n * (1 - split))
    assert rows.tolist() == list(range(n - k, n))


def test_one_sample_cannot_be_split(tmp_path):
    d = str(tmp_path / "ds")
    ArraysToRecords.from_arrays(np.zeros((1, 3), np.float32), np.zeros(1), d, verbose=0)
    with pytest.raises(ValueError, match="at least 2 samples"):
        TFRecordSequenceSource(d, 4, seed=0, validation_split=0.5, subset="training")


@pytest.fixture(scope="module")
def sorted_classes(tmp_path_factory):
    """10 classes x 6,000 samples, sorted by class (as arrays built class by class are)."""
    d = str(tmp_path_factory.mktemp("sorted") / "ds")
    y = np.repeat(np.arange(10, dtype=np.int32), 6000)
    x = np.repeat(np.arange(10, dtype=np.float32), 6000)[:, None] * np.ones(16, np.float32)
    ArraysToRecords.from_arrays(x, y, d, verbose=0)
    return d


def test_class_sorted_split_is_representative(sorted_classes):
    kw = dict(batch_size=256, seed=0, validation_split=0.1)
    va = TFRecordSequenceSource(sorted_classes, subset="validation", shuffle=False, **kw)
    tr = TFRecordSequenceSource(sorted_classes, subset="training", **kw)
    yva, ytr = _ys(va), _ys(tr)
    assert len(yva) == 6000 and len(ytr) == 54000
    shares = np.bincount(yva, minlength=10) / len(yva)
    assert np.all(np.abs(shares - 0.1) <= 0.03), shares
    assert np.all(np.abs(np.bincount(ytr, minlength=10) / len(ytr) - 0.1) <= 0.03)


def test_class_sorted_shuffle_mixes_every_batch(sorted_classes):
    """At most 5 % of full batches may hold one class above 20 % (a global shuffle gives
    about 0 %), in every epoch, in both subsets."""
    src = TFRecordSequenceSource(sorted_classes, batch_size=256, seed=1)
    split = TFRecordSequenceSource(
        sorted_classes, batch_size=256, seed=1, validation_split=0.1, subset="training"
    )
    for s in (src, split):
        for _ in range(2):
            full = [b[1].numpy() for b in s if b[1].shape[0] == 256]
            skewed = [np.bincount(ys, minlength=10).max() / 256 > 0.2 for ys in full]
            assert np.mean(skewed) <= 0.05, np.mean(skewed)


# ------------------------------------------------------------------ block mode


def _subsets(d, **kw):
    kw = {"batch_size": 32, "seed": 5, "validation_split": 0.2, **kw}
    return {
        subset: TFRecordSequenceSource(d, subset=subset, **kw)
        for subset in ("training", "validation")
    }


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("compression", [None, "GZIP"])
def test_block_mode_splits_a_small_data_set_by_sample_as_sample_mode_does(
    tmp_path, compression, shuffle
):
    """1,003 samples written with defaults are one record: block mode (the default for
    compressed shards) splits them by sample, and picks the very samples sample mode
    picks for the same seed."""
    n = 1003
    x = np.random.default_rng(0).standard_normal((n, 7, 5)).astype(np.float32)
    y = np.arange(n, dtype=np.int64)
    d = str(tmp_path / "ds")
    ArraysToRecords.from_arrays(x, y, d, compression=compression, verbose=0)
    blocks = _subsets(d, shuffle=shuffle, access="blocks")
    got = {}
    for subset, src in blocks.items():
        assert src.access == "blocks"
        ys = []
        for xb, yb in src:
            assert np.array_equal(xb.numpy(), x[yb.numpy()])  # bit for bit, with its index
            ys.append(yb.numpy())
        got[subset] = np.concatenate(ys)
        assert src.num_samples == len(got[subset])
        assert len(src) == -(-len(got[subset]) // 32)
    assert len(got["validation"]) == int(0.2 * n)
    assert set(got["training"].tolist()).isdisjoint(got["validation"].tolist())
    assert sorted(np.concatenate(list(got.values())).tolist()) == list(range(n))
    if compression is None:
        for subset, src in _subsets(d, shuffle=shuffle, access="samples").items():
            if shuffle:
                assert np.array_equal(np.sort(_ys(src)), np.sort(got[subset]))
            else:  # both in written order: the very same stream
                assert np.array_equal(_ys(src), got[subset])
    if not shuffle:
        for ids in got.values():
            assert (np.diff(ids) > 0).all()
    if shuffle:  # a new order each epoch, the same samples
        again = _ys(blocks["training"])
        assert not np.array_equal(again, got["training"])
        assert np.array_equal(np.sort(again), np.sort(got["training"]))


def test_block_mode_splits_small_variable_length_data_by_sample(tmp_path):
    """Variable-length data read in block mode only; 1,003 sequences are one record."""
    rng = np.random.default_rng(1)
    n = 1003
    seqs = [rng.standard_normal((int(rng.integers(1, 9)), 5)).astype(np.float32) for _ in range(n)]
    y = np.arange(n, dtype=np.int64)
    d = str(tmp_path / "ds")
    ArraysToRecords.from_arrays(seqs, y, d, variable_length=["x"], verbose=0)
    got = {}
    for subset, src in _subsets(d, ragged="ragged").items():
        assert src.access == "blocks"
        ys = []
        for xb, yb in src:
            for row, label in zip(xb, yb.numpy()):
                assert row.numpy().tobytes() == seqs[label].tobytes()
            ys.append(yb.numpy())
        got[subset] = np.concatenate(ys)
    assert len(got["validation"]) == int(0.2 * n)
    assert sorted(np.concatenate(list(got.values())).tolist()) == list(range(n))


def test_block_mode_split_of_small_sorted_data_is_representative(tmp_path):
    d = str(tmp_path / "ds")
    y = np.repeat(np.arange(10, dtype=np.int32), 300)
    ArraysToRecords.from_arrays(y[:, None].astype(np.float32), y, d, verbose=0)
    src = TFRecordSequenceSource(
        d, 64, seed=0, validation_split=0.1, subset="validation", access="blocks"
    )
    shares = np.bincount(_ys(src), minlength=10) / 300
    assert np.all(np.abs(shares - 0.1) <= 0.03), shares


@pytest.mark.parametrize("split", [None, "training"])
def test_block_mode_shares_a_small_data_set_among_workers_as_sample_mode(tmp_path, split):
    """A data set of one record (1,003 samples) shared by 3 workers, split or not: each
    worker reads the very samples sample mode gives it, with the same step count; the
    shares are disjoint and cover the subset."""
    n = 1003
    d = str(tmp_path / "ds")
    y = np.arange(n, dtype=np.int64)
    ArraysToRecords.from_arrays(y.astype(np.float32), y, d, verbose=0)
    kw = dict(batch_size=32, seed=5, num_workers=3)
    if split:
        kw.update(validation_split=0.2, subset=split)
    shares, steps = [], set()
    for w in range(3):
        blocks = TFRecordSequenceSource(d, worker_index=w, access="blocks", **kw)
        samples = TFRecordSequenceSource(d, worker_index=w, access="samples", **kw)
        got = [b[1].numpy() for b in blocks]
        assert len(got) == len(blocks) == len(samples)
        steps.add(len(blocks))
        ids = np.concatenate(got)
        assert np.array_equal(np.sort(ids), np.sort(_ys(samples)))
        shares.append(ids)
    assert len(steps) == 1
    every = np.concatenate(shares)
    assert len(set(every.tolist())) == len(every) == (n - int(0.2 * n) if split else n)


def test_block_mode_splits_a_larger_data_set_by_record(tmp_path):
    """Past 64 records, block mode assigns whole records (every record is on one side)."""
    spr, records = 10, 80
    n = spr * records
    d = str(tmp_path / "ds")
    y = np.arange(n, dtype=np.int64)
    ArraysToRecords.from_arrays(y.astype(np.float32), y, d, samples_per_record=spr, verbose=0)
    got = {k: _ys(s) for k, s in _subsets(d, access="blocks", shuffle=False).items()}
    assert sorted(np.concatenate(list(got.values())).tolist()) == list(range(n))
    val_records = set((got["validation"] // spr).tolist())
    assert len(val_records) == round(0.2 * records)
    assert len(got["validation"]) == spr * len(val_records)  # whole records
    assert val_records.isdisjoint((got["training"] // spr).tolist())


@pytest.mark.parametrize(
    "n, spr, by_sample",
    [(320, 5, True), (325, 5, False), ((1 << 22), 1 << 20, True), ((1 << 22) + 1, 1 << 20, False)],
    ids=["64-records", "65-records", "4Mi-samples", "4Mi+1-samples"],
)
def test_block_mode_splits_by_sample_up_to_64_records_and_4mi_samples(tmp_path, n, spr, by_sample):
    """README: block mode takes samples on data sets of up to 64 records and 4 million
    (2**22) samples, whole records past either."""
    d = str(tmp_path / "ds")
    ArraysToRecords.from_arrays(
        np.zeros((n, 1), np.uint8), directory=d, samples_per_record=spr, verbose=0
    )
    src = TFRecordSequenceSource(
        d, 256, seed=0, validation_split=0.3, subset="validation", access="blocks"
    )
    by_records = {0, n % spr}  # whole records: the short last one or none of it
    assert int(0.3 * n) % spr not in by_records  # the two meanings differ here
    if by_sample:
        assert src.num_samples == int(0.3 * n)
    else:
        assert src.num_samples % spr in by_records


@pytest.mark.parametrize(
    "kw",
    [
        dict(subset="validation"),
        dict(subset="training"),
        dict(subset="validation", num_workers=3, worker_index=1),
        dict(subset="training", num_workers=2, worker_index=0, shuffle_window="64KB"),
    ],
)
def test_unshuffled_subsets_read_in_written_order(tmp_path, kw):
    """``shuffle=False`` reads in written order, a split's subset (or a worker's share of
    it) included, with or without windows: what `predict` needs to line up with the
    arrays. The subset is the one the shuffled source reads."""
    n = 5000
    d = str(tmp_path / "ds")
    y = np.arange(n, dtype=np.int64)
    x = np.random.default_rng(0).standard_normal((n, 6)).astype(np.float32)
    ArraysToRecords.from_arrays(x, y, d, samples_per_record=128, verbose=0)
    common = dict(batch_size=64, seed=7, validation_split=0.3, access="samples", **kw)
    src = TFRecordSequenceSource(d, shuffle=False, **common)
    ids = _ys(src)
    assert (np.diff(ids) > 0).all()
    assert np.array_equal(ids, src.sample_order(0)) and np.array_equal(ids, src.sample_order(3))
    assert np.array_equal(np.concatenate([b[0] for b in src.as_numpy_iterator()]), x[ids])
    shuffled = TFRecordSequenceSource(d, shuffle=True, **common)
    assert np.array_equal(np.sort(_ys(shuffled)), ids)
    import keras

    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
    np.testing.assert_allclose(
        model.predict(src, verbose=0), model.predict(x[ids], batch_size=64, verbose=0)
    )
