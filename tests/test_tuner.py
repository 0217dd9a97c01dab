"""keras-tuner on keras-tfr sources: every built-in tuner, tuned batch sizes, the launcher."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from _procs import start_and_wait, still_running

N_TRAIN = 200
N_VAL = 40
FEATURES = 4


@pytest.fixture(scope="module")
def data_dirs(tmp_path_factory):
    """200 training and 40 validation samples of a linear problem, 8 samples a record."""
    from keras_tfr import ArraysToRecords

    root = tmp_path_factory.mktemp("tuner_data")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N_TRAIN + N_VAL, FEATURES)).astype(np.float32)
    y = (x @ np.arange(1, FEATURES + 1, dtype=np.float32)).astype(np.float32)[:, None]
    train, val = str(root / "train"), str(root / "val")
    ArraysToRecords.from_arrays(x[:N_TRAIN], y[:N_TRAIN], train, samples_per_record=8, verbose=0)
    ArraysToRecords.from_arrays(x[N_TRAIN:], y[N_TRAIN:], val, samples_per_record=8, verbose=0)
    return {"train": train, "val": val, "x": x, "y": y}


@pytest.fixture(scope="module")
def sources(data_dirs):
    from keras_tfr import TFRecordSequenceSource

    train = TFRecordSequenceSource(data_dirs["train"], batch_size=10, seed=0)
    val = TFRecordSequenceSource(data_dirs["val"], batch_size=10, shuffle=False)
    return train, val


def _recorder():
    """A callback class whose runs land in a class-level list (keras-tuner deep-copies
    callbacks per execution, so instance state would be lost)."""
    import keras

    class Recorder(keras.callbacks.Callback):
        runs: list = []

        def on_train_begin(self, logs=None):
            self._counts = []

        def on_epoch_begin(self, epoch, logs=None):
            self._counts.append(0)

        def on_train_batch_end(self, batch, logs=None):
            self._counts[-1] += 1

        def on_train_end(self, logs=None):
            Recorder.runs.append(
                {
                    "batch_size": getattr(self.model, "_test_batch_size", None),
                    "steps": self.params["steps"],
                    "counted": list(self._counts),
                }
            )

    return Recorder


def _build_fn(units=False, seen=None):
    """A tiny regression model; remembers the trial's batch size on the model."""
    import keras

    def build(hp):
        width = hp.Int("units", 2, 4, step=2) if units else 2
        model = keras.Sequential(
            [keras.Input((FEATURES,)), keras.layers.Dense(width), keras.layers.Dense(1)]
        )
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        model._test_batch_size = hp.values.get("batch_size")
        if seen is not None:
            fit = model.fit

            def recording_fit(x=None, *args, **kwargs):
                val = kwargs.get("validation_data")
                seen.append(
                    {
                        "x": x,
                        "val_batch_size": getattr(val, "batch_size", None),
                        "batch_size_kwarg": kwargs.get("batch_size"),
                        "validation_batch_size_kwarg": kwargs.get("validation_batch_size"),
                    }
                )
                return fit(x, *args, **kwargs)

            model.fit = recording_fit
        return model

    return build


def _check_runs(runs, n=N_TRAIN):
    """Every fit took ceil(n / its batch size) steps, in Keras' count and in batches seen."""
    assert runs
    for run in runs:
        expected = math.ceil(n / run["batch_size"])
        assert run["steps"] == expected, run
        assert run["counted"] and all(c == expected for c in run["counted"]), run


def _tuner(cls, hypermodel, tmp_path, **kwargs):
    return cls(
        hypermodel,
        objective="val_loss",
        directory=str(tmp_path),
        project_name=cls.__name__,
        overwrite=True,
        seed=1,
        **kwargs,
    )


TUNERS = {
    "RandomSearch": {"max_trials": 2},
    "GridSearch": {"max_trials": 2},
    "BayesianOptimization": {"max_trials": 2},
    "Hyperband": {"max_epochs": 2, "factor": 3, "hyperband_iterations": 1},
}


@pytest.mark.parametrize("tuner_name", sorted(TUNERS))
def test_every_builtin_tuner_searches_a_source_with_tuned_batch_size(tuner_name, sources, tmp_path):
    import keras_tuner

    if tuner_name == "BayesianOptimization":
        pytest.importorskip("sklearn")
    from keras_tfr.tuner import TFRecordHyperModel

    train, val = sources
    Recorder = _recorder()
    hypermodel = TFRecordHyperModel(
        _build_fn(units=tuner_name != "GridSearch"), batch_size=[16, 64]
    )
    tuner = _tuner(getattr(keras_tuner, tuner_name), hypermodel, tmp_path, **TUNERS[tuner_name])
    tuner.search(train, validation_data=val, epochs=1, callbacks=[Recorder()], verbose=0)

    trials = list(tuner.oracle.trials.values())
    assert trials and all(t.status == "COMPLETED" for t in trials)
    assert all(t.hyperparameters.values["batch_size"] in (16, 64) for t in trials)
    assert len(Recorder.runs) == len(trials)
    _check_runs(Recorder.runs)
    if tuner_name == "GridSearch":
        # The only hyperparameter is the batch size: both values, one trial each.
        assert sorted(r["batch_size"] for r in Recorder.runs) == [16, 64]
    best = tuner.get_best_hyperparameters()[0].values
    assert best["batch_size"] in (16, 64)
    # The user's sources are untouched.
    assert train.batch_size == 10 and val.batch_size == 10


