"""Memory across keras-tuner trials: RSS after trial 10 against RSS after trial 1.

A search builds a model and, with `keras_tfr.tuner.TFRecordHyperModel`, two re-batched
copies of the sources per trial. None of that may pile up: the target is RSS after the
last trial within 10% of RSS after the first (the first trial pays for TensorFlow's and
Keras' one-time set-up, which is why it is the reference).

The data set is written chunk by chunk and streamed; every trial draws a batch size and
a shuffle memory budget, so each builds new pipelines. RSS is read (``psutil``) after
each trial, after a ``gc.collect()``.

Usage::

    python benchmarks/tuner_memory.py                    # 10 trials, 40k x 64 samples
    python benchmarks/tuner_memory.py --trials 20 --samples 200000

Writes ``benchmarks/results/tuner_memory.json``; exits 1 when the target is missed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
TARGET = 1.10


def _chunks(samples: int, features: int, chunk: int = 8192):
    """Synthetic regression data, generated chunk by chunk (never all in memory)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal(features).astype(np.float32)
    for start in range(0, samples, chunk):
        n = min(chunk, samples - start)
        x = rng.standard_normal((n, features)).astype(np.float32)
        yield x, (x @ w)[:, None].astype(np.float32)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--samples", type=int, default=40_000)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--out", default=os.path.join(RESULTS, "tuner_memory.json"))
    args = parser.parse_args(argv)

    import keras
    import keras_tuner
    import psutil

    from keras_tfr import ArraysToRecords, TFRecordSequenceSource
    from keras_tfr.tuner import TFRecordHyperModel

    process = psutil.Process()
    work = tempfile.mkdtemp(prefix="keras-tfr-tuner-memory-")
    try:
        data = os.path.join(work, "data")
        ArraysToRecords.from_arrays(_chunks(args.samples, args.features), None, data, verbose=0)
        train = TFRecordSequenceSource(
            data, batch_size=64, shuffle=True, seed=0, validation_split=0.2, subset="training"
        )
        val = TFRecordSequenceSource(
            data, batch_size=64, shuffle=False, seed=0, validation_split=0.2, subset="validation"
        )

        def build(hp):
            model = keras.Sequential(
                [
                    keras.Input((args.features,)),
                    keras.layers.Dense(hp.Int("units", 16, 128, step=16), activation="relu"),
                    keras.layers.Dense(hp.Int("units2", 16, 128, step=16), activation="relu"),
                    keras.layers.Dense(1),
                ]
            )
            model.compile(keras.optimizers.Adam(hp.Float("lr", 1e-4, 1e-2, sampling="log")), "mse")
            return model

        rss: list[float] = []
        seconds: list[float] = []

        class Measured(keras_tuner.RandomSearch):
            def on_trial_end(self, trial):
                super().on_trial_end(trial)
                gc.collect()
                rss.append(process.memory_info().rss / 2**20)
                seconds.append(time.perf_counter() - start)
                print(
                    f"trial {len(rss):3d}: batch_size={trial.hyperparameters['batch_size']:4d} "
                    f"shuffle_memory={trial.hyperparameters['shuffle_memory']:>5s} "
                    f"RSS {rss[-1]:8.1f} MiB",
                    flush=True,
                )

        tuner = Measured(
            TFRecordHyperModel(
                build, batch_size=[32, 64, 128, 256], shuffle_memory=["4MB", "16MB", "32MB"]
            ),
            objective="val_loss",
            max_trials=args.trials,
            directory=os.path.join(work, "tuner"),
            project_name="memory",
            overwrite=True,
            seed=0,
        )
        start = time.perf_counter()
        tuner.search(train, validation_data=val, epochs=args.epochs, verbose=0)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    ratio = rss[-1] / rss[0]
    result = {
        "benchmark": "tuner_memory",
        "trials": len(rss),
        "samples": args.samples,
        "features": args.features,
        "data_mib": args.samples * (args.features + 1) * 4 / 2**20,
        "rss_mib_per_trial": [round(r, 1) for r in rss],
        "rss_first_mib": round(rss[0], 1),
        "rss_last_mib": round(rss[-1], 1),
        "rss_max_mib": round(max(rss), 1),
        "ratio_last_to_first": round(ratio, 4),
        "target_ratio": TARGET,
        "passed": ratio <= TARGET,
        "seconds": round(seconds[-1], 1),
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                    "platform": platform.platform()},
    }  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    print(
        f"RSS after trial 1: {rss[0]:.1f} MiB; after trial {len(rss)}: {rss[-1]:.1f} MiB "
        f"(x{ratio:.3f}, target <= x{TARGET}); max {max(rss):.1f} MiB -> "
        f"{'PASS' if ratio <= TARGET else 'FAIL'}; {args.out}"
    )
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
