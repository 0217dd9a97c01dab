"""TFRecord files of other tools: streamed by `from_tfrecords`, rewritten by `convert_tfrecords`."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import tensorflow as tf

from keras_tfr import TFRecordSequenceSource
from keras_tfr.manifest import Manifest
from keras_tfr.tfrecords import (
    COUNTS_NAME,
    TensorFeature,
    convert_tfrecords,
    count_records,
    from_tfrecords,
    infer_features,
)

N = 45


def _write_tutorial(directory, n=N, files=3, seed=0, shape=(6, 4)):
    """Exactly as TensorFlow's TFRecord tutorial writes images: serialize_tensor + float
    label (and a variable-length ``tokens`` list), in ``train-K.tfrecord`` files."""
    rng = np.random.default_rng(seed)
    images = rng.standard_normal((n, *shape)).astype(np.float32)
    labels = rng.standard_normal(n).astype(np.float32)
    tokens = [rng.integers(0, 99, size=int(rng.integers(1, 6))) for _ in range(n)]
    per = -(-n // files)
    os.makedirs(directory, exist_ok=True)
    for k in range(files):
        with tf.io.TFRecordWriter(os.path.join(directory, f"train-{k}.tfrecord")) as w:
            for i in range(k * per, min(n, (k + 1) * per)):
                feature = {
                    "image": tf.train.Feature(
                        bytes_list=tf.train.BytesList(
                            value=[tf.io.serialize_tensor(images[i]).numpy()]
                        )
                    ),
                    "label": tf.train.Feature(float_list=tf.train.FloatList(value=[labels[i]])),
                    "tokens": tf.train.Feature(int64_list=tf.train.Int64List(value=tokens[i])),
                }
                example = tf.train.Example(features=tf.train.Features(feature=feature))
                w.write(example.SerializeToString())
    return images, labels, tokens


FEATURES = {
    "image": TensorFeature(tf.float32, (6, 4)),
    "label": tf.io.FixedLenFeature([], tf.float32),
}


def test_tutorial_layout_streams_bit_for_bit_with_known_length(tmp_path):
    images, labels, _ = _write_tutorial(tmp_path)
    ds = TFRecordSequenceSource.from_tfrecords(
        str(tmp_path / "train-*.tfrecord"),
        features=FEATURES,
        batch_size=8,
        y="label",
        shuffle=False,
    )
    assert len(ds) == 6  # 45 / 8, known before the first epoch
    xb = np.concatenate([x.numpy() for x, _ in ds])
    yb = np.concatenate([y.numpy() for _, y in ds])
    assert xb.tobytes() == images.tobytes() and yb.tobytes() == labels.tobytes()


def test_record_counts_are_cached_beside_the_files(tmp_path, monkeypatch):
    _write_tutorial(tmp_path)
    paths = sorted(str(p) for p in tmp_path.glob("*.tfrecord"))
    assert count_records(paths) == [15, 15, 15]
    cache = json.loads((tmp_path / COUNTS_NAME).read_text())
    assert set(cache["files"]) == {"train-0.tfrecord", "train-1.tfrecord", "train-2.tfrecord"}
    # A second count reads no record: make reading fail to prove it.
    monkeypatch.setattr(tf.data, "TFRecordDataset", None)
    assert count_records(paths) == [15, 15, 15]
    monkeypatch.undo()
    # A changed file is counted again.
    with tf.io.TFRecordWriter(paths[0]) as w:
        w.write(b"one record only")
    assert count_records(paths) == [1, 15, 15]


def test_shuffled_epoch_covers_every_sample_once(tmp_path):
    _, labels, _ = _write_tutorial(tmp_path)
    ds = from_tfrecords(
        str(tmp_path / "*.tfrecord"),
        FEATURES,
        7,
        y="label",
        shuffle=True,
        seed=1,
        shuffle_memory=2000,
    )
    got = np.concatenate([y.numpy() for _, y in ds])
    assert sorted(got.tolist()) == sorted(labels.tolist())
    assert not np.array_equal(got, labels)


def _labels(ds):
    return np.concatenate([y.numpy() for _, y in ds]).tolist()


def test_shuffles_by_default_as_the_source_does(tmp_path):
    _, labels, _ = _write_tutorial(tmp_path)
    pattern = str(tmp_path / "*.tfrecord")
    got = _labels(from_tfrecords(pattern, FEATURES, 7, y="label", seed=0))
    assert sorted(got) == sorted(labels.tolist()) and got != labels.tolist()
    assert _labels(from_tfrecords(pattern, FEATURES, 7, y="label", shuffle=False)) == (
        labels.tolist()
    )
    with pytest.raises(TypeError, match="`shuffle`"):
        from_tfrecords(pattern, FEATURES, 7, y="label", shuffle="yes")


def test_seed_alone_decides_the_order_whatever_set_random_seed_did(tmp_path):
    import keras

    _write_tutorial(tmp_path)
    pattern = str(tmp_path / "*.tfrecord")

    def two_epochs(seed):
        ds = from_tfrecords(
            pattern, FEATURES, 7, y="label", shuffle=True, seed=seed, shuffle_memory=2000
        )
        return _labels(ds), _labels(ds)

    plain = two_epochs(5)
    assert plain[0] != plain[1], "each epoch reshuffles"
    try:
        keras.utils.set_random_seed(123)
        seeded = two_epochs(5)
        keras.utils.set_random_seed(7)
        other_global = two_epochs(5)
    finally:
        tf.random.set_seed(None)
    assert seeded == plain and other_global == plain
    assert two_epochs(6) != plain
    top = two_epochs((1 << 63) - 1)  # the records' shuffle takes the seed after it
    assert sorted(top[0]) == sorted(plain[0]) and top == two_epochs((1 << 63) - 1)
    assert two_epochs(-(1 << 63))[0] != top[0]
    with pytest.raises(ValueError, match=r"`seed` to be an int below 2\*\*63"):
        from_tfrecords(pattern, FEATURES, 7, y="label", seed=1 << 63)


def test_without_a_seed_set_random_seed_makes_the_order_reproducible(tmp_path):
    """As for Keras' shuffle of NumPy arrays: ``seed=None`` draws from the global state."""
    import keras

    _write_tutorial(tmp_path, n=90, files=6)
    pattern = str(tmp_path / "*.tfrecord")

    def two_epochs():
        ds = from_tfrecords(pattern, FEATURES, 7, y="label", shuffle_memory=2000)
        return _labels(ds), _labels(ds)

    try:
        keras.utils.set_random_seed(11)
        first = two_epochs()
        keras.utils.set_random_seed(11)
        again = two_epochs()
        keras.utils.set_random_seed(12)
        other = two_epochs()
    finally:
        tf.random.set_seed(None)
    assert first == again
    assert first[0] != first[1], "each epoch reshuffles"
    assert other != first and sorted(other[0]) == sorted(first[0])