def test_executions_per_trial(sources, tmp_path):
    import keras_tuner

    from keras_tfr.tuner import TFRecordHyperModel

    train, val = sources
    Recorder = _recorder()
    tuner = _tuner(
        keras_tuner.RandomSearch,
        TFRecordHyperModel(_build_fn(), batch_size=[32]),
        tmp_path,
        max_trials=1,
        executions_per_trial=2,
    )
    tuner.search(train, validation_data=val, epochs=1, callbacks=[Recorder()], verbose=0)
    (trial,) = tuner.oracle.trials.values()
    assert trial.status == "COMPLETED"
    assert len(Recorder.runs) == 2
    _check_runs(Recorder.runs)
    assert all(r["steps"] == 7 for r in Recorder.runs)  # ceil(200 / 32)


def test_copies_share_the_manifest_and_take_the_trials_values(sources, tmp_path):
    import keras_tuner

    from keras_tfr.tuner import TFRecordHyperModel

    train, val = sources
    seen: list = []
    tuner = _tuner(
        keras_tuner.GridSearch,
        TFRecordHyperModel(_build_fn(seen=seen), batch_size=25, shuffle_memory=["1MB", "2MB"]),
        tmp_path,
        max_trials=2,
    )
    tuner.search(train, validation_data=val, epochs=1, verbose=0)
    assert len(seen) == 2
    trials = sorted(tuner.oracle.trials.values(), key=lambda t: t.trial_id)
    for call, trial in zip(seen, trials):
        x = call["x"]
        assert x is not train and x.manifest is train.manifest  # no re-reading from disk
        assert x.batch_size == 25 and len(x) == 8  # ceil(200 / 25)
        assert x.config.shuffle_memory == trial.hyperparameters.values["shuffle_memory"]
        assert call["val_batch_size"] == 25  # validation follows, as fit does for arrays
    assert sorted(c["x"].config.shuffle_memory for c in seen) == ["1MB", "2MB"]


def test_trials_read_their_own_copies_quietly_and_a_search_batch_size_is_said(
    data_dirs, tmp_path, caplog
):
    """At the source's own batch size, the trials read the user's source itself: the
    second trial read on from the first's epochs, and the user's source after them. Each
    trial now reads copies from epoch 0; nothing is logged (a `shuffle=False` the
    hypermodel passed drew keras-tfr's fit-order warning on every trial). A `batch_size`
    given to `search` overrides the trial's, which the tuner still records: said once."""
    import keras_tuner

    from keras_tfr import TFRecordSequenceSource
    from keras_tfr.tuner import TFRecordHyperModel

    train = TFRecordSequenceSource(data_dirs["train"], batch_size=10, seed=0)
    val = TFRecordSequenceSource(data_dirs["val"], batch_size=10, shuffle=False)
    seen: list = []
    hypermodel = TFRecordHyperModel(_build_fn(units=True, seen=seen), batch_size=[10])
    tuner = _tuner(keras_tuner.RandomSearch, hypermodel, tmp_path, max_trials=2)
    with caplog.at_level("WARNING", logger="keras_tfr"):
        tuner.search(train, validation_data=val, epochs=2, verbose=0)
    assert caplog.records == []
    assert len(seen) == 2 and all(c["x"] is not train and c["x"].batch_size == 10 for c in seen)
    first = next(iter(train))[1].numpy()  # the user's source still reads its epoch 0
    assert np.array_equal(first, data_dirs["y"][train.sample_order(0)[:10]])

    caplog.clear()
    seen.clear()
    tuner = _tuner(keras_tuner.RandomSearch, hypermodel, tmp_path / "override", max_trials=2)
    with caplog.at_level("WARNING", logger="keras_tfr"):
        tuner.search(train, validation_data=val, epochs=1, verbose=0, batch_size=25)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said
    assert "batch_size=25 given to fit" in said[0] and "batch_size hyperparameter (10)" in said[0]
    assert all(c["x"].batch_size == 25 for c in seen)


def test_validation_batch_size_overrides_the_validation_batch_size(data_dirs, sources, tmp_path):
    """docs/tuning.md: the validation source gets the trial's batch size "unless you pass
    `validation_batch_size`" (to `search`, which hands it to `fit`)."""
    import keras_tuner

    from keras_tfr.tuner import TFRecordHyperModel

    train, val = sources
    seen: list = []
    tuner = _tuner(
        keras_tuner.RandomSearch,
        TFRecordHyperModel(_build_fn(seen=seen), batch_size=25),
        tmp_path,
        max_trials=1,
    )
    tuner.search(train, validation_data=val, validation_batch_size=8, epochs=1, verbose=0)
    (call,) = seen
    assert call["x"].batch_size == 25
    assert call["val_batch_size"] == 8  # not the trial's 25, nor the source's own 10
    assert call["validation_batch_size_kwarg"] is None  # used up on the source
    assert val.batch_size == 10  # the user's source is unchanged
    # Arrays: Keras batches them, so both sizes go to model.fit.
    x, y = data_dirs["x"], data_dirs["y"]
    seen.clear()
    tuner = _tuner(
        keras_tuner.RandomSearch,
        TFRecordHyperModel(_build_fn(seen=seen), batch_size=25),
        tmp_path / "arrays",
        max_trials=1,
    )
    tuner.search(
        x[:N_TRAIN],
        y[:N_TRAIN],
        validation_data=(x[N_TRAIN:], y[N_TRAIN:]),
        validation_batch_size=8,
        epochs=1,
        verbose=0,
    )
    (call,) = seen
    assert (call["batch_size_kwarg"], call["validation_batch_size_kwarg"]) == (25, 8)


