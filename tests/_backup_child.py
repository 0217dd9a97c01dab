"""Child process of tests/test_backup.py: one ``fit`` with `keras_tfr.BackupAndRestore`.

Usage: ``python tests/_backup_child.py CONFIG.json`` (the backend from ``KERAS_BACKEND``).
The test file also imports `StandInSource`, `Counter` and `model_for` from here.
The same command is run again after each SIGKILL, as a user would restart a job. The
config names the kill points; each one is used once (recorded in ``killed.txt`` before
the kill), so the restarted command goes past it. When ``fit`` returns, the final
weights, optimizer variables, History and per-sample training counts are written to
``result.npz`` / ``result.json``. Every trained batch is appended to ``batches.txt`` as
``pid epoch step`` (``pid -1 -1`` when a process starts training).

The model makes training observable: a ``Counter`` layer adds one per trained sample to
a non-trainable variable (backed up and restored with the model), so after ``fit`` every
training sample must have been counted exactly ``epochs`` times.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import keras
import numpy as np
import tensorflow as tf

from keras_tfr import BackupAndRestore

CONFIG: dict = {}
OUT = ""


class StandInSource(tf.data.Dataset):
    """The resume API of `TFRecordSequenceSource` over in-memory arrays (tests only).

    Epoch ``e``'s order is a permutation seeded by ``(seed, e)``; ``set_epoch(e, k)``
    makes the next iterator deliver epoch ``e`` from batch ``k``; each later iterator
    advances the epoch by one. The cardinality is always the full epoch's.
    """

    def __init__(self, features, ids, y, batch_size, seed, shuffle):
        self._arrays = (features, ids, y)
        self._batch_size, self._seed, self._shuffle = batch_size, seed, shuffle
        self._steps = -(-len(y) // batch_size)
        self._next = (0, 0)
        self.calls = []  # every set_epoch call, for tests
        self.iterators = 0
        self._template = self._pipeline(0, 0)
        super().__init__(self._template._variant_tensor)

    def sample_order(self, epoch):
        n = len(self._arrays[2])
        if not self._shuffle:
            return np.arange(n)
        return np.random.default_rng([self._seed, epoch]).permutation(n)

    def set_epoch(self, epoch, step=0):
        self.calls.append((epoch, step))
        self._next = (epoch, step)

    def _pipeline(self, epoch, step):
        order = self.sample_order(epoch)[step * self._batch_size :]
        features, ids, y = self._arrays
        ds = tf.data.Dataset.from_tensor_slices(
            ({"x": features[order], "id": ids[order]}, y[order])
        ).batch(self._batch_size)
        return ds.apply(tf.data.experimental.assert_cardinality(self._steps - step))

    def __iter__(self):
        self.iterators += 1
        epoch, step = self._next
        self._next = (epoch + 1, 0)
        return iter(self._pipeline(epoch, step))

    def __len__(self):
        return self._steps

    def _inputs(self):
        return []

    @property
    def element_spec(self):
        return self._template.element_spec


class Counter(keras.layers.Layer):
    """Passes ``x`` through; in training, counts each sample id it sees."""

    def __init__(self, n, **kwargs):
        super().__init__(**kwargs)
        self.n = n

    def build(self, shapes):
        self.counts = self.add_weight(
            shape=(self.n,), initializer="zeros", trainable=False, name="counts"
        )

    def call(self, inputs, training=False):
        x, ids = inputs
        if training:
            seen = keras.ops.sum(keras.ops.one_hot(ids, self.n), axis=0)
            self.counts.assign(self.counts + seen)
        return x


def arrays(n, n_val):
    """Training and validation ``(features, ids, y)``; ids number all samples."""
    rng = np.random.default_rng(123)
    features = rng.standard_normal((n + n_val, 5)).astype(np.float32)
    ids = np.arange(n + n_val, dtype=np.int32)
    y = (features @ rng.standard_normal((5, 1)) + 0.1).astype(np.float32)
    return (features[:n], ids[:n], y[:n]), (features[n:], ids[n:], y[n:])


def data():
    train, val = arrays(CONFIG["train"], CONFIG["val"])
    bs, seed = CONFIG["batch_size"], CONFIG["seed"]
    if CONFIG["data"] == "standin":
        return (
            StandInSource(*train, bs, seed, shuffle=True),
            StandInSource(*val, bs, seed, shuffle=False),
        )
    from keras_tfr import ArraysToRecords, TFRecordSequenceSource

    sources = []
    for name, (fx, fid, fy), shuffle in (("train", train, True), ("val", val, False)):
        directory = os.path.join(OUT, "data-" + name)
        if not os.path.exists(os.path.join(directory, "manifest.json")):
            ArraysToRecords.from_arrays(
                {"x": fx, "id": fid}, fy, directory, verbose=0, overwrite=True
            )
        sources.append(TFRecordSequenceSource(directory, batch_size=bs, shuffle=shuffle, seed=seed))
    return tuple(sources)


def model_for(n_ids, jit_compile="auto", steps_per_execution=1):
    """Counter -> Dense -> Dropout (seeded) -> Dense; Adam with a decaying learning rate."""
    keras.utils.set_random_seed(0)
    x = keras.Input((5,), name="x")
    ids = keras.Input((), dtype="int32", name="id")
    h = Counter(n_ids)([x, ids])
    h = keras.layers.Dense(8, activation="relu")(h)
    h = keras.layers.Dropout(0.25, seed=1)(h)
    out = keras.layers.Dense(1)(h)
    model = keras.Model({"x": x, "id": ids}, out)
    lr = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=4, decay_rate=0.8)
    model.compile(
        keras.optimizers.Adam(lr),
        "mse",
        metrics=["mae"],
        jit_compile=jit_compile,
        steps_per_execution=steps_per_execution,
    )
    return model


def used():
    path = os.path.join(OUT, "killed.txt")
    if not os.path.exists(path):
        return set()
    with open(path) as f:
        return set(f.read().split())


class Killer(keras.callbacks.Callback):
    """SIGKILLs this process at the first configured point not used yet."""

    def __init__(self, points):
        super().__init__()
        self.points, self.used = points, used()
        self.epoch = self.step = 0

    def maybe(self, hook, epoch, step):
        for point in self.points:
            if point["id"] in self.used:
                continue
            if (point["hook"], point["epoch"], point["step"]) == (hook, epoch, step):
                with open(os.path.join(OUT, "killed.txt"), "a") as f:
                    f.write(point["id"] + "\n")
                os.kill(os.getpid(), signal.SIGKILL)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self.step = batch
        self.maybe("train_batch_begin", self.epoch, batch)

    def on_train_batch_end(self, batch, logs=None):
        self.maybe("train_batch_end", self.epoch, batch)

    def on_test_batch_end(self, batch, logs=None):
        self.maybe("test_batch_end", self.epoch, batch)


class BatchLog(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.file = open(os.path.join(OUT, "batches.txt"), "a", buffering=1)  # noqa: SIM115
        self.epoch = 0

    def on_train_begin(self, logs=None):
        self.file.write(f"{os.getpid()} -1 -1\n")  # this process started

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.file.write(f"{os.getpid()} {self.epoch} {batch}\n")


def main():
    global OUT
    with open(sys.argv[1]) as f:
        CONFIG.update(json.load(f))
    OUT = CONFIG["out"]
    train, val = data()
    n_ids = CONFIG["train"] + CONFIG["val"]
    model = model_for(n_ids)
    killer = Killer(CONFIG.get("kill", []))
    save_weights = keras.Model.save_weights

    def save_weights_then_maybe_die(self, filepath, overwrite=True, **kwargs):
        # A kill in the middle of writing a backup: the weights file is cut in half and
        # the backup's metadata.json is never written.
        save_weights(self, filepath, overwrite=overwrite, **kwargs)
        for point in killer.points:
            here = (point["hook"], point["epoch"], point["step"])
            if point["id"] not in killer.used and here == ("backup", killer.epoch, killer.step):
                size = os.path.getsize(filepath)
                with open(filepath, "r+b") as f:
                    f.truncate(size // 2)
                killer.maybe("backup", killer.epoch, killer.step)

    keras.Model.save_weights = save_weights_then_maybe_die
    backup = BackupAndRestore(
        os.path.join(OUT, "backup"),
        save_freq=CONFIG["save_freq"],
        double_checkpoint=CONFIG.get("double_checkpoint", False),
        delete_checkpoint=False,
    )
    history = model.fit(
        train,
        validation_data=val,
        epochs=CONFIG["epochs"],
        verbose=0,
        callbacks=[BatchLog(), backup, killer],
    )
    arrays = {f"w{i}": w for i, w in enumerate(model.get_weights())}
    for i, v in enumerate(model.optimizer.variables):
        arrays[f"opt{i}"] = keras.ops.convert_to_numpy(v)
    counter = next(layer for layer in model.layers if isinstance(layer, Counter))
    arrays["counts"] = keras.ops.convert_to_numpy(counter.counts)
    np.savez(os.path.join(OUT, "result.npz"), **arrays)
    result = {
        "history": history.history,
        "epoch": history.epoch,
        "iterations": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
    }
    if hasattr(train, "sample_order"):
        result["orders"] = [train.sample_order(e).tolist() for e in range(CONFIG["epochs"])]
    with open(os.path.join(OUT, "result.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