def test_variable_length_feature_padded_or_ragged(tmp_path):
    _, _, tokens = _write_tutorial(tmp_path)
    feats = {**FEATURES, "tokens": tf.io.VarLenFeature(tf.int64)}
    rag = from_tfrecords(
        str(tmp_path / "*.tfrecord"),
        feats,
        10,
        x=["image", "tokens"],
        y="label",
        ragged="ragged",
        shuffle=False,
    )
    rows = [r.numpy() for x, _ in rag for r in x["tokens"]]
    assert all(np.array_equal(a, b) for a, b in zip(rows, tokens)) and len(rows) == N
    pad = from_tfrecords(
        str(tmp_path / "*.tfrecord"), feats, 10, x=["image", "tokens"], y="label", shuffle=False
    )
    x, _ = next(iter(pad))
    assert isinstance(x["tokens"], tf.Tensor)
    assert np.array_equal(x["tokens"][0, : len(tokens[0])], tokens[0])


def test_infer_features_recognizes_serialized_tensors(tmp_path):
    _write_tutorial(tmp_path)
    f = infer_features([str(tmp_path / "train-0.tfrecord")])
    assert f["image"] == TensorFeature("float32", (6, 4))
    assert f["label"].shape == [] and f["label"].dtype == tf.float32
    assert isinstance(f["tokens"], tf.io.VarLenFeature)