def test_batch_size_declared_in_build_or_passed_by_a_subclass(sources, tmp_path):
    import keras_tuner

    from keras_tfr.tuner import TFRecordHyperModel

    train, val = sources
    build = _build_fn()

    def build_declaring(hp):
        hp.Choice("batch_size", [40])
        return build(hp)

    Recorder = _recorder()
    tuner = _tuner(
        keras_tuner.RandomSearch, TFRecordHyperModel(build_declaring), tmp_path, max_trials=1
    )
    tuner.search(train, validation_data=val, epochs=1, callbacks=[Recorder()], verbose=0)
    assert [r["steps"] for r in Recorder.runs] == [5]  # ceil(200 / 40)

    class Documented(TFRecordHyperModel):
        """keras-tuner's documented way to tune the batch size, now with a source."""

        def build(self, hp):
            return build(hp)

        def fit(self, hp, model, *args, **kwargs):
            return super().fit(hp, model, *args, batch_size=hp.Choice("batch_size", [50]), **kwargs)

    Recorder = _recorder()
    tuner = _tuner(keras_tuner.RandomSearch, Documented(), tmp_path / "b", max_trials=1)
    tuner.search(train, validation_data=val, epochs=1, callbacks=[Recorder()], verbose=0)
    assert [r["steps"] for r in Recorder.runs] == [4]  # ceil(200 / 50)


def test_arrays_get_the_batch_size_passed_to_fit(data_dirs, tmp_path):
    import keras_tuner

    from keras_tfr.tuner import TFRecordHyperModel

    x, y = data_dirs["x"], data_dirs["y"]
    Recorder = _recorder()
    tuner = _tuner(
        keras_tuner.RandomSearch,
        TFRecordHyperModel(_build_fn(), batch_size=lambda hp: hp.Choice("batch_size", [64])),
        tmp_path,
        max_trials=1,
    )
    tuner.search(
        x[:N_TRAIN],
        y[:N_TRAIN],
        validation_data=(x[N_TRAIN:], y[N_TRAIN:]),
        epochs=1,
        callbacks=[Recorder()],
        verbose=0,
    )
    _check_runs(Recorder.runs)
    assert [r["steps"] for r in Recorder.runs] == [4]


