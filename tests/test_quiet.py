"""Quiet output: Keras' shuffle warning off for sources only, TensorFlow's start-up lines.

`keras_tfr._compat.keras_shuffle` holds the private Keras API use behind the filter;
``tests/test_compat.py`` fails loudly, naming the API, when Keras moves it or the
installed Keras was never verified.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
from _readers import write_examples

from keras_tfr import _quiet
from keras_tfr._compat import keras_shuffle

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _original_init(iterator_class):
    init = iterator_class.__init__
    return getattr(init, "__wrapped__", init) if getattr(init, keras_shuffle._MARK, False) else init


@pytest.mark.parametrize(
    "version, expected",
    [("3.14.9", False), ("3.15.0", True), ("3.15.1", True), ("3.16.0", False), ("4.0", False)],
)
def test_keras_version_range(version, expected):
    assert keras_shuffle.keras_version_verified(version) is expected


def _shuffle_warnings(record):
    return [w for w in record if keras_shuffle.SHUFFLE_WARNING in str(w.message)]


def test_fit_on_a_source_does_not_warn_but_a_users_dataset_does(make_dataset, small_xy):
    import keras
    import tensorflow as tf

    from keras_tfr import TFRecordSequenceSource

    x, y = small_xy
    source = TFRecordSequenceSource(make_dataset(x, y), batch_size=8, shuffle=True, seed=0)
    assert keras_shuffle.install_shuffle_warning_filter() is True
    assert keras_shuffle.install_shuffle_warning_filter() is True  # idempotent: wrapped once
    from keras.src.trainers.epoch_iterator import EpochIterator

    assert not getattr(EpochIterator.__init__.__wrapped__, keras_shuffle._MARK, False)

    model = keras.Sequential([keras.Input((5, 3)), keras.layers.Flatten(), keras.layers.Dense(34)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    users = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model.fit(source, epochs=1, verbose=0)  # shuffle=True is fit's default
        assert _shuffle_warnings(record) == []
        model.fit(users, epochs=1, verbose=0)
        from_user = _shuffle_warnings(record)
        assert len(from_user) == 1
        # Keras' own location, as without keras-tfr (no wrapper frame in between).
        assert from_user[0].filename.endswith(os.path.join("trainers", "epoch_iterator.py"))
        model.fit(source.map(lambda a, b: (a, b)), epochs=1, verbose=0)  # no longer a source
        assert len(_shuffle_warnings(record)) == 2


def test_keras_tfr_data_sets_that_shuffle_themselves_do_not_warn_either(tmp_path, small_xy):
    """`from_tfrecords`'s data set and `distribute_source`'s shuffle by their own
    arguments, like a source: no Keras shuffle warning; with ``shuffle=False`` they are
    not marked (and Keras' `fit(shuffle=True)` warns as for any data set)."""
    import keras
    import tensorflow as tf

    from keras_tfr import ArraysToRecords, TFRecordSequenceSource, distribute_source
    from keras_tfr.tfrecords import from_tfrecords

    x, y = small_xy
    path = str(tmp_path / "old.tfrecord")
    features = write_examples(path, x, y)
    ArraysToRecords.from_arrays(x.reshape(34, 15), y, str(tmp_path / "ds"), verbose=0)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])  # a distributed data set, not a source
    model = keras.Sequential([keras.Input((15,)), keras.layers.Dense(34)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    for shuffle in (True, False):
        data = [
            from_tfrecords(path, features, batch_size=8, y="y", shuffle=shuffle, seed=0),
            distribute_source(strategy, str(tmp_path / "ds"), batch_size=8, shuffle=shuffle),
        ]
        for ds in data:
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                model.fit(ds, epochs=1, verbose=0)  # shuffle=True is fit's default
            assert not isinstance(ds, TFRecordSequenceSource)
            assert len(_shuffle_warnings(record)) == (0 if shuffle else 1), (shuffle, ds)


def test_constructing_a_source_installs_the_filter(make_dataset, small_xy, monkeypatch):
    from keras.src.trainers.epoch_iterator import EpochIterator

    from keras_tfr import TFRecordSequenceSource

    directory = make_dataset(*small_xy)
    # Keras as it was before any filter (another test may have installed one already).
    monkeypatch.setattr(EpochIterator, "__init__", _original_init(EpochIterator))
    assert not getattr(EpochIterator.__init__, keras_shuffle._MARK, False)
    TFRecordSequenceSource(directory, batch_size=8)
    assert getattr(EpochIterator.__init__, keras_shuffle._MARK, False)


# -- TensorFlow's start-up lines ----------------------------------------------------------

NOISE = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1796102325.200200    6787 port.cc:153] oneDNN custom operations are on.",
    "I0000 00:00:1796102325.200653    6787 cudart_stub.cc:31] Could not find cuda drivers",
    "W0000 00:00:1796102325.2    6787 some_file.cc:1] a warning before InitializeLog",
]
CUINIT = (
    "E0000 00:00:1796102329.860795    6787 cuda_platform.cc:52] failed call to cuInit: "
    "INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)"
)
KEPT = [
    "/home/me/train.py:12: UserWarning: my own warning",
    "WARNING:tensorflow:a Python-level TensorFlow warning",
    "I0512 10:11:12.123456 140 train.py:9] absl-py logging carries a real date",
    "F0000 00:00:1796102329.8    6787 other.cc:7] fatal lines always stay",
    "epoch 1/3 - loss 0.5",
]


