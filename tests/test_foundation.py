"""Write-then-read round trips: every sample back exactly once, bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import tensorflow as tf

from keras_tfr import ArraysToRecords, CorruptRecordError, TFRecordSequenceSource
from keras_tfr.manifest import MANIFEST_NAME, Manifest

ALL_DTYPES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
]


def _random_array(rng, dtype, shape):
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)
    # Floats: random bit patterns (NaNs, infinities, subnormals included) to check bits.
    raw = rng.integers(0, 256, size=(*shape, dt.itemsize), dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def _collect(source):
    """All batches of one epoch, concatenated per position of the element structure."""
    batches = [tf.nest.map_structure(lambda t: t.numpy(), b) for b in source]
    return tf.nest.map_structure(lambda *xs: np.concatenate(xs), *batches), len(batches)


def _same_bits(a, b):
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    if a.dtype == np.bool_:
        return np.array_equal(a, b)
    return np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_dtype_round_trips_bit_for_bit(make_dataset, dtype, shuffle):
    rng = np.random.default_rng(ALL_DTYPES.index(dtype))
    n = 37
    x = _random_array(rng, dtype, (n, 3, 2))
    scalar = _random_array(rng, dtype, (n,))  # per-sample shape ()
    ids = np.arange(n, dtype=np.int64)
    d = make_dataset({"v": x, "s": scalar}, ids, samples_per_record=4, min_shards=3)
    src = TFRecordSequenceSource(d, batch_size=8, shuffle=shuffle, seed=3)
    assert len(src) == 5 and int(src.cardinality()) == 5
    (xs, ys), nb = _collect(src)
    assert nb == 5
    order = np.argsort(ys)
    assert np.array_equal(ys[order], ids), "every sample exactly once"
    if not shuffle:
        assert np.array_equal(ys, ids), "written order"
    assert _same_bits(xs["v"][order], x)
    assert _same_bits(xs["s"][order], scalar)


@pytest.mark.parametrize("access", ["samples", "blocks"])
def test_bool_bytes_other_than_0_and_1_are_written_as_1(tmp_path, access):
    """NumPy takes any nonzero byte of a bool array for True (`u8.view(bool)`,
    `np.frombuffer(b, bool)`); the format stores 0 or 1, so both modes read the same
    values, and a bitcast or a sum counts True as 1 (fixed and variable-length)."""
    raw = np.array([[0, 1, 2, 255, 128, 0]] * 10, dtype=np.uint8)
    x = raw.view(np.bool_)[:, ::-1]  # non-contiguous too
    d = str(tmp_path / "ds")
    ArraysToRecords.from_arrays(x, np.arange(10), d, verbose=0)
    src = TFRecordSequenceSource(d, batch_size=10, shuffle=False, access=access)
    (xs, ys), nb = _collect(src)
    assert nb == 1 and np.array_equal(ys, np.arange(10))
    expected = (raw != 0)[:, ::-1]
    assert xs.view(np.uint8).max() == 1 and np.array_equal(xs, expected)
    xb = next(iter(src))[0]
    assert int(tf.reduce_sum(tf.cast(xb, tf.int32))) == expected.sum()
    assert np.array_equal(next(src.as_numpy_iterator())[0].view(np.uint8), expected)

    rows = [raw[i, : 2 + i % 4].view(np.bool_) for i in range(10)]
    v = str(tmp_path / "varlen")
    ArraysToRecords.from_arrays(rows, np.arange(10), v, variable_length=["x"], verbose=0)
    xb, yb = next(iter(TFRecordSequenceSource(v, batch_size=10, shuffle=False, ragged="ragged")))
    assert np.array_equal(yb.numpy(), np.arange(10))
    for i, row in enumerate(xb):
        assert np.array_equal(row.numpy().view(np.uint8), raw[i, : 2 + i % 4] != 0)
    m = Manifest.load(v)
    (key,) = [f.key for f in m.features if f.role == "x"]
    for r in tf.data.TFRecordDataset(m.shard_path(m.shards[0])):
        stored = tf.train.Example.FromString(r.numpy()).features.feature[key].bytes_list.value
        assert set(b"".join(stored)) == {0, 1}, "the payload's bytes as written"


def test_partial_last_batch_and_drop_remainder(make_dataset, small_xy):
    x, y = small_xy
    d = make_dataset(x, y, samples_per_record=5)
    src = TFRecordSequenceSource(d, batch_size=16, shuffle=False)
    sizes = [int(b[1].shape[0]) for b in src]
    assert sizes == [16, 16, 2] and len(src) == 3
    dropped = TFRecordSequenceSource(d, batch_size=16, shuffle=False, drop_remainder=True)
    assert [int(b[1].shape[0]) for b in dropped] == [16, 16] and len(dropped) == 2


def test_shuffle_is_seeded_reshuffled_each_epoch_and_complete(make_dataset):
    x = np.arange(300, dtype=np.int32).reshape(300, 1)
    y = np.arange(300, dtype=np.int64)
    d = make_dataset(x, y, samples_per_record=7, min_shards=5)

    def epoch(src):
        return np.concatenate([b[1].numpy() for b in src])

    a = TFRecordSequenceSource(d, batch_size=32, shuffle=True, seed=11)
    e1, e2 = epoch(a), epoch(a)
    b = TFRecordSequenceSource(d, batch_size=32, shuffle=True, seed=11)
    assert np.array_equal(e1, epoch(b)), "same seed, same order"
    assert not np.array_equal(e1, e2), "reshuffled each epoch"
    assert sorted(e1) == list(range(300)) and sorted(e2) == list(range(300))
    c = TFRecordSequenceSource(d, batch_size=32, shuffle=True, seed=12)
    assert not np.array_equal(e1, epoch(c))
    # Samples of one record are spread over the epoch, not kept together.
    pos = np.empty(300, dtype=int)
    pos[e1] = np.arange(300)
    spreads = [np.ptp(pos[i : i + 7]) for i in range(0, 294, 7)]
    assert np.median(spreads) > 30


def test_golden_seeded_order(tmp_path, reader):
    """Pins the seeded order: a change to the shuffle breaks reproducibility for users."""
    x = np.arange(20, dtype=np.int64)
    d = str(tmp_path / "g")
    ArraysToRecords.from_arrays(x, None, d, samples_per_record=2, min_shards=2, verbose=0)
    src = TFRecordSequenceSource(d, batch_size=4, shuffle=True, seed=0)
    order = np.concatenate([b.numpy() for b in src]).tolist()
    golden_path = os.path.join(os.path.dirname(__file__), "golden_shuffle_order.json")
    with open(golden_path) as f:
        golden = json.load(f)
    assert sorted(order) == list(range(20))
    assert order == golden[reader]["seed0_20samples_2per_record_2shards"]


def test_seeded_order_ignores_tensorflows_global_seed(tmp_path, reader):
    """`seed=` alone decides the order, whatever `keras.utils.set_random_seed` did."""
    import keras

    x = np.arange(20, dtype=np.int64)
    d = str(tmp_path / "g")
    ArraysToRecords.from_arrays(x, None, d, samples_per_record=2, min_shards=2, verbose=0)
    keras.utils.set_random_seed(123)
    src = TFRecordSequenceSource(d, batch_size=4, shuffle=True, seed=0)
    order = np.concatenate([b.numpy() for b in src])
    golden_path = os.path.join(os.path.dirname(__file__), "golden_shuffle_order.json")
    with open(golden_path) as f:
        golden = json.load(f)
    pinned = golden[reader]["seed0_20samples_2per_record_2shards"]
    assert order.tolist() == pinned
    from tensorflow.python.eager import context

    assert context.global_seed() == 123, "the user's global seed is left in place"


@pytest.mark.parametrize("access", ["samples", "blocks"])
def test_without_a_seed_set_random_seed_makes_the_order_reproducible(tmp_path, access):
    """README: ``seed=None`` draws a seed from NumPy's global state, so that
    `keras.utils.set_random_seed` makes the orders the same from run to run, as for
    `fit(x, y, shuffle=True)`; without it every source reads its own orders. (It drew
    OS entropy: set_random_seed changed nothing.)"""
    import keras

    x = np.arange(600, dtype=np.int64)
    d = str(tmp_path / "d")
    ArraysToRecords.from_arrays(x, None, d, samples_per_record=4, min_shards=3, verbose=0)
    kw = dict(batch_size=16, access=access, deterministic=True)

    def orders(src):
        assert src.access == access
        return [np.concatenate([b.numpy() for b in src]).tolist() for _ in range(2)]

    keras.utils.set_random_seed(7)
    first = orders(TFRecordSequenceSource(d, **kw))
    other = orders(TFRecordSequenceSource(d, **kw))  # the global state moved on
    keras.utils.set_random_seed(7)
    again = orders(TFRecordSequenceSource(d, **kw))
    np.random.seed(8)
    eight = orders(TFRecordSequenceSource(d, **kw))
    assert first == again and sorted(first[0]) == list(range(600))
    assert first[0] != first[1]  # reshuffled each epoch
    assert other != first and eight != first


@pytest.mark.parametrize("set_epoch", [False, True])
def test_fit_with_initial_epoch_reads_the_epoch_set(tmp_path, set_epoch):
    """README: `fit(..., initial_epoch=k)` does not tell the source its epoch;
    `source.set_epoch(k)` first makes `fit`'s epochs k, k+1, ... read epochs k, k+1, ...;
    without it the source reads its own next epochs (0, 1, ...)."""
    import keras

    n = 96
    d = str(tmp_path / "d")
    x = np.arange(n * 2, dtype=np.float32).reshape(n, 2)
    ArraysToRecords.from_arrays(x, np.arange(n), d, verbose=0)
    src = TFRecordSequenceSource(d, batch_size=32, seed=3)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    seen = []

    class Epochs(keras.callbacks.Callback):  # the epochs fit ran
        def on_epoch_begin(self, epoch, logs=None):
            seen.append(epoch)

    if set_epoch:
        src.set_epoch(2)
    model.fit(src, epochs=4, initial_epoch=2, verbose=0, callbacks=[Epochs()])
    assert seen == [2, 3]
    # The next iterator reads the epoch after the last one fit read.
    after = np.concatenate([by.numpy() for _, by in src])
    assert after.tolist() == src.sample_order(4 if set_epoch else 2).tolist()


@pytest.mark.parametrize("access", ["samples", "blocks"])
def test_every_64_bit_seed_works_and_no_two_share_an_order(make_dataset, small_xy, access):
    """Seeds are TensorFlow's int64: each in range gives its own order in both modes (no
    seed taken modulo 2**64 stands for another); one out of range is refused up front."""
    x, y = small_xy
    d = make_dataset(x, y, samples_per_record=4)

    def order(seed):
        src = TFRecordSequenceSource(d, batch_size=16, shuffle=True, seed=seed, access=access)
        return np.concatenate([b[1] for b in src.as_numpy_iterator()]).tolist()

    seeds = [-(1 << 63), -1, 0, 1, (1 << 63) - 1]
    orders = [order(s) for s in seeds]
    for o in orders:
        assert sorted(o) == sorted(y.tolist())
    assert len({tuple(o) for o in orders}) == len(seeds)
    assert order(-1) == orders[1]  # seeded: the same seed, the same order
    for bad in (1 << 63, 1 << 64, -(1 << 63) - 1):
        with pytest.raises(ValueError, match=r"`seed` to be an int below 2\*\*63"):
            TFRecordSequenceSource(d, batch_size=16, seed=bad, access=access)


@pytest.mark.parametrize("split_seed", [0, 1])
def test_validation_split_disjoint_complete_deterministic(make_dataset, small_xy, split_seed):
    x, y = small_xy
    d = make_dataset(x, y, samples_per_record=3)
    kw = dict(batch_size=8, seed=split_seed, validation_split=0.25)
    tr = TFRecordSequenceSource(d, subset="training", shuffle=True, **kw)
    va = TFRecordSequenceSource(d, subset="validation", shuffle=False, **kw)
    (_, ytr), _ = _collect(tr)
    (_, yva), _ = _collect(va)
    assert len(ytr) == tr.num_samples and len(yva) == va.num_samples
    assert set(ytr.tolist()).isdisjoint(yva.tolist())
    assert sorted(np.concatenate([ytr, yva]).tolist()) == list(range(34))
    assert 0.15 < len(yva) / 34 < 0.35
    again = TFRecordSequenceSource(d, subset="validation", shuffle=False, **kw)
    assert np.array_equal(_collect(again)[0][1], yva)
    assert len(tr) == -(-tr.num_samples // 8)


def test_structures_dict_list_and_sample_weight(make_dataset):
    rng = np.random.default_rng(1)
    n = 21
    xa = rng.standard_normal((n, 4)).astype(np.float32)
    xb = rng.integers(0, 9, (n, 2, 2)).astype(np.int32)
    y0 = rng.standard_normal((n, 1)).astype(np.float64)
    y1 = np.arange(n, dtype=np.int64)
    w = rng.random(n).astype(np.float32)
    d = make_dataset({"a": xa, "b": xb}, [y0, y1], sample_weight=w, samples_per_record=4)
    m = Manifest.load(d)
    assert m.structure == {"x": "dict", "y": "list", "sample_weight": "array"}
    src = TFRecordSequenceSource(d, batch_size=6, shuffle=False)
    (xs, ys, ws), _ = _collect(src)
    assert set(xs) == {"a", "b"} and isinstance(ys, tuple) and len(ys) == 2
    assert _same_bits(xs["a"], xa) and _same_bits(xs["b"], xb)
    assert _same_bits(ys[0], y0) and _same_bits(ys[1], y1) and _same_bits(ws, w)


def test_x_only_yields_plain_tensors(make_dataset):
    x = np.arange(10, dtype=np.float32).reshape(10, 1)
    d = make_dataset(x, samples_per_record=3)
    src = TFRecordSequenceSource(d, batch_size=4, shuffle=False)
    b = next(iter(src))
    assert isinstance(b, tf.Tensor) and b.shape == (4, 1)


@pytest.mark.parametrize("access, spr", [("samples", 7), ("samples", None), ("blocks", 7)])
def test_x_only_list_of_inputs_yields_a_one_tuple_keras_reads_as_x(make_dataset, access, spr):
    """A bare ``(a, b)`` would be read by Keras as ``(x, y)``: a data set of a list of
    inputs and nothing else yields ``((a, b),)``, and `predict` takes it as
    ``predict([a, b])`` does."""
    import keras

    rng = np.random.default_rng(4)
    a = rng.standard_normal((30, 4)).astype(np.float32)
    b = rng.standard_normal((30, 3)).astype(np.float32)
    d = make_dataset([a, b], samples_per_record=spr)  # None: one record, on a lattice
    src = TFRecordSequenceSource(d, batch_size=8, shuffle=False, access=access)
    assert access == "blocks" or (src._mapped_plan.lattice is not None) == (spr is None)
    first = next(iter(src))
    assert isinstance(first, tuple) and len(first) == 1 and len(first[0]) == 2
    assert _same_bits(first[0][0].numpy(), a[:8]) and _same_bits(first[0][1].numpy(), b[:8])
    (numpy_first,) = next(src.as_numpy_iterator())
    assert _same_bits(numpy_first[1], b[:8])
    ia, ib = keras.Input((4,)), keras.Input((3,))
    model = keras.Model([ia, ib], keras.layers.Dense(2)(keras.layers.Concatenate()([ia, ib])))
    np.testing.assert_allclose(
        model.predict(src, verbose=0), model.predict([a, b], batch_size=8, verbose=0)
    )


def test_incremental_writes_memmap_h5py_and_iterables_agree(tmp_path):
    h5py = pytest.importorskip("h5py")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((103, 6)).astype(np.float32)
    y = rng.integers(0, 5, 103).astype(np.uint8)
    mm = np.lib.format.open_memmap(str(tmp_path / "x.npy"), mode="w+", dtype=x.dtype, shape=x.shape)
    mm[:] = x
    mm.flush()
    mm = np.load(str(tmp_path / "x.npy"), mmap_mode="r")
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["x"] = x
        f["y"] = y
    h5 = h5py.File(tmp_path / "d.h5", "r")
    kw = dict(samples_per_record=8, verbose=0, chunk_size=200)
    ArraysToRecords.from_arrays(mm, y, str(tmp_path / "mm"), **kw)
    ArraysToRecords.from_arrays(h5["x"], h5["y"], str(tmp_path / "h5"), **kw)
    ArraysToRecords.from_arrays(
        ((x[i : i + 10], y[i : i + 10]) for i in range(0, 103, 10)),
        None,
        str(tmp_path / "it"),
        **kw,
    )
    with ArraysToRecords(str(tmp_path / "inc"), samples_per_record=8, verbose=0) as w:
        for i in range(0, 103, 13):
            w.write(x[i : i + 13], y[i : i + 13])
    h5.close()
    for name in ("mm", "h5", "it", "inc"):
        (xs, ys), _ = _collect(TFRecordSequenceSource(str(tmp_path / name), 16, shuffle=False))
        assert _same_bits(xs, x) and _same_bits(ys, y), name
        m = Manifest.load(str(tmp_path / name))
        assert m.total_samples == 103 and m.total_records == 13


def test_a_list_of_batch_tuples_is_written_as_batches(tmp_path):
    """``[(x, y), ...]`` (the README's "iterable of (x, y[, w])" as a list) is batches; a
    list of arrays stays one array per input, as Keras reads a list."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((103, 6)).astype(np.float32)
    y = rng.integers(0, 5, 103).astype(np.uint8)
    w = rng.random(103).astype(np.float32)
    cases = {
        "xy": ([(x[i : i + 10], y[i : i + 10]) for i in range(0, 103, 10)], (x, y)),
        "xyw": ([(x[i : i + 7], y[i : i + 7], w[i : i + 7]) for i in range(0, 103, 7)], (x, y, w)),
        "x": ([(x[i : i + 50],) for i in range(0, 103, 50)], (x,)),
    }
    for name, (batches, want) in cases.items():
        m = ArraysToRecords.from_arrays(batches, directory=str(tmp_path / name), verbose=0)
        assert m.total_samples == 103, name
        got = list(TFRecordSequenceSource(str(tmp_path / name), 16, shuffle=False))
        parts = [g if isinstance(g, tuple) else (g,) for g in got]
        assert len(parts[0]) == len(want), name
        for k, arr in enumerate(want):
            assert _same_bits(np.concatenate([np.asarray(p[k]) for p in parts]), arr), name
    # A list of two arrays: two inputs (x as a list), not two batches.
    ArraysToRecords.from_arrays([x, x[:, :2]], y, str(tmp_path / "two"), verbose=0)
    (first, labels) = next(iter(TFRecordSequenceSource(str(tmp_path / "two"), 103, shuffle=False)))
    assert isinstance(first, (list, tuple)) and len(first) == 2
    assert _same_bits(np.asarray(first[1]), x[:, :2]) and _same_bits(np.asarray(labels), y)


def test_pandas_frames_and_series_are_arrays_as_keras_reads_them(tmp_path):
    """`fit(df, series)` takes pandas data (their values); the writer read a DataFrame as
    an iterable of batches (its column names). Mixed dtypes are refused with a hint."""
    pd = pytest.importorskip("pandas")
    rng = np.random.default_rng(3)
    values = rng.standard_normal((41, 3)).astype(np.float32)
    values[0] = [-0.0, np.nan, np.inf]
    df = pd.DataFrame(values, columns=["a", "b", "c"])
    labels = pd.Series(rng.integers(0, 5, 41).astype(np.int64))
    weights = pd.DataFrame({"w": rng.random(41).astype(np.float32)})
    d = str(tmp_path / "frame")
    m = ArraysToRecords.from_arrays(df, labels, d, sample_weight=weights["w"], verbose=0)
    assert m.total_samples == 41
    bx, by, bw = next(iter(TFRecordSequenceSource(d, 64, shuffle=False)))
    assert _same_bits(bx.numpy(), values) and _same_bits(by.numpy(), labels.to_numpy())
    assert _same_bits(bw.numpy(), weights["w"].to_numpy())
    named = str(tmp_path / "named")  # a dict of columns: named inputs
    ArraysToRecords.from_arrays({"a": df["a"], "bc": df[["b", "c"]]}, labels, named, verbose=0)
    bx, _ = next(iter(TFRecordSequenceSource(named, 64, shuffle=False)))
    want = np.ascontiguousarray(values[:, 1:]), np.ascontiguousarray(values[:, 0])
    assert _same_bits(bx["bc"].numpy(), want[0]) and _same_bits(bx["a"].numpy(), want[1])
    chunks = str(tmp_path / "chunks")  # batches of frames, as read_csv(chunksize=...) gives
    ArraysToRecords.from_arrays(
        ((df[i : i + 10], labels[i : i + 10]) for i in range(0, 41, 10)),
        directory=chunks,
        verbose=0,
    )
    bx, by = next(iter(TFRecordSequenceSource(chunks, 64, shuffle=False)))
    assert _same_bits(bx.numpy(), values) and _same_bits(by.numpy(), labels.to_numpy())
    flags = rng.random(41) > 0.5  # bool and float32 columns: float32, as Keras reads them
    both = str(tmp_path / "bool_and_float")
    ArraysToRecords.from_arrays(df.assign(flag=flags), labels, both, verbose=0)
    bx, _ = next(iter(TFRecordSequenceSource(both, 64, shuffle=False)))
    assert _same_bits(bx.numpy(), np.column_stack([values, flags.astype(np.float32)]))
    tokens = pd.Series([np.arange(i % 5, dtype=np.int64) for i in range(41)])  # lists: ragged
    ragged = str(tmp_path / "tokens")
    ArraysToRecords.from_arrays(tokens, labels, ragged, verbose=0)
    rows = [r for bx, _ in TFRecordSequenceSource(ragged, 64, shuffle=False, ragged="ragged")
            for r in bx.to_list()]  # fmt: skip
    assert rows == [list(range(i % 5)) for i in range(41)]
    mixed = pd.DataFrame({"a": values[:, 0], "s": ["x"] * 41})
    with pytest.raises(TypeError, match=r"columns of `x`.*column 's' of dtype"):
        ArraysToRecords.from_arrays(mixed, labels, str(tmp_path / "mixed"), verbose=0)
    assert not os.path.exists(tmp_path / "mixed")
    empty = pd.DataFrame(index=range(41))
    with pytest.raises(ValueError, match=r"`x` \(a pandas DataFrame\) to have at least one col"):
        ArraysToRecords.from_arrays(empty, labels, str(tmp_path / "empty"), verbose=0)
    assert not os.path.exists(tmp_path / "empty")


def test_a_ragged_tensor_is_variable_length_without_being_declared(tmp_path):
    """`TextVectorization(ragged=True)` gives a `tf.RaggedTensor`: written as a
    variable-length feature, as a 1-D object array is, also in batches of a data set,
    one of which holds rows of one length (its `numpy()` is a dense array)."""
    rng = np.random.default_rng(4)
    lengths = rng.integers(0, 7, 30)
    lengths[8:16] = 3  # the second batch of 8
    rows = [rng.integers(1, 50, n).astype(np.int64) for n in lengths]
    tokens = tf.ragged.constant([r.tolist() for r in rows], dtype=tf.int64)
    y = np.arange(30)
    for name, given in {
        "tensor": dict(x=tokens, y=y),
        "batches": dict(x=tf.data.Dataset.from_tensor_slices((tokens, y)).batch(8)),
    }.items():
        d = str(tmp_path / name)
        ArraysToRecords.from_arrays(directory=d, verbose=0, **given)
        got = [
            r for bx, _ in TFRecordSequenceSource(d, 64, shuffle=False, ragged="ragged")
            for r in bx.to_list()
        ]  # fmt: skip
        assert got == [r.tolist() for r in rows], name


def test_a_sequence_of_batches_by_index_is_read_to_its_length(tmp_path):
    """An old-style `keras.utils.Sequence` (`__len__` and `__getitem__`, no `__iter__`):
    its batches 0 .. len - 1, though its `__getitem__` would go on past the end."""
    x = np.arange(50, dtype=np.float32).reshape(25, 2)
    y = np.arange(25)

    class Batches:
        def __len__(self):
            return 3

        def __getitem__(self, i):  # wraps around, as many such classes do
            i %= 3
            return x[i * 10 : i * 10 + 10], y[i * 10 : i * 10 + 10]

    d = str(tmp_path / "seq")
    assert ArraysToRecords.from_arrays(Batches(), directory=d, verbose=0).total_samples == 25
    bx, by = next(iter(TFRecordSequenceSource(d, 64, shuffle=False)))
    assert _same_bits(bx.numpy(), x) and _same_bits(by.numpy(), y)


def test_tensors_tf_data_batches_and_empty_batches_are_written(tmp_path):
    """TensorFlow, Keras and torch tensors are arrays (their dtypes are not NumPy's); a
    tf.data.Dataset of batches is an iterable of batches; an empty batch holds nothing."""
    import keras
    import torch

    rng = np.random.default_rng(7)
    x = rng.standard_normal((37, 3, 2)).astype(np.float32)
    y = rng.integers(0, 9, 37).astype(np.int64)
    batches = [(x[i : i + 10], y[i : i + 10]) for i in range(0, 37, 10)]
    cases = {
        "tf": (tf.constant(x), tf.constant(y)),
        "keras": (keras.ops.convert_to_tensor(x), y),
        "torch": (torch.from_numpy(x).requires_grad_(True), torch.from_numpy(y)),
        "tf.data": (tf.data.Dataset.from_tensor_slices((x, y)).batch(8), None),
        "empty batch": ([*batches[:2], (x[:0], y[:0]), *batches[2:]], None),
    }
    for name, (a, b) in cases.items():
        d = str(tmp_path / name.replace(" ", "_"))
        m = ArraysToRecords.from_arrays(a, b, d, verbose=0)
        assert m.total_samples == 37, name
        got = list(TFRecordSequenceSource(d, 64, shuffle=False))
        assert _same_bits(got[0][0].numpy(), x) and _same_bits(got[0][1].numpy(), y), name


def test_inputs_the_writer_cannot_take_are_refused_clearly_before_any_write(tmp_path):
    """Each error names the argument and says what to do; nothing is created."""
    import ml_dtypes
    import torch

    x = np.zeros((10, 4), np.float32)
    y = np.arange(10)
    d = str(tmp_path / "ds")
    cases = [
        # torch's bfloat16 has no NumPy dtype: TypeError from torch, naming nothing.
        (
            dict(x=torch.zeros(10, 3, dtype=torch.bfloat16), y=y),
            TypeError,
            "`x`.*bfloat16.*cast it",
        ),
        (dict(x=x, y=torch.zeros(10, dtype=torch.bfloat16)), TypeError, "`y`.*bfloat16"),
        (
            dict(x=x.astype(ml_dtypes.bfloat16), y=y),
            TypeError,
            "`x`.*cast it to float32 or float16",
        ),
        (dict(x=np.zeros(10, "datetime64[s]"), y=y), TypeError, r"`x`.*\.astype\('int64'\)"),
        # pandas' `.values` of a column of numbers is an object array.
        (
            dict(x=x, y=np.array(list(range(10)), dtype=object)),
            TypeError,
            r"np\.asarray\(y, dtype='int64'\)",
        ),
        # A tf.data.Dataset of single samples (not batched).
        (dict(x=tf.data.Dataset.from_tensor_slices((x, y))), ValueError, r"dataset\.batch\(256\)"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            ArraysToRecords.from_arrays(directory=d, verbose=0, **kwargs)
        assert not os.path.exists(d), kwargs


def test_a_tf_data_set_of_single_samples_is_refused_whatever_their_shapes(tmp_path):
    """`from_tensor_slices` or `unbatch` with no `batch` after: 100 images of 28 x 28 were
    written as 2,800 rows of 28, and `(x, one-hot y)` of 10 columns as 1,000 scalars.
    Batches (also sliced from batches made already, or read through a `flat_map`) are
    written as given, bit for bit."""
    rng = np.random.default_rng(0)
    images = rng.random((100, 28, 28), dtype=np.float32)
    x = rng.random((100, 10), dtype=np.float32)
    onehot = np.eye(10, dtype=np.float32)[np.arange(100) % 10]
    slices = tf.data.Dataset.from_tensor_slices
    d = str(tmp_path / "ds")
    refused = {
        "images": (slices(images), "from_tensor_slices"),
        "x, one-hot y": (slices((x, onehot)), "from_tensor_slices"),
        "mapped and shuffled": (
            slices((x, onehot)).map(lambda a, b: (a * 2, b)).shuffle(10).prefetch(2),
            "from_tensor_slices",
        ),
        "zipped": (tf.data.Dataset.zip((slices(x), slices(onehot))), "from_tensor_slices"),
        "unbatched": (slices((x, onehot)).batch(8).unbatch(), "unbatch"),
    }
    for name, (data, made_by) in refused.items():
        with pytest.raises(ValueError, match=rf"made by `{made_by}`.*dataset\.batch\(256\)"):
            ArraysToRecords.from_arrays(data, directory=d, verbose=0)
        assert not os.path.exists(d), name
    made = (x.reshape(10, 10, 10), onehot.reshape(10, 10, 10))  # batches of 10 made already
    y1 = onehot
    taken = {
        "batched": (slices((x, onehot)).batch(8), 100),
        "batched, then mapped": (slices((x, onehot)).batch(8).map(lambda a, b: (a, b)), 100),
        "sliced batches, rebatched": (slices(made).unbatch().batch(7), 100),
        "flat_map": (tf.data.Dataset.range(2).flat_map(lambda _: slices((x, y1)).batch(25)), 200),
    }  # fmt: skip
    for name, (data, n) in taken.items():
        out = str(tmp_path / name.replace(" ", "_").replace(",", ""))
        m = ArraysToRecords.from_arrays(data, directory=out, verbose=0)
        assert m.total_samples == n, name
        got = list(TFRecordSequenceSource(out, 100, shuffle=False))
        assert _same_bits(got[0][0].numpy(), x) and _same_bits(got[0][1].numpy(), onehot), name


def test_batches_given_as_lists_are_inputs_and_said_so(tmp_path, caplog):
    """A generator of ``[x, y]`` lists: one `x` of two inputs (as Keras reads a list),
    with a warning that shows tuples for ``(x, y)``; tuples draw no warning."""
    x = np.arange(40, dtype=np.float32).reshape(10, 4)
    y = np.arange(10)
    with caplog.at_level("WARNING", logger="keras_tfr"):
        m = ArraysToRecords.from_arrays(
            ([x[i : i + 5], y[i : i + 5]] for i in (0, 5)), str(tmp_path / "a"), verbose=0
        )
    assert [f.role for f in m.features] == ["x", "x"]
    assert caplog.text.count("lists of 2 arrays") == 1 and "give tuples" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="keras_tfr"):
        m = ArraysToRecords.from_arrays(
            ((x[i : i + 5], y[i : i + 5]) for i in (0, 5)), str(tmp_path / "b"), verbose=0
        )
    assert [f.role for f in m.features] == ["x", "y"] and caplog.text == ""


def test_sizes_take_numpy_integers(tmp_path):
    """`record_size`, `shard_size`, `chunk_size` take NumPy integers, as `batch_size`
    and `samples_per_record` do (an `np.int64` of bytes was refused)."""
    x = np.arange(400, dtype=np.float32).reshape(100, 4)
    d = str(tmp_path / "ds")
    m = ArraysToRecords.from_arrays(
        x, None, d, record_size=np.int64(64), shard_size=np.int32(4096),
        chunk_size=np.uint32(256), verbose=0,
    )  # fmt: skip
    assert m.samples_per_record == 4 and m.total_samples == 100
    with pytest.raises(TypeError, match="`record_size`"):
        ArraysToRecords(str(tmp_path / "b"), record_size=np.bool_(True))


def test_format_is_standard_tfrecord_of_examples(make_dataset):
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    y = np.arange(6, dtype=np.int64)
    d = make_dataset(x, y, samples_per_record=4, min_shards=1)
    m = Manifest.load(d)
    assert len(m.shards) == 1 and m.total_records == 2
    with open(os.path.join(d, MANIFEST_NAME)) as f:
        raw = json.load(f)
    for key in (
        "format",
        "format_version",
        "features",
        "samples_per_record",
        "compression",
        "total_samples",
        "shards",
        "writer_version",
    ):
        assert key in raw
    assert set(raw["shards"][0]) == {"file", "samples", "records", "bytes", "checksum"}
    records = list(tf.data.TFRecordDataset(os.path.join(d, m.shards[0].file)))
    ex = tf.train.Example.FromString(records[0].numpy())
    feats = ex.features.feature
    assert feats["__count__"].int64_list.value == [4]
    assert feats["x"].bytes_list.value[0] == x[:4].astype("<f4").tobytes()
    assert feats["y"].bytes_list.value[0] == y[:4].astype("<i8").tobytes()
    assert tf.train.Example.FromString(records[1].numpy()).features.feature[
        "__count__"
    ].int64_list.value == [2]
    assert len(records[0].numpy()) == m.record_bytes


def test_shard_size_in_bytes_and_compression(make_dataset):
    x = np.random.default_rng(0).integers(0, 3, (400, 64)).astype(np.uint8)
    d = make_dataset(x, None, shard_size="4KB", samples_per_record=10, min_shards=1)
    m = Manifest.load(d)
    assert len(m.shards) >= 6
    assert all(s.bytes <= 4000 + m.record_bytes + 16 for s in m.shards)
    dz = make_dataset(x, None, name="gz", compression="GZIP", samples_per_record=10)
    mz = Manifest.load(dz)
    assert mz.compression == "GZIP" and mz.total_bytes < m.total_bytes
    (xs), _ = _collect(TFRecordSequenceSource(dz, 64, shuffle=False))
    assert _same_bits(xs, x)


def test_fit_evaluate_predict_in_written_order(make_dataset):
    import keras

    rng = np.random.default_rng(0)
    x = rng.standard_normal((90, 4)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32))[:, None]
    d = make_dataset(x, y, samples_per_record=8)
    train = TFRecordSequenceSource(
        d, batch_size=16, shuffle=True, seed=0, validation_split=0.2, subset="training"
    )
    val = TFRecordSequenceSource(
        d, batch_size=16, shuffle=False, seed=0, validation_split=0.2, subset="validation"
    )
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(0.1), "mse")
    steps_seen = []

    class Steps(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            steps_seen.append(self.params["steps"])

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hist = model.fit(train, validation_data=val, epochs=30, verbose=0, callbacks=[Steps()])
    assert not [w for w in caught if "ran out of data" in str(w.message)]
    assert steps_seen == [len(train)]
    assert hist.history["loss"][-1] < 0.1 * hist.history["loss"][0]
    assert np.isfinite(model.evaluate(val, verbose=0))
    pred = model.predict(TFRecordSequenceSource(d, batch_size=16, shuffle=False), verbose=0)
    assert np.allclose(pred, model(x).numpy(), atol=1e-5), "predict keeps written order"


def test_replace_and_with_batch_size_reuse_manifest(make_dataset, small_xy):
    x, y = small_xy
    d = make_dataset(x, y, samples_per_record=4)
    src = TFRecordSequenceSource(d, batch_size=4, shuffle=False)
    os.remove(os.path.join(d, MANIFEST_NAME))  # a copy must not read it again
    bigger = src.with_batch_size(10)
    assert len(bigger) == 4 and bigger.manifest is src.manifest
    assert [int(b[0].shape[0]) for b in bigger] == [10, 10, 10, 4]
    with pytest.raises(TypeError, match="unknown"):
        src.replace(bogus=1)


@pytest.mark.subprocess
@pytest.mark.slow
def test_jax_backend_trains_on_the_same_source(make_dataset):
    pytest.importorskip("jax")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 3)).astype(np.float32)
    y = x.sum(axis=1, keepdims=True)
    d = make_dataset(x, y, samples_per_record=8)
    script = textwrap.dedent(
        f"""
        import os
        os.environ["KERAS_BACKEND"] = "jax"
        import keras, numpy as np
        from keras_tfr import TFRecordSequenceSource
        assert keras.config.backend() == "jax"
        src = TFRecordSequenceSource({d!r}, batch_size=16, shuffle=True, seed=0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.1), "mse")
        h = model.fit(src, epochs=20, verbose=0)
        print("LOSS", h.history["loss"][0], h.history["loss"][-1], len(src))
        """
    )
    env = {**os.environ, "KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "2"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("LOSS"))
    first, last, steps = line.split()[1:]
    assert float(last) < 0.05 * float(first) and int(steps) == 4


@pytest.mark.parametrize("shuffle", [False, True])
def test_full_records_of_every_dtype_decode_by_offset(make_dataset, shuffle):
    """No short record: pools take the offset-decoding path; still bit for bit."""
    rng = np.random.default_rng(7)
    n = 48
    x = {dt: _random_array(rng, dt, (n, 2, 3)) for dt in ALL_DTYPES}
    ids = np.arange(n, dtype=np.int64)
    d = make_dataset(x, ids, samples_per_record=4, min_shards=2)
    src = TFRecordSequenceSource(d, batch_size=10, shuffle=shuffle, seed=5)
    (xs, ys), _ = _collect(src)
    order = np.argsort(ys)
    assert np.array_equal(ys[order], ids)
    for dt in ALL_DTYPES:
        assert _same_bits(xs[dt][order], x[dt]), dt


def test_record_with_valid_crc_but_wrong_layout_is_refused(make_dataset):
    from keras_tfr.write.sink import _FramedFile

    x = np.arange(64, dtype=np.float32).reshape(16, 4)
    d = make_dataset(x, np.arange(16), samples_per_record=4, min_shards=1)
    m = Manifest.load(d)
    path = os.path.join(d, m.shards[0].file)
    records = [r.numpy() for r in tf.data.TFRecordDataset(path)]
    bad = bytearray(records[1])
    key_at = bad.index(b"__count__")
    bad[key_at : key_at + 9] = b"__COUNT__"  # same length, valid framing, wrong layout
    records[1] = bytes(bad)
    f = _FramedFile(path)
    for r in records:
        f.write(r)
    f.close()
    for reader in ("mapped", "graph"):
        os.environ["KERAS_TFR_READER"] = reader
        try:
            src = TFRecordSequenceSource(d, batch_size=16, shuffle=False, check_files=False)
            with pytest.raises(CorruptRecordError, match="layout"):
                list(src)
        finally:
            del os.environ["KERAS_TFR_READER"]