def test_a_plain_dataset_is_told_that_the_batch_size_has_no_effect(data_dirs, tmp_path, caplog):
    """A `tf.data.Dataset` brings its own batches: Keras ignores `batch_size`, so the
    trials' batch size would be recorded without being used; the log says so once."""
    import keras_tuner
    import tensorflow as tf

    from keras_tfr.tuner import TFRecordHyperModel

    x, y = data_dirs["x"], data_dirs["y"]
    data = tf.data.Dataset.from_tensor_slices((x[:N_TRAIN], y[:N_TRAIN])).batch(10)
    Recorder = _recorder()
    hypermodel = TFRecordHyperModel(_build_fn(), batch_size=[64, 128])
    tuner = _tuner(keras_tuner.RandomSearch, hypermodel, tmp_path, max_trials=2)
    with caplog.at_level("WARNING", logger="keras_tfr"):
        tuner.search(data, epochs=1, callbacks=[Recorder()], verbose=0)
    assert [r["steps"] for r in Recorder.runs] == [N_TRAIN // 10] * len(Recorder.runs)
    said = [r for r in caplog.records if "batch_size has no effect" in r.getMessage()]
    assert len(said) == 1 and "TFRecordSequenceSource" in said[0].getMessage()


def test_memory_goes_back_to_the_system_before_each_trial_trains(sources, tmp_path, monkeypatch):
    """docs/tuning.md, "Memory across trials": `TFRecordHyperModel` drops each trial's
    pipelines and, on Linux, hands their freed memory back to the system (glibc's
    `malloc_trim`) before the next trial starts."""
    import ctypes
    import platform
    import weakref

    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc_trim is glibc's")
    import keras_tuner

    from keras_tfr.tuner import TFRecordHyperModel

    events: list = []
    pipelines: list = []  # weak references to each trial's training and validation sources

    class Libc:
        """The process's own symbols (``CDLL(None)``), with `malloc_trim` recorded."""

        def __init__(self, lib):
            self._lib = lib

        def __getattr__(self, name):
            return getattr(self._lib, name)

        def malloc_trim(self, pad):
            events.append(("malloc_trim", pad, [ref() is None for ref in pipelines]))
            return self._lib.malloc_trim(pad)

    real_cdll = ctypes.CDLL

    def cdll(name, *args, **kwargs):
        lib = real_cdll(name, *args, **kwargs)
        return Libc(lib) if name is None else lib

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    build = _build_fn()

    def recording_build(hp):
        model = build(hp)
        events.append(("build",))
        fit = model.fit

        def recording_fit(x=None, *args, **kwargs):
            events.append(("fit",))
            pipelines.extend([weakref.ref(x), weakref.ref(kwargs["validation_data"])])
            return fit(x, *args, **kwargs)

        model.fit = recording_fit
        return model

    train, val = sources
    tuner = _tuner(
        keras_tuner.GridSearch,
        TFRecordHyperModel(recording_build, batch_size=[25, 50]),
        tmp_path,
        max_trials=2,
    )
    tuner.search(train, validation_data=val, epochs=1, verbose=0)
    # keras-tuner builds once more before the trials to learn the search space.
    assert events[0] == ("build",)
    trials = events[1:]
    assert [e[0] for e in trials] == ["build", "malloc_trim", "fit"] * 2, events
    # Each trial trims (pad 0) before it trains; by the second trial's trim the first
    # trial's re-batched sources are garbage already.
    assert trials[1] == ("malloc_trim", 0, [])
    assert trials[4] == ("malloc_trim", 0, [True, True])


def test_rebatch(sources):
    from keras_tfr.tuner import rebatch

    train, _ = sources
    assert rebatch(train) is train
    assert rebatch(train, 10) is train
    copy = rebatch(train, 7, shuffle_memory="3MB")
    assert copy is not train and copy.manifest is train.manifest
    assert (copy.batch_size, len(copy), copy.config.shuffle_memory) == (7, 29, "3MB")
    arrays = np.zeros((3, 2))
    assert rebatch(arrays, 7) is arrays
    with pytest.raises(ValueError, match="batch_size"):
        rebatch(train, 0)
    with pytest.raises(TypeError, match="batch_size"):
        rebatch(train, 2.5)
    with pytest.raises(ValueError, match="shuffle_memory"):
        rebatch(train, shuffle_memory="lots")


def test_hypermodel_checks_its_arguments():
    from keras_tfr.tuner import TFRecordHyperModel

    with pytest.raises(ValueError, match="batch_size"):
        TFRecordHyperModel(lambda hp: None, batch_size=[16, 0])
    with pytest.raises(ValueError, match="batch_size"):
        TFRecordHyperModel(lambda hp: None, batch_size=[])
    with pytest.raises(TypeError, match="batch_size"):
        TFRecordHyperModel(lambda hp: None, batch_size=[16, "32"])
    with pytest.raises(ValueError, match="shuffle_memory"):
        TFRecordHyperModel(lambda hp: None, shuffle_memory=["1MB", "a lot"])
    with pytest.raises(TypeError, match="build"):
        TFRecordHyperModel("not a function")
    import keras_tuner

    with pytest.raises(NotImplementedError, match="build"):
        TFRecordHyperModel().build(keras_tuner.HyperParameters())


def test_importing_the_tune_command_does_not_load_tensorflow():
    code = (
        "import argparse, sys; import keras_tfr.tuner; from keras_tfr.cli import tune as t; "
        "t.add_arguments(argparse.ArgumentParser()); "
        "print(sorted(m for m in ('tensorflow', 'keras', 'keras_tuner') if m in sys.modules))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERAS_TFR_GPU")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------- launcher


def _script(tmp_path, body: str, name="script.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


@pytest.mark.subprocess
def test_launcher_sets_each_processs_environment(tmp_path):
    from keras_tfr.tuner import tune

    script = _script(
        tmp_path,
        """
        import json, os, sys
        keys = ["KERASTUNER_TUNER_ID", "KERASTUNER_ORACLE_IP", "KERASTUNER_ORACLE_PORT",
                "KERAS_TFR_GPU_MEMORY_MB", "CUDA_VISIBLE_DEVICES"]
        env = {k: os.environ.get(k) for k in keys}
        env["argv"] = sys.argv[1:]
        with open(os.path.join(sys.argv[1], env["KERASTUNER_TUNER_ID"] + ".json"), "w") as f:
            json.dump(env, f)
        """,
    )
    out = tmp_path / "out"
    out.mkdir()
    result = tune(
        script, [str(out), "--flag"], workers=3, gpu_memory_mb=512, gpus=["0", "1"],
        port=None, timeout=120, log_dir=tmp_path / "logs", verbose=False,
    )  # fmt: skip
    envs = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert sorted(envs) == ["chief", "tuner0", "tuner1", "tuner2"]
    ports = {e["KERASTUNER_ORACLE_PORT"] for e in envs.values()}
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536
    assert all(e["KERASTUNER_ORACLE_IP"] == "127.0.0.1" for e in envs.values())
    assert all(e["argv"] == [str(out), "--flag"] for e in envs.values())
    assert envs["chief"]["CUDA_VISIBLE_DEVICES"] == ""
    assert envs["chief"]["KERAS_TFR_GPU_MEMORY_MB"] is None
    assert [envs[f"tuner{i}"]["CUDA_VISIBLE_DEVICES"] for i in range(3)] == ["0", "1", "0"]
    assert all(envs[f"tuner{i}"]["KERAS_TFR_GPU_MEMORY_MB"] == "512" for i in range(3))
    # The script built no tuner: nothing to report, which is a failure.
    assert result.returncode == 1
    assert any("no keras-tuner tuner" in e for e in result.errors)
    assert sorted(os.listdir(tmp_path / "logs")) == [
        "chief.log",
        "tuner0.log",
        "tuner1.log",
        "tuner2.log",
    ]


@pytest.mark.subprocess
def test_launcher_stops_workers_when_the_chief_fails(tmp_path):
    from keras_tfr.tuner import tune

    script = _script(
        tmp_path,
        """
        import os, sys, time
        if os.environ["KERASTUNER_TUNER_ID"] == "chief":
            sys.exit(3)
        time.sleep(300)
        """,
    )
    start = time.monotonic()
    result = tune(script, workers=2, timeout=200, log_dir=tmp_path / "logs", verbose=False)
    assert time.monotonic() - start < 60
    assert result.returncode == 1
    assert result.returncodes["chief"] == 3
    assert all(result.returncodes[w] not in (0, None) for w in ("tuner0", "tuner1"))
    assert any("chief exited with status 3" in e for e in result.errors)


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "sig, ignoring",
    [
        (signal.SIGINT, False),
        (signal.SIGTERM, False),
        (signal.SIGKILL, False),
        (signal.SIGTERM, True),
        (signal.SIGKILL, True),
    ],
    ids=["SIGINT", "SIGTERM", "SIGKILL", "SIGTERM-ignored", "SIGKILL-ignored"],
)
def test_processes_stop_when_the_launcher_is_terminated_or_killed(
    tmp_path, monkeypatch, sig, ignoring
):
    """`keras-tfr tune` stops the chief and the workers (in process groups of their own)
    on SIGTERM, as on Ctrl-C; killed, its guard process stops them. Processes that
    ignore SIGTERM are killed 5 s later, all at once (they were stopped one after the
    other: 5 s each). Its temporary report directory goes too, unless it was killed;
    the log directory stays."""
    n = 3 if ignoring else 2  # processes: the chief and the workers
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))  # where the launcher's mkdtemp puts both
    script = _script(
        tmp_path,
        f"""
        import os, signal, time
        if {ignoring}:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        who = os.environ["KERASTUNER_TUNER_ID"]
        open({str(tmp_path)!r} + f"/tmp-{{who}}", "w").write(str(os.getpid()))
        os.replace({str(tmp_path)!r} + f"/tmp-{{who}}", {str(tmp_path)!r} + f"/pid-{{who}}")
        time.sleep(300)
        """,
    )
    cmd = [sys.executable, "-m", "keras_tfr.cli", "tune", "--workers", str(n - 1), script]
    proc, started = start_and_wait(cmd, tmp_path, n, 120, stdout=subprocess.DEVNULL)
    pids = list(started.values())
    proc.send_signal(sig)
    start = time.monotonic()
    _, err = proc.communicate(timeout=60)
    if ignoring and sig == signal.SIGTERM:
        assert 4.5 < time.monotonic() - start < 12, "not SIGKILLed together, 5 s after"
    guarded = f"keras-tfr tune: the launcher ended without stopping its {n} process(es)" in err
    if sig == signal.SIGINT:  # Ctrl-C
        assert proc.returncode == 130 and "keras-tfr: interrupted" in err, err
        assert not guarded, err  # the launcher stopped them itself
    elif sig == signal.SIGTERM:
        assert proc.returncode == 143 and "keras-tfr: terminated (SIGTERM)" in err, err
        assert not guarded, err
    else:
        assert proc.returncode == -signal.SIGKILL and guarded, err
    assert still_running(pids, 20) == [], "a tuner process outlived the launcher"
    reports = sorted(temp.glob("keras-tfr-tune-report-*"))
    logs = [p for p in temp.glob("keras-tfr-tune-*") if p not in reports]
    assert len(logs) == 1 and (logs[0] / "chief.log").exists(), sorted(temp.iterdir())
    assert len(reports) == (1 if sig == signal.SIGKILL else 0), reports


