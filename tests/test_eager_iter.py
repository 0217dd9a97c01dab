"""A Python loop over a sample-mode source (``for x, y in source``): tensors straight from
the memory-mapped reader (`keras_tfr.read.numpy_iter.TensorBatches`), bit for bit the
batches of tf.data's own iterator over the same source, with the same epochs, resume
point and errors; TensorFlow's iterator made only when a tf.function needs it."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from _readers import check_order

from keras_tfr import ArraysToRecords, TFRecordSequenceSource


@pytest.fixture
def sorted_data(write_sorted):
    """1,003 class-sorted samples (7, 5) float32, int64 labels, float32 weights, in
    records of 300 samples, on a lattice."""
    d, x, y, w, m = write_sorted(300)
    assert m.lattice is not None  # the writer's default, and what this reader needs
    return d, x, y, w


def _tf_data(src):
    """tf.data's own iterator over the source (the pipeline `fit` runs)."""
    return tf.data.Dataset.__iter__(src)


def _same(t, expected):
    """Bit for bit (float NaNs and -0.0 included)."""
    got = np.asarray(t)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert got.tobytes() == expected.tobytes()


def _address(t) -> int:
    return np.from_dlpack(t).ctypes.data  # no copy: the tensor's own memory


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_remainder", [False, True])
def test_python_loop_batches_are_tf_datas_bit_for_bit(sorted_data, shuffle, drop_remainder):
    d, x, y, w = sorted_data
    kwargs = dict(batch_size=64, shuffle=shuffle, seed=3, drop_remainder=drop_remainder)
    a = TFRecordSequenceSource(d, **kwargs)
    b = TFRecordSequenceSource(d, **kwargs)
    assert a.access == "samples"
    specs = tf.nest.flatten(a.element_spec)
    for epoch in range(2):
        it = iter(a)
        fast = list(it)
        assert it._resource is None  # no TensorFlow iterator was made for the loop
        slow = list(_tf_data(b))
        assert len(fast) == len(slow) == len(a)
        for f, s in zip(fast, slow):
            assert isinstance(f, tuple) and len(f) == 3
            for ft, st, spec in zip(f, s, specs):
                assert isinstance(ft, tf.Tensor) and ft.dtype == spec.dtype
                assert spec.shape.is_compatible_with(ft.shape)
                _same(ft, st.numpy())
        at = check_order(fast, a.sample_order(epoch), x, y, w)
        assert at == (len(x) // 64 * 64 if drop_remainder else len(x))


def test_every_tensor_is_aligned_and_usable_by_any_kernel(sorted_data):
    """TensorFlow's kernels abort the process (CHECK) on a buffer not on a 64-byte
    boundary, and DLPack hands over any address: every batch must be aligned."""
    d, x, _, _ = sorted_data
    src = TFRecordSequenceSource(d, batch_size=50, seed=0)
    total = 0.0
    for batch in src:
        for t in batch:
            assert _address(t) % 64 == 0
        total += float(tf.reduce_sum(batch[0]))
    assert np.isclose(total, float(x.sum(dtype=np.float64)), rtol=1e-4)


@pytest.mark.parametrize("layout", ["lattice", "plain"])
def test_structures_and_dtypes_round_trip_through_every_reader(tmp_path, layout):
    """A dict of x (every dtype, bool included) and a list of y, read by the source's own
    iterator, by tf.data's and by `as_numpy_iterator()`: the same batches, bit for bit."""
    n = 3000 if layout == "lattice" else 300
    rng = np.random.default_rng(1)
    x = {
        "img": rng.integers(0, 255, (n, 4, 4), dtype=np.uint8),
        "flag": rng.random(n) > 0.5,
        "small": rng.integers(-128, 127, (n, 3), dtype=np.int8),
        "half": rng.standard_normal((n, 2)).astype(np.float16),
        "big": rng.integers(0, 2**63, n, dtype=np.uint64),
    }
    y = [rng.standard_normal((n, 3)), np.arange(n, dtype=np.int32)]
    d = str(tmp_path / "ds")
    spr = 1100 if layout == "lattice" else 11  # records of 11 samples: too small to pad
    ArraysToRecords.from_arrays(x, y, d, samples_per_record=spr, verbose=0)
    kwargs = dict(batch_size=256, seed=9)
    src = TFRecordSequenceSource(d, **kwargs)
    assert src._tensor_direct() == (layout == "lattice")
    readers = {
        "source": list(src),
        "tf.data": list(_tf_data(TFRecordSequenceSource(d, **kwargs))),
        "numpy": list(TFRecordSequenceSource(d, **kwargs).as_numpy_iterator()),
    }
    order = src.sample_order(0)
    for name, batches in readers.items():
        at = 0
        for bx, by in batches:
            assert isinstance(bx, dict) and sorted(bx) == sorted(x), name
            assert isinstance(by, tuple) and len(by) == 2, name
            rows = order[at : at + len(by[1])]
            for k in x:
                _same(bx[k], x[k][rows])
            for i in range(2):
                _same(by[i], y[i][rows])
            at += len(rows)
        assert at == n, name


def test_x_alone_comes_as_one_tensor(tmp_path):
    x = np.arange(100 * 3, dtype=np.float32).reshape(100, 3)
    d = str(tmp_path / "ds")
    ArraysToRecords.from_arrays(x, None, d, verbose=0)
    src = TFRecordSequenceSource(d, batch_size=40, shuffle=False)
    got = list(src)
    assert all(isinstance(t, tf.Tensor) for t in got)
    _same(tf.concat(got, 0), x)


def test_resume_mid_epoch_ends_where_the_epoch_does(sorted_data):
    d, x, _, _ = sorted_data
    src = TFRecordSequenceSource(d, batch_size=64, seed=1)
    src.set_epoch(3, 5)
    rest = list(src)
    assert len(rest) == len(src) - 5
    _same(tf.concat([b[0] for b in rest], 0), x[src.sample_order(3)[5 * 64 :]])
    assert len(list(src)) == len(src)  # the next iterator reads epoch 4 whole
    _same(tf.concat([b[0] for b in src], 0), x[src.sample_order(5)])


def test_get_next_and_get_next_as_optional(sorted_data):
    d, x, _, _ = sorted_data
    src = TFRecordSequenceSource(d, batch_size=500, shuffle=False)
    it = iter(src)
    _same(it.get_next()[0], x[:500])
    opt = it.get_next_as_optional()
    assert bool(opt.has_value())
    _same(opt.get_value()[0], x[500:1000])
    _same(next(it)[0], x[1000:])
    assert not bool(it.get_next_as_optional().has_value())
    with pytest.raises(tf.errors.OutOfRangeError):
        it.get_next()
    with pytest.raises(StopIteration):
        next(it)
    assert it._resource is None


def test_an_iterator_read_in_python_is_not_then_read_in_a_tf_function(sorted_data):
    d, _, _, _ = sorted_data
    src = TFRecordSequenceSource(d, batch_size=64, seed=0)

    @tf.function
    def first_label(iterator):
        return next(iterator)[1][0]

    it = iter(src)
    next(it)
    with pytest.raises(RuntimeError, match=r"tf\.function") as e:
        first_label(it)
    assert d in str(e.value)


def test_a_tf_function_first_makes_every_batch_come_from_tf_data(sorted_data):
    """Once a tf.function has read the iterator, eager reads continue the same epoch
    from TensorFlow's iterator, where the function left it."""
    d, _, y, _ = sorted_data
    src = TFRecordSequenceSource(d, batch_size=64, seed=0)

    @tf.function
    def labels(iterator):
        return next(iterator)[1]

    it = iter(src)
    first = labels(it).numpy()
    rest = [b[1].numpy() for b in it]
    assert it._resource is not None
    assert len(rest) == len(src) - 1
    _same(np.concatenate([first, *rest]), y[src.sample_order(0)])


def test_a_tf_function_may_loop_over_the_source_itself(sorted_data):
    d, _, y, _ = sorted_data
    src = TFRecordSequenceSource(d, batch_size=64, seed=0)

    @tf.function
    def total(ds):
        s = tf.constant(0, tf.int64)
        for _, labels, _ in ds:
            s += tf.reduce_sum(labels)
        return s

    assert int(total(src)) == int(y.sum())


def test_a_data_set_without_lattice_reads_through_tf_data(tmp_path):
    x = np.random.default_rng(0).random((200, 3), dtype=np.float32)
    d = str(tmp_path / "ds")
    m = ArraysToRecords.from_arrays(x, None, d, lattice=False, verbose=0)
    assert m.lattice is None
    src = TFRecordSequenceSource(d, batch_size=64, shuffle=False)
    assert src.access == "samples"
    it = iter(src)
    _same(tf.concat(list(it), 0), x)
    assert it._resource is not None  # tf.data's iterator: the gather lives in its pipeline


def test_checkpointing_the_iterator_names_set_epoch(sorted_data, tmp_path):
    d, _, _, _ = sorted_data
    it = iter(TFRecordSequenceSource(d, batch_size=64, seed=0))
    next(it)
    with pytest.raises(tf.errors.FailedPreconditionError, match="set_epoch"):
        tf.train.Checkpoint(iterator=it).save(str(tmp_path / "ckpt"))


def test_keras_predict_and_eager_fit_read_the_python_batches(sorted_data, monkeypatch):
    """Keras' TensorFlow backend pulls `predict`'s batches (and `fit`'s with
    ``run_eagerly=True``) in Python, from the source's own iterator."""
    import keras

    made = []
    tensor_batches = TFRecordSequenceSource._tensor_batches

    def counted(self):
        made.append(1)
        return tensor_batches(self)

    monkeypatch.setattr(TFRecordSequenceSource, "_tensor_batches", counted)
    d, x, _, _ = sorted_data
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((7, 5)), keras.layers.Flatten(), keras.layers.Dense(10)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    src = TFRecordSequenceSource(d, batch_size=128, shuffle=False)  # (x, y, weight)
    want = model.predict(x, batch_size=128, verbose=0)
    got = model.predict(src, verbose=0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert len(made) == 1
    model.compile(
        "sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True), run_eagerly=True
    )
    train = TFRecordSequenceSource(d, batch_size=128, seed=0)
    history = model.fit(train, epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2 and np.isfinite(history.history["loss"]).all()
    assert len(made) == 3  # one epoch each


def test_a_tf_function_with_the_sources_signature_takes_every_batch(sorted_data):
    """The README's custom training loop: one trace for every batch, the last short one
    included."""
    d, x, _, _ = sorted_data
    src = TFRecordSequenceSource(d, batch_size=128, shuffle=False)
    traces = []

    @tf.function(input_signature=[src.element_spec])
    def step(batch):
        traces.append(1)
        return tf.reduce_sum(batch[0])

    total = sum(float(step(batch)) for batch in src)
    assert len(traces) == 1
    assert np.isclose(total, float(x.sum(dtype=np.float64)), rtol=1e-4)


@pytest.mark.parametrize("access, lattice", [("blocks", True), ("samples", False)])
def test_an_iterator_keras_drops_unread_makes_no_tf_data_iterator(
    tmp_path, monkeypatch, access, lattice
):
    """Keras makes a new iterator at the end of each epoch and another at the start of the
    next (and so for each validation pass); TensorFlow's iterator, whose functions it
    prepares anew each time (about 0.1 s for block mode's on a 2-core VM), is made only
    for the iterators `fit` reads: one per epoch and per validation pass."""
    import keras

    from keras_tfr import source as source_module

    x = np.random.default_rng(0).random((600, 4), dtype=np.float32)
    y = (x.sum(axis=1) > 2).astype(np.int32)
    d = str(tmp_path / "ds")
    ArraysToRecords.from_arrays(x, y, d, lattice=lattice, verbose=0)
    kw = dict(batch_size=64, seed=0, validation_split=0.2, access=access)
    train = TFRecordSequenceSource(d, subset="training", **kw)
    val = TFRecordSequenceSource(d, subset="validation", **kw)
    iterators = []
    init = source_module._Iterator.__init__

    def recorded(self, source):
        iterators.append(self)
        init(self, source)

    monkeypatch.setattr(source_module._Iterator, "__init__", recorded)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, activation="sigmoid")])
    model.compile("sgd", "binary_crossentropy")
    epochs = 3
    history = model.fit(train, validation_data=val, epochs=epochs, verbose=0)
    assert len(history.history["val_loss"]) == epochs
    made = [it for it in iterators if it._resource is not None]
    assert len(made) == 2 * epochs  # a training epoch and a validation pass each
    assert len(iterators) > len(made)  # Keras made others, and dropped them unread


