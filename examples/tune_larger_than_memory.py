"""Tune a model on a data set larger than memory, with the batch size as a hyperparameter.

The data set is written chunk by chunk (only one chunk is ever in memory) as sharded
TFRecords, then streamed into every trial. `TFRecordHyperModel` re-batches the sources
for each trial with the trial's ``batch_size`` and shuffle memory budget, so the user
writes only ``build(hp)``.

Run it in one process::

    python examples/tune_larger_than_memory.py                 # small: well under a minute
    python examples/tune_larger_than_memory.py --samples 50_000_000 --trials 20
                                                               # ~13 GB: more than most RAM

or with trials in parallel (a chief and two workers, each capped on a shared GPU)::

    keras-tfr tune --workers 2 --gpu-memory-mb 1024 examples/tune_larger_than_memory.py

The same script runs unchanged in all three processes: keras-tuner's distributed mode,
chosen by the environment ``keras-tfr tune`` sets, shares out the trials. Only the chief
(or a plain run) writes the data set; workers wait for its manifest.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

FEATURES = 64
CLASSES = 10
CHUNK = 16_384


def write_data(directory: str, samples: int) -> None:
    """A learnable 10-class task, generated and written one chunk at a time."""
    import numpy as np

    from keras_tfr import ArraysToRecords

    rng = np.random.default_rng(0)
    teacher = rng.standard_normal((FEATURES, CLASSES)).astype(np.float32)

    def chunks():
        for start in range(0, samples, CHUNK):
            x = rng.standard_normal((min(CHUNK, samples - start), FEATURES), dtype=np.float32)
            yield x, np.argmax(x @ teacher, axis=1).astype(np.int64)

    ArraysToRecords.from_arrays(chunks(), None, directory, verbose=1)


def wait_for_data(directory: str, timeout: float = 3600) -> None:
    """Workers start with the chief: wait until its data set is complete."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(os.path.join(directory, "manifest.json")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no data set in {directory} after {timeout:g} s")
        time.sleep(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=os.path.join("tune_demo", "data"))
    parser.add_argument("--project", default="tune_demo")
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()

    # TensorFlow's start-up lines that TF_CPP_MIN_LOG_LEVEL does not reach (Abseil prints
    # them before TensorFlow's level applies) are left out; nothing else is.
    from keras_tfr._quiet import import_tensorflow_quietly

    import_tensorflow_quietly()
    from keras_tfr.tuner import is_worker

    if not os.path.exists(os.path.join(args.data, "manifest.json")):
        if is_worker():
            wait_for_data(args.data)
        else:
            write_data(args.data, args.samples)

    import keras
    import keras_tuner

    from keras_tfr import TFRecordSequenceSource
    from keras_tfr.tuner import TFRecordHyperModel

    # One split (seed=0) for all trials; the sources stream, whatever the data set's size.
    train = TFRecordSequenceSource(
        args.data, batch_size=128, shuffle=True, seed=0, validation_split=0.1, subset="training"
    )
    val = TFRecordSequenceSource(
        args.data, batch_size=128, shuffle=False, seed=0, validation_split=0.1, subset="validation"
    )

    def build(hp):
        model = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(hp.Int("units", 32, 256, step=32), activation="relu"),
                keras.layers.Dropout(hp.Float("dropout", 0.0, 0.3, step=0.1)),
                keras.layers.Dense(CLASSES),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(hp.Float("lr", 1e-4, 1e-2, sampling="log")),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        return model

    tuner = keras_tuner.RandomSearch(
        # batch_size and shuffle_memory become hyperparameters "batch_size" and
        # "shuffle_memory"; each trial gets sources re-batched to its values.
        TFRecordHyperModel(build, batch_size=[64, 256, 1024], shuffle_memory=["16MB", "64MB"]),
        objective="val_accuracy",
        max_trials=args.trials,
        directory=args.project,
        project_name="search",
        overwrite=True,  # only the chief starts afresh under `keras-tfr tune`
        seed=0,
    )
    tuner.search(train, validation_data=val, epochs=args.epochs, verbose=2)

    # Workers stop here: asking the tuner now would wait for a chief that has finished.
    if not is_worker():
        best = tuner.get_best_hyperparameters()[0]
        print("best hyperparameters:", best.values)
        print("best val_accuracy:", tuner.oracle.get_best_trials()[0].score)


if __name__ == "__main__":
    main()
