"""Four models on one GPU: each trains from the same shards in its own capped process.

Streaming from shards keeps each model's GPU memory small, so one GPU can hold several
trainings at once. This script

1. writes a small synthetic data set once, as sharded TFRecords (`ArraysToRecords`);
2. starts four copies of itself with `keras_tfr.parallel.launch`, the Python side of
   ``keras-tfr parallel -n 4 --gpu-memory-mb 1024 -- python this.py --trial {i}``.
   Each child gets ``KERAS_TFR_GPU_MEMORY_MB`` in its environment, which ``import
   keras_tfr`` applies before TensorFlow touches the GPU, and trains a model of its own
   width (trial 0: 16 units, trial 3: 128) from the same shards;
3. prints each trial's validation accuracy and GPU peak, prefixed ``[i]``, and exits
   non-zero if any trial failed. Ctrl-C stops all four.

On a machine without a GPU the same script runs (the cap is then a no-op, logged once).

Run: ``python examples/four_models_one_gpu.py`` (``--gpu-memory-mb 2048``, ``--epochs 5``,
``--samples 100000`` for a heavier run).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

FEATURES = 32
CLASSES = 4
WIDTHS = [16, 32, 64, 128]


def write_data(directory: str, samples: int) -> None:
    """A learnable task: the class is the argmax of a fixed linear map of the features."""
    import numpy as np

    from keras_tfr import ArraysToRecords

    rng = np.random.default_rng(0)
    teacher = rng.standard_normal((FEATURES, CLASSES)).astype(np.float32)
    x = rng.standard_normal((samples, FEATURES), dtype=np.float32)
    y = np.argmax(x @ teacher, axis=1).astype(np.int64)
    ArraysToRecords.from_arrays(x, y, directory, shard_size="256KB", verbose=0)


def train_one(trial: int, data: str, epochs: int) -> None:
    """One child: the launcher's cap (KERAS_TFR_GPU_MEMORY_MB) applies when keras_tfr is
    imported below (Keras is imported already, so at once), before TensorFlow touches
    the GPU."""
    import keras

    from keras_tfr import TFRecordSequenceSource, limit_gpu_memory

    # The cap is already in place (applied by the keras_tfr import above); calling
    # limit_gpu_memory() again with the same setting only hands back a report of it.
    gpu = limit_gpu_memory() if os.environ.get("KERAS_TFR_GPU_MEMORY_MB") else None

    keras.utils.set_random_seed(trial)
    # The same split (seed=0) for every trial, so that their accuracies compare.
    train = TFRecordSequenceSource(
        data, batch_size=128, seed=0, validation_split=0.2, subset="training"
    )
    val = TFRecordSequenceSource(
        data, batch_size=512, seed=0, validation_split=0.2, subset="validation"
    )
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(WIDTHS[trial % len(WIDTHS)], activation="relu"),
            keras.layers.Dense(CLASSES, activation="softmax"),
        ]
    )
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    history = model.fit(train, validation_data=val, epochs=epochs, verbose=2)
    accuracy = history.history["val_accuracy"][-1]
    print(f"trial {trial}: {WIDTHS[trial % len(WIDTHS)]} units, val_accuracy {accuracy:.3f}")
    if gpu is not None:
        print(gpu.report())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trial", type=int, help="(set by the launcher) train one model")
    parser.add_argument("--data", help="the data set directory (default: a temporary one)")
    parser.add_argument("--models", type=int, default=4, help="how many models at once")
    parser.add_argument("--gpu-memory-mb", type=int, default=1024, help="cap per process")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=8192)
    args = parser.parse_args(argv)

    if args.trial is not None:
        train_one(args.trial, args.data, args.epochs)
        return 0

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # TensorFlow's start-up lines that TF_CPP_MIN_LOG_LEVEL does not reach (Abseil prints
    # them before TensorFlow's level applies) are left out, here and in the children's
    # output; nothing else is.
    from keras_tfr._quiet import FilteredOutput, import_tensorflow_quietly
    from keras_tfr.parallel import launch

    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or os.path.join(tmp, "train")
        if not os.path.exists(os.path.join(data, "manifest.json")):
            import_tensorflow_quietly()
            write_data(data, args.samples)
        command = [sys.executable, os.path.abspath(__file__), "--trial", "{i}", "--data", data]
        command += ["--epochs", str(args.epochs)]
        output = FilteredOutput(sys.stdout)
        return launch(command, args.models, gpu_memory_mb=args.gpu_memory_mb, output=output)


if __name__ == "__main__":
    sys.exit(main())