def _in_forked_child(read) -> int:
    """Runs ``read()`` in a child forked from this process; returns its exit status (the
    child ends with ``os._exit``: TensorFlow's iterators left from the parent hold up a
    normal exit; SIGALRM ends it after 60 s should it wait)."""
    import os
    import signal

    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 99
        try:
            signal.alarm(60)
            code = read()
        except BaseException:
            code = 98
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.parametrize("access", ["blocks", "samples"])
def test_a_tf_data_iterator_continued_in_a_forked_child_says_so(make_dataset, access):
    """TensorFlow's iterator waits for ever when a forked child reads it on (its threads
    stayed in the parent): the source's iterator raises instead, naming the fix."""
    x = np.arange(400, dtype=np.float32).reshape(100, 4)
    src = TFRecordSequenceSource(
        make_dataset(x, np.arange(100)), batch_size=10, access=access, seed=0
    )
    it = iter(src)
    if access == "samples":  # read in Python, it has no tf.data iterator: `fit` makes one
        tf.function(lambda i: next(i))(it)
    else:
        next(it)

    def read() -> int:
        try:
            next(it)
        except RuntimeError as e:
            if not ("forked" in str(e) and "iter(source)" in str(e)):
                return 2
            # The fix it names: a new iterator, made in the child, reads the epoch.
            return 0 if sum(len(b[0]) for b in iter(src)) == 100 else 3
        return 1

    assert _in_forked_child(read) == 0
    assert len(list(it)) == 9  # the parent reads on


def test_a_numpy_iterator_of_sample_mode_goes_on_in_a_forked_child(make_dataset):
    x = np.arange(400, dtype=np.float32).reshape(100, 4)
    src = TFRecordSequenceSource(make_dataset(x, np.arange(100)), batch_size=10, seed=0)
    it = src.as_numpy_iterator()
    first = next(it)[0]

    def read() -> int:
        rest = np.concatenate([b[0] for b in it])
        seen = np.sort(np.concatenate([first, rest]), axis=0)
        return 0 if np.array_equal(seen, x) else 3

    assert _in_forked_child(read) == 0
