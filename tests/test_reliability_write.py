"""Writing never loses data or fails silently: bad input is refused before anything is
written, interrupted writes leave no manifest, overwrite never mixes old and new shards,
one writer per directory, and an interrupted conversion resumes bit for bit."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from keras_tfr import ArraysToRecords, TFRecordSequenceSource
from keras_tfr.errors import (
    DatasetExistsError,
    DatasetLockedError,
    IncompleteDatasetError,
    ManifestError,
)
from keras_tfr.manifest import MANIFEST_NAME, PROGRESS_NAME, Manifest
from keras_tfr.verifier import verify

LOCK_NAME = ".keras-tfr.lock"

# Small, exact layout: 4 samples per record, 3 records per shard (1000 // (record + 16)).
LAYOUT = dict(samples_per_record=4, shard_size=1000, verbose=0)


def _listdir(d):
    return os.listdir(d) if os.path.isdir(d) else []


def _data(n=200, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 16)).astype(np.float32)
    y = np.arange(n, dtype=np.int64)
    return x, y


def _dir_files(d):
    return sorted(os.listdir(d))


def _shard_bytes(d):
    m = Manifest.load(d)
    return [Path(os.path.join(d, s.file)).read_bytes() for s in m.shards]


def _manifest_json(d):
    obj = json.loads(Path(os.path.join(d, MANIFEST_NAME)).read_text())
    obj.pop("created")
    return obj


def _assert_same_dataset(a, b):
    """Bit for bit: the same manifest (but its creation time) and the same shard bytes."""
    assert _manifest_json(a) == _manifest_json(b)
    assert _shard_bytes(a) == _shard_bytes(b)
    assert verify(a).ok


def _read_all(d):
    src = TFRecordSequenceSource(d, batch_size=64, shuffle=False)
    xs, ys = zip(*[(bx.numpy(), by.numpy()) for bx, by in src])
    return np.concatenate(xs), np.concatenate(ys)


def _no_dataset_written(d):
    """Nothing a reader could take for data: no manifest, no shard, no journal."""
    if not os.path.exists(d):
        return True
    names = os.listdir(d)
    return not any(n in (MANIFEST_NAME, PROGRESS_NAME) or n.startswith("shard-") for n in names)


# ------------------------------------------------------------------ bad input, refused early


@pytest.mark.parametrize(
    "kwargs, names",
    [
        (dict(y=np.zeros(9)), ["`x`", "`y`", "x: 10", "y: 9"]),
        (dict(y=np.zeros(10), sample_weight=np.ones(11)), ["sample_weight: 11", "x: 10"]),
        (dict(y={"a": np.zeros(10), "b": np.zeros(8)}), ["y/b: 8"]),
    ],
)
def test_lengths_that_differ_are_refused_before_writing(tmp_path, kwargs, names):
    d = str(tmp_path / "ds")
    with pytest.raises(ValueError, match="same number of samples") as e:
        ArraysToRecords.from_arrays(np.zeros((10, 2), np.float32), directory=d, **kwargs)
    for name in names:
        assert name in str(e.value)
    assert not os.path.exists(d), "validated before the directory was touched"


def test_a_list_of_varying_lengths_gets_a_short_error_with_the_hint(tmp_path):
    """1,000 sequences given as a list read as 1,000 inputs (Keras' reading of a list):
    the error names a few of them, not all, and says how to write sequences."""
    rng = np.random.default_rng(0)
    seqs = [np.zeros((int(rng.integers(1, 9)), 5), np.float32) for _ in range(1000)]
    d = str(tmp_path / "ds")
    with pytest.raises(ValueError, match="same number of samples") as e:
        ArraysToRecords.from_arrays(seqs, np.zeros(1000), d, verbose=0)
    message = str(e.value)
    assert "x/0: " in message and "(1001 in all)" in message and "x/999" not in message
    assert "variable_length=['x']" in message
    assert len(message) < 400
    assert not os.path.exists(d)
    ArraysToRecords.from_arrays(seqs, np.zeros(1000), d, variable_length=["x"], verbose=0)


def _objects(*items):
    """A 1-D object array holding ``items`` as they are (NumPy would stack equal arrays)."""
    out = np.empty(len(items), dtype=object)
    for i, item in enumerate(items):
        out[i] = item
    return out


@pytest.mark.parametrize(
    "array, shown, error",
    [
        (np.zeros((4, 2), np.complex64), "complex64", TypeError),
        (np.zeros((4,), np.complex128), "complex128", TypeError),
        (np.array([{"a": 1}, None, 3, "s"], dtype=object), "object", TypeError),
        (np.array([1, 2, 3, 4], dtype=object), "object", TypeError),
        (_objects("a", "b", "c", "d"), "str", TypeError),
        (np.zeros((4,), "datetime64[s]"), "datetime64", TypeError),
        (np.zeros((4,), "timedelta64[s]"), "timedelta64", TypeError),
        (np.array(["a", "b", "c", "d"]), "<U1", TypeError),
        (np.array([b"a", b"b", b"c", b"d"]), "S1", TypeError),
        (np.zeros((4,), "V4"), "V4", TypeError),
        (np.zeros((4,), [("a", "f4")]), "('a', '<f4')", TypeError),
        # Ragged samples (an object array of arrays) of an unsupported dtype.
        (_objects(*[np.zeros(2, np.complex64)] * 4), "complex64", TypeError),
        # Ragged samples of supported dtypes that differ between samples: a mismatch
        # between samples, not an unsupported dtype.
        (
            _objects(
                np.zeros(2, np.float32), np.zeros(3, np.int64), *[np.zeros(1, np.float32)] * 2
            ),
            "int64",
            ValueError,
        ),
    ],
)
@pytest.mark.parametrize("role", ["x", "y", "sample_weight"])
def test_unsupported_dtypes_are_refused_naming_the_argument(tmp_path, array, shown, error, role):
    """docs/reliability.md: object, string, complex, datetime dtypes raise `TypeError`."""
    d = str(tmp_path / "ds")
    args = {"x": np.zeros((4, 2), np.float32), "y": np.zeros(4), "sample_weight": np.ones(4)}
    args[role] = array
    with pytest.raises(error) as e:
        ArraysToRecords.from_arrays(
            args["x"], args["y"], d, sample_weight=args["sample_weight"], verbose=0
        )
    other = ValueError if error is TypeError else TypeError
    assert not isinstance(e.value, other), f"{type(e.value).__name__}: {e.value}"
    msg = str(e.value)
    assert f"`{role}`" in msg and shown in msg and "Expected" in msg, msg
    assert not os.path.exists(d)


@pytest.mark.parametrize("write", ["from_arrays", "writer.write"])
def test_unsupported_dtype_in_a_dict_names_its_key(tmp_path, write):
    d = str(tmp_path / "ds")
    x = {"image": np.zeros((4, 2), np.float32), "text": np.array(["a", "b", "c", "d"])}
    with pytest.raises(TypeError, match=r"`x\['text'\]`.*dtype=<U1") as e:
        if write == "from_arrays":
            ArraysToRecords.from_arrays(x, np.zeros(4), d, verbose=0)
        else:
            with ArraysToRecords(d, verbose=0) as w:
                w.write(x, np.zeros(4))
    assert not isinstance(e.value, ValueError)
    assert not os.path.exists(d) or not os.listdir(d), "nothing of the batch was written"


@pytest.mark.parametrize("x", [{"a": {"b": np.zeros((4, 2))}}, [{"b": np.zeros((4, 2))}]])
def test_nested_inputs_are_refused_naming_the_nesting(tmp_path, x):
    d = str(tmp_path / "ds")
    with pytest.raises(TypeError, match=r"`x\[.*\]` to be an array: inputs nest one level"):
        ArraysToRecords.from_arrays(x, np.zeros(4), d, verbose=0)
    assert not os.path.exists(d)


def test_changing_shape_dtype_or_structure_between_writes_is_refused(tmp_path):
    d = str(tmp_path / "ds")
    x, y = _data(40)
    with ArraysToRecords(d, samples_per_record=4, verbose=0) as w:
        w.write(x[:10], y[:10])
        with pytest.raises(ValueError, match=r"per-sample shape \(16,\).*shape \(8,\)"):
            w.write(x[10:20, :8], y[10:20])
        with pytest.raises(ValueError, match=r"dtype float32.*dtype float64"):
            w.write(x[10:20].astype(np.float64), y[10:20])
        with pytest.raises(ValueError, match="structure of the first"):
            w.write(x[10:20])  # y missing
        with pytest.raises(ValueError, match="structure of the first"):
            w.write({"a": x[10:20]}, y[10:20])
        # The refused batches left no trace: the writer goes on with good data.
        w.write(x[10:], y[10:])
    xs, ys = _read_all(d)
    assert np.array_equal(xs, x) and np.array_equal(ys, y)


@pytest.mark.parametrize(
    "x, match",
    [
        (np.zeros((0, 3), np.float32), "at least one sample"),
        (np.zeros((5, 0), np.float32), "at least one value"),
        ({}, "non-empty dict"),
        ([], "non-empty list"),
        (np.float32(3.0), "first axis indexes samples"),
        (None, "at least one array"),
    ],
)
def test_empty_input_is_refused(tmp_path, x, match):
    d = str(tmp_path / "ds")
    with pytest.raises(ValueError, match=match):
        ArraysToRecords.from_arrays(x, directory=d, verbose=0)
    assert not os.path.exists(d)


@pytest.mark.parametrize("as_path", [str, Path])
def test_the_directory_given_first_to_from_arrays_is_named(tmp_path, as_path):
    """``from_arrays(directory, x, y)``, the constructor's order: the path would be
    taken as `x` and the labels as `directory`. Refused before anything is written,
    naming the order and the path, not printing the labels."""
    d = tmp_path / "ds"
    x, y = np.zeros((1000, 3), np.float32), np.repeat(np.arange(10), 100)
    with pytest.raises(TypeError, match=r"arrays first: ArraysToRecords.from_arrays\(x, y, ") as e:
        ArraysToRecords.from_arrays(as_path(d), x, y, verbose=0)
    assert repr(str(d)) in str(e.value)
    assert not d.exists()


def test_a_directory_that_is_not_a_path_is_shown_by_shape_not_by_value(tmp_path):
    """An array where the directory goes: the error gives its shape and dtype (its repr
    ran to 46 lines for 1,000 labels), for the writer and for the source alike."""
    labels = np.repeat(np.arange(10), 100)
    expected = "Received: ndarray of shape (1000,) and dtype int64"
    with pytest.raises(TypeError, match="Expected `directory`") as e:
        ArraysToRecords.from_arrays(np.zeros((1000, 3), np.float32), directory=labels)
    assert expected in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(TypeError, match="Expected `directory`") as e:
        ArraysToRecords(labels)
    assert expected in str(e.value)
    with pytest.raises(TypeError, match="Expected `directory`") as e:
        TFRecordSequenceSource(labels)
    assert expected in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(TypeError, match="Received: 3"):
        TFRecordSequenceSource(3)
    long = "x" * 500
    with pytest.raises(TypeError) as e:
        ArraysToRecords([long])
    assert len(str(e.value)) < 300 and str(e.value).endswith("...")


def test_empty_iterable_or_no_write_leaves_no_dataset(tmp_path):
    d = str(tmp_path / "ds")
    with pytest.raises(ValueError, match="No samples were written"):
        ArraysToRecords.from_arrays(iter([]), directory=d, verbose=0)
    assert _no_dataset_written(d)
    with (
        pytest.raises(ValueError, match="No samples were written"),
        ArraysToRecords(d, verbose=0),
    ):
        pass
    assert _no_dataset_written(d)
    assert not os.path.exists(os.path.join(d, LOCK_NAME))


def test_failed_write_removes_the_directory_it_made_and_only_that(tmp_path):
    made = str(tmp_path / "made" / "ds")
    with pytest.raises(ValueError, match="No samples were written"):
        ArraysToRecords.from_arrays(iter([]), directory=made, verbose=0)
    assert not os.path.exists(made)  # created by the writer, left empty: removed
    assert os.path.isdir(str(tmp_path / "made"))  # its parent is not the writer's
    kept = tmp_path / "kept"
    kept.mkdir()
    with pytest.raises(ValueError, match="No samples were written"):
        ArraysToRecords.from_arrays(iter([]), directory=str(kept), verbose=0)
    assert kept.is_dir() and not list(kept.iterdir())  # the user's directory stays
    # A directory holding what resume needs is kept, even one the writer made.
    x, y = _data()

    def batches():
        yield x[:100], y[:100]
        raise OSError("source went away")

    partial = str(tmp_path / "partial")
    with pytest.raises(OSError, match="source went away"):
        ArraysToRecords.from_arrays(batches(), directory=partial, **LAYOUT)
    assert os.path.isdir(partial) and os.listdir(partial)
    assert not os.path.exists(os.path.join(partial, MANIFEST_NAME))


@pytest.mark.parametrize(
    "x, match",
    [
        ({1: np.zeros(4), "1": np.zeros(4)}, "keys of `x`"),  # would collide as "1"
        ({"a/b": np.zeros(4)}, "without '/'"),  # would collide with nested keys
        ({"": np.zeros(4)}, "non-empty strings"),
        ({"a\x00": np.zeros(4)}, "keys of `x`"),
    ],
)
def test_feature_names_that_could_collide_are_refused(tmp_path, x, match):
    d = str(tmp_path / "ds")
    with pytest.raises(ValueError, match=match):
        ArraysToRecords.from_arrays(x, np.zeros(4), d, verbose=0)
    assert not os.path.exists(d)


def test_same_names_in_different_roles_do_not_collide(make_dataset):
    x = {"a": np.arange(8, dtype=np.int32)}
    y = {"a": np.arange(8, dtype=np.int32) * 10}
    d = make_dataset(x, y, samples_per_record=4)
    keys = [f.key for f in Manifest.load(d).features]
    assert sorted(keys) == ["x/a", "y/a"]
    (bx, by), *_ = list(TFRecordSequenceSource(d, batch_size=8, shuffle=False))
    assert np.array_equal(bx["a"].numpy(), x["a"]) and np.array_equal(by["a"].numpy(), y["a"])


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        (dict(shard_size=0), "shard_size"),
        (dict(shard_size=-5), "shard_size"),
        (dict(shard_size="big"), "shard_size"),
        (dict(shard_size="1PB"), "shard_size"),
        (dict(shard_size=True), "shard_size"),
        (dict(shard_size=1.5), "shard_size"),
        (dict(record_size="3GB"), "record_size"),
        (dict(record_size=0), "record_size"),
        (dict(chunk_size="-1MB"), "chunk_size"),
        (dict(samples_per_record=0), "samples_per_record"),
        (dict(samples_per_record=2.5), "samples_per_record"),
        (dict(samples_per_record=True), "samples_per_record"),
        (dict(compression="lz4"), "compression"),
        (dict(min_shards=0), "min_shards"),
        (dict(verbose=7), "verbose"),
        (dict(metadata=[1, 2]), "metadata"),
        (dict(metadata={"f": object()}), "metadata"),
        (dict(metadata={"nan": float("nan")}), "metadata"),
        (dict(overwrite=True, resume=True), "resume=True"),
    ],
)
def test_options_out_of_range_are_refused_naming_the_argument(tmp_path, kwargs, argument):
    d = str(tmp_path / "ds")
    with pytest.raises((TypeError, ValueError)) as e:
        ArraysToRecords.from_arrays(np.zeros((4, 2), np.float32), directory=d, **kwargs)
    assert f"`{argument}`" in str(e.value)
    assert not os.path.exists(d)
    with pytest.raises((TypeError, ValueError)):
        ArraysToRecords(d, **kwargs)
    assert not os.path.exists(d)


def test_sample_weight_without_y_is_refused(tmp_path):
    d = str(tmp_path / "ds")
    x, sw = np.zeros((6, 2), np.float32), np.ones(6, np.float32)
    with pytest.raises(ValueError, match="Expected `y` with `sample_weight`"):
        ArraysToRecords.from_arrays(x, directory=d, sample_weight=sw, verbose=0)
    assert not os.path.exists(d)
    with ArraysToRecords(d, verbose=0) as w:
        with pytest.raises(ValueError, match="Expected `y` with `sample_weight`"):
            w.write(x, None, sw)
        w.write(x, np.zeros(6))
    with pytest.raises(ValueError, match="Expected `y` with `sample_weight`"):
        ArraysToRecords.from_arrays(iter([(x, None, sw)]), directory=str(tmp_path / "it"))
    assert _no_dataset_written(str(tmp_path / "it"))


# ------------------------------------------------------------------ interrupted writes


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("after", [0, 5, 120])
def test_exception_inside_with_leaves_no_manifest(tmp_path, exc, after):
    d = str(tmp_path / "ds")
    x, y = _data()
    with pytest.raises(exc), ArraysToRecords(d, **LAYOUT) as w:
        if after:
            w.write(x[:after], y[:after])
        raise exc("stop")
    assert not os.path.exists(os.path.join(d, MANIFEST_NAME))
    # No record completed: nothing is left, and the directory the writer made is gone.
    assert os.path.isdir(d) == (after >= 12)
    assert not any(n.endswith(".tmp") for n in _listdir(d)), "unfinished shard removed"
    assert not os.path.exists(os.path.join(d, LOCK_NAME)), "lock released"
    expected = IncompleteDatasetError if after >= 12 else ManifestError  # a shard completed
    with pytest.raises(expected):
        TFRecordSequenceSource(d, batch_size=8)
    with pytest.raises(expected):
        verify(d)


class _Exploding:
    """An array-like whose slices fail half-way through the conversion (from sample 100)."""

    def __init__(self, a):
        self.a, self.shape, self.dtype = a, a.shape, a.dtype

    def __getitem__(self, s):
        if s.start is not None and s.start >= 100:
            raise OSError("disk went away")
        return self.a[s]


def test_error_while_writing_aborts_and_keeps_completed_shards_for_resume(tmp_path):
    d = str(tmp_path / "ds")
    x, y = _data()
    with pytest.raises(OSError, match="disk went away"):
        ArraysToRecords.from_arrays(_Exploding(x), y, d, chunk_size=200, **LAYOUT)
    assert not os.path.exists(os.path.join(d, MANIFEST_NAME))
    with pytest.raises(IncompleteDatasetError, match="resume=True"):
        TFRecordSequenceSource(d, batch_size=8)
    ArraysToRecords.from_arrays(x, y, d, resume=True, **LAYOUT)
    ref = str(tmp_path / "ref")
    ArraysToRecords.from_arrays(x, y, ref, **LAYOUT)
    _assert_same_dataset(d, ref)


def test_the_key_order_of_the_first_batch_is_kept_by_later_batches_and_a_resume(tmp_path):
    """A dict's keys come back in the order the first batch gave them (`key_order`), what
    later batches and a resumed conversion give them in."""

    x, y = _data()
    d = str(tmp_path / "ds")
    with pytest.raises(OSError, match="disk went away"):
        ArraysToRecords.from_arrays(
            {"z": _Exploding(x), "a": x[:, :1]}, y, d, chunk_size=200, **LAYOUT
        )
    assert json.loads(Path(d, PROGRESS_NAME).read_text())["config"]["key_order"] == {
        "x": ["z", "a"]
    }
    ArraysToRecords.from_arrays({"a": x[:, :1], "z": x}, y, d, resume=True, **LAYOUT)
    src = TFRecordSequenceSource(d, batch_size=8, shuffle=False)
    assert list(src.element_spec[0]) == ["z", "a"]
    first = next(src.as_numpy_iterator())[0]
    assert list(first) == ["z", "a"]
    np.testing.assert_array_equal(first["z"], x[:8])

    d2 = str(tmp_path / "incremental")
    with ArraysToRecords(d2, **LAYOUT) as writer:
        writer.write({"z": x[:50], "a": x[:50, :1]}, y[:50])
        writer.write({"a": x[50:, :1], "z": x[50:]}, y[50:])
    assert Manifest.load(d2).key_order == {"x": ["z", "a"]}
    src = TFRecordSequenceSource(d2, batch_size=8, shuffle=False)
    assert list(next(iter(src))[0]) == ["z", "a"]


# ------------------------------------------------------------------ existing data, overwrite


def test_existing_dataset_is_refused_and_left_intact(make_dataset, tmp_path):
    x, y = _data()
    d = make_dataset(x, y, **{k: v for k, v in LAYOUT.items() if k != "verbose"})
    before = {n: Path(os.path.join(d, n)).read_bytes() for n in os.listdir(d)}
    with pytest.raises(DatasetExistsError, match="overwrite=True"):
        ArraysToRecords.from_arrays(x[:10], y[:10], d, verbose=0)
    with pytest.raises(DatasetExistsError), ArraysToRecords(d, verbose=0) as w:
        w.write(x[:10], y[:10])
    after = {n: Path(os.path.join(d, n)).read_bytes() for n in os.listdir(d)}
    assert after == before


def test_overwrite_replaces_every_old_shard(make_dataset, tmp_path):
    x, y = _data(400)
    d = make_dataset(x, y, **{k: v for k, v in LAYOUT.items() if k != "verbose"})
    old_shards = len(Manifest.load(d).shards)
    x2, y2 = x[:30] * 2, y[:30] + 1000
    m = ArraysToRecords.from_arrays(x2, y2, d, overwrite=True, **LAYOUT)
    assert len(m.shards) < old_shards
    assert _dir_files(d) == sorted([MANIFEST_NAME] + [s.file for s in m.shards])
    xs, ys = _read_all(d)
    assert np.array_equal(xs, x2) and np.array_equal(ys, y2)


def test_overwrite_removes_shards_named_by_the_old_manifest(make_dataset):
    x, y = _data(40)
    d = make_dataset(x, y, samples_per_record=4, min_shards=2)
    # A data set whose shards another tool named differently.
    mpath = os.path.join(d, MANIFEST_NAME)
    obj = json.loads(Path(mpath).read_text())
    for i, s in enumerate(obj["shards"]):
        new = f"train-{i}-of-{len(obj['shards'])}.tfrecord"
        os.rename(os.path.join(d, s["file"]), os.path.join(d, new))
        s["file"] = new
    Path(mpath).write_text(json.dumps(obj))
    assert verify(d).ok
    m = ArraysToRecords.from_arrays(
        x[:8], y[:8], d, overwrite=True, samples_per_record=4, verbose=0
    )
    assert _dir_files(d) == sorted([MANIFEST_NAME] + [s.file for s in m.shards])


def test_overwrite_with_bad_input_keeps_the_old_dataset(make_dataset):
    x, y = _data()
    d = make_dataset(x, y, samples_per_record=4)
    before = {n: Path(os.path.join(d, n)).read_bytes() for n in os.listdir(d)}
    with pytest.raises(ValueError, match="same number of samples"):
        ArraysToRecords.from_arrays(x, y[:5], d, overwrite=True, verbose=0)
    with (
        pytest.raises(TypeError, match="complex"),
        ArraysToRecords(d, overwrite=True, verbose=0) as w,
    ):
        w.write(x.astype(np.complex64), y)
    with pytest.raises(RuntimeError), ArraysToRecords(d, overwrite=True, verbose=0):
        raise RuntimeError("changed my mind before writing")
    after = {n: Path(os.path.join(d, n)).read_bytes() for n in os.listdir(d)}
    assert after == before
    assert verify(d).ok


def test_interrupted_overwrite_never_mixes_old_and_new_shards(make_dataset):
    x, y = _data(400)
    d = make_dataset(x, y, **{k: v for k, v in LAYOUT.items() if k != "verbose"})
    old = set(_shard_bytes(d))
    with pytest.raises(KeyboardInterrupt), ArraysToRecords(d, overwrite=True, **LAYOUT) as w:
        w.write(-x[:50], y[:50])
        raise KeyboardInterrupt
    assert not os.path.exists(os.path.join(d, MANIFEST_NAME))
    shard_files = [n for n in os.listdir(d) if n.startswith("shard-")]
    assert shard_files, "the new conversion's completed shards stay for resume"
    assert not old & {Path(os.path.join(d, n)).read_bytes() for n in shard_files}
    with pytest.raises(IncompleteDatasetError):
        TFRecordSequenceSource(d, batch_size=8)
    # Resuming finishes the *new* data set, bit for bit.
    ArraysToRecords.from_arrays(-x[:50], y[:50], d, resume=True, **LAYOUT)
    xs, ys = _read_all(d)
    assert np.array_equal(xs, -x[:50]) and np.array_equal(ys, y[:50])


# ------------------------------------------------------------------ one writer per directory


def test_second_writer_on_a_directory_is_refused(tmp_path):
    d = str(tmp_path / "ds")
    x, y = _data()
    with ArraysToRecords(d, **LAYOUT) as first:
        first.write(x[:50], y[:50])
        with (
            pytest.raises(DatasetLockedError, match="Another writer"),
            ArraysToRecords(d, **LAYOUT) as second,
        ):
            second.write(x, y)
        with pytest.raises(DatasetLockedError):
            ArraysToRecords.from_arrays(x, y, d, overwrite=True, **LAYOUT)
        first.write(x[50:], y[50:])
    assert not os.path.exists(os.path.join(d, LOCK_NAME))
    xs, ys = _read_all(d)
    assert np.array_equal(xs, x) and np.array_equal(ys, y), "the first writer was not disturbed"


def _write_lock(d, pid, host):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, LOCK_NAME), "w") as f:
        json.dump({"pid": pid, "host": host, "time": 0}, f)


def test_lock_of_a_live_process_or_another_host_is_respected(tmp_path):
    d = str(tmp_path / "ds")
    x, y = _data(20)
    for pid, host in [(os.getpid(), socket.gethostname()), (1, "some-other-host")]:
        _write_lock(d, pid, host)
        with pytest.raises(DatasetLockedError, match=LOCK_NAME.replace(".", r"\.")):
            ArraysToRecords.from_arrays(x, y, d, verbose=0)
        assert not os.path.exists(os.path.join(d, MANIFEST_NAME))


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    d = str(tmp_path / "ds")
    x, y = _data(20)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # its pid no longer runs
    _write_lock(d, child.pid, socket.gethostname())
    ArraysToRecords.from_arrays(x, y, d, verbose=0)
    assert not os.path.exists(os.path.join(d, LOCK_NAME))
    assert verify(d).ok


_HOLD_EMPTY_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)  # created, no pid written yet
fcntl.flock(fd, fcntl.LOCK_EX)
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.subprocess
@pytest.mark.skipif(not hasattr(os, "fork"), reason="flock needs a POSIX system")
def test_empty_lock_of_a_killed_writer_is_taken_over(tmp_path):
    d = str(tmp_path / "ds")
    os.makedirs(d)
    x, y = _data(20)
    lock = os.path.join(d, LOCK_NAME)
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLD_EMPTY_LOCK, lock], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        assert os.path.getsize(lock) == 0
        with pytest.raises(DatasetLockedError, match="Another writer is writing"):
            ArraysToRecords.from_arrays(x, y, d, verbose=0)  # its writer still runs
    finally:
        child.kill()  # between creating the lock and writing its pid
        child.wait()
    assert os.path.getsize(lock) == 0
    ArraysToRecords.from_arrays(x, y, d, verbose=0)
    assert not os.path.exists(lock)
    assert verify(d).ok


def test_empty_lock_file_is_taken_over(tmp_path):
    d = str(tmp_path / "ds")
    os.makedirs(d)
    Path(d, LOCK_NAME).touch()  # what a writer killed before writing its pid leaves
    x, y = _data(20)
    ArraysToRecords.from_arrays(x, y, d, verbose=0)
    assert not os.path.exists(os.path.join(d, LOCK_NAME))
    assert verify(d).ok


def test_lock_whose_pid_was_reused_is_taken_over(tmp_path):
    # The file names a running process (this one), but no one holds it: its writer died
    # and the pid went to another process.
    d = str(tmp_path / "ds")
    os.makedirs(d)
    info = {"pid": os.getpid(), "host": socket.gethostname(), "time": 0, "flock": True}
    Path(d, LOCK_NAME).write_text(json.dumps(info))
    x, y = _data(20)
    ArraysToRecords.from_arrays(x, y, d, verbose=0)
    assert verify(d).ok


@pytest.mark.skipif(not hasattr(os, "fork"), reason="flock needs a POSIX system")
def test_racing_takeovers_of_an_empty_lock_leave_one_holder(tmp_path):
    import threading

    from keras_tfr import _io

    d = str(tmp_path / "ds")
    os.makedirs(d)
    for _ in range(20):
        Path(d, LOCK_NAME).touch()
        locks = [_io.DirectoryLock(d) for _ in range(6)]
        start = threading.Barrier(len(locks))
        held = []

        def take(lock, start=start, held=held):
            start.wait()
            try:
                lock.acquire()
                held.append(lock)
            except DatasetLockedError:
                pass

        threads = [threading.Thread(target=take, args=(lock,)) for lock in locks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(held) == 1
        assert json.loads(Path(d, LOCK_NAME).read_text())["pid"] == os.getpid()
        held[0].release()
        assert not Path(d, LOCK_NAME).exists()


def test_without_flock_only_an_old_empty_lock_is_taken_over(tmp_path, monkeypatch):
    from keras_tfr import _io

    monkeypatch.setattr(_io, "fcntl", None)  # as on Windows
    d = str(tmp_path / "ds")
    os.makedirs(d)
    lock = Path(d, LOCK_NAME)
    lock.touch()  # just created: its writer may be about to write its pid
    x, y = _data(20)
    with pytest.raises(DatasetLockedError, match="Another writer is writing"):
        ArraysToRecords.from_arrays(x, y, d, verbose=0)
    old = lock.stat().st_mtime - 2 * _io.DirectoryLock.STALE_EMPTY_S
    os.utime(lock, (old, old))
    ArraysToRecords.from_arrays(x, y, d, verbose=0)
    assert not lock.exists()
    assert verify(d).ok


# ------------------------------------------------------------------ resume


def _interrupt_after(d, x, y, n):
    """Writes n samples, then stops as Ctrl-C would (completed shards and journal stay)."""
    with (
        pytest.raises(KeyboardInterrupt),
        ArraysToRecords(d, expected_samples=len(x), **LAYOUT) as w,
    ):
        w.write(x[:n], y[:n])
        raise KeyboardInterrupt
    journal = json.loads(Path(os.path.join(d, PROGRESS_NAME)).read_text())
    return journal


@pytest.mark.parametrize(
    "where",
    [
        "as its file is made",
        "before the journal lists it",
        "as the journal lists it",
        "before its rename",
    ],
)
def test_ctrl_c_while_a_shard_closes_leaves_no_partial_shard(tmp_path, monkeypatch, where):
    """Ctrl-C between a shard's close and its rename left its ``.tmp`` file behind, and
    one inside the journal's write, once the journal on disk listed the shard, left the
    journal listing a shard whose file was removed; one as the next shard's file was
    made (created, not yet the writer's) left that ``.tmp`` (a SIGTERM to `convert`, once
    in 30 runs). A shard the journal does not list yet goes; one it lists takes its
    name; resume then writes the rest, the same data set as one uninterrupted write."""
    from keras_tfr import _io
    from keras_tfr.write import sink

    d, ref = str(tmp_path / "ds"), str(tmp_path / "ref")
    x, y = _data()
    calls = {"n": 0}
    if where == "as its file is made":
        made = sink.open_record_file

        def interrupted(path, compression):
            file = made(path, compression)
            calls["n"] += 1
            if calls["n"] == 2:  # the file exists; the interrupt comes before the writer has it
                file.close()
                raise KeyboardInterrupt
            return file

        monkeypatch.setattr(sink, "open_record_file", interrupted)
    elif where == "before the journal lists it":
        original = sink.start_writeback

        def interrupted(path):
            calls["n"] += 1
            if calls["n"] == 2:
                raise KeyboardInterrupt
            return original(path)

        monkeypatch.setattr(sink, "start_writeback", interrupted)
    elif where == "as the journal lists it":
        original = sink.write_journal

        def interrupted(*args, **kwargs):
            original(*args, **kwargs)
            calls["n"] += 1
            if calls["n"] == 2:  # the journal on disk lists the 2nd shard
                raise KeyboardInterrupt

        monkeypatch.setattr(sink, "write_journal", interrupted)
    else:
        original = _io.rename

        def interrupted(src, dst, *args, **kwargs):
            if src.endswith(".tmp"):
                calls["n"] += 1
                if calls["n"] == 2:
                    raise KeyboardInterrupt
            return original(src, dst, *args, **kwargs)

        monkeypatch.setattr(_io, "rename", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ArraysToRecords.from_arrays(x, y, d, **LAYOUT)
    monkeypatch.undo()
    left = _listdir(d)
    assert not [f for f in left if f.endswith(".tmp")], left
    listed = json.loads(Path(os.path.join(d, PROGRESS_NAME)).read_text())["shards"]
    on_disk = sorted(f for f in left if f.startswith("shard-"))
    assert on_disk == sorted(s["file"] for s in listed)
    assert len(on_disk) == (2 if where in ("as the journal lists it", "before its rename") else 1)
    ArraysToRecords.from_arrays(x, y, d, resume=True, **LAYOUT)
    ArraysToRecords.from_arrays(x, y, ref, **LAYOUT)
    _assert_same_dataset(d, ref)


def test_writer_without_resume_refuses_an_unfinished_conversion(tmp_path):
    d = str(tmp_path / "ds")
    x, y = _data()
    _interrupt_after(d, x, y, 100)
    with pytest.raises(IncompleteDatasetError, match="resume=True"):
        ArraysToRecords.from_arrays(x, y, d, **LAYOUT)
    with (
        pytest.raises(IncompleteDatasetError, match="resume=True"),
        ArraysToRecords(d, **LAYOUT) as w,
    ):
        w.write(x, y)


def test_resume_keeps_complete_shards_and_finishes_bit_for_bit(tmp_path):
    d, ref = str(tmp_path / "ds"), str(tmp_path / "ref")
    x, y = _data()
    journal = _interrupt_after(d, x, y, 100)
    kept = [s["file"] for s in journal["shards"]]
    assert len(kept) >= 2
    stats = {n: os.stat(os.path.join(d, n)) for n in kept}
    m = ArraysToRecords.from_arrays(x, y, d, resume=True, **LAYOUT)
    ArraysToRecords.from_arrays(x, y, ref, **LAYOUT)
    _assert_same_dataset(d, ref)
    for n, st in stats.items():  # not rewritten
        now = os.stat(os.path.join(d, n))
        assert (now.st_ino, now.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    assert _dir_files(d) == sorted([MANIFEST_NAME] + [s.file for s in m.shards])


def test_resume_stores_the_resuming_calls_metadata(tmp_path):
    """docs/reliability.md: the manifest's `user_metadata` is the resuming call's."""
    d = str(tmp_path / "ds")
    x, y = _data()
    with (
        pytest.raises(KeyboardInterrupt),
        ArraysToRecords(d, expected_samples=len(x), metadata={"run": 1}, **LAYOUT) as w,
    ):
        w.write(x[:100], y[:100])
        raise KeyboardInterrupt
    m = ArraysToRecords.from_arrays(x, y, d, resume=True, metadata={"run": 2}, **LAYOUT)
    assert m.user_metadata == {"run": 2} == Manifest.load(d).user_metadata


def test_resume_rewrites_a_damaged_shard(tmp_path, caplog):
    d, ref = str(tmp_path / "ds"), str(tmp_path / "ref")
    x, y = _data()
    journal = _interrupt_after(d, x, y, 100)
    victim = journal["shards"][1]["file"]
    p = os.path.join(d, victim)
    raw = bytearray(Path(p).read_bytes())
    raw[40] ^= 0x10
    Path(p).write_bytes(raw)
    with caplog.at_level("WARNING", logger="keras_tfr"):
        ArraysToRecords.from_arrays(x, y, d, resume=True, **LAYOUT)
    assert victim in caplog.text
    ArraysToRecords.from_arrays(x, y, ref, **LAYOUT)
    _assert_same_dataset(d, ref)


def test_resume_after_a_kill_between_journal_and_rename(tmp_path):
    """The journal lists the last shard, but it is still under its temporary name."""
    d, ref = str(tmp_path / "ds"), str(tmp_path / "ref")
    x, y = _data()
    journal = _interrupt_after(d, x, y, 100)
    last = journal["shards"][-1]["file"]
    os.rename(os.path.join(d, last), os.path.join(d, last + ".tmp"))
    with pytest.raises(IncompleteDatasetError):
        TFRecordSequenceSource(d, batch_size=8)
    ArraysToRecords.from_arrays(x, y, d, resume=True, **LAYOUT)
    ArraysToRecords.from_arrays(x, y, ref, **LAYOUT)
    _assert_same_dataset(d, ref)


def test_resume_after_a_kill_between_rename_and_journal(tmp_path):
    """A complete shard exists that the journal does not list yet; atomic-write
    leftovers lie around too."""
    d, ref = str(tmp_path / "ds"), str(tmp_path / "ref")
    x, y = _data()
    _interrupt_after(d, x, y, 100)
    jpath = os.path.join(d, PROGRESS_NAME)
    journal = json.loads(Path(jpath).read_text())
    journal["shards"] = journal["shards"][:-1]
    Path(jpath).write_text(json.dumps(journal))
    Path(jpath + ".tmp-99999").write_text("{")
    Path(os.path.join(d, MANIFEST_NAME + ".tmp-99999")).write_text("{")
    with pytest.raises(IncompleteDatasetError):
        ArraysToRecords.from_arrays(x, y, d, **LAYOUT)
    m = ArraysToRecords.from_arrays(x, y, d, resume=True, **LAYOUT)
    ArraysToRecords.from_arrays(x, y, ref, **LAYOUT)
    _assert_same_dataset(d, ref)
    assert _dir_files(d) == sorted([MANIFEST_NAME] + [s.file for s in m.shards])


def test_resume_with_other_input_is_refused(tmp_path):
    d = str(tmp_path / "ds")
    x, y = _data()
    _interrupt_after(d, x, y, 100)
    with pytest.raises(ValueError, match="per-sample shape"):
        ArraysToRecords.from_arrays(x[:, :8], y, d, resume=True, **LAYOUT)
    with pytest.raises(ValueError, match="more than the 20 given"):
        ArraysToRecords.from_arrays(x[:20], y[:20], d, resume=True, **LAYOUT)
    # An iterable of batches shorter than what is written is found at its end.
    short = [(x[i : i + 7], y[i : i + 7]) for i in range(0, 21, 7)]
    with pytest.raises(ValueError, match="more than the 21 the iterable gave"):
        ArraysToRecords.from_arrays(short, directory=d, resume=True, **LAYOUT)
    assert not os.path.exists(os.path.join(d, MANIFEST_NAME))
    ArraysToRecords.from_arrays(x, y, d, resume=True, **LAYOUT)  # the right input still works
    assert verify(d).ok


def test_resume_with_every_shard_written_still_checks_input_and_options(tmp_path, monkeypatch):
    """A writer killed while it wrote the manifest leaves every shard and the journal:
    resume then had nothing left to write and took any input (another dtype, no `y`)
    and any options (`compression="GZIP"` gave an uncompressed data set), writing the
    old schema's manifest. Other input, and options that would write other records, are
    refused, and the same ones finish it."""
    from keras_tfr.manifest import Manifest

    d, ref = str(tmp_path / "ds"), str(tmp_path / "ref")
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((2000, 64)).astype(np.float32), np.arange(2000)
    layout = dict(samples_per_record=64, shard_size="64KB", verbose=0)  # on a lattice
    with monkeypatch.context() as m:
        m.setattr(
            Manifest, "save", lambda self, directory: (_ for _ in ()).throw(KeyboardInterrupt)
        )
        with pytest.raises(KeyboardInterrupt):
            ArraysToRecords.from_arrays(x, y, d, **layout)
    journal = json.loads(Path(d, PROGRESS_NAME).read_text())
    assert sum(s["samples"] for s in journal["shards"]) == len(x)  # every sample written
    assert "lattice" in journal["config"]  # so that lattice=False asks for other records
    other_input = [
        ((x.astype(np.float64), y), {}, "dtype float32"),
        ((x[:, :8], y), {}, "per-sample shape"),
        ((x,), {}, "structure"),
        (([(x.astype(np.float64), y)],), {}, "dtype float32"),  # an iterable of batches
    ]
    other_options = [
        ((x, y), dict(compression="GZIP"), "these options give compression=GZIP"),
        ((x, y), dict(samples_per_record=32), "64 samples per record"),
        ((x, y), dict(lattice=False), "on a lattice"),
    ]
    for args, kw, said in other_input + other_options:
        options = {**layout, **kw}
        with pytest.raises(ValueError, match="was begun with") as e:
            if len(args) == 1:
                ArraysToRecords.from_arrays(args[0], directory=d, resume=True, **options)
            else:
                ArraysToRecords.from_arrays(*args, d, resume=True, **options)
        assert said in str(e.value), (kw, str(e.value))
        assert not os.path.exists(os.path.join(d, MANIFEST_NAME))
    assert json.loads(Path(d, PROGRESS_NAME).read_text()) == journal  # nothing touched
    ArraysToRecords.from_arrays(x, y, d, resume=True, **layout)
    ArraysToRecords.from_arrays(x, y, ref, **layout)
    _assert_same_dataset(d, ref)


def test_damaged_journal_is_refused_with_a_way_out(tmp_path):
    d = str(tmp_path / "ds")
    x, y = _data()
    _interrupt_after(d, x, y, 100)
    Path(os.path.join(d, PROGRESS_NAME)).write_text('{"format": "keras-tfr", "shards": 3')
    with pytest.raises(IncompleteDatasetError, match="overwrite=True"):
        ArraysToRecords.from_arrays(x, y, d, resume=True, **LAYOUT)
    ArraysToRecords.from_arrays(x, y, d, overwrite=True, **LAYOUT)
    xs, ys = _read_all(d)
    assert np.array_equal(xs, x) and np.array_equal(ys, y)


def test_resume_from_an_iterable_of_batches_skips_what_was_written(tmp_path):
    d, ref = str(tmp_path / "ds"), str(tmp_path / "ref")
    x, y = _data()

    def batches():
        for i in range(0, len(x), 30):  # batches that do not align with shards
            yield x[i : i + 30], y[i : i + 30]

    _interrupt_after(d, x, y, 100)
    ArraysToRecords.from_arrays(batches(), directory=d, resume=True, **LAYOUT)
    ArraysToRecords.from_arrays(x, y, ref, **LAYOUT)
    _assert_same_dataset(d, ref)


@pytest.mark.parametrize(
    "change, error, said",
    [
        (lambda a, b: (a.astype(np.float64), b), ValueError, "dtype"),
        (lambda a, b: (a[:, :1], b), ValueError, "shape"),
        (lambda a, b: (a, b[:-1]), ValueError, ""),
        (lambda a, b: (a, b, np.ones(len(b), np.float32)), ValueError, ""),
        # Batches that hold no array: they escaped as IndexError or StopIteration.
        (lambda a, b: 1.0, ValueError, r"first axis .*Received: 1.0 \(a float\)"),
        (lambda a, b: None, ValueError, "Received: None"),
        (lambda a, b: "abc", ValueError, "Received: 'abc' \\(a str\\)"),
        (lambda a, b: ({}, b), ValueError, "Received: an empty dict"),
        (lambda a, b: ([], b), ValueError, "Received: an empty list"),
    ],
)
def test_a_batch_that_changes_mid_way_is_named_and_nothing_is_lost(tmp_path, change, error, said):
    """A generator whose 7th batch changes dtype, shape or parts: the error says which
    batch and how many samples came before it; the complete shards stay for `resume`."""
    d, ref = str(tmp_path / "ds"), str(tmp_path / "ref")
    x, y = _data()

    def batches(bad):
        for k, i in enumerate(range(0, len(x), 30)):
            item = (x[i : i + 30], y[i : i + 30])
            yield change(*item) if k == bad else item

    named = r"\(batch 6 of the iterable, counted from 0, after 180 samples were accepted\)"
    with pytest.raises(error, match=rf"(?s){said}.*{named}"):
        ArraysToRecords.from_arrays(batches(6), directory=d, **LAYOUT)
    assert not os.path.exists(os.path.join(d, "manifest.json"))
    ArraysToRecords.from_arrays(batches(None), directory=d, resume=True, **LAYOUT)
    ArraysToRecords.from_arrays(x, y, ref, **LAYOUT)
    _assert_same_dataset(d, ref)


@pytest.mark.parametrize("compression", [None, "GZIP"])
def test_caller_may_reuse_its_arrays_once_write_returns(tmp_path, compression):
    """Full records are written straight from the caller's arrays (no joined copy): `write`
    must not return while a queued record still points into them."""
    from keras_tfr import TFRecordSequenceSource

    buf = np.zeros((64, 3), np.float32)
    labels = np.zeros(64, np.int64)
    d = str(tmp_path / "ds")
    expected = []
    with ArraysToRecords(
        d, samples_per_record=8, shard_size="2KB", compression=compression, verbose=0
    ) as w:
        for k in range(6):
            buf[:] = np.arange(64 * 3, dtype=np.float32).reshape(64, 3) + 1000 * k
            labels[:] = np.arange(64) + 64 * k
            w.write(buf, labels)
            expected.append(buf.copy())
            buf[:] = -1  # the caller reuses its buffer at once
            labels[:] = -1
    got = list(TFRecordSequenceSource(d, batch_size=64, shuffle=False))
    assert np.array_equal(np.concatenate([bx.numpy() for bx, _ in got]), np.concatenate(expected))
    assert np.array_equal(np.concatenate([by.numpy() for _, by in got]), np.arange(6 * 64))


# ------------------------------------------------------------------ a full disk

_FILE_SIZE_LIMIT = """
import json, os, resource, sys
import numpy as np
from keras_tfr import ArraysToRecords

limit, d, shard_size = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
x = np.arange(400, dtype=np.float32).reshape(400, 1)
# Writes past `limit` bytes fail with EFBIG (Python ignores SIGXFSZ), as on a full disk.
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
try:
    ArraysToRecords.from_arrays(x, np.arange(400), d, samples_per_record=1,
                                shard_size=shard_size, verbose=0)
    print(json.dumps(None))
except OSError as e:
    print(json.dumps([type(e).__name__, e.errno, str(e)]))
"""


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "limit, shard_size, failed, kept",
    [
        (2000, 100_000, "shard-00000.tfrecord.tmp", 0),  # the first shard cannot be written
        (400, 300, ".keras-tfr-progress.json", 0),  # nor the journal of the first shard
        (1500, 300, ".keras-tfr-progress.json", 11),  # the journal outgrows the limit
    ],
)
def test_a_full_disk_names_the_file_and_leaves_no_partial_file(
    tmp_path, limit, shard_size, failed, kept
):
    """A write that fails for want of space said only "[Errno 27] File too large" and
    left the shard it was writing (complete, but in no journal) and the journal's
    temporary file. The error names the file, nothing partial stays, and once there is
    room `resume=True` finishes the data set as one uninterrupted write."""
    import errno

    d, ref = str(tmp_path / "ds"), str(tmp_path / "ref")
    child = subprocess.run(
        [sys.executable, "-c", _FILE_SIZE_LIMIT, str(limit), d, str(shard_size)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    kind, code, said = json.loads(child.stdout.splitlines()[-1])
    assert (kind, code) == ("OSError", errno.EFBIG), said
    assert said == f"[Errno 27] Could not write {'the shard ' if 'shard' in failed else ''}" + (
        f"{os.path.join(d, failed)}: File too large"
    )
    shards = [f"shard-{i:05d}.tfrecord" for i in range(kept)]
    assert sorted(_listdir(d)) == ([PROGRESS_NAME, *shards] if kept else []), _listdir(d)
    x = np.arange(400, dtype=np.float32).reshape(400, 1)
    layout = dict(samples_per_record=1, shard_size=shard_size, verbose=0)
    ArraysToRecords.from_arrays(x, np.arange(400), d, resume=True, **layout)
    ArraysToRecords.from_arrays(x, np.arange(400), ref, **layout)
    _assert_same_dataset(d, ref)


def test_no_space_left_names_the_shard(tmp_path, monkeypatch):
    """The same for ENOSPC, raised by the writing thread's ``writev`` (a full disk)."""
    import errno

    from keras_tfr.write import sink

    writev, calls = os.writev, []

    def full_after_three(fd, parts):
        calls.append(fd)
        if len(calls) > 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return writev(fd, parts)

    monkeypatch.setattr(sink.os, "writev", full_after_three)
    d = str(tmp_path / "ds")
    x, y = _data()
    with pytest.raises(OSError) as e:
        ArraysToRecords.from_arrays(x, y, d, chunk_size=200, **LAYOUT)
    assert e.value.errno == errno.ENOSPC
    assert "Could not write the shard " + os.path.join(d, "shard-") in str(e.value)
    assert str(e.value).endswith(".tfrecord.tmp: No space left on device")
    assert not [n for n in _listdir(d) if ".tmp" in n], _listdir(d)


def test_the_journal_encodes_each_shard_once(tmp_path, monkeypatch):
    # The journal is rewritten after every shard: encoding every shard's entry again each
    # time (indented) made writing quadratic (2,000 shards 10.1 s, 1,000 2.6 s).
    from keras_tfr.write import journal

    encoded = []
    original = journal._shard_json

    def counting(shard):
        encoded.append(shard.file)
        return original(shard)

    monkeypatch.setattr(journal, "_shard_json", counting)
    seen = []
    real_write = journal._io.write_atomic

    def keep(path, data, durable=True):
        if path.endswith(journal.PROGRESS_NAME):
            seen.append(json.loads(data))
        return real_write(path, data, durable=durable)

    monkeypatch.setattr(journal._io, "write_atomic", keep)
    x = np.arange(600 * 2, dtype=np.float32).reshape(600, 2)
    m = ArraysToRecords.from_arrays(
        x, None, str(tmp_path / "ds"), samples_per_record=10, min_shards=30, verbose=0
    )
    assert len(m.shards) == 30
    assert sorted(encoded) == sorted(s.file for s in m.shards)  # once each
    assert [len(j["shards"]) for j in seen] == list(range(1, 31))
    assert seen[-1]["shards"] == [s.to_json() for s in m.shards]
    assert seen[-1]["records_per_shard"] == m.shards[0].records


_INTERRUPTED_WAITS = """
import json, os, queue, random, signal, sys, threading, time

class HeldQueue(queue.Queue):
    # `get` keeps the lock a moment after waking a waiting `put`: the window in which an
    # interrupt of that `put` broke `queue.Queue`'s lock (the writer's queue until the
    # fix), made wide enough to hit in most runs.
    def get(self, block=True, timeout=None):
        with self.not_empty:
            while not self._qsize():
                self.not_empty.wait()
            item = self._get()
            self.not_full.notify()
            time.sleep(0.001)
            return item

queue.Queue = HeldQueue
from keras_tfr.write.sink import _RecordSink

class Writer:  # as slow as the held queue: the caller waits for room most of the time
    def write_many(self, records):
        time.sleep(0.001)

thread_errors = []
threading.excepthook = lambda args: thread_errors.append(repr(args.exc_value))
random.seed(0)
interrupted = hung = raised = 0

def interrupt_later(go, delay):
    go.acquire()  # once the caller is inside its `try`
    time.sleep(delay)
    os.kill(os.getpid(), signal.SIGINT)  # to the process, as `kill` and Ctrl-C send it

for i in range(60):
    sink = _RecordSink(max_records=2)
    sink.start_shard(Writer())
    go = threading.Lock()
    go.acquire()
    threading.Thread(target=interrupt_later, args=(go, random.random() * 0.01)).start()
    try:
        go.release()
        for j in range(10**6):
            sink.put((b"x", 0))
            if j % 7 == 6:
                sink.finish_shard()  # the other wait: for the queued records to be written
    except KeyboardInterrupt:
        interrupted += 1
    except RuntimeError:
        raised += 1
    done = threading.Event()
    def stop():
        try:
            sink.stop()
        finally:
            done.set()
    threading.Thread(target=stop, daemon=True).start()
    hung += not done.wait(5)
print(json.dumps({"interrupted": interrupted, "hung": hung, "raised": raised,
                  "thread_errors": thread_errors[:3]}))
"""


@pytest.mark.subprocess
def test_ctrl_c_while_the_writer_waits_on_its_queue_leaves_the_queue_whole(run_script):
    """An interrupt (Ctrl-C, or SIGTERM in the command line) raised inside the writer's
    wait on its full `queue.Queue` broke the queue's lock: the writer's thread died with
    "release unlocked lock" or waited forever for the item that ends it, and `keras-tfr
    convert` hung on SIGTERM (2 runs in about 85 under load). The caller now waits only
    in C (`keras_tfr.write.sink._RecordSink`), where an interrupt leaves nothing half
    done."""
    got = json.loads(run_script(_INTERRUPTED_WAITS, timeout=300).strip().splitlines()[-1])
    assert got == {"interrupted": 60, "hung": 0, "raised": 0, "thread_errors": []}