@pytest.mark.parametrize("line", NOISE)
def test_startup_noise_is_dropped_at_level_2(line):
    assert _quiet.is_startup_noise(line + "\n", 2)
    assert _quiet.is_startup_noise("[3] " + line, 2)  # keras_tfr.parallel's prefix
    assert not _quiet.is_startup_noise(line, 0)  # the user asked for everything


@pytest.mark.parametrize("line", KEPT)
def test_everything_else_stays(line):
    for level in (0, 1, 2, 3):
        assert not _quiet.is_startup_noise(line, level)


def test_cpp_errors_stay_below_level_3():
    error = "E0000 00:00:1796102329.8    6787 other.cc:7] an error from C++ that is not cuInit"
    for level in (0, 1, 2):
        assert not _quiet.is_startup_noise(error, level)
    assert _quiet.is_startup_noise(error, 3)  # TF_CPP_MIN_LOG_LEVEL=3 asks to hide errors


def test_levels_follow_tf_cpp_min_log_level(monkeypatch):
    warning = NOISE[3]
    assert not _quiet.is_startup_noise(warning, 1)
    assert _quiet.is_startup_noise(warning, 2)
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "1")
    assert not _quiet.is_startup_noise(warning)
    assert _quiet.is_startup_noise(NOISE[1])
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "3")
    assert _quiet.is_startup_noise(CUINIT)


def test_cuinit_failure_is_dropped_only_without_an_nvidia_device(monkeypatch):
    monkeypatch.setattr(_quiet, "_no_nvidia_device", lambda: True)
    assert _quiet.is_startup_noise(CUINIT, 2)
    assert not _quiet.is_startup_noise(CUINIT, 0)
    monkeypatch.setattr(_quiet, "_no_nvidia_device", lambda: False)  # a GPU whose driver fails
    assert not _quiet.is_startup_noise(CUINIT, 2)


def test_filtered_output_passes_whole_lines_on():
    out = io.StringIO()
    stream = _quiet.FilteredOutput(out, min_level=2)
    stream.write("[0] " + NOISE[1] + "\n[1] keep me\n[2] and ")
    stream.write("me\n")
    stream.flush()
    assert out.getvalue() == "[1] keep me\n[2] and me\n"


def test_quiet_stderr_replays_all_but_noise(capfd):
    with _quiet.quiet_stderr(min_level=2):
        os.write(2, ("\n".join([*NOISE, *KEPT]) + "\n").encode())
        print("to stdout, untouched")
        print("mine, from Python's sys.stderr", file=sys.stderr)
    captured = capfd.readouterr()
    assert captured.out == "to stdout, untouched\n"
    lines = captured.err.splitlines()
    assert [line for line in lines if line in KEPT] == KEPT
    assert "mine, from Python's sys.stderr" in lines
    assert len(lines) == len(KEPT) + 1
    assert not any(noise in captured.err for noise in NOISE)


def test_quiet_stderr_replays_when_the_block_raises(capfd):
    with pytest.raises(RuntimeError), _quiet.quiet_stderr(min_level=2):
        os.write(2, b"before the error\n")
        raise RuntimeError("boom")
    assert capfd.readouterr().err == "before the error\n"


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": REPO, "TF_CPP_MIN_LOG_LEVEL": "2", **env}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=300
    )


