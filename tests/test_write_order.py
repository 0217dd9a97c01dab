"""`from_arrays(..., shuffle_seed=)`: samples written in a seeded order, so that block
mode's split and shuffle (whole records) mix class-sorted input as sample mode does."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest

from keras_tfr import ArraysToRecords, TFRecordSequenceSource, verify
from keras_tfr.manifest import MANIFEST_NAME, Manifest
from keras_tfr.read.order import WRITE_ORDER, Permutation


def _order(n, seed):
    # The key as the README gives the on-disk format, (shuffle_seed, 3): a literal, not
    # WRITE_ORDER, so that changing the constant (and every data set's order) fails here.
    return Permutation(n, key=(seed, 3))(np.arange(n))


def test_the_write_order_key_is_the_one_the_readme_gives():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert "`Permutation(total_samples, key=(shuffle_seed, 3))(i)`" in readme
    assert WRITE_ORDER == 3


def _read(d):
    src = TFRecordSequenceSource(d, batch_size=97, shuffle=False)
    xs, ys = zip(*[(bx, by) for bx, by in src.as_numpy_iterator()])
    return np.concatenate(xs), np.concatenate(ys)


def _sorted_classes(n_per_class=600, width=16):
    y = np.repeat(np.arange(10, dtype=np.int32), n_per_class)
    x = np.arange(len(y) * width, dtype=np.float32).reshape(len(y), width)
    return x, y


def test_samples_are_written_in_the_seeded_order_bit_for_bit(tmp_path):
    x, y = _sorted_classes()
    d = str(tmp_path / "ds")
    m = ArraysToRecords.from_arrays(x, y, d, shuffle_seed=7, chunk_size="20KB", verbose=0)
    assert m.shuffle_seed == 7 == Manifest.load(d).shuffle_seed
    assert json.loads(Path(d, MANIFEST_NAME).read_text())["shuffle_seed"] == 7
    xs, ys = _read(d)
    perm = _order(len(y), 7)
    assert sorted(perm.tolist()) == list(range(len(y)))
    assert xs.tobytes() == x[perm].tobytes() and ys.tobytes() == y[perm].tobytes()
    assert verify(d).ok
    assert np.array_equal(Manifest.load(d).input_indices(), perm)
    assert Manifest.load(d).input_indices([5, 0]).tolist() == [perm[5], perm[0]]
    with pytest.raises(IndexError, match=r"\[0, 6000\)"):
        Manifest.load(d).input_indices([6000])
    # Another seed, another order; no seed, the order given (and no field).
    other = str(tmp_path / "other")
    ArraysToRecords.from_arrays(x, y, other, shuffle_seed=8, verbose=0)
    assert not np.array_equal(_read(other)[1], ys)
    plain = str(tmp_path / "plain")
    assert ArraysToRecords.from_arrays(x, y, plain, verbose=0).shuffle_seed is None
    assert "shuffle_seed" not in json.loads(Path(plain, MANIFEST_NAME).read_text())
    assert _read(plain)[0].tobytes() == x.tobytes()
    assert np.array_equal(Manifest.load(plain).input_indices(), np.arange(len(y)))


def test_block_mode_mixes_class_sorted_data_written_shuffled(tmp_path):
    """10 classes sorted, 31 MB in 120 records: block mode splits by whole records, and
    shuffles in pools of 16 records (a quarter of `shuffle_memory`). Written in the order
    given, its validation subset and batches are skewed; written shuffled, the validation
    class shares are within 3 points and at most 5 % of batches hold a class above 20 %."""
    y = np.repeat(np.arange(10, dtype=np.int32), 3000)
    x = y.astype(np.float32)[:, None] * np.ones(256, np.float32)
    figures = {}
    for seed in (None, 0):
        d = str(tmp_path / f"ds-{seed}")
        ArraysToRecords.from_arrays(x, y, d, record_size="256KB", shuffle_seed=seed, verbose=0)
        assert Manifest.load(d).total_records > 64  # split by record
        kw = dict(
            batch_size=256, seed=0, validation_split=0.1, access="blocks", shuffle_memory="16MB"
        )
        va = TFRecordSequenceSource(d, subset="validation", shuffle=False, **kw)
        tr = TFRecordSequenceSource(d, subset="training", **kw)
        yva = np.concatenate([b[1].numpy() for b in va])
        off = np.abs(np.bincount(yva, minlength=10) / len(yva) - 0.1).max()
        full = [b[1].numpy() for b in tr if b[1].shape[0] == 256]
        skewed = np.mean([np.bincount(b, minlength=10).max() / 256 > 0.2 for b in full])
        figures[seed] = off, skewed
    assert figures[None][0] > 0.03 and figures[None][1] > 0.05, figures  # the problem
    assert figures[0][0] <= 0.03 and figures[0][1] <= 0.05, figures  # solved


def test_variable_length_samples_in_the_seeded_order(tmp_path):
    rng = np.random.default_rng(0)
    seqs = [
        rng.standard_normal((int(rng.integers(1, 6)), 3)).astype(np.float32) for _ in range(300)
    ]
    y = np.arange(300, dtype=np.int64)
    d = str(tmp_path / "ds")
    ArraysToRecords.from_arrays(seqs, y, d, variable_length=["x"], shuffle_seed=2, verbose=0)
    src = TFRecordSequenceSource(d, batch_size=64, shuffle=False, ragged="ragged")
    labels, rows = [], []
    for xb, yb in src:
        labels.extend(yb.numpy().tolist())
        rows.extend(r.numpy() for r in xb)
    assert labels == _order(300, 2).tolist()
    assert all(r.tobytes() == seqs[i].tobytes() for r, i in zip(rows, labels))


def test_memmap_and_h5py_inputs_in_the_seeded_order(tmp_path):
    h5py = pytest.importorskip("h5py")
    x, y = _sorted_classes(200)
    np.save(tmp_path / "x.npy", x)
    with h5py.File(tmp_path / "y.h5", "w") as f:
        f["y"] = y
    with h5py.File(tmp_path / "y.h5", "r") as f:
        xm = np.load(tmp_path / "x.npy", mmap_mode="r")
        d = str(tmp_path / "ds")
        ArraysToRecords.from_arrays(xm, f["y"], d, shuffle_seed=5, chunk_size="8KB", verbose=0)
    xs, ys = _read(d)
    perm = _order(len(y), 5)
    assert xs.tobytes() == x[perm].tobytes() and ys.tobytes() == y[perm].tobytes()


@pytest.mark.parametrize(
    "seed, error",
    [
        (-1, ValueError),
        (1 << 63, ValueError),
        ("1", TypeError),
        (1.5, TypeError),
        (True, TypeError),
    ],
)
def test_a_bad_seed_is_refused_before_writing(tmp_path, seed, error):
    d = str(tmp_path / "ds")
    with pytest.raises(error, match="shuffle_seed"):
        ArraysToRecords.from_arrays(np.zeros((8, 2)), np.zeros(8), d, shuffle_seed=seed)
    assert not os.path.exists(d)


def test_an_iterable_of_batches_cannot_be_written_shuffled(tmp_path):
    d = str(tmp_path / "ds")
    batches = ((np.zeros((4, 2)), np.zeros(4)) for _ in range(3))
    with pytest.raises(ValueError, match="Expected arrays with `shuffle_seed`"):
        ArraysToRecords.from_arrays(batches, directory=d, shuffle_seed=0)
    assert not os.path.exists(d)


def test_a_conversion_begun_in_the_given_order_is_not_resumed_shuffled(tmp_path, caplog):
    x, y = _sorted_classes(100)
    layout = dict(samples_per_record=10, shard_size=2000, chunk_size="4KB", verbose=0)
    d = str(tmp_path / "ds")

    def batches():  # the input fails after 60 samples (the disk went away)
        for i in range(0, 60, 10):
            yield x[i : i + 10], y[i : i + 10]
        raise OSError("disk went away")

    with pytest.raises(OSError, match="disk went away"):
        ArraysToRecords.from_arrays(batches(), directory=d, **layout)
    before = {n: Path(d, n).read_bytes() for n in os.listdir(d)}
    assert any(n.startswith("shard-") for n in before), "completed shards stay"
    caplog.clear()
    with (
        caplog.at_level(logging.INFO, logger="keras_tfr"),
        pytest.raises(
            ValueError,
            match=r"begun with shuffle_seed=None: .* shuffle_seed=None .*: shuffle_seed=2",
        ),
    ):
        ArraysToRecords.from_arrays(x, y, d, shuffle_seed=2, resume=True, **layout)
    assert {n: Path(d, n).read_bytes() for n in os.listdir(d)} == before
    # Refused before the shards are checked: no "resuming ... after N complete shards".
    assert not [r for r in caplog.records if "resuming" in r.getMessage()]
    ArraysToRecords.from_arrays(x, y, d, resume=True, **layout)  # in the order given: fine
    assert _read(d)[1].tobytes() == y.tobytes()


def test_an_interrupted_shuffled_conversion_resumes_with_its_seed(tmp_path):
    class Failing:
        """An array-like whose reads fail after a few chunks (the disk went away)."""

        def __init__(self, a, fail_after):
            self.a, self.shape, self.dtype = a, a.shape, a.dtype
            self.reads, self.fail_after = 0, fail_after

        def __getitem__(self, index):
            self.reads += 1
            if self.reads > self.fail_after:
                raise OSError("disk went away")
            return self.a[index]

    x, y = _sorted_classes(100)
    layout = dict(samples_per_record=10, shard_size=2000, chunk_size="4KB", verbose=0)
    d = str(tmp_path / "ds")
    with pytest.raises(OSError, match="disk went away"):
        ArraysToRecords.from_arrays(Failing(x, 6), y, d, shuffle_seed=3, **layout)
    assert not os.path.exists(os.path.join(d, MANIFEST_NAME))
    assert any(n.startswith("shard-") for n in os.listdir(d)), "completed shards stay"
    before = {n: Path(d, n).read_bytes() for n in os.listdir(d)}
    begun = r"was begun with shuffle_seed=3: its shards hold the samples in that order"
    with pytest.raises(ValueError, match=rf"{begun}.*Received: shuffle_seed=4"):
        ArraysToRecords.from_arrays(x, y, d, shuffle_seed=4, resume=True, **layout)
    with pytest.raises(ValueError, match=rf"{begun}.*Received: shuffle_seed=None"):
        ArraysToRecords.from_arrays(x, y, d, resume=True, **layout)
    # An iterable of batches, or the incremental writer, writes in the order given: the
    # rest of the seeded order cannot follow (it wrote some samples twice, others never).
    batches = ((x[i : i + 10], y[i : i + 10]) for i in range(0, len(y), 10))
    with pytest.raises(
        ValueError, match=rf"{begun}. Resume it with shuffle_seed=3 and the same arrays"
    ):
        ArraysToRecords.from_arrays(batches, directory=d, resume=True, **layout)
    with pytest.raises(ValueError, match=rf"{begun}.*Received: shuffle_seed=None"):
        ArraysToRecords(d, resume=True, **layout).write(x, y)
    assert {n: Path(d, n).read_bytes() for n in os.listdir(d)} == before
    ArraysToRecords.from_arrays(x, y, d, shuffle_seed=3, resume=True, **layout)
    ref = str(tmp_path / "ref")
    ArraysToRecords.from_arrays(x, y, ref, shuffle_seed=3, **layout)
    for name in sorted(os.listdir(ref)):
        if name.startswith("shard-"):
            assert Path(d, name).read_bytes() == Path(ref, name).read_bytes(), name
    assert Manifest.load(d).shuffle_seed == 3 and verify(d).ok
    xs, ys = _read(d)
    perm = _order(len(y), 3)
    assert xs.tobytes() == x[perm].tobytes() and ys.tobytes() == y[perm].tobytes()