@pytest.mark.subprocess
def test_launcher_stops_a_waiting_chief_when_a_worker_fails(tmp_path):
    from keras_tfr.tuner import tune

    script = _script(
        tmp_path,
        """
        import os, sys, time
        if os.environ["KERASTUNER_TUNER_ID"] == "chief":
            time.sleep(300)  # like an oracle waiting for a trial that will never end
        sys.exit(4 if os.environ["KERASTUNER_TUNER_ID"] == "tuner1" else 0)
        """,
    )
    start = time.monotonic()
    result = tune(script, workers=2, timeout=200, log_dir=tmp_path / "logs", verbose=False)
    assert time.monotonic() - start < 60
    assert result.returncode == 1
    assert result.returncodes["tuner0"] == 0 and result.returncodes["tuner1"] == 4
    assert result.returncodes["chief"] not in (0, None)  # stopped
    assert any("tuner1 exited with status 4" in e for e in result.errors)


@pytest.mark.subprocess
def test_launcher_timeout_and_bad_arguments(tmp_path):
    from keras_tfr.cli import main
    from keras_tfr.tuner import tune

    script = _script(tmp_path, "import time\ntime.sleep(300)\n")
    start = time.monotonic()
    result = tune(script, workers=1, timeout=2, log_dir=tmp_path / "logs", verbose=False)
    assert time.monotonic() - start < 60
    assert result.returncode == 1 and any("timed out" in e for e in result.errors)

    with pytest.raises(ValueError, match="workers"):
        tune(script, workers=0)
    with pytest.raises(FileNotFoundError, match="script"):
        tune(tmp_path / "missing.py")
    assert main(["tune", "--workers", "0", script]) == 2
    assert main(["tune", str(tmp_path / "missing.py")]) == 2


