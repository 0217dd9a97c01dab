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


def test_one_sample_cannot_be_split(tmp_path):
    d = str(tmp_path / "ds")
    ArraysToRecords.from_arrays(np.zeros((1, 3), np.float32), np.zeros(1), d, verbose=0)
    with pytest.raises(ValueError, match="holds no samples"):
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
