"""Variable-length and bytes features: written as blocks with lengths, read padded or ragged."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import tensorflow as tf

from keras_tfr import ArraysToRecords, TFRecordSequenceSource, verify
from keras_tfr.manifest import Manifest
from keras_tfr.schema import decode_example


def _sequences(n=37, seed=0, dtype=np.int32, row=()):
    rng = np.random.default_rng(seed)
    return [
        rng.integers(-50, 50, size=(int(rng.integers(0, 7)), *row)).astype(dtype) for _ in range(n)
    ]


def _records(directory):
    m = Manifest.load(directory)
    out = []
    for shard in m.shards:
        for r in tf.data.TFRecordDataset(m.shard_path(shard)):
            out.append(decode_example(m.features, r.numpy()))
    return m, out


def test_ragged_round_trip_bit_for_bit_in_blocks(tmp_path):
    seqs = _sequences(row=(2,), dtype=np.float32)
    y = np.arange(37, dtype=np.int64)
    d = str(tmp_path / "ds")
    ArraysToRecords.from_arrays(seqs, y, d, variable_length="x", samples_per_record=5, verbose=0)
    m, recs = _records(d)
    (spec,) = m.features_of("x")
    assert (spec.kind, spec.dtype, spec.shape) == ("ragged", "float32", (2,))
    assert len(recs) == 8  # 37 samples in blocks of 5: the lengths live in each block
    back = [a for r in recs for a in r["x"]]
    assert len(back) == 37
    for a, b in zip(back, seqs):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    assert verify(d).ok


def test_fixed_features_serialize_exactly_as_before(tmp_path, small_xy):
    x, y = small_xy
    d = str(tmp_path / "ds")
    ArraysToRecords.from_arrays(x, y, d, verbose=0)
    with open(os.path.join(d, "manifest.json")) as f:
        raw = json.load(f)
    assert all("kind" not in f for f in raw["features"])


@pytest.mark.parametrize("shuffle", [False, True])
def test_source_pads_or_yields_ragged(tmp_path, shuffle):
    seqs = _sequences()
    y = np.arange(37, dtype=np.int64)
    d = str(tmp_path / "ds")
    ArraysToRecords.from_arrays(seqs, y, d, variable_length=["x"], samples_per_record=4, verbose=0)
    rag = TFRecordSequenceSource(d, batch_size=8, shuffle=shuffle, seed=3, ragged="ragged")
    assert len(rag) == 5
    got = {}
    for xb, yb in rag:
        assert isinstance(xb, tf.RaggedTensor)
        for row, label in zip(xb, yb.numpy()):
            got[int(label)] = row.numpy()
    assert sorted(got) == list(range(37))
    for i, s in enumerate(seqs):
        assert got[i].dtype == s.dtype and np.array_equal(got[i], s)
    pad = TFRecordSequenceSource(d, batch_size=8, shuffle=shuffle, seed=3, ragged="pad")
    fresh = rag.replace()  # a new source: the same first epoch as `pad` for the same seed
    for (xb, _), (rb, _) in zip(pad, fresh):
        assert isinstance(xb, tf.Tensor)
        assert xb.shape[1] == int(tf.reduce_max(rb.row_lengths()))
        assert np.array_equal(xb.numpy(), rb.to_tensor().numpy())


def test_shuffle_order_of_fixed_features_unchanged_by_a_ragged_feature(tmp_path, monkeypatch):
    """Adding a ragged feature must not change the seeded order of the others.

    (Both data sets go through the graph reader: the direct reader takes fixed-size
    features only, and its order is its own.)"""
    monkeypatch.setenv("KERAS_TFR_READER", "graph")
    y = np.arange(50, dtype=np.int64)
    seqs = [np.full(i % 5, i, np.int16) for i in range(50)]
    a = str(tmp_path / "a")
    b = str(tmp_path / "b")
    ArraysToRecords.from_arrays(y.astype(np.float32), y, a, samples_per_record=4, verbose=0)
    ArraysToRecords.from_arrays(
        {"v": y.astype(np.float32), "s": seqs},
        y,
        b,
        samples_per_record=4,
        verbose=0,
        variable_length=["x/s"],
    )
    order_a = np.concatenate([yb.numpy() for _, yb in TFRecordSequenceSource(a, 8, seed=1)])
    src_b = TFRecordSequenceSource(b, 8, seed=1)
    order_b, rows = [], []
    for xb, yb in src_b:
        order_b.extend(yb.numpy())
        rows.extend(zip(yb.numpy(), xb["s"].numpy(), xb["v"].numpy()))
    assert np.array_equal(order_a, order_b)
    for label, padded, v in rows:  # every feature of a sample stays together
        assert v == label and np.array_equal(padded[: label % 5], np.full(label % 5, label))


def _png(pixels: np.ndarray) -> bytes:
    return tf.io.encode_png(pixels).numpy()


def test_bytes_feature_decoded_with_user_function(tmp_path):
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, size=(6, 5, 3), dtype=np.uint8) for _ in range(21)]
    for i, im in enumerate(images):
        im[: i % 6] = 7  # flat rows compress: the PNGs differ in length
    pngs = [_png(im) for im in images]
    assert len({len(p) for p in pngs}) > 1  # really variable-length
    labels = np.arange(21, dtype=np.int32)
    d = str(tmp_path / "ds")
    obj = np.empty(len(pngs), dtype=object)
    for i, p in enumerate(pngs):
        obj[i] = p
    ArraysToRecords.from_arrays(obj, labels, d, samples_per_record=4, verbose=0)  # detected
    assert Manifest.load(d).features_of("x")[0].kind == "bytes"
    raw = TFRecordSequenceSource(d, batch_size=5, shuffle=False)
    assert [s for xb, _ in raw for s in xb.numpy()] == pngs
    src = TFRecordSequenceSource(
        d, batch_size=5, shuffle=True, seed=0, decode={"x": lambda s: tf.io.decode_png(s, 3)}
    )
    seen = 0
    for xb, yb in src:
        assert xb.dtype == tf.uint8 and xb.shape[1:] == (6, 5, 3)
        for im, label in zip(xb.numpy(), yb.numpy()):
            assert np.array_equal(im, images[label])
            seen += 1
    assert seen == 21
    assert verify(d).ok


def test_variable_feature_trains_a_model(tmp_path):
    import keras

    # Sequences of 1 to 12 tokens; the class says which half of the vocabulary they use,
    # so a model learns it only if each padded sequence arrives with its own label.
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, size=160).astype(np.float32)
    seqs = [
        rng.integers(1, 30, size=int(rng.integers(1, 13))).astype(np.int32) + 29 * int(c) for c in y
    ]
    d = str(tmp_path / "ds")
    ArraysToRecords.from_arrays(seqs, y, d, variable_length="x", samples_per_record=8, verbose=0)
    src = TFRecordSequenceSource(d, batch_size=16, seed=0)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.layers.Embedding(60, 8),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )
    model.compile(keras.optimizers.Adam(0.05), "binary_crossentropy", metrics=["accuracy"])
    loss = model.fit(src, epochs=6, shuffle=False, verbose=0).history["loss"]
    assert loss[-1] < 0.5 * loss[0], loss
    _, accuracy = model.evaluate(TFRecordSequenceSource(d, batch_size=32, shuffle=False), verbose=0)
    assert accuracy >= 0.95, accuracy


@pytest.mark.parametrize(
    "bad, match",
    [
        ([{"a": 1}, {"b": 2}], "dict"),
        (["text", "more"], "encode strings"),
        ([np.zeros(3, np.float32), np.zeros(2, np.int64)], "dtype float32"),
        ([np.zeros((2, 3)), np.zeros((2, 4))], "shape"),
        ([np.zeros(2, np.complex64)], "dtypes"),
        ([b"ok", np.zeros(2)], "byte strings"),
    ],
)
def test_unsupported_object_values_are_refused(tmp_path, bad, match):
    obj = np.empty(len(bad), dtype=object)
    for i, v in enumerate(bad):
        obj[i] = v
    with pytest.raises((TypeError, ValueError), match=match):
        ArraysToRecords.from_arrays(obj, str(tmp_path / "ds"), verbose=0)
    assert not os.path.exists(tmp_path / "ds" / "manifest.json")


def test_two_dimensional_object_arrays_still_refused(tmp_path):
    obj = np.empty((3, 2), dtype=object)
    obj[:] = 1
    with pytest.raises(TypeError, match="dtype"):
        ArraysToRecords.from_arrays(obj, str(tmp_path / "ds"), verbose=0)


def test_kind_must_stay_the_same_across_batches(tmp_path):
    with ArraysToRecords(str(tmp_path / "ds"), verbose=0, variable_length=["x"]) as w:
        w.write([np.zeros(2, np.float32)])
        with pytest.raises(ValueError, match="across batches"):
            w.write([b"bytes now"])
        w.write([np.ones(3, np.float32)])
    _, recs = _records(str(tmp_path / "ds"))
    assert [len(a) for r in recs for a in r["x"]] == [2, 3]


def test_resume_with_a_variable_feature(tmp_path):
    seqs = _sequences(n=60)
    d = str(tmp_path / "ds")

    class Boom(Exception):
        pass

    with (
        pytest.raises(Boom),
        ArraysToRecords(
            d, samples_per_record=5, shard_size=300, verbose=0, variable_length="x"
        ) as w,
    ):
        w.write(seqs[:30])
        raise Boom
    with ArraysToRecords(d, samples_per_record=5, resume=True, verbose=0, variable_length="x") as w:
        assert 0 < w.resumed_samples <= 30
        w.write(seqs[w.resumed_samples :])
    _, recs = _records(d)
    back = [a for r in recs for a in r["x"]]
    assert len(back) == 60 and all(np.array_equal(a, b) for a, b in zip(back, seqs))


def test_verify_names_a_shard_whose_lengths_do_not_add_up(tmp_path):
    from keras_tfr.schema import BlockEncoder, FeatureSpec
    from keras_tfr.verifier import verify_shard

    d = str(tmp_path / "ds")
    ArraysToRecords.from_arrays(
        _sequences(n=10), d, variable_length="x", verbose=0, samples_per_record=10
    )
    m = Manifest.load(d)
    enc = BlockEncoder([FeatureSpec("x", "", "int32", (), "ragged")])
    bad = enc.encode(2, [(b"\0" * 12, np.array([1, 1], "<i8").tobytes())])  # 12 bytes != 2*4
    path = m.shard_path(m.shards[0])
    with tf.io.TFRecordWriter(path) as w:
        w.write(bad)
    problems = verify_shard(m, m.shards[0])
    assert any("need 8" in p for p in problems), problems


def test_object_array_of_int_arrays_is_detected_as_ragged(tmp_path):
    seqs = _sequences(n=23, dtype=np.int16)
    obj = np.empty(len(seqs), dtype=object)
    for i, s in enumerate(seqs):
        obj[i] = s
    y = np.arange(23, dtype=np.int64)
    d = str(tmp_path / "ds")
    ArraysToRecords.from_arrays(obj, y, d, samples_per_record=4, verbose=0)  # no variable_length
    (spec,) = Manifest.load(d).features_of("x")
    assert (spec.kind, spec.dtype, spec.shape) == ("ragged", "int16", ())
    src = TFRecordSequenceSource(d, batch_size=5, shuffle=False, ragged="ragged")
    rows = [r.numpy() for xb, _ in src for r in xb]
    assert len(rows) == 23
    for a, b in zip(rows, seqs):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def test_on_disk_layout_of_variable_features(tmp_path):
    """Checked with TensorFlow's own Example parser, not keras-tfr's decoder."""
    seqs = _sequences(n=11, row=(2,), dtype=np.float32)
    pngs = [bytes([i]) * (i % 4) for i in range(11)]  # bytes of varying length, some empty
    d = str(tmp_path / "ds")
    ArraysToRecords.from_arrays(
        {"seq": seqs, "img": pngs},
        np.arange(11, dtype=np.int64),
        d,
        variable_length=["x/seq", "x/img"],
        samples_per_record=4,
        verbose=0,
    )
    with open(os.path.join(d, "manifest.json")) as f:
        kinds = {spec["name"]: spec.get("kind") for spec in json.load(f)["features"]}
    assert kinds == {"seq": "ragged", "img": "bytes", "": None}
    shards = sorted(p for p in os.listdir(d) if p.endswith(".tfrecord"))
    assert shards
    examples = [
        tf.train.Example.FromString(r.numpy())
        for s in shards
        for r in tf.data.TFRecordDataset(os.path.join(d, s))
    ]
    assert len(examples) == 3  # 11 samples in blocks of 4

    def one_bytes(example, key):
        (value,) = example.features.feature[key].bytes_list.value
        return value

    keys = {"x/seq", "x/seq/__lengths__", "x/img", "x/img/__lengths__"}
    start = 0
    for ex in examples:
        block = slice(start, start + 4)
        n = len(seqs[block])
        assert set(ex.features.feature) >= keys
        lengths = np.frombuffer(one_bytes(ex, "x/seq/__lengths__"), "<i8")
        assert lengths.tolist() == [len(s) for s in seqs[block]]  # rows, not values
        assert one_bytes(ex, "x/seq") == b"".join(s.astype("<f4").tobytes() for s in seqs[block])
        lengths = np.frombuffer(one_bytes(ex, "x/img/__lengths__"), "<i8")
        assert lengths.tolist() == [len(p) for p in pngs[block]]
        assert one_bytes(ex, "x/img") == b"".join(pngs[block])
        assert len(one_bytes(ex, "x/seq/__lengths__")) == 8 * n
        start += n
    assert start == 11


@pytest.mark.parametrize(
    "bad, match",
    [
        ([np.zeros(2, np.int32), "text"], r"element 1 of type str \(encode strings"),
        ([np.zeros(2, np.int32), np.zeros(1, np.int32), {"a": 1}], r"element 2 of type dict"),
        ([np.zeros(2, np.int32), None], r"element 1 of type NoneType"),
        ([np.zeros(2, np.int32), np.zeros(3, np.int32), b"ok"], r"element 2 of type bytes"),
        ([np.zeros(2, np.int32), np.array([1, None], object)], r"element 1 of dtype object"),
        ([np.zeros(2, np.int32), np.int32(4)], r"element 1 of dtype int32 and shape \(\)"),
        (
            [np.zeros(3, np.float32), np.zeros(1, np.float32), np.zeros(2, np.int64)],
            r"dtype float32 .*element 2 of dtype int64",
        ),
        (
            [np.zeros((2, 3)), np.zeros((0, 3)), np.zeros((1, 3)), np.zeros((2, 4))],
            r"element 3 of dtype float64 and shape \(2, 4\)",
        ),
        # The first element's dtype is not supported: named too, with the dtype.
        ([np.array(["ab", "c"]), np.array(["d"])], r"dtype=<U2 .*element 0 of `x`"),
        ([np.zeros(2, np.complex64), np.zeros(1, np.complex64)], r"complex64.*element 0 of"),
    ],
)
@pytest.mark.parametrize("declared", [False, True])
def test_refused_values_name_the_element(tmp_path, bad, match, declared):
    obj = np.empty(len(bad), dtype=object)
    for i, v in enumerate(bad):
        obj[i] = v
    kwargs = {"variable_length": "x"} if declared else {}  # given as a list, or detected
    values = list(bad) if declared else obj
    with pytest.raises((TypeError, ValueError), match=match):
        ArraysToRecords.from_arrays(values, str(tmp_path / "ds"), verbose=0, **kwargs)
    assert not os.path.exists(tmp_path / "ds" / "manifest.json")
