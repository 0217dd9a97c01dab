"""The writer's size options are kept, never silently ignored: `shard_size` bounds every
shard (records shrink to fit one), and `min_shards` splits the data or is refused."""

from __future__ import annotations

import os

import numpy as np
import pytest

from keras_tfr import ArraysToRecords, TFRecordSequenceSource
from keras_tfr.manifest import Manifest


def _images(n=80, seed=0):
    """n samples of 28x28 float32 (3,136 bytes each) and int64 labels."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 28, 28)).astype(np.float32), np.arange(n, dtype=np.int64)


def _read_all(d):
    src = TFRecordSequenceSource(d, batch_size=16, shuffle=False)
    xs, ys = zip(*((x.numpy(), y.numpy()) for x, y in src))
    return np.concatenate(xs), np.concatenate(ys)


def _check_shards_fit(d, shard_size):
    m = Manifest.load(d)
    sizes = [os.path.getsize(m.shard_path(s)) for s in m.shards]
    assert max(sizes) <= shard_size, (sizes, shard_size)
    return m


def _batches(x, y, size=7):
    for i in range(0, len(x), size):
        yield x[i : i + size], y[i : i + size]


# ------------------------------------------------------------------ shard_size


@pytest.mark.parametrize("how", ["from_arrays", "incremental", "iterable"])
def test_shard_size_below_the_record_size_is_kept(tmp_path, how):
    # 80 x 3,136 bytes = 251 KB: one 1 MB default record would hold all of it.
    x, y = _images()
    d = str(tmp_path / "ds")
    if how == "from_arrays":
        ArraysToRecords.from_arrays(x, y, d, shard_size=20000, verbose=0)
    elif how == "incremental":
        with ArraysToRecords(d, shard_size=20000, verbose=0) as w:
            for xb, yb in _batches(x, y):
                w.write(xb, yb)
    else:
        ArraysToRecords.from_arrays(_batches(x, y), d, shard_size=20000, verbose=0)
    m = _check_shards_fit(d, 20000)
    # (3,136 + 8) bytes per sample: 6 samples and their framing fit in 20,000 bytes, 7 do not.
    assert m.samples_per_record == 6
    assert len(m.shards) >= 14
    xs, ys = _read_all(d)
    assert xs.tobytes() == x.tobytes() and ys.tobytes() == y.tobytes()


def test_records_shrink_to_the_largest_that_fits(tmp_path):
    x, y = _images(40)
    for shard_size in (3300, 6500, 12000):
        d = str(tmp_path / f"ds{shard_size}")
        m = ArraysToRecords.from_arrays(x, y, d, shard_size=shard_size, min_shards=1, verbose=0)
        _check_shards_fit(d, shard_size)
        # One more sample per record would not fit in a shard.
        bigger = str(tmp_path / f"big{shard_size}")
        with pytest.raises(ValueError, match="`samples_per_record="):
            ArraysToRecords.from_arrays(
                x, y, bigger, shard_size=shard_size, samples_per_record=m.samples_per_record + 1
            )


def test_a_sample_larger_than_a_shard_is_refused_naming_both_sizes(tmp_path):
    x, y = _images(10)
    d = str(tmp_path / "ds")
    with pytest.raises(ValueError, match=r"shard_size=2000 bytes") as e:
        ArraysToRecords.from_arrays(x, y, d, shard_size=2000, verbose=0)
    assert "one sample" in str(e.value) and "3144 bytes of data" in str(e.value)
    assert not os.path.exists(d), "refused before the directory was created"
    with (
        pytest.raises(ValueError, match=r"shard_size=2000 bytes"),
        ArraysToRecords(d, shard_size=2000, verbose=0) as w,
    ):
        w.write(x, y)


def test_explicit_samples_per_record_that_does_not_fit_is_refused(tmp_path):
    x, y = _images(10)
    with pytest.raises(ValueError, match=r"samples_per_record=8.*Received: shard_size=20000"):
        ArraysToRecords.from_arrays(
            x, y, str(tmp_path / "ds"), shard_size=20000, samples_per_record=8, verbose=0
        )


def test_refused_sizes_leave_the_old_dataset_intact(make_dataset):
    x, y = _images(20)
    d = make_dataset(x, y)
    before = sorted(os.listdir(d))
    with pytest.raises(ValueError, match="shard_size"):
        ArraysToRecords.from_arrays(x, y, d, shard_size=1000, overwrite=True, verbose=0)
    assert sorted(os.listdir(d)) == before
    xs, ys = _read_all(d)
    assert xs.tobytes() == x.tobytes() and ys.tobytes() == y.tobytes()


def test_variable_length_records_shrink_to_the_shard_size(tmp_path):
    rng = np.random.default_rng(0)
    seqs = [rng.standard_normal(int(rng.integers(90, 110))).astype(np.float32) for _ in range(60)]
    d = str(tmp_path / "ds")
    m = ArraysToRecords.from_arrays(
        seqs, np.arange(60), d, variable_length="x", shard_size=3000, verbose=0
    )
    assert m.samples_per_record < 8  # ~400 bytes per sample: the 1 MB default would hold all
    assert len(m.shards) >= 8


# ------------------------------------------------------------------ min_shards


def test_from_arrays_writes_at_least_8_shards_by_default(tmp_path):
    x, y = _images(40)
    m = ArraysToRecords.from_arrays(x, y, str(tmp_path / "ds"), samples_per_record=4, verbose=0)
    assert len(m.shards) == 10  # 10 records: at least 8 shards, whole records each


def test_incremental_writer_splits_by_min_shards_with_expected_samples(tmp_path):
    x, y = _images(40)
    d = str(tmp_path / "ds")
    with ArraysToRecords(
        d, samples_per_record=4, min_shards=5, expected_samples=40, verbose=0
    ) as w:
        for xb, yb in _batches(x, y):
            w.write(xb, yb)
    assert len(w.manifest.shards) == 5


def test_min_shards_without_a_known_total_is_refused(tmp_path):
    x, y = _images(40)
    d = str(tmp_path / "ds")
    with pytest.raises(ValueError, match=r"`expected_samples` with `min_shards=4`"):
        ArraysToRecords(d, min_shards=4)
    with pytest.raises(ValueError, match=r"iterable of batches.*min_shards=4"):
        ArraysToRecords.from_arrays(_batches(x, y), d, min_shards=4, verbose=0)
    assert not os.path.exists(d), "refused before anything was written"
    # Its default (and 1) write shards of `shard_size` as the data comes.
    m = ArraysToRecords.from_arrays(_batches(x, y), d, samples_per_record=4, verbose=0)
    assert len(m.shards) == 1 and m.total_samples == 40


def test_readme_states_the_writer_defaults():
    import inspect
    import re
    from pathlib import Path

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    options = re.search(r"^- Options: (.*?)\n- ", readme, flags=re.M | re.S).group(1)
    stated = dict(re.findall(r"`(\w+)` \([^`]*?default `\"(\w+)\"`", options))
    assert set(stated) == {"shard_size", "record_size"}
    for fn in (ArraysToRecords.__init__, ArraysToRecords.from_arrays):
        params = inspect.signature(fn).parameters
        for name, value in stated.items():
            assert params[name].default == value, (fn.__qualname__, name)
    assert "~1 MB (`record_size`)" in readme
