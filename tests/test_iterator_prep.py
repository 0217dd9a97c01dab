"""What building a source and each new iterator prepare: the source's tf.data functions
are marked ``experimental_ints_on_device`` (`keras_tfr._compat.tf.one_device_functions`),
so that TensorFlow prepares them on one device, without its Grappler pass, each time
Keras makes an iterator (every epoch, every validation pass), and are traced without
AutoGraph. Only the source's own functions: the user's (``source.map(f)``) and any other
pipeline keep TensorFlow's default, and the user's ``decode`` functions are still
converted. The time it saves is measured in ``benchmarks/epoch_start.py``, not here."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import tensorflow as tf
from _readers import write_examples

from keras_tfr import ArraysToRecords, TFRecordSequenceSource, _compat
from keras_tfr._compat import tf as compat_tf

ATTR = "experimental_ints_on_device"


def _functions(ds) -> dict:
    """The tf.data functions of ``ds``'s graph (stage functions and those they call),
    by name."""
    ignore = tf.data.experimental.ExternalStatePolicy.IGNORE
    graph = tf.compat.v1.GraphDef.FromString(
        ds._as_serialized_graph(external_state_policy=ignore).numpy()
    )
    return {f.signature.name: f for f in graph.library.function if "_tf_data_function" in f.attr}


def _marked(f) -> bool:
    return ATTR in f.attr and f.attr[ATTR].b


def _batches(ds) -> list:
    return [[np.asarray(t).tobytes() for t in tf.nest.flatten(b)] for b in ds]


@pytest.fixture
def sources(write_sorted, tmp_path):
    """One source per kind of pipeline: sample mode on a lattice and without one (its
    records too small for the padding), block mode, a split, variable-length data."""
    lattice, *_ = write_sorted(300)
    rng = np.random.default_rng(1)
    plain = str(tmp_path / "plain")
    ArraysToRecords.from_arrays(
        rng.standard_normal((200, 7, 5)).astype(np.float32), np.arange(200), plain,
        samples_per_record=37, verbose=0,
    )  # fmt: skip
    seqs = str(tmp_path / "seqs")
    rows = [rng.integers(1, 9, n, dtype=np.int32) for n in rng.integers(1, 12, 90)]
    ArraysToRecords.from_arrays(
        [(rows[i : i + 30], np.arange(i, i + 30)) for i in range(0, 90, 30)],
        directory=seqs, variable_length=["x"], verbose=0,
    )  # fmt: skip
    kw = dict(batch_size=32, seed=3)
    return {
        "samples, lattice": TFRecordSequenceSource(lattice, **kw),
        "samples, no lattice": TFRecordSequenceSource(plain, **kw),
        "blocks": TFRecordSequenceSource(lattice, access="blocks", **kw),
        "split": TFRecordSequenceSource(lattice, validation_split=0.2, subset="validation", **kw),
        "variable length": TFRecordSequenceSource(seqs, **kw),
    }


def test_every_function_of_every_pipeline_is_marked(sources):
    assert sources["samples, no lattice"].access == "samples"
    assert sources["variable length"].access == "blocks"
    for name, src in sources.items():
        functions = _functions(src)
        assert functions, name
        unmarked = [n for n, f in functions.items() if not _marked(f)]
        assert unmarked == [], (name, unmarked)


def test_the_pipeline_of_an_epoch_resumed_mid_way_is_marked(sources):
    src = sources["samples, lattice"]
    resumed = src._resumed(2)  # what Keras' multi-step loop reads after `set_epoch(e, 2)`
    assert resumed is not src
    functions = _functions(resumed)
    assert functions and all(_marked(f) for f in functions.values())


def test_the_users_functions_keep_tensorflows_default(sources):
    for name, src in sources.items():
        ours = set(_functions(src))
        mapped = src.map(lambda *b: b)
        theirs = {n: f for n, f in _functions(mapped).items() if n not in ours}
        assert theirs, name
        assert not any(_marked(f) for f in theirs.values()), name


def test_only_the_building_thread_inside_the_block_is_marked(sources):
    assert sources  # keras-tfr's hook is installed by now
    outside = tf.data.Dataset.range(4).map(lambda v: v + 1)
    got = {}

    def other():
        got["other"] = tf.data.Dataset.range(4).map(lambda v: v + 2)

    with compat_tf.one_device_functions() as installed:
        inside = tf.data.Dataset.range(4).map(lambda v: v + 3)
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert installed
    assert all(_marked(f) for f in _functions(inside).values())
    for ds in (outside, got["other"]):
        assert not any(_marked(f) for f in _functions(ds).values())
    assert list(inside.as_numpy_iterator()) == [3, 4, 5, 6]


def test_tensorflows_default_rewrites_turned_on_read_the_same_batches(sources):
    """TensorFlow 2.21's `inject_prefetch` rewrite, one of its defaults, fails on a marked
    function with several outputs, an int32 among them ("Expected only one fetch node"):
    the source turns it off (its pipeline ends in a prefetch), also where a user turns
    the defaults on."""
    on = tf.data.Options()
    on.experimental_optimization.apply_default_optimizations = True
    on.autotune.enabled = True
    for name, src in sources.items():
        if name == "split":
            continue  # the same pipeline as the first
        src.set_epoch(4)
        expected = _batches(src)
        src.set_epoch(4)
        assert _batches(src.with_options(on)) == expected, name


def test_a_moved_tracing_api_is_named_and_changes_nothing(monkeypatch, sources):
    from tensorflow.python.data.ops import structured_function

    cls = structured_function.StructuredFunctionWrapper
    monkeypatch.setattr(cls, "__init__", lambda self, func, transformation_name: None)
    problems = [p for p in _compat.check_all() if "StructuredFunctionWrapper" in p]
    assert len(problems) == 1 and "defun_kwargs" in problems[0], problems
    with compat_tf.one_device_functions() as installed:
        pass
    assert not installed


def test_the_sources_functions_are_traced_without_autograph(write_sorted, tmp_path, monkeypatch):
    """AutoGraph converted every Python function the pipeline's functions call (the
    layout's byte arithmetic included), which took 3.6 s for a block-mode source of two
    features and 11.7 s for one of 150 (docs/benchmarks.md); none of them has Python
    control flow on tensors, so the source traces them as they are."""
    from tensorflow.python.autograph.impl import api

    d, *_ = write_sorted(300)
    converted = []
    original = api.converted_call

    def counting(f, *args, **kwargs):
        func = getattr(f, "__func__", f)
        converted.append(str(getattr(func, "__module__", "")))
        return original(f, *args, **kwargs)

    monkeypatch.setattr(api, "converted_call", counting)
    for access in ("samples", "blocks"):
        src = TFRecordSequenceSource(d, batch_size=32, seed=2, access=access)
        assert len(_batches(src)) == len(src)
    ours = [m for m in converted if m.startswith("keras_tfr")]
    assert ours == []


def test_a_users_decoder_with_python_control_flow_is_still_converted(tmp_path):
    """The user's ``decode`` functions run inside the source's (unconverted) function:
    they are still converted by AutoGraph, so a Python ``if`` on a tensor works."""
    rng = np.random.default_rng(4)
    seqs = [rng.integers(1, 9, n, dtype=np.int32) for n in rng.integers(1, 9, 40)]
    labels = np.arange(40)
    d = str(tmp_path / "seqs")
    ArraysToRecords.from_arrays(
        [(seqs[i : i + 10], labels[i : i + 10]) for i in range(0, 40, 10)],
        directory=d, variable_length=["x"], verbose=0,
    )  # fmt: skip

    def total_or_minus_one(v):
        total = tf.reduce_sum(v)
        if total > 20:  # a Python `if` on a tensor: AutoGraph makes it a `tf.cond`
            total = -tf.ones_like(total)
        return total

    src = TFRecordSequenceSource(d, batch_size=8, seed=0, decode={"x": total_or_minus_one})
    got = {}
    for xb, yb in src:
        got.update(zip(yb.numpy().tolist(), xb.numpy().tolist()))
    expected = {i: (int(s.sum()) if s.sum() <= 20 else -1) for i, s in enumerate(seqs)}
    assert got == expected
    assert any(v == -1 for v in got.values()) and any(v > 0 for v in got.values())


def test_from_tfrecords_functions_are_marked_and_read_with_the_defaults_on(tmp_path):
    rng = np.random.default_rng(6)
    x = rng.random((90, 4), dtype=np.float32)
    path = str(tmp_path / "d.tfrecord")
    features = write_examples(path, x, np.arange(90))
    ds = TFRecordSequenceSource.from_tfrecords(path, features, 16, y="y", seed=1)
    functions = _functions(ds)
    assert functions and all(_marked(f) for f in functions.values())
    on = tf.data.Options()
    on.experimental_optimization.apply_default_optimizations = True
    batches = list(ds.with_options(on).as_numpy_iterator())
    assert len(batches) == len(ds) == 6
    ids = np.concatenate([yb for _, yb in batches])
    assert sorted(ids.tolist()) == list(range(90)) and ids.tolist() != list(range(90))
    for xb, yb in batches:
        assert xb.tobytes() == x[yb].tobytes()