@pytest.mark.subprocess
def test_a_first_fit_shows_only_what_the_user_can_act_on(make_dataset):
    # The whole stderr of a process that imports TensorFlow, fits on a source and on the
    # user's own tf.data.Dataset, and warns for itself.
    x = np.random.default_rng(0).standard_normal((40, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    directory = make_dataset(x, y)
    code = textwrap.dedent(
        f"""
        from keras_tfr._quiet import import_tensorflow_quietly
        import_tensorflow_quietly()
        import warnings
        import keras
        import tensorflow as tf
        from keras_tfr import TFRecordSequenceSource
        from keras_tfr._compat import keras_shuffle
        keras_shuffle.install_shuffle_warning_filter()  # until source.py calls it itself
        source = TFRecordSequenceSource({directory!r}, batch_size=16, seed=0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(source, epochs=1, verbose=0)
        print("fitted on the source", flush=True)
        x, y = next(iter(source.unbatch().batch(40)))
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=1, verbose=0)
        warnings.warn("the user's own warning")
        """
    )
    result = _run_python(code)
    assert result.returncode == 0, result.stderr
    assert "fitted on the source" in result.stdout
    err = result.stderr
    assert err.count(keras_shuffle.SHUFFLE_WARNING) == 1, err  # the user's data set's, only
    assert "UserWarning: the user's own warning" in err
    for noise in ("absl::InitializeLog", "I0000 ", "port.cc", "cudart_stub.cc"):
        assert noise not in err, err
    if _quiet._no_nvidia_device():
        assert "cuInit" not in err, err


@pytest.mark.subprocess
@pytest.mark.parametrize("lattice", [True, False])
def test_a_damaged_record_in_fit_is_one_error_not_a_python_traceback(tmp_path, lattice):
    # Sample mode finds damage in a Python call tf.data makes: raised there, TensorFlow
    # logged it with its traceback, twice (about 90 lines), before `fit` raised it.
    from keras_tfr import ArraysToRecords

    x = np.random.default_rng(0).standard_normal((4000, 6)).astype(np.float32)
    y = np.arange(4000) % 3
    d = str(tmp_path / "ds")
    m = ArraysToRecords.from_arrays(x, y, d, samples_per_record=100, lattice=lattice, verbose=0)
    path = m.shard_path(m.shards[0])
    with open(path, "r+b") as f:
        f.seek(m.shards[0].bytes // 2)
        byte = f.read(1)
        f.seek(m.shards[0].bytes // 2)
        f.write(bytes([byte[0] ^ 1]))
    code = textwrap.dedent(
        f"""
        import keras
        from keras_tfr import CorruptRecordError, TFRecordSequenceSource
        source = TFRecordSequenceSource({d!r}, batch_size=64, seed=0, access="samples")
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        try:
            model.fit(source, epochs=1, verbose=0)
        except CorruptRecordError as e:
            print("caught:", e.file, e.offset, flush=True)
        """
    )
    result = _run_python(code, TF_CPP_MIN_LOG_LEVEL="0")  # TensorFlow's default: warnings shown
    assert result.returncode == 0, result.stderr
    assert f"caught: {path} " in result.stdout, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stderr.count("keras-tfr: corrupt record") <= 1, result.stderr
    assert result.stderr.count("Local rendezvous is aborting") <= 1, result.stderr
    assert "op_kernel.cc" not in result.stderr, result.stderr


@pytest.mark.parametrize("batch_mb", [1, 5])
def test_reading_through_tf_data_draws_no_python_warning(tmp_path, batch_mb):
    """Sample mode's pipeline, batches under 4 MB (gathered in parallel) and over (one at
    a time), read through tf.data: no Python warning (TensorFlow warned that
    `deterministic` has no effect without `num_parallel_calls`)."""
    import numpy as np

    from keras_tfr import ArraysToRecords, TFRecordSequenceSource

    x = np.zeros((64, 64, 64, 3), np.float32)  # 48 KB per sample
    ArraysToRecords.from_arrays(x, np.arange(64), str(tmp_path / "ds"), verbose=0)
    batch = batch_mb * 2**20 // (64 * 64 * 3 * 4)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        src = TFRecordSequenceSource(str(tmp_path / "ds"), batch_size=batch, shuffle=False)
        assert src.access == "samples"
        ys = [b[1].numpy() for b in src.map(lambda a, b: (a, b))]
    assert sorted(np.concatenate(ys).tolist()) == list(range(64))
    assert [str(w.message) for w in record] == []
