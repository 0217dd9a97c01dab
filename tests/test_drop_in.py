"""What a Keras user moving from arrays types first, with a source: `fit`'s own
`validation_split`, `batch_size` and `steps_per_epoch`."""

from __future__ import annotations

import json
import logging
import os

import keras
import numpy as np
import pytest

from keras_tfr import TFRecordSequenceSource


def test_fit_with_validation_split_on_a_source_says_how_the_source_splits(make_dataset):
    """Keras refuses `fit(dataset, validation_split=...)`; for a source the ValueError
    also shows the two sources to make. Arrays still split as Keras splits them."""
    import keras

    x = np.arange(40, dtype=np.float32).reshape(20, 2)
    y = np.zeros(20, np.float32)
    d = make_dataset(x, y)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match="only") as e:
        model.fit(TFRecordSequenceSource(d, 4, seed=0), validation_split=0.25, verbose=0)
    message = str(e.value)
    assert "Keras splits arrays only" in message and d in message
    assert "validation_split=0.25, subset='training'" in message
    assert "subset='validation', shuffle=False" in message
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    # The lines shown run, on the source passed, and keep its options (seed included).
    source = TFRecordSequenceSource(d, 4, seed=5, drop_remainder=True)
    with pytest.raises(ValueError, match="only") as e:
        model.fit(source, validation_split=0.25, verbose=0)
    scope = {"source": source}
    for line in str(e.value).splitlines()[1:3]:
        exec(line.strip(), scope)
    train, val = scope["train"], scope["val"]
    assert train.config.seed == val.config.seed == 5 and train.config.drop_remainder
    assert not set(train.sample_order(0)) & set(val.sample_order(0))
    # A source that is a subset already is shown its other subset, not a new split.
    with pytest.raises(ValueError, match="already the 'training' subset") as e:
        model.fit(train, validation_split=0.1, verbose=0)
    assert "source.replace(subset='validation', shuffle=False)" in str(e.value)
    history = model.fit(x, y, validation_split=0.25, epochs=1, verbose=0).history
    assert "val_loss" in history
    with pytest.raises(ValueError, match="only supported for tensors or NumPy arrays") as e:
        model.fit(tf_dataset_of(x, y), validation_split=0.25, verbose=0)
    assert "keras-tfr" not in str(e.value)


def test_a_source_without_a_seed_passes_the_seed_it_drew_on(make_dataset):
    """`replace` keeps the seed, also the one a `seed=None` source drew: its copies
    (`with_batch_size`, the split the hint shows) read the same orders and can be split;
    they drew new seeds, and the split asked for a seed."""
    import keras

    x = np.arange(80, dtype=np.float32).reshape(40, 2)
    d = make_dataset(x, np.arange(40, dtype=np.float32))
    source = TFRecordSequenceSource(d, 4)
    assert source.config.seed is None
    order = [source.sample_order(e).tolist() for e in range(2)]
    for copy in (source.with_batch_size(4), source.replace(verify="every_epoch")):
        assert [copy.sample_order(e).tolist() for e in range(2)] == order
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    with pytest.raises(ValueError, match="only") as e:
        model.fit(source, validation_split=0.25, verbose=0)
    assert "seed=0" not in str(e.value)
    scope = {"source": source}
    for line in str(e.value).splitlines()[1:3]:
        exec(line.strip(), scope)
    train, val = scope["train"], scope["val"]
    assert len(train.sample_order(0)) == 30 and len(val.sample_order(0)) == 10
    assert not set(train.sample_order(0)) & set(val.sample_order(0))
    # Unshuffled, no seed is drawn: the hint gives one.
    unshuffled = TFRecordSequenceSource(d, 4, shuffle=False)
    with pytest.raises(ValueError, match="only") as e:
        model.fit(unshuffled, validation_split=0.25, verbose=0)
    assert "subset='training', seed=0)" in str(e.value)


def tf_dataset_of(x, y):
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices((x, y)).batch(4)