def test_child_env_replaces_a_fraction_from_the_shell():
    """import keras_tfr refuses KERAS_TFR_GPU_MEMORY_MB beside _FRACTION: the launcher's
    cap replaces the shell's; the chief (no GPU) gets neither."""
    from keras_tfr.tuner.launch import _child_env

    mb, fraction = "KERAS_TFR_GPU_MEMORY_MB", "KERAS_TFR_GPU_MEMORY_FRACTION"
    base = {"PATH": "/bin", fraction: "0.5"}
    worker = _child_env(base, "tuner0", 1, 256, None)
    assert (worker.get(mb), worker.get(fraction)) == ("256", None)
    chief = _child_env({**base, mb: "64"}, "chief", 0, 256, None)
    assert (chief.get(mb), chief.get(fraction)) == (None, None)
    # Without gpu_memory_mb a worker keeps whatever cap the shell exports.
    assert _child_env(base, "tuner0", 1, None, None)[fraction] == "0.5"
    assert base == {"PATH": "/bin", fraction: "0.5"}  # not changed in place


@pytest.mark.subprocess
def test_gpu_memory_mb_with_a_fraction_exported_by_the_shell(tmp_path, monkeypatch):
    """Every worker crashed at `import keras_tfr` when the shell exported
    KERAS_TFR_GPU_MEMORY_FRACTION and the launcher added KERAS_TFR_GPU_MEMORY_MB."""
    from keras_tfr.tuner import tune

    monkeypatch.setenv("KERAS_TFR_GPU_MEMORY_FRACTION", "0.5")
    script = _script(
        tmp_path,
        """
        import json, os, sys
        import keras_tfr  # applies the cap; raises with both variables set
        keys = ["KERAS_TFR_GPU_MEMORY_MB", "KERAS_TFR_GPU_MEMORY_FRACTION"]
        env = {k: os.environ.get(k) for k in keys}
        with open(os.path.join(sys.argv[1], os.environ["KERASTUNER_TUNER_ID"] + ".json"), "w") as f:
            json.dump(env, f)
        """,
    )
    out = tmp_path / "out"
    out.mkdir()
    result = tune(
        script, [str(out)], workers=1, gpu_memory_mb=256, timeout=120,
        log_dir=tmp_path / "logs", verbose=False,
    )  # fmt: skip
    logs = {p.name: p.read_text()[-2000:] for p in (tmp_path / "logs").glob("*.log")}
    assert result.returncodes == {"chief": 0, "tuner0": 0}, logs
    envs = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert envs == {
        "chief": {"KERAS_TFR_GPU_MEMORY_MB": None, "KERAS_TFR_GPU_MEMORY_FRACTION": None},
        "tuner0": {"KERAS_TFR_GPU_MEMORY_MB": "256", "KERAS_TFR_GPU_MEMORY_FRACTION": None},
    }


# A stand-in for a keras-tuner script: the chief leaves what keras-tuner's chief leaves
# (trial_*/trial.json in the project, its tuner reported to the launcher) and each process
# prints a line; with "linger", workers go on after the search (like a worker calling
# get_best_models, which would wait an hour for the finished chief).
FAKE_SEARCH = """
import json, os, sys, time, types
from keras_tfr.tuner.launch import _write_report

tuner_id = os.environ["KERASTUNER_TUNER_ID"]
print(f"hello from {tuner_id} gpu={os.environ.get('CUDA_VISIBLE_DEVICES')}", flush=True)
if tuner_id == "chief":
    project = os.path.abspath("project")
    for trial_id, units, score in (("0", 8, 0.5), ("1", 16, 0.25), ("2", 32, None)):
        os.makedirs(os.path.join(project, "trial_" + trial_id))
        state = {"trial_id": trial_id, "status": "COMPLETED" if score else "FAILED",
                 "score": score, "hyperparameters": {"values": {"units": units}}}
        with open(os.path.join(project, "trial_" + trial_id, "trial.json"), "w") as f:
            json.dump(state, f)
    objective = types.SimpleNamespace(name="val_loss", direction="min")
    _write_report(types.SimpleNamespace(project_dir=project,
                                        oracle=types.SimpleNamespace(objective=objective)))
elif sys.argv[1:] == ["linger"]:
    time.sleep(300)
"""