def test_infer_features_names_a_file_it_cannot_read(tmp_path):
    """Another compression, or records that are not `tf.train.Example`s: an error that
    names the file, without TensorFlow's function and op names (the command line exits
    2 on it, as on any bad input)."""
    example = tf.train.Example(
        features=tf.train.Features(
            feature={"v": tf.train.Feature(float_list=tf.train.FloatList(value=[1.0]))}
        )
    ).SerializeToString()
    plain, zipped, junk = (str(tmp_path / f"{n}.tfrecord") for n in ("plain", "zipped", "junk"))
    for path, record, options in ((plain, example, None), (zipped, example, "GZIP")):
        with tf.io.TFRecordWriter(path, options=options) as w:
            w.write(record)
    with tf.io.TFRecordWriter(junk) as w:
        w.write(b"\xff\xfe not an Example")
    for path, compression in ((plain, "GZIP"), (zipped, None)):
        with pytest.raises(
            OSError, match=f"Could not read the TFRecord file {re.escape(path)}"
        ) as e:
            infer_features([path], compression=compression)
        assert "function_node" not in str(e.value) and "[Op:" not in str(e.value)
    with pytest.raises(ValueError, match=r"record 0 of .*junk\.tfrecord is not a `tf\.train"):
        infer_features([junk])
    assert infer_features([zipped], compression="GZIP")["v"].shape == []


def test_wrong_tensor_feature_names_the_feature(tmp_path):
    _write_tutorial(tmp_path)
    ds = from_tfrecords(
        str(tmp_path / "*.tfrecord"), {"image": TensorFeature(tf.float32, (4, 6))}, 8
    )
    with pytest.raises(tf.errors.InvalidArgumentError, match="feature `image`"):
        next(iter(ds))


def test_unknown_shape_maps_parse_tensor(tmp_path):
    images, _, _ = _write_tutorial(tmp_path)
    ds = from_tfrecords(
        str(tmp_path / "*.tfrecord"), {"image": TensorFeature(tf.float32)}, 9, shuffle=False
    )
    got = np.concatenate([x.numpy() for x in ds])
    assert got.tobytes() == images.tobytes()


def test_bad_arguments_are_named(tmp_path):
    _write_tutorial(tmp_path)
    with pytest.raises(FileNotFoundError, match="matches no file"):
        from_tfrecords(str(tmp_path / "nothing-*.tfrecord"), FEATURES)
    with pytest.raises(ValueError, match="not in `features`"):
        from_tfrecords(str(tmp_path / "*.tfrecord"), FEATURES, y="labels")
    with pytest.raises(TypeError, match=r"features\['image'\]"):
        from_tfrecords(str(tmp_path / "*.tfrecord"), {"image": "float32"})
    with pytest.raises(ValueError, match="`ragged`"):
        from_tfrecords(str(tmp_path / "*.tfrecord"), FEATURES, ragged="dense")


def test_convert_keeps_every_value_and_order(tmp_path):
    images, labels, tokens = _write_tutorial(tmp_path / "old")
    m = convert_tfrecords(
        str(tmp_path / "old" / "*.tfrecord"),
        str(tmp_path / "new"),
        y="label",
        verbose=0,
        samples_per_record=4,
        read_batch_size=16,
    )
    assert m.total_samples == N
    kinds = {
        f.key: (f.kind, f.dtype, f.shape) for f in Manifest.load(str(tmp_path / "new")).features
    }
    assert kinds == {
        "x/image": ("fixed", "float32", (6, 4)),
        "x/tokens": ("ragged", "int64", ()),
        "y": ("fixed", "float32", ()),
    }
    src = TFRecordSequenceSource(
        str(tmp_path / "new"), batch_size=10, shuffle=False, ragged="ragged"
    )
    xs = list(src)
    assert np.concatenate([x["image"].numpy() for x, _ in xs]).tobytes() == images.tobytes()
    assert np.concatenate([y.numpy() for _, y in xs]).tobytes() == labels.tobytes()
    rows = [r.numpy() for x, _ in xs for r in x["tokens"]]
    assert all(np.array_equal(a, b) for a, b in zip(rows, tokens))


