"""What each epoch pays before its first batch, and what that does to `fit` on small data.

Keras makes a new tf.data iterator for every epoch (and another for every validation
pass), and TensorFlow prepares every function of the pipeline again for each iterator.
On a data set of a few thousand samples that start-up, not reading, sets the pace. This
script measures it side by side on the size of keras-tuner's tutorial data:

* ``fixed``: 2,000 samples of 8 float32 and a 0/1 label, written with default settings:
  in-memory NumPy (``fit(x, y, validation_split=0.2, shuffle=True)``), keras-tfr in
  sample mode (the default for this data) and keras-tfr with ``access="blocks"``;
* ``sequences``: 2,000 int32 sequences of 5 to 50 tokens (variable-length features, so
  block mode is the default): NumPy padded to 50 against keras-tfr (``ragged="pad"``).

For each pipeline it prints the median time to make a new tf.data iterator and read its
first batch (``tf.data.Dataset.__iter__``, the iterator `fit` reads), and the median
time per epoch of ``fit`` for 10 epochs with a validation split of 0.2 (batch 32), over
``--rounds`` rounds run in turn in one process; ratios are to NumPy.

Usage::

    python benchmarks/epoch_start.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np

SAMPLES, FEATURES, MAX_LEN, VOCAB, BATCH, EPOCHS, SPLIT = 2000, 8, 50, 1000, 32, 10, 0.2


def _data(tmp: str) -> dict:
    from keras_tfr import ArraysToRecords

    rng = np.random.default_rng(0)
    x = rng.random((SAMPLES, FEATURES), dtype=np.float32)
    y = (x.sum(axis=1) > FEATURES / 2).astype(np.int32)
    ArraysToRecords.from_arrays(x, y, os.path.join(tmp, "fixed"), verbose=0)
    lengths = rng.integers(5, MAX_LEN + 1, SAMPLES)
    seqs = [rng.integers(1, VOCAB, n, dtype=np.int32) for n in lengths]
    padded = np.zeros((SAMPLES, MAX_LEN), np.int32)
    for i, s in enumerate(seqs):
        padded[i, : len(s)] = s
    ys = (lengths > (MAX_LEN + 5) / 2).astype(np.int32)
    batches = [(seqs[i : i + 500], ys[i : i + 500]) for i in range(0, SAMPLES, 500)]
    ArraysToRecords.from_arrays(
        batches, directory=os.path.join(tmp, "seq"), variable_length=["x"], verbose=0
    )
    return {"fixed": (x, y), "sequences": (padded, ys)}


def _model(kind: str):
    import keras

    if kind == "fixed":
        layers = [keras.Input((FEATURES,)), keras.layers.Dense(16, activation="relu")]
    else:
        layers = [
            keras.Input((None,), dtype="int32"),
            keras.layers.Embedding(VOCAB, 16),
            keras.layers.GlobalAveragePooling1D(),
        ]
    model = keras.Sequential([*layers, keras.layers.Dense(1, activation="sigmoid")])
    model.compile("adam", "binary_crossentropy")
    return model


def _sources(directory: str, access: str):
    from keras_tfr import TFRecordSequenceSource

    kw = dict(batch_size=BATCH, seed=0, validation_split=SPLIT, access=access)
    train = TFRecordSequenceSource(directory, subset="training", **kw)
    val = TFRecordSequenceSource(directory, subset="validation", shuffle=False, **kw)
    return train, val


def _start_ms(dataset, times: int = 10) -> float:
    import tensorflow as tf

    got = []
    for _ in range(times + 1):
        t = time.perf_counter()
        it = tf.data.Dataset.__iter__(dataset)
        next(it)
        got.append((time.perf_counter() - t) * 1e3)
        del it
    return statistics.median(got[1:])  # the first one traces


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter

    with tempfile.TemporaryDirectory(prefix="keras-tfr-epoch-start-") as tmp:
        arrays = _data(tmp)
        pipelines = {
            "fixed": {
                "numpy": None,
                "keras-tfr samples": _sources(os.path.join(tmp, "fixed"), "auto"),
                "keras-tfr blocks": _sources(os.path.join(tmp, "fixed"), "blocks"),
            },
            "sequences": {
                "numpy (padded)": None,
                "keras-tfr": _sources(os.path.join(tmp, "seq"), "auto"),
            },
        }
        assert pipelines["fixed"]["keras-tfr samples"][0].access == "samples"
        assert pipelines["sequences"]["keras-tfr"][0].access == "blocks"
        print(
            f"{SAMPLES} samples, batch {BATCH}, fit {EPOCHS} epochs with validation_split="
            f"{SPLIT}, median of {args.rounds} rounds run in turn"
        )
        for kind, group in pipelines.items():
            x, y = arrays[kind]
            start: dict[str, float] = {}
            epoch: dict[str, list[float]] = {name: [] for name in group}
            for name, srcs in group.items():
                if srcs is None:
                    n = SAMPLES - int(SPLIT * SAMPLES)  # Keras' own training share
                    adapter = ArrayDataAdapter(x[:n], y[:n], batch_size=BATCH, shuffle=True)
                    start[name] = _start_ms(adapter.get_tf_dataset())
                else:
                    start[name] = _start_ms(srcs[0])
            for r in range(args.rounds):
                order = list(group) if r % 2 == 0 else list(reversed(group))
                for name in order:
                    model = _model(kind)
                    srcs = group[name]
                    t = time.perf_counter()
                    if srcs is None:
                        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, validation_split=SPLIT,
                                  shuffle=True, verbose=0)  # fmt: skip
                    else:
                        model.fit(srcs[0], validation_data=srcs[1], epochs=EPOCHS, verbose=0)
                    epoch[name].append((time.perf_counter() - t) / EPOCHS * 1e3)
            base = next(iter(group))
            print(f"\n{kind}:")
            print(f"  {'pipeline':20s} {'new iterator + 1st batch':>26s} {'fit, per epoch':>16s}")
            for name in group:
                ms = statistics.median(epoch[name])
                ratio = ms / statistics.median(epoch[base])
                print(
                    f"  {name:20s} {start[name]:20.1f} ms {ms:12.0f} ms  "
                    f"({ratio:.2f}x NumPy's time)"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