@pytest.mark.subprocess
def test_cli_tune_results_log_dir_gpus_and_prefixed_output(tmp_path):
    script = _script(tmp_path, FAKE_SEARCH)
    logs, results = tmp_path / "logs", tmp_path / "results.json"
    cmd = [sys.executable, "-m", "keras_tfr.cli", "tune", "--workers", "3", "--gpus", "0, 1"]
    cmd += ["--log-dir", str(logs), "--results", str(results), script]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERAS_TFR_GPU")}
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, (r.stdout, r.stderr)
    # The terminal: each process's lines prefixed with its tuner id.
    assert sorted(line for line in r.stdout.splitlines() if "hello" in line) == [
        "[chief] hello from chief gpu=",
        "[tuner0] hello from tuner0 gpu=0",
        "[tuner1] hello from tuner1 gpu=1",
        "[tuner2] hello from tuner2 gpu=0",
    ]
    assert 'keras-tfr tune: best val_loss = 0.25 with {"units": 16}' in r.stderr
    # --log-dir: one log per process, without the prefix.
    assert sorted(p.name for p in logs.iterdir()) == [
        "chief.log", "tuner0.log", "tuner1.log", "tuner2.log",
    ]  # fmt: skip
    assert (logs / "tuner1.log").read_text() == "hello from tuner1 gpu=1\n"
    # --results: the TuneResult as JSON.
    saved = json.loads(results.read_text())
    assert os.path.samefile(saved.pop("project_dir"), tmp_path / "project")
    assert saved.pop("log_dir") == str(logs)
    assert [t["trial_id"] for t in saved.pop("trials")] == ["0", "1", "2"]
    assert saved == {
        "returncode": 0,
        "objective": "val_loss",
        "direction": "min",
        "best_hyperparameters": {"units": 16},
        "best_score": 0.25,
        "trials_completed": 2,
        "returncodes": {"chief": 0, "tuner0": 0, "tuner1": 0, "tuner2": 0},
        "errors": [],
    }


@pytest.mark.parametrize("gpus", ["0,,1", "", "1,"])
def test_cli_tune_bad_gpus(tmp_path, gpus, capsys):
    from keras_tfr.cli import main

    script = _script(tmp_path, FAKE_SEARCH)
    logs = tmp_path / "logs"
    assert main(["tune", "--gpus", gpus, "--log-dir", str(logs), script]) == 2
    err = capsys.readouterr().err
    assert "keras-tfr tune: error: Expected `--gpus` to list GPU ids like ['0', '1']." in err
    assert f"Received: {[g.strip() for g in gpus.split(',')]!r}" in err
    assert not logs.exists()  # nothing was started


@pytest.mark.subprocess
def test_worker_still_running_after_the_search_is_stopped_after_worker_grace(tmp_path, caplog):
    import inspect
    import signal
    from pathlib import Path

    from keras_tfr.tuner import tune

    # The documented default.
    assert inspect.signature(tune).parameters["worker_grace"].default == 30
    doc = (Path(__file__).parent.parent / "docs" / "tuning.md").read_text()
    assert "a worker still running 30 s after the chief\nended well" in doc
    with pytest.raises(ValueError, match=r"`worker_grace` to be seconds >= 0\. Received: -1"):
        tune(_script(tmp_path, "", name="empty.py"), worker_grace=-1)

    script = _script(tmp_path, FAKE_SEARCH)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="keras_tfr"):
        result = tune(
            script, ["linger"], workers=2, worker_grace=0.5, timeout=60, cwd=tmp_path,
            log_dir=tmp_path / "logs", verbose=False,
        )  # fmt: skip
    assert time.monotonic() - start < 20  # not the workers' 300 s, nor a 30 s grace
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        m.startswith("keras-tfr tune: tuner0, tuner1 still running 0.5 s after the search ended")
        for m in warnings
    ), warnings
    # The search was complete: stopping the lingering workers is no failure.
    assert result.returncode == 0 and result.errors == []
    assert result.trials_completed == 2 and result.best_hyperparameters == {"units": 16}
    assert result.returncodes == {
        "chief": 0, "tuner0": -signal.SIGTERM, "tuner1": -signal.SIGTERM,
    }  # fmt: skip


DISTRIBUTED_SCRIPT = """
import json, os, sys
import keras, keras_tuner
from keras_tfr import TFRecordSequenceSource
from keras_tfr.tuner import TFRecordHyperModel, is_worker

train_dir, val_dir, log_path, project = sys.argv[1:5]
train = TFRecordSequenceSource(train_dir, batch_size=10, seed=0)
val = TFRecordSequenceSource(val_dir, batch_size=10, shuffle=False)


def build(hp):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(hp.Choice("units", [1, 3])),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


class Log(keras.callbacks.Callback):
    def on_train_end(self, logs=None):
        line = {"tuner_id": os.environ["KERASTUNER_TUNER_ID"], "pid": os.getpid(),
                "steps": self.params["steps"], "val_loss": float(logs["val_loss"]),
                "units": int(self.model.layers[0].units),
                "batch_size": self.model._test_batch_size}
        with open(log_path, "a") as f:
            f.write(json.dumps(line) + "\\n")


class HyperModel(TFRecordHyperModel):
    def build(self, hp):
        model = build(hp)
        model._test_batch_size = hp.values["batch_size"]
        return model


tuner = keras_tuner.RandomSearch(HyperModel(batch_size=[20, 50]), objective="val_loss",
                                 max_trials=4, directory=project, project_name="p",
                                 overwrite=True, seed=3)
tuner.search(train, validation_data=val, epochs=1, callbacks=[Log()], verbose=0)
if not is_worker():
    best = tuner.get_best_hyperparameters()[0].values
    with open(log_path + ".best", "w") as f:
        json.dump(best, f)
"""