@pytest.mark.parametrize("how", ["api", "cli"])
def test_convert_writes_compressed_shards_with_output_compression(tmp_path, how):
    """docs/existing_data.md, docs/cli.md: ``output_compression`` / ``--output-compression``
    compresses the new shards (gzip files, block mode), every value kept."""
    import gzip
    import subprocess
    import sys

    images, labels, _ = _write_tutorial(tmp_path / "old")
    new = str(tmp_path / "new")
    pattern = str(tmp_path / "old" / "*.tfrecord")
    if how == "api":
        convert_tfrecords(pattern, new, FEATURES, y="label", output_compression="GZIP", verbose=0)
    else:
        r = subprocess.run(
            [sys.executable, "-m", "keras_tfr.cli", "convert-tfrecords", pattern, new,
             "--y", "label", "--feature", "image=tensor:float32:6,4",
             "--feature", "label=float32", "--output-compression", "gzip", "--quiet"],
            capture_output=True,
            text=True,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
    m = Manifest.load(new)
    assert m.compression == "GZIP"
    with gzip.open(m.shard_path(m.shards[0]), "rb") as f:
        assert f.read(8)  # a gzip stream
    src = TFRecordSequenceSource(new, batch_size=10, shuffle=False)
    assert src.access == "blocks"
    xs = list(src)
    assert np.concatenate([x.numpy() for x, _ in xs]).tobytes() == images.tobytes()
    assert np.concatenate([y.numpy() for _, y in xs]).tobytes() == labels.tobytes()


def test_convert_stores_encoded_images_as_bytes(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, size=(12, 4, 4, 1), dtype=np.uint8)
    os.makedirs(tmp_path / "old")
    with tf.io.TFRecordWriter(str(tmp_path / "old" / "a.tfrecord")) as w:
        for i, im in enumerate(images):
            f = {
                "png": tf.train.Feature(
                    bytes_list=tf.train.BytesList(value=[tf.io.encode_png(im).numpy()])
                ),
                "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[i])),
            }
            w.write(tf.train.Example(features=tf.train.Features(feature=f)).SerializeToString())
    convert_tfrecords(
        str(tmp_path / "old" / "a.tfrecord"), str(tmp_path / "new"), y="label", verbose=0
    )
    (spec,) = Manifest.load(str(tmp_path / "new")).features_of("x")
    assert spec.kind == "bytes"
    src = TFRecordSequenceSource(
        str(tmp_path / "new"), batch_size=5, shuffle=False, decode={"x": tf.io.decode_png}
    )
    got = np.concatenate([x.numpy() for x, _ in src])
    assert np.array_equal(got, images)


def _write_token_lengths(path, lengths):
    """One Example per record: `tokens`, an int64 list of the given length (values = i)."""
    with tf.io.TFRecordWriter(str(path)) as w:
        for i, n in enumerate(lengths):
            f = {"tokens": tf.train.Feature(int64_list=tf.train.Int64List(value=[i] * n))}
            w.write(tf.train.Example(features=tf.train.Features(feature=f)).SerializeToString())


@pytest.mark.parametrize("odd, inferred", [(64, "fixed"), (63, "varlen")])
def test_features_none_infers_from_the_first_64_records_of_the_first_file(tmp_path, odd, inferred):
    # Every record has 3 tokens except record `odd` (0-based) and, in a second file, all
    # of them: only the first 64 records of the first file are looked at.
    _write_token_lengths(tmp_path / "a-0.tfrecord", [5 if i == odd else 3 for i in range(70)])
    _write_token_lengths(tmp_path / "a-1.tfrecord", [1, 2, 4, 6])
    f = infer_features([str(tmp_path / "a-0.tfrecord"), str(tmp_path / "a-1.tfrecord")])
    if inferred == "fixed":
        assert isinstance(f["tokens"], tf.io.FixedLenFeature) and f["tokens"].shape == [3]
    else:
        assert isinstance(f["tokens"], tf.io.VarLenFeature)
    ds = from_tfrecords(str(tmp_path / "a-*.tfrecord"), None, 8, ragged="ragged", shuffle=False)
    if inferred == "fixed":  # the guess from 64 records: a fixed [3] list
        assert ds.element_spec == tf.TensorSpec([None, 3], tf.int64)
        assert next(iter(ds)).numpy().tolist() == [[i] * 3 for i in range(8)]
    else:
        assert isinstance(ds.element_spec, tf.RaggedTensorSpec)
        rows = [r.numpy().tolist() for b in ds for r in b]
        assert len(rows) == 74 and rows[63] == [63] * 5
        assert rows[70:] == [[0], [1, 1], [2] * 4, [3] * 6]  # the second file, as it is


def test_read_only_directory_is_recounted_each_time(tmp_path, monkeypatch):
    import keras_tfr._io

    _write_tutorial(tmp_path)
    paths = sorted(str(p) for p in tmp_path.glob("*.tfrecord"))
    refused = []

    def read_only(path, data, durable=True):  # as a directory without write permission
        refused.append(path)
        raise PermissionError(13, "Permission denied", path)

    # Tests run as root, whom chmod does not stop: refuse the write itself.
    monkeypatch.setattr(keras_tfr._io, "write_atomic", read_only)
    opened = []
    real = tf.data.TFRecordDataset

    def counting(path, *args, **kwargs):
        if isinstance(path, str):  # not the pipeline's per-file datasets (traced)
            opened.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(tf.data, "TFRecordDataset", counting)
    for attempt in (1, 2):
        ds = from_tfrecords(str(tmp_path / "*.tfrecord"), FEATURES, 8, y="label", shuffle=False)
        assert len(ds) == 6
        assert count_records(paths) == [15, 15, 15]
        # Each count reads every file again: nothing was cached, on disk or in memory.
        assert sorted(opened) == sorted(paths * 2 * attempt)
        assert refused and all(p.endswith(COUNTS_NAME) for p in refused)
        assert not (tmp_path / COUNTS_NAME).exists()
    assert np.concatenate([y.numpy() for _, y in ds]).shape == (N,)


@pytest.mark.parametrize("dtype", [tf.int32, tf.float64, tf.uint8])
def test_wrong_tensor_feature_dtype_names_the_feature(tmp_path, dtype):
    # int32 has float32's size: the serialized tensors' length matches, only the dtype
    # recorded in their header tells them apart.
    _write_tutorial(tmp_path)
    ds = from_tfrecords(str(tmp_path / "*.tfrecord"), {"image": TensorFeature(dtype, (6, 4))}, 8)
    with pytest.raises(
        tf.errors.InvalidArgumentError, match=rf"feature `image`.* not {dtype.name} of shape"
    ):
        next(iter(ds))


def test_inference_skips_empty_files_and_a_bracket_path_is_a_file(tmp_path):
    # Sharded writers leave empty shards; a directory name may hold `[`.
    d = tmp_path / "run[1]"
    images, labels, _ = _write_tutorial(d, files=3)
    empty = d / "train-0.tfrecord"
    empty.write_bytes(b"")  # the first file now holds no record
    first = len(images) // 3
    features = infer_features([str(empty), str(d / "train-1.tfrecord")])
    assert set(features) == {"image", "label", "tokens"}
    literal = str(d / "train-1.tfrecord")  # exists: not a glob, though it holds `[`
    ds = from_tfrecords(literal, FEATURES, 64, y="label", shuffle=False)
    x, y = next(iter(ds))
    assert np.array_equal(x.numpy(), images[first : 2 * first])
    assert np.array_equal(y.numpy(), labels[first : 2 * first])
    with pytest.raises(ValueError, match="none of the 2 files holds a record"):
        infer_features([str(empty), str(empty)])


def test_a_string_tensor_feature_with_a_shape_is_refused_by_name(tmp_path):
    _write_tutorial(tmp_path)
    with pytest.raises(ValueError, match=r"Feature 'image': .*TensorFeature\(tf.string\)"):
        from_tfrecords(str(tmp_path / "*.tfrecord"), {"image": TensorFeature(tf.string, (2,))}, 8)


def test_a_serialized_tensor_with_no_element(tmp_path):
    path = str(tmp_path / "z.tfrecord")
    with tf.io.TFRecordWriter(path) as w:
        for _ in range(5):
            value = tf.io.serialize_tensor(tf.zeros((0, 3), tf.float32)).numpy()
            feature = {"z": tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))}
            w.write(
                tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()
            )
    assert infer_features([path]) == {"z": TensorFeature("float32", (0, 3))}
    for shape in [(0, 3), None]:
        got = next(iter(from_tfrecords(path, {"z": TensorFeature(tf.float32, shape)}, 8)))
        assert got.shape == (5, 0, 3) and got.dtype == tf.float32
    with pytest.raises(tf.errors.InvalidArgumentError, match="not float32 of shape"):
        next(iter(from_tfrecords(path, {"z": TensorFeature(tf.float32, (0, 4))}, 8)))
