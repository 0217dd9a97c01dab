"""Preemptible training: a job killed at any step goes on exactly where it stopped.

``train`` is the job a user would run (on a spot VM, under a scheduler that restarts it):
it converts the data once, then trains with `keras_tfr.BackupAndRestore`, backing up
every ``--save-freq`` steps. Killed (SIGKILL included) and started again with the same
command, it continues at the step after the last backup, with the same batches.

``demo`` (the default) shows it:

1. runs ``train``, which SIGKILLs itself at step ``--kill-at`` (what preemption does);
2. runs the same ``train`` command again: it resumes from the last backup;
3. runs ``train`` uninterrupted in a second directory;

and prints where each run started and whether the final weights are bit for bit the
same (they are, on CPU).

Run (about a minute on 2 CPU cores):

    python examples/preemptible_training.py --samples 2048 --epochs 3 --kill-at 50

The job alone: ``python examples/preemptible_training.py train --workdir run1``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np


def train(args: argparse.Namespace) -> None:
    import keras

    from keras_tfr import ArraysToRecords, BackupAndRestore, TFRecordSequenceSource

    data = os.path.join(args.workdir, "data")
    if not os.path.exists(os.path.join(data, "manifest.json")):
        rng = np.random.default_rng(0)
        x = rng.standard_normal((args.samples, 32)).astype(np.float32)
        y = (x @ rng.standard_normal(32) > 0).astype(np.int64)
        ArraysToRecords.from_arrays(x, y, data, verbose=0, overwrite=True)
    train_source = TFRecordSequenceSource(
        data, batch_size=32, seed=0, validation_split=0.2, subset="training"
    )
    val_source = TFRecordSequenceSource(
        data, batch_size=32, shuffle=False, seed=0, validation_split=0.2, subset="validation"
    )

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dropout(0.2, seed=1),
            keras.layers.Dense(2),
        ]
    )
    schedule = keras.optimizers.schedules.CosineDecay(1e-2, decay_steps=args.epochs * 60)
    model.compile(
        keras.optimizers.Adam(schedule),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )

    class Preempt(keras.callbacks.Callback):
        """Stands in for the machine going away: SIGKILL after this process's step
        ``--kill-at``, once per work directory (a marker file remembers it)."""

        def __init__(self) -> None:
            super().__init__()
            self.step = 0
            self.marker = os.path.join(args.workdir, "preempted-once")

        def on_train_batch_end(self, batch, logs=None):
            self.step += 1
            if self.step == args.kill_at and not os.path.exists(self.marker):
                open(self.marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)

    class Started(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.epoch = 0
            self.reported = False

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            if not self.reported:
                print(f"  training starts at epoch {self.epoch}, step {batch}", flush=True)
                self.reported = True

    callbacks = [
        Started(),
        BackupAndRestore(os.path.join(args.workdir, "backup"), save_freq=args.save_freq),
    ]
    if args.kill_at:
        callbacks.append(Preempt())
    history = model.fit(
        train_source,
        validation_data=val_source,
        epochs=args.epochs,
        verbose=0,
        callbacks=callbacks,
    )
    print(f"  finished: val_accuracy per epoch {np.round(history.history['val_accuracy'], 4)}")
    np.savez(os.path.join(args.workdir, "weights.npz"), *model.get_weights())


def demo(args: argparse.Namespace) -> None:
    root = tempfile.mkdtemp(prefix="keras-tfr-preemptible-")
    common = [
        f"--samples={args.samples}",
        f"--epochs={args.epochs}",
        f"--save-freq={args.save_freq}",
    ]

    kill_at = args.kill_at or 50
    common.append(f"--kill-at={kill_at}")

    def run(workdir: str) -> int:
        cmd = [sys.executable, __file__, "train", f"--workdir={workdir}", *common]
        return subprocess.run(cmd).returncode

    try:
        killed = os.path.join(root, "killed")
        print(f"1. train, preempted (SIGKILL) after step {kill_at}:")
        print(f"  exit status {run(killed)} (-9: killed)")
        print("2. the same command again:")
        run(killed)
        print("3. an uninterrupted run, for comparison:")
        clean = os.path.join(root, "clean")
        os.makedirs(clean)
        open(os.path.join(clean, "preempted-once"), "w").close()  # this one is not preempted
        run(clean)
        a = np.load(os.path.join(killed, "weights.npz"))
        b = np.load(os.path.join(clean, "weights.npz"))
        same = all(np.array_equal(a[k], b[k]) for k in b.files)
        print("final weights identical to the uninterrupted run:", same)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", nargs="?", default="demo", choices=["demo", "train"])
    parser.add_argument("--workdir", default="preemptible-run")
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--save-freq", type=int, default=20)
    parser.add_argument(
        "--kill-at", type=int, default=0, help="SIGKILL after this step, once (demo: 50)"
    )
    args = parser.parse_args()
    (train if args.command == "train" else demo)(args)


if __name__ == "__main__":
    main()