def test_the_chief_binds_a_port_of_its_own_and_workers_connect_to_it(tmp_path, monkeypatch):
    import grpc

    from keras_tfr.tuner import launch

    # `_port_handoff` replaces these two; put back after the test.
    monkeypatch.setattr(grpc, "server", grpc.server)
    monkeypatch.setattr(grpc, "insecure_channel", grpc.insecure_channel)
    open_channel, make_server = grpc.insecure_channel, grpc.server
    servers = []
    with socket.socket() as taken:
        # The port picked up front, taken since by another program.
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        up_front = taken.getsockname()[1]
        plain = grpc.server(ThreadPoolExecutor(max_workers=1))
        with pytest.raises(RuntimeError):  # what the chief met before
            plain.add_insecure_port(f"127.0.0.1:{up_front}")
        port_file = tmp_path / "oracle.port"
        monkeypatch.setenv("KERASTUNER_ORACLE_IP", "127.0.0.1")
        monkeypatch.setenv("KERASTUNER_ORACLE_PORT", str(up_front))
        monkeypatch.setenv(launch._PORT_FILE_ENV, str(port_file))
        try:
            launch._port_handoff(chief=True)
            chief = grpc.server(ThreadPoolExecutor(max_workers=1))
            servers.append(chief)
            bound = chief.add_insecure_port(f"127.0.0.1:{up_front}")
            assert bound not in (0, up_front)
            assert int(port_file.read_text()) == bound
            chief.start()
            # Another server of the script binds what it asks for; the file stays.
            other = grpc.server(ThreadPoolExecutor(max_workers=1))
            servers.append(other)
            assert other.add_insecure_port("127.0.0.1:0") not in (0, bound)
            assert int(port_file.read_text()) == bound

            launch._port_handoff(chief=False)
            channel = grpc.insecure_channel(f"127.0.0.1:{up_front}")
            grpc.channel_ready_future(channel).result(timeout=20)  # the chief's server
            channel.close()
            # The address given up front holds no gRPC server: a channel there is not ready.
            stray = open_channel(f"127.0.0.1:{up_front}")
            with pytest.raises(grpc.FutureTimeoutError):
                grpc.channel_ready_future(stray).result(timeout=1)
            stray.close()
            # Why a port picked up front is not enough: a second gRPC server (a second
            # search) binds a port in use without an error, and the two share it.
            twin = make_server(ThreadPoolExecutor(max_workers=1))
            servers.append(twin)
            assert twin.add_insecure_port(f"127.0.0.1:{bound}") == bound
        finally:
            for srv in servers:
                srv.stop(None)


def test_a_worker_waits_for_the_chiefs_port(tmp_path):
    from keras_tfr.tuner import launch

    port_file = tmp_path / "oracle.port"

    def chief_binds() -> None:
        time.sleep(0.3)
        (tmp_path / "oracle.port.tmp").write_text("4242")
        os.replace(tmp_path / "oracle.port.tmp", port_file)

    writer = threading.Thread(target=chief_binds)
    start = time.monotonic()
    writer.start()
    assert launch._wait_for_port(str(port_file)) == 4242
    assert time.monotonic() - start >= 0.3
    writer.join()


@pytest.mark.slow
@pytest.mark.subprocess
def test_distributed_search_with_two_workers(data_dirs, tmp_path, monkeypatch):
    from keras_tfr.tuner import launch, tune

    script = _script(tmp_path, DISTRIBUTED_SCRIPT)
    log_path = tmp_path / "runs.jsonl"
    project = tmp_path / "project"
    with socket.socket() as taken:
        # The port the launcher picks up front is taken before the chief starts (another
        # program, another search): the chief binds one of its own, the workers find it.
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(launch, "_free_port", lambda: taken.getsockname()[1])
        result = tune(
            script,
            [data_dirs["train"], data_dirs["val"], str(log_path), str(project)],
            workers=2,
            timeout=400,
            cwd=tmp_path,
            log_dir=tmp_path / "logs",
            verbose=False,
        )
    logs = {p.name: p.read_text()[-3000:] for p in (tmp_path / "logs").glob("*.log")}
    assert result.returncode == 0, (result.errors, logs)
    assert result.returncodes == {"chief": 0, "tuner0": 0, "tuner1": 0}

    runs = [json.loads(line) for line in log_path.read_text().splitlines()]
    # Every trial ran once, in a worker (the chief runs none), with its batch size.
    assert len(runs) == 4
    assert {r["tuner_id"] for r in runs} <= {"tuner0", "tuner1"}
    combos = sorted((r["units"], r["batch_size"]) for r in runs)
    assert combos == [(1, 20), (1, 50), (3, 20), (3, 50)]  # the whole space, none twice
    assert all(r["steps"] == math.ceil(N_TRAIN / r["batch_size"]) for r in runs)

    assert result.trials_completed == 4 and len(result.trials) == 4
    assert os.path.samefile(result.project_dir, project / "p")
    assert result.objective == "val_loss" and result.direction == "min"
    best_run = min(runs, key=lambda r: r["val_loss"])
    assert result.best_hyperparameters == {
        "units": best_run["units"],
        "batch_size": best_run["batch_size"],
    }
    assert result.best_score == pytest.approx(best_run["val_loss"], rel=1e-5)
    # The chief's own answer agrees.
    assert json.loads((tmp_path / "runs.jsonl.best").read_text()) == result.best_hyperparameters