def test_steps_per_epoch_with_a_repeated_source(make_dataset):
    """README: with `steps_per_epoch`, `source.repeat()`: each pass is the source's next
    epoch, in that epoch's order; `fit` runs every step without running out of data."""
    import warnings

    import keras

    x = np.arange(320, dtype=np.float32)[:, None]
    src = TFRecordSequenceSource(make_dataset(x, x[:, 0]), batch_size=32, seed=0)
    it = iter(src.repeat())
    passes = [np.concatenate([next(it)[1].numpy() for _ in range(10)]) for _ in range(3)]
    for e, ys in enumerate(passes):
        assert np.array_equal(ys, src.sample_order(e)), e
    assert not np.array_equal(passes[0], passes[1])
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    steps = []

    class Count(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            steps.append(self.model.optimizer.iterations.numpy())

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*ran out of data")
        # A repeated source still shuffles itself: no "shuffle=True ... ignored" either.
        warnings.filterwarnings("error", message=".*shuffle=True. was passed")
        model.fit(src.repeat(), steps_per_epoch=3, epochs=5, verbose=0, callbacks=[Count()])
    assert steps == [3, 6, 9, 12, 15]

    class PerEpoch(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.batches = []

        def on_epoch_begin(self, epoch, logs=None):
            self.batches.append(0)

        def on_train_batch_end(self, batch, logs=None):
            self.batches[-1] += 1

    # README: without `repeat()`, one iterator across epochs; the epoch that reaches the
    # end of the data is cut short ("ran out of data"), the next starts a new pass: as
    # for arrays. 10 batches per pass.
    counts = {}
    for name, data in (("source", dict(x=src)), ("arrays", dict(x=x, y=x[:, 0], batch_size=32))):
        for spe in (3, 12):
            per_epoch = PerEpoch()
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                model.fit(**data, steps_per_epoch=spe, epochs=5, verbose=0, callbacks=[per_epoch])
            ran_out = any("ran out of data" in str(w.message) for w in said)
            counts[name, spe] = (per_epoch.batches, ran_out)
    assert counts["source", 3] == counts["arrays", 3] == ([3, 3, 3, 1, 3], True)
    assert counts["source", 12] == counts["arrays", 12] == ([10] * 5, True)


def test_a_batch_size_given_to_fit_that_the_source_ignores_is_said_once(make_dataset, caplog):
    """Keras ignores `fit(batch_size=)` for a data set: the source's batches are read, and
    the log says how to get the batch size asked for; nothing is said when they agree."""
    import keras

    x = np.arange(320, dtype=np.float32)[:, None]
    src = TFRecordSequenceSource(make_dataset(x, x[:, 0]), batch_size=32, seed=0)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    steps = []

    class Steps(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            steps.append(batch)

    with caplog.at_level("WARNING", logger="keras_tfr"):
        model.fit(src, batch_size=32, epochs=1, verbose=0)
        model.evaluate(src, batch_size=32, verbose=0)
        assert not [r for r in caplog.records if "is ignored" in r.getMessage()]
        model.fit(src, batch_size=64, epochs=2, verbose=0, callbacks=[Steps()])
        model.evaluate(src, batch_size=64, verbose=0)
    said = [r.getMessage() for r in caplog.records if "is ignored" in r.getMessage()]
    assert len(said) == 1, said
    assert "batch_size=64 is ignored" in said[0] and "with_batch_size(64)" in said[0]
    assert len(steps) == 20  # 2 epochs of 10 steps: the source's batches of 32


def test_fit_asking_for_another_order_than_the_source_reads_is_said_once(make_dataset, caplog):
    """`fit(x, y)` shuffles by default and `fit(x, y, shuffle=False)` keeps the written
    order; Keras does neither for a data set. Where fit's `shuffle` asks for the order the
    source does not give, the log says which one is read and how to get the other (once
    per source); validation data, `evaluate` and `predict` are not trained on."""
    import keras

    x = np.arange(320, dtype=np.float32)[:, None]
    d = make_dataset(x, x[:, 0])
    ordered = TFRecordSequenceSource(d, batch_size=32, shuffle=False)
    shuffled = TFRecordSequenceSource(d, batch_size=32, seed=0)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")

    def said_after(*calls):
        caplog.clear()
        with caplog.at_level("WARNING", logger="keras_tfr"):
            for call in calls:
                call()
        return [r.getMessage() for r in caplog.records if "fit" in r.getMessage()]

    quiet = said_after(
        lambda: model.fit(shuffled, validation_data=ordered, epochs=1, verbose=0),
        lambda: model.fit(ordered, shuffle=False, epochs=1, verbose=0),
        lambda: model.evaluate(ordered, verbose=0),
        lambda: model.predict(ordered, verbose=0),
    )
    assert quiet == []
    said = said_after(
        lambda: model.fit(ordered, epochs=1, verbose=0),  # fit's default: shuffle=True
        lambda: model.fit(ordered, epochs=1, verbose=0),
    )
    assert len(said) == 1, said
    assert "in written order, the same order every epoch" in said[0]
    assert "source.replace(shuffle=True)" in said[0] and "fit(..., shuffle=False)" in said[0]
    said = said_after(lambda: model.fit(shuffled, shuffle=False, epochs=2, verbose=0))
    assert len(said) == 1, said
    assert "fit(shuffle=False) does not change the order" in said[0]
    assert "source.replace(shuffle=False)" in said[0]


def test_predict_on_a_source_that_drops_its_last_batch_says_how_many_it_reads(make_dataset, caplog):
    """`predict` on arrays keeps every row; a source made with `drop_remainder=True`
    leaves out its partial last batch, and the log says so (once per source)."""
    import keras

    x = np.arange(200, dtype=np.float32)[:, None]
    d = make_dataset(x, x[:, 0])
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    kw = dict(batch_size=32, shuffle=False)
    with caplog.at_level("WARNING", logger="keras_tfr"):
        whole = model.predict(
            TFRecordSequenceSource(d, drop_remainder=True, batch_size=40, shuffle=False), verbose=0
        )
        assert len(whole) == 200 and not caplog.records  # 5 full batches: nothing left out
        dropping = TFRecordSequenceSource(d, drop_remainder=True, **kw)
        first = model.predict(dropping, verbose=0)
        model.predict(dropping, verbose=0)
    said = [r.getMessage() for r in caplog.records]
    assert len(first) == 192
    assert len(said) == 1, said
    assert "predict reads 192 of the 200 samples" in said[0]
    assert "source.replace(drop_remainder=False)" in said[0]


@pytest.mark.parametrize(
    "batch_size, split", [(100, None), (64, None), (50, 0.2), (64, 0.2), (1000, None)]
)
def test_batches_have_the_shapes_keras_gives_the_same_arrays(make_dataset, batch_size, split):
    """A drop-in source says what Keras' own pipeline for the arrays says: a static batch
    dimension where every batch is full (1,000 samples), `None` where the last is short."""
    from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter

    x = np.random.default_rng(0).standard_normal((1000, 3, 2)).astype(np.float32)
    y = np.arange(1000, dtype=np.int32)
    d = make_dataset(x, y)
    src = TFRecordSequenceSource(
        d,
        batch_size,
        seed=0,
        validation_split=split,
        subset=None if split is None else "validation",
    )
    assert src.access == "samples"
    n = len(y) if split is None else int(split * len(y))
    keras_spec = (
        ArrayDataAdapter(x[:n], y[:n], batch_size=batch_size, shuffle=True)
        .get_tf_dataset()
        .element_spec
    )
    assert src.element_spec == keras_spec
    # Through tf.data's iterator (a mapped source), and straight from the mapped reader.
    shapes = {int(bx.shape[0]) for bx in src.map(lambda bx, by: bx)}
    assert shapes == {int(b[0].shape[0]) for b in src}
    assert shapes == {b[0].shape[0] for b in src.as_numpy_iterator()}
    assert shapes == ({batch_size} if n % batch_size == 0 else {batch_size, n % batch_size})


@pytest.mark.parametrize("access", ["samples", "blocks"])
def test_an_epoch_set_mid_way_is_read_whole_by_a_data_set_made_from_the_source(
    make_dataset, caplog, access
):
    # A data set made from a source counts whole epochs (len(source), fixed when it was
    # made): cut short at a step `set_epoch` gave, it ended with TensorFlow's "Input dataset
    # was expected to contain 13 elements but contained only 10".
    x = np.arange(104 * 3, dtype=np.float32).reshape(104, 3)
    y = np.arange(104)
    d = make_dataset(x, y, samples_per_record=8)

    def labels(data):
        return np.concatenate([np.asarray(b[1]) for b in data])

    ref = TFRecordSequenceSource(d, batch_size=8, seed=0, access=access)
    ref.set_epoch(1)
    epoch_1, epoch_2 = labels(ref), labels(ref)
    src = TFRecordSequenceSource(d, batch_size=8, seed=0, access=access)
    src.set_epoch(1, step=3)
    assert np.array_equal(labels(src), epoch_1[24:])  # the source itself: from batch 3 on
    src.set_epoch(1, step=3)
    with caplog.at_level(logging.WARNING, logger="keras_tfr"):
        assert np.array_equal(labels(src.map(lambda a, b: (a, b))), epoch_1)
    assert "set_epoch(1, step=3)" in caplog.text
    assert "reads epoch 1 from its first batch" in caplog.text
    assert np.array_equal(labels(src.map(lambda a, b: (a, b))), epoch_2)
    # Keras wraps the source in a `map` for `class_weight`: a whole epoch, no error.
    src.set_epoch(1, step=3)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    steps = []
    batch_end = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: steps.append(batch)
    )
    model.fit(
        src, epochs=1, verbose=0, class_weight={k: 1.0 for k in range(104)}, callbacks=[batch_end]
    )
    assert steps == list(range(13))


def test_a_source_says_it_cannot_be_pickled_and_copy_copy_still_reads(make_dataset):
    # Pickling (multiprocessing's "spawn", copy.deepcopy) failed deep inside, as "cannot
    # pickle '_thread.lock' object".
    import copy
    import gc
    import pickle

    x = np.arange(40, dtype=np.float32).reshape(20, 2)
    d = make_dataset(x, np.arange(20))
    src = TFRecordSequenceSource(d, batch_size=8, seed=0, shuffle=False)
    for attempt in (pickle.dumps, copy.deepcopy):
        with pytest.raises(TypeError, match=r"cannot be pickled.*source\.config"):
            attempt(src)
    c = src.config  # what the message says to send instead
    again = TFRecordSequenceSource(c.directory, **pickle.loads(pickle.dumps(c)).as_kwargs())
    assert np.array_equal(np.concatenate([b[0] for b in again.as_numpy_iterator()]), x)
    shallow = copy.copy(src)
    del src
    gc.collect()
    gc.collect()  # the original, then what it held: the copy still runs its pipeline
    got = np.concatenate([np.asarray(b[0]) for b in shallow.map(lambda a, b: (a, b))])
    assert np.array_equal(got, x)


def test_one_source_as_data_and_validation_data_reads_every_other_epoch(make_dataset):
    """README: every iterator counts, whoever makes it: the same source given as
    `validation_data` uses up an epoch at each validation, so `fit` trains on epochs 0,
    2, 4 (a source of its own for validation keeps them 0, 1, 2); so does an `evaluate`
    between two `fit` calls."""
    x = np.arange(64, dtype=np.float32)[:, None]
    d = make_dataset(x, x[:, 0])
    seen: list[np.ndarray] = []

    class Recording(keras.Sequential):
        def train_step(self, data):
            seen.append(np.asarray(data[1]))
            return super().train_step(data)

    for validation, epochs in (("same", [0, 2, 4]), ("own", [0, 1, 2]), ("evaluate", [0, 2])):
        seen.clear()
        src = TFRecordSequenceSource(d, batch_size=16, seed=0)
        val = src if validation == "same" else TFRecordSequenceSource(d, batch_size=16, seed=0)
        model = Recording([keras.Input((1,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse", run_eagerly=True)
        if validation == "evaluate":  # an evaluate between two fits reads an epoch too
            model.fit(src, epochs=1, verbose=0)
            model.evaluate(src, verbose=0)
            model.fit(src, epochs=1, verbose=0)
        else:
            model.fit(src, validation_data=val, epochs=3, verbose=0)
        read = np.concatenate(seen).reshape(len(epochs), 64)
        for k, e in enumerate(epochs):
            assert np.array_equal(read[k], src.sample_order(e)), (validation, k, e)


def test_dict_inputs_keep_the_order_given_and_class_weight_needs_number_labels(make_dataset):
    """README: a dict comes with its keys in the order the writer was given them, as a
    dict of arrays under TensorFlow (a data set written before `key_order`: sorted);
    `class_weight` fails on bool labels, as for any tf.data data set, and works on the
    same labels as uint8."""
    rng = np.random.default_rng(0)
    x = {"b": rng.random((32, 2)).astype(np.float32), "a": rng.random((32, 3)).astype(np.float32)}
    y = rng.random(32) < 0.5
    seen: list[list[str]] = []

    class ByPosition(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def call(self, inputs):
            seen.append(list(inputs))
            return self.dense(keras.ops.concatenate(list(inputs.values()), axis=-1))

    model = ByPosition()
    model.compile("sgd", "mse")
    from_arrays = model.predict(x, batch_size=32, verbose=0)
    assert seen[-1] == ["b", "a"]  # arrays: as built
    directory = make_dataset(x, y)
    for access in ("samples", "blocks"):
        src = TFRecordSequenceSource(directory, batch_size=32, shuffle=False, access=access)
        assert list(src.element_spec[0]) == ["b", "a"], access
        assert list(next(iter(src))[0]) == list(next(src.as_numpy_iterator())[0]) == ["b", "a"]
        # A model that reads the dict by position sees what it sees with the arrays.
        np.testing.assert_array_equal(
            model.predict(src.map(lambda x, y: x), verbose=0), from_arrays
        )
        assert seen[-1] == ["b", "a"], access
    a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
    named = keras.Model({"b": b, "a": a}, keras.layers.Dense(1)(keras.layers.concatenate([b, a])))
    np.testing.assert_array_equal(  # a functional model: by name either way
        named.predict(src.map(lambda x, y: x), verbose=0), named.predict(x, verbose=0)
    )
    # Written before the manifest kept the order: sorted, as then.
    path = os.path.join(directory, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    assert manifest.pop("key_order") == {"x": ["b", "a"]}
    with open(path, "w") as f:
        json.dump(manifest, f)
    old = TFRecordSequenceSource(directory, batch_size=32, shuffle=False)
    assert list(next(iter(old))[0]) == list(next(old.as_numpy_iterator())[0]) == ["a", "b"]

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, "sigmoid")])
    model.compile("sgd", "binary_crossentropy")
    weights = {0: 0.5, 1: 2.0}
    bools = TFRecordSequenceSource(make_dataset(x["a"], y, name="b"), batch_size=8, seed=0)
    with pytest.raises(TypeError, match="bool"):
        model.fit(bools, class_weight=weights, epochs=1, verbose=0)
    ints = TFRecordSequenceSource(
        make_dataset(x["a"], y.astype(np.uint8), name="u"), batch_size=8, seed=0
    )
    model.fit(ints, class_weight=weights, epochs=1, verbose=0)
    model.fit(x["a"], y, class_weight=weights, batch_size=8, epochs=1, verbose=0)  # arrays


@pytest.mark.parametrize(
    "access, lattice", [("samples", True), ("samples", False), ("blocks", True)]
)
def test_set_epoch_at_its_last_step_reads_nothing_then_the_next_epoch(
    make_dataset, access, lattice
):
    """README: `set_epoch(e, step=k)` makes the next iterator read epoch `e` from batch
    `k`; `k = len(source)` (accepted) is an empty epoch. Block mode and tf.data's
    iterator read the whole epoch again."""
    x = np.arange(100, dtype=np.float32)[:, None]
    d = make_dataset(x, np.arange(100), name=f"{access}-{lattice}", lattice=lattice)
    src, ref = (TFRecordSequenceSource(d, batch_size=10, seed=0, access=access) for _ in "ab")

    def labels(source, how):
        batches = source.as_numpy_iterator() if how == "numpy" else iter(source)
        return [np.asarray(b[1]) for b in batches]

    for how in ("numpy", "tensors"):
        src.set_epoch(3, step=len(src))
        assert labels(src, how) == [], how
        ref.set_epoch(4)
        assert np.array_equal(np.concatenate(labels(src, how)), np.concatenate(labels(ref, how)))
