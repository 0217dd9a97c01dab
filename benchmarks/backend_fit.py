"""`fit` under one Keras backend: keras-tfr against in-memory NumPy, side by side.

Up to three pipelines, each in its own process (the backend is fixed when Keras is
imported), run in interleaved rounds, each reporting its fastest epoch after the first and the
CPU-seconds (all threads) that epoch took:

* ``numpy``: ``model.fit(x, y, batch_size=256, shuffle=True)`` on arrays in RAM;
* ``keras-tfr``: ``model.fit(source)`` with a sample-mode `TFRecordSequenceSource`, which
  Keras' JAX and torch backends read through `as_numpy_iterator`
  (``keras_tfr/_compat/keras_numpy.py``);
* ``keras-tfr via tf.data`` (JAX, torch): the same source with that hook switched off,
  so Keras iterates the tf.data pipeline eagerly and converts each batch (what it did
  before). Under TensorFlow, ``keras-tfr`` is that tf.data pipeline, inside ``fit``'s
  compiled step.

The model is Flatten + Dense(10) on 28x28x1 float32 samples, batch 256.

Usage::

    python benchmarks/backend_fit.py --backend jax          # or torch, tensorflow
    python benchmarks/backend_fit.py --backend jax --samples 40000 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

SHAPE = (28, 28, 1)
BATCH = 256
EPOCHS = 4
PIPELINES = {
    "jax": ["numpy", "keras-tfr", "keras-tfr-tfdata"],
    "torch": ["numpy", "keras-tfr", "keras-tfr-tfdata"],
    "tensorflow": ["numpy", "keras-tfr"],
}
LABELS = {
    "numpy": "model.fit(x, y) in-memory NumPy",
    "keras-tfr": "keras-tfr",
    "keras-tfr-tfdata": "keras-tfr via tf.data (hook off)",
}


def worker(data: str, pipeline: str) -> dict:
    if pipeline == "keras-tfr-tfdata":
        from keras_tfr._compat import keras_numpy

        keras_numpy.install_numpy_batches = lambda: False  # Keras' own tf.data iteration
    import keras

    times: list[tuple[float, float]] = []

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_epoch_end(self, epoch, logs=None):
            times.append((time.perf_counter() - self.t0, time.process_time() - self.c0))

    model = keras.Sequential([keras.Input(SHAPE), keras.layers.Flatten(), keras.layers.Dense(10)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if pipeline == "numpy":
        x, y = np.load(os.path.join(data, "x.npy")), np.load(os.path.join(data, "y.npy"))
        n = len(x)
        model.fit(
            x, y, batch_size=BATCH, shuffle=True, epochs=EPOCHS, verbose=0, callbacks=[Timer()]
        )
    else:
        from keras_tfr import TFRecordSequenceSource

        src = TFRecordSequenceSource(os.path.join(data, "ktfr"), batch_size=BATCH, seed=0)
        n = src.num_samples
        model.fit(src, epochs=EPOCHS, verbose=0, callbacks=[Timer()])
    wall, cpu = min(times[1:])
    return {"examples_per_s": n / wall, "cpu_s": cpu, "backend": keras.backend.backend()}


def generate(data: str, samples: int, shape: tuple[int, ...] = SHAPE) -> None:
    """Random float32 ``x`` of ``shape`` and int32 labels as ``x.npy``/``y.npy``, and the
    same arrays written by keras-tfr under ``ktfr``, 64 MB of samples at a time."""
    from keras_tfr import ArraysToRecords

    x = np.lib.format.open_memmap(
        os.path.join(data, "x.npy"), mode="w+", dtype=np.float32, shape=(samples, *shape)
    )
    y = np.lib.format.open_memmap(
        os.path.join(data, "y.npy"), mode="w+", dtype=np.int32, shape=(samples,)
    )
    rng = np.random.default_rng(0)
    step = max(1, (64 << 20) // (4 * int(np.prod(shape))))
    for i in range(0, samples, step):
        j = min(samples, i + step)
        x[i:j] = rng.random((j - i, *shape), dtype=np.float32)
        y[i:j] = rng.integers(0, 10, j - i, dtype=np.int32)
    x.flush()
    y.flush()
    ArraysToRecords.from_arrays(x, y, os.path.join(data, "ktfr"), verbose=0)


def serve(worker: Callable[[str, str], dict], main: Callable[[], int]) -> None:
    """A script's entry point: ``script --_worker DATA ARG`` prints ``worker(DATA, ARG)`` as
    JSON (what `run_worker` reads), anything else runs ``main()``."""
    if len(sys.argv) > 3 and sys.argv[1] == "--_worker":
        print(json.dumps(worker(sys.argv[2], sys.argv[3])))
    else:
        sys.exit(main())


def run_worker(script: str, args: list[str], backend: str, timeout: float) -> dict | None:
    """Runs ``script --_worker *args`` in a new process under Keras backend ``backend``
    and returns its last line of output as JSON (checked to be that backend's), or None
    after printing the end of its stderr when it failed."""
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run(
        [sys.executable, script, "--_worker", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if out.returncode != 0:
        print(out.stderr[-3000:], file=sys.stderr)
        return None
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["backend"] == backend, res
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="jax", choices=["jax", "torch", "tensorflow"])
    ap.add_argument("--samples", type=int, default=160_000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="keras-tfr-backend-fit-") as data:
        generate(data, args.samples)
        pipelines = PIPELINES[args.backend]
        rates: dict[str, list[float]] = {p: [] for p in pipelines}
        cpus: dict[str, list[float]] = {p: [] for p in pipelines}
        for _ in range(args.rounds):
            for p in pipelines:
                res = run_worker(__file__, [data, p], args.backend, 1800)
                if res is None:
                    return 1
                rates[p].append(res["examples_per_s"])
                cpus[p].append(res["cpu_s"])
    ours = statistics.median(rates["keras-tfr"])
    print(
        f"fit under {args.backend}, {args.samples} x {SHAPE} float32, batch {BATCH}, "
        f"median of {args.rounds} interleaved rounds"
    )
    print(f"{'pipeline':36s} {'examples/s':>12s} {'keras-tfr / this':>18s} {'CPU-s/epoch':>12s}")
    for p in pipelines:
        rate = statistics.median(rates[p])
        cpu = statistics.median(cpus[p])
        print(f"{LABELS[p]:36s} {rate:12,.0f} {ours / rate:17.2f}x {cpu:12.2f}")
    print("rounds (examples/s):", {p: [round(r) for r in rates[p]] for p in pipelines})
    return 0


if __name__ == "__main__":
    serve(worker, main)
