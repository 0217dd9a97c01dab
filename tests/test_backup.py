"""`keras_tfr.BackupAndRestore`: exact mid-epoch resume inside ``fit``.

The subprocess tests run ``tests/_backup_child.py`` (a small model, 40 training samples
in batches of 4, 3 epochs, a validation source) and SIGKILL it at chosen points: the
first step, mid-epoch, while a backup is being written, an epoch's last step and during
validation. The same command is started again after each kill, and the finished run must
equal one that was never interrupted: weights and optimizer variables bit for bit (CPU),
the History, the optimizer's step count (which drives the learning-rate schedule), and
every training sample counted exactly once per epoch by the model itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import keras
import numpy as np
import pytest
from _backup_child import StandInSource, arrays, model_for

from keras_tfr import BackupAndRestore
from keras_tfr._compat import keras_resume
from keras_tfr.backup import BackupRestoreError

ROOT = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).resolve().parent / "_backup_child.py"
STEPS, EPOCHS = 10, 3  # 40 samples, batches of 4
BASE = dict(train=40, val=12, batch_size=4, seed=0, epochs=EPOCHS, data="source")


def _run(out: Path, backend: str, **config) -> int:
    out.mkdir(parents=True, exist_ok=True)
    cfg = out / "config.json"
    cfg.write_text(json.dumps({**BASE, **config, "out": str(out)}))
    env = {
        **os.environ,
        "KERAS_BACKEND": backend,
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, str(CHILD), str(cfg)], env=env, capture_output=True, text=True
    )
    if proc.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.returncode


def _result(out: Path):
    with np.load(out / "result.npz") as f:
        arrays = {k: f[k] for k in f.files}
    return arrays, json.loads((out / "result.json").read_text())


def _batches(out: Path) -> list[tuple[int, int, int]]:
    lines = (out / "batches.txt").read_text().split("\n")
    return [tuple(int(v) for v in line.split()) for line in lines if line]


def _backup_points(save_freq, hook, epoch, step):
    """The (epoch, step) the run killed at this point must resume from: the newest
    backup complete when it died (None: no backup yet, start over)."""
    points = []
    for e in range(EPOCHS):
        for s in range(STEPS):
            g = e * STEPS + s + 1
            if save_freq != "epoch" and g % save_freq == 0:
                # A backup due at an epoch's last step is written at its end instead.
                points.append((e + 1, 0, ("epoch_end", e)) if s + 1 == STEPS else (e, s + 1, g))
        if save_freq == "epoch":
            points.append((e + 1, 0, ("epoch_end", e)))

    def written(point):
        e, s, when = point
        if isinstance(when, tuple):  # at epoch `when[1]`'s end, after its validation
            return when[1] < epoch
        if hook == "train_batch_begin":
            return (e, s) <= (epoch, step)
        if hook == "train_batch_end":
            return (e, s) <= (epoch, step + 1)
        if hook == "test_batch_end":
            return (e, s) <= (epoch, STEPS)
        if hook == "backup":  # dies while writing the backup at (epoch, step + 1)
            return (e, s) < (epoch, step + 1)
        raise AssertionError(hook)

    done = [p[:2] for p in points if written(p)]
    return max(done) if done else None


def _check_same_as_uninterrupted(out: Path, baseline: Path):
    arrays, result = _result(out)
    base_arrays, base_result = _result(baseline)
    assert sorted(arrays) == sorted(base_arrays)
    for key in base_arrays:
        np.testing.assert_array_equal(arrays[key], base_arrays[key], err_msg=key)
    # Every training sample trained once per epoch, counting all processes from each
    # backup on (the counts are model state: restored with the backup).
    counts = arrays["counts"]
    np.testing.assert_array_equal(counts[: BASE["train"]], np.full(BASE["train"], EPOCHS))
    np.testing.assert_array_equal(counts[BASE["train"] :], 0)  # validation never trains
    assert result["iterations"] == base_result["iterations"] == EPOCHS * STEPS
    assert result["epoch"] == base_result["epoch"] == list(range(EPOCHS))
    assert result["history"] == base_result["history"]
    assert result.get("orders") == base_result.get("orders")


def _check_resumes(out: Path, kills: list[dict], save_freq):
    """Each process after a kill trains first the step after the backup it resumed from,
    and the steps trained from each backup on cover each epoch exactly once."""
    rows = _batches(out)
    pids = [pid for pid, e, _ in rows if e == -1]
    rows = [r for r in rows if r[1] >= 0]
    first = {pid: next(((e, s) for p, e, s in rows if p == pid), None) for pid in pids}
    assert len(pids) == len(kills) + 1
    for kill, pid in zip(kills, pids[1:]):
        resume = _backup_points(save_freq, kill["hook"], kill["epoch"], kill["step"])
        assert first[pid] == (resume or (0, 0)), (kill, first[pid], resume)
    # Keep, of each process, only the steps before the backup the next one resumed from.
    kept = []
    for i, pid in enumerate(pids):
        upto = first[pids[i + 1]] if i + 1 < len(pids) else (EPOCHS, 0)
        kept += [(e, s) for p, e, s in rows if p == pid and (e, s) < upto]
    assert sorted(kept) == [(e, s) for e in range(EPOCHS) for s in range(STEPS)]


@pytest.fixture(scope="module")
def baselines(tmp_path_factory):
    """Uninterrupted runs, one per backend (backups do not change training)."""
    made = {}

    def get(backend):
        if backend not in made:
            out = tmp_path_factory.mktemp(f"baseline-{backend}")
            assert _run(out, backend, save_freq=3) == 0
            made[backend] = out
        return made[backend]

    return get


def _chain(out: Path, backend: str, kills: list[dict], **config) -> None:
    for i, _ in enumerate(kills):
        assert _run(out, backend, kill=kills, **config) == -signal.SIGKILL, f"kill {i}"
    assert _run(out, backend, kill=kills, **config) == 0
    killed = (out / "killed.txt").read_text().split()
    assert killed == [k["id"] for k in kills]


def _kill(hook, epoch, step):
    return {"id": f"{hook}-{epoch}-{step}", "hook": hook, "epoch": epoch, "step": step}


@pytest.mark.slow
@pytest.mark.subprocess
def test_sigkill_at_many_points_resumes_exactly_tensorflow(tmp_path, baselines):
    kills = [
        _kill("train_batch_begin", 0, 0),  # the very first step: nothing to restore
        _kill("train_batch_end", 0, 4),  # mid-epoch, after the backup at step 3
        _kill("backup", 1, 4),  # while the backup of (1, 5) is written: falls back to (1, 2)
        _kill("train_batch_end", 1, STEPS - 1),  # an epoch's last step
        _kill("test_batch_end", 2, 1),  # during validation
    ]
    _chain(tmp_path, "tensorflow", kills, save_freq=3)
    _check_resumes(tmp_path, kills, 3)
    _check_same_as_uninterrupted(tmp_path, baselines("tensorflow"))


@pytest.mark.slow
@pytest.mark.subprocess
def test_sigkill_resumes_exactly_jax(tmp_path, baselines):
    kills = [
        _kill("train_batch_end", 0, 6),  # mid-epoch, right after the backup at step 6
        _kill("test_batch_end", 1, 2),  # during validation
    ]
    _chain(tmp_path, "jax", kills, save_freq=3)
    _check_resumes(tmp_path, kills, 3)
    _check_same_as_uninterrupted(tmp_path, baselines("jax"))


@pytest.mark.subprocess
def test_sigkill_with_save_freq_epoch(tmp_path, baselines):
    kills = [_kill("train_batch_end", 1, 4)]  # resumes at epoch 1, step 0
    _chain(tmp_path, "jax", kills, save_freq="epoch")
    _check_resumes(tmp_path, kills, "epoch")
    _check_same_as_uninterrupted(tmp_path, baselines("jax"))


# -- in this process (TensorFlow backend; 2 epochs, no XLA, to stay quick) ---------------

IN_EPOCHS = 2


class _Stop(keras.callbacks.Callback):
    """Interrupts fit (an exception, as a crash would) after a given training step."""

    def __init__(self, epoch, step):
        super().__init__()
        self.at, self.epoch = (epoch, step), 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise RuntimeError("interrupted")


class _Steps(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.trained, self.epoch = [], 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.trained.append((self.epoch, batch))


def _fit(backup, epochs=IN_EPOCHS, stop=None, sources=None, steps_per_execution=1):
    train, val = sources or _sources()
    model = model_for(
        BASE["train"] + BASE["val"], jit_compile=False, steps_per_execution=steps_per_execution
    )
    steps = _Steps()
    callbacks = [steps] + ([backup] if backup else []) + ([_Stop(*stop)] if stop else [])
    if stop:
        with pytest.raises(RuntimeError, match="interrupted"):
            model.fit(train, validation_data=val, epochs=epochs, verbose=0, callbacks=callbacks)
        return model, None, steps.trained
    history = model.fit(train, validation_data=val, epochs=epochs, verbose=0, callbacks=callbacks)
    return model, history, steps.trained


def _sources():
    train, val = arrays(BASE["train"], BASE["val"])
    return (
        StandInSource(*train, BASE["batch_size"], BASE["seed"], shuffle=True),
        StandInSource(*val, BASE["batch_size"], BASE["seed"], shuffle=False),
    )


def _weights(model):
    return [np.asarray(w) for w in model.get_weights()] + [
        keras.ops.convert_to_numpy(v) for v in model.optimizer.variables
    ]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    # With the callback too: without it nothing sets the epoch, and the stand-in (as a
    # real source) moves on one epoch per iterator, and Keras makes two per epoch.
    model, history, _ = _fit(BackupAndRestore(str(tmp_path_factory.mktemp("u") / "b")))
    return _weights(model), history.history


def _ckpts(directory):
    return sorted(p.name for p in Path(directory).iterdir() if p.name.startswith("ckpt-"))


def test_damaged_newest_backup_falls_back_to_the_previous(tmp_path, uninterrupted):
    d = tmp_path / "backup"
    make = lambda: BackupAndRestore(str(d), save_freq=3, double_checkpoint=True)  # noqa: E731
    _fit(make(), stop=(1, 6))  # backups at (1, 2) and (1, 5)
    assert _ckpts(d) == ["ckpt-000001-000000002", "ckpt-000001-000000005"]
    weights = d / "ckpt-000001-000000005" / "model.weights.h5"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit... and more: a damaged file
    weights.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match=r"Restored the previous backup .*ckpt-000001-000000002"):
        model, history, trained = _fit(make())
    assert trained[0] == (1, 2)
    for got, want in zip(_weights(model), uninterrupted[0]):
        np.testing.assert_array_equal(got, want)
    assert history.history == uninterrupted[1]


@pytest.mark.parametrize("double", [False, True])
def test_backup_cut_short_by_a_kill_is_ignored(tmp_path, uninterrupted, double):
    d = tmp_path / "backup"
    make = lambda: BackupAndRestore(str(d), save_freq=3, double_checkpoint=double)  # noqa: E731
    _fit(make(), stop=(1, 6))
    kept = ["ckpt-000001-000000005"]  # without double_checkpoint: one kept
    assert _ckpts(d) == (["ckpt-000001-000000002", *kept] if double else kept)
    # What a kill while writing the backup of (1, 8) leaves: no metadata.json, half a file.
    partial = d / "ckpt-000001-000000008"
    partial.mkdir()
    whole = (d / "ckpt-000001-000000005" / "model.weights.h5").read_bytes()
    (partial / "model.weights.h5").write_bytes(whole[: len(whole) // 2])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # ignored quietly: nothing was lost
        warnings.filterwarnings("ignore", message=".*shuffle=True.*")
        model, history, trained = _fit(make())
    assert trained[0] == (1, 5)  # the newest complete backup, not the one before it
    assert not partial.exists()
    for got, want in zip(_weights(model), uninterrupted[0]):
        np.testing.assert_array_equal(got, want)
    assert history.history == uninterrupted[1]


def test_steps_per_execution(tmp_path):
    def fit(name, stop=None):
        backup = BackupAndRestore(str(tmp_path / name), save_freq=4)
        return _fit(backup, stop=stop, steps_per_execution=2)

    model, history, trained = fit("u")
    assert trained[:3] == [(0, 1), (0, 3), (0, 5)]  # Keras reports each pair's last step
    fit("k", stop=(1, 5))  # backups after 4 and 8 steps of epoch 0, 2 and 6 of epoch 1
    resumed, resumed_history, resumed_trained = fit("k")
    assert resumed_trained == [(1, 7), (1, 9)]
    for got, want in zip(_weights(resumed), _weights(model)):
        np.testing.assert_array_equal(got, want)
    assert resumed_history.history == history.history


@pytest.mark.parametrize("access", ["samples", "blocks"])
@pytest.mark.parametrize("spe, stop", [(2, (1, 11)), (3, (1, 8)), (2, (0, 3))])
def test_steps_per_execution_that_does_not_divide_the_epoch(tmp_path, access, spe, stop):
    # 13 steps per epoch: the resumed epoch's last group reads one batch past its end
    # inside TensorFlow's multi-step loop (a whole epoch's cardinality failed there).
    from keras_tfr import ArraysToRecords, TFRecordSequenceSource

    rng = np.random.default_rng(0)
    x = rng.standard_normal((208, 4)).astype(np.float32)
    y = x.sum(axis=1, keepdims=True)
    data = str(tmp_path / "data")
    ArraysToRecords.from_arrays(x, y, data, samples_per_record=8, verbose=0)

    def fit(name, stop=None):
        keras.utils.set_random_seed(0)
        source = TFRecordSequenceSource(data, batch_size=16, seed=0, access=access)
        assert len(source) == 13
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse", steps_per_execution=spe, jit_compile=False)
        steps = _Steps()
        backup = BackupAndRestore(str(tmp_path / name), save_freq=spe)
        callbacks = [steps, backup] + ([_Stop(*stop)] if stop else [])
        if stop:
            with pytest.raises(RuntimeError, match="interrupted"):
                model.fit(source, epochs=2, verbose=0, callbacks=callbacks)
            return None, steps.trained
        history = model.fit(source, epochs=2, verbose=0, callbacks=callbacks)
        return (model, history.history), steps.trained

    (model, history), trained = fit("u")
    # Keras numbers a group by its last step: 13 steps in groups of `spe`.
    assert [b for e, b in trained if e == 1] == list(range(spe - 1, 13 + spe - 1, spe))
    fit("k", stop=stop)
    (resumed, resumed_history), resumed_trained = fit("k")
    assert resumed_trained[0][0] == stop[0] and resumed_trained[0][1] > stop[1] - spe
    assert resumed_trained[-1] == trained[-1]
    for got, want in zip(_weights(resumed), _weights(model)):
        np.testing.assert_array_equal(got, want)
    assert resumed_history == history


def test_only_backup_damaged_raises_naming_the_file(tmp_path):
    d = tmp_path / "backup"
    _fit(BackupAndRestore(str(d), save_freq=3), stop=(0, 4))
    [name] = _ckpts(d)
    state = d / name / "state.npz"
    state.write_bytes(state.read_bytes()[:-10])
    # An OSError, as documented: code that catches OSError around `fit` catches it.
    with pytest.raises(OSError, match=r"state\.npz is damaged: expected \d+ bytes") as info:
        _fit(BackupAndRestore(str(d), save_freq=3))
    assert type(info.value) is BackupRestoreError


def test_backup_of_other_data_is_refused(tmp_path):
    d = tmp_path / "backup"
    _fit(BackupAndRestore(str(d), save_freq=3), stop=(0, 4))
    train, val = arrays(BASE["train"], BASE["val"])
    other = (
        StandInSource(*train, 8, BASE["seed"], shuffle=True),  # 5 steps per epoch, not 10
        StandInSource(*val, 8, BASE["seed"], shuffle=False),
    )
    with pytest.raises(BackupRestoreError, match=r"written for 10 steps per epoch.*has 5"):
        _fit(BackupAndRestore(str(d), save_freq=3), sources=other)


def test_epoch_set_on_the_sources_at_every_epoch_begin(tmp_path):
    sources = _sources()
    _fit(BackupAndRestore(str(tmp_path / "b"), save_freq=4), sources=sources)
    assert sources[0].calls == [(0, 0), (1, 0)]
    assert sources[1].calls == [(0, 0), (1, 0)]
    # Why the epoch must be set: Keras makes two iterators per epoch (one at its start,
    # one at its end that is never read), so counting iterators would skip epochs.
    assert sources[0].iterators == 2 * IN_EPOCHS
    sources = _sources()
    _fit(BackupAndRestore(str(tmp_path / "c"), save_freq=4), stop=(1, 5), sources=sources)
    sources = _sources()
    _, _, trained = _fit(BackupAndRestore(str(tmp_path / "c"), save_freq=4), sources=sources)
    assert sources[0].calls == [(1, 6)]  # backups at (0, 4), (0, 8), (1, 2), (1, 6)
    assert trained == [(1, s) for s in range(6, STEPS)]
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()  # deleted at end


def _numpy_fit(callback, stop=None):
    train, val = arrays(BASE["train"], BASE["val"])
    model = model_for(BASE["train"] + BASE["val"], jit_compile=False)
    steps = _Steps()
    callbacks = [steps, callback] + ([_Stop(*stop)] if stop else [])
    kwargs = dict(
        x={"x": train[0], "id": train[1]},
        y=train[2],
        validation_data=({"x": val[0], "id": val[1]}, val[2]),
        batch_size=4,
        shuffle=False,
        epochs=IN_EPOCHS,
        verbose=0,
        callbacks=callbacks,
    )
    if stop:
        with pytest.raises(RuntimeError, match="interrupted"):
            model.fit(**kwargs)
        return model, None, steps.trained
    return model, model.fit(**kwargs), steps.trained


def test_without_a_resumable_source_it_is_keras_callback(tmp_path):
    runs = {}
    for name, cls in (("keras", keras.callbacks.BackupAndRestore), ("tfr", BackupAndRestore)):
        d = tmp_path / name
        _numpy_fit(cls(str(d), save_freq=3), stop=(1, 6))
        files = sorted(p.name for p in d.iterdir())
        model, history, trained = _numpy_fit(cls(str(d), save_freq=3))
        runs[name] = files, _weights(model), history.history, history.epoch, trained
    keras_run, tfr_run = runs["keras"], runs["tfr"]
    assert tfr_run[0] == keras_run[0] == ["latest.weights.h5", "training_metadata.json"]
    for got, want in zip(tfr_run[1], keras_run[1]):
        np.testing.assert_array_equal(got, want)
    assert tfr_run[2:] == keras_run[2:]
    assert tfr_run[4][0] == (1, 0)  # Keras restarts the interrupted epoch at step 0
    assert tfr_run[3] == [1]  # and its History holds only the epochs of this run


def test_plain_dataset_gets_keras_callback(tmp_path):
    import tensorflow as tf

    train, _ = arrays(BASE["train"], BASE["val"])
    ds = tf.data.Dataset.from_tensor_slices(({"x": train[0], "id": train[1]}, train[2])).batch(4)
    model = model_for(BASE["train"] + BASE["val"], jit_compile=False)
    d = tmp_path / "backup"
    callback = BackupAndRestore(str(d), delete_checkpoint=False)
    model.fit(ds, epochs=1, verbose=0, callbacks=[callback])
    assert sorted(p.name for p in d.iterdir()) == ["latest.weights.h5", "training_metadata.json"]


def test_save_weights_leaves_out_seed_generators(tmp_path):
    # Why the backup also keeps the non-trainable variables in state.npz.
    h5py = pytest.importorskip("h5py")
    model = model_for(BASE["train"] + BASE["val"])
    seeds = [v for v in model.non_trainable_variables if "seed" in v.path]
    assert seeds
    model.save_weights(str(tmp_path / "m.weights.h5"))
    saved = []
    with h5py.File(tmp_path / "m.weights.h5") as f:
        f.visititems(lambda name, obj: saved.append(name))
    assert not any("seed" in name for name in saved)
    assert len([n for n in saved if n.endswith("/vars/0")]) >= 1  # the weights are there


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        ({}, None),
        ({"steps_per_epoch": 5}, "steps_per_epoch"),
        ({"class_weight": {0: 1.0}}, "Keras wraps the source"),
    ],
)
def test_falls_back_when_keras_does_not_iterate_the_source(kwargs, problem):
    from keras.src.trainers.epoch_iterator import EpochIterator

    train, _ = _sources()
    iterator = EpochIterator(x=train, **kwargs)
    context = keras_resume.FitContext(None, train, None, iterator, None)
    found = context.iterates_source_directly()
    assert (found is None) if problem is None else (problem in found)


def test_own_backup_with_data_that_cannot_resume_is_refused(tmp_path):
    d = tmp_path / "backup"
    _fit(BackupAndRestore(str(d), save_freq=3), stop=(0, 4))
    with pytest.raises(BackupRestoreError, match="cannot resume mid-epoch"):
        _numpy_fit(BackupAndRestore(str(d), save_freq=3))


def test_unverified_keras_version_falls_back_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(keras, "version", lambda: "3.99.0")
    d = tmp_path / "backup"
    with pytest.warns(UserWarning, match=r"falls back to Keras' own callback.*Keras 3\.99\.0"):
        _fit(BackupAndRestore(str(d), save_freq=3, delete_checkpoint=False))
    assert sorted(p.name for p in d.iterdir()) == ["latest.weights.h5", "training_metadata.json"]


@pytest.mark.parametrize("save_freq", [0, -3, True, False, "batch"])
def test_bad_save_freq(tmp_path, save_freq):
    with pytest.raises(ValueError, match="save_freq"):
        BackupAndRestore(str(tmp_path), save_freq=save_freq)


def test_backup_restore_error_is_an_os_error():
    from keras_tfr.errors import KerasTFRError

    error = BackupRestoreError("no backup could be restored")
    assert isinstance(error, OSError) and isinstance(error, KerasTFRError)


@pytest.fixture(scope="module")
def tfr_train(tmp_path_factory):
    """A real `TFRecordSequenceSource`: 40 samples (10 batches of 4), class labels."""
    from keras_tfr import ArraysToRecords, TFRecordSequenceSource

    (features, _, target), _ = arrays(BASE["train"], BASE["val"])
    labels = (target[:, 0] > np.median(target)).astype(np.int64)
    d = str(tmp_path_factory.mktemp("tfr") / "train")
    ArraysToRecords.from_arrays(features, labels, d, verbose=0)
    return TFRecordSequenceSource(d, batch_size=BASE["batch_size"], seed=0)


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        ({"steps_per_epoch": STEPS}, "`fit` was given `steps_per_epoch`"),
        ({"class_weight": {0: 1.0, 1: 2.0}}, "Keras wraps the source"),
    ],
)
def test_real_fit_falls_back_to_keras_callback_with_a_warning(tmp_path, tfr_train, kwargs, problem):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile("adam", loss, jit_compile=False)
    d = tmp_path / "backup"
    callback = BackupAndRestore(str(d), save_freq=3, delete_checkpoint=False)
    assert len(tfr_train) == STEPS
    with pytest.warns(UserWarning, match=rf"falls back to Keras' own callback.*{problem}"):
        model.fit(tfr_train, epochs=1, verbose=0, callbacks=[callback], **kwargs)
    # Keras' code ran: its files, no keras-tfr backup directory.
    assert sorted(p.name for p in d.iterdir()) == ["latest.weights.h5", "training_metadata.json"]
