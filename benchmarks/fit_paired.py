"""`fit` on keras-tfr against `fit` on in-memory NumPy, epoch by epoch in one process.

On a shared VM a process's speed moves by 10-20 % within minutes, which hides a few
percent between two pipelines measured in separate processes. Here one model is fitted
for one epoch on the NumPy arrays, then one epoch on a `TFRecordSequenceSource` of the
same data, and so on (the order flips each round, the first round is warm-up); each
epoch is timed alone and each keras-tfr epoch is divided by the NumPy epoch of its
round. It prints the median of those ratios with a 95 % bootstrap interval (the rounds
resampled with replacement, seeded: a median whose interval holds 1.0 is parity within
what the rounds can tell apart), each pipeline's median rate and CPU-seconds per epoch
(all threads), and every ratio.

Shapes (float32, batch 256, Flatten + Dense(10), as `run_all.py`'s ``fit`` rows):
``small`` 160,000 x 28x28x1 (0.5 GB), ``large`` 16,384 x 64x64x3 (0.8 GB).

Usage::

    python benchmarks/fit_paired.py --shape large --rounds 12
    python benchmarks/fit_paired.py --shape small --backend jax --rounds 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from backend_fit import generate, run_worker, serve

SHAPES = {"small": (160_000, (28, 28, 1)), "large": (16_384, (64, 64, 3))}
BATCH = 256


def median_interval(
    ratios: list[float], level: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> tuple[float, float]:
    """A percentile bootstrap interval for the median of ``ratios``: the rounds drawn
    with replacement ``resamples`` times (seeded, so a run's report is reproducible),
    and the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of their medians."""
    if not ratios:
        raise ValueError("Expected at least one ratio. Received: none")
    if not 0 < level < 1:
        raise ValueError(f"Expected `level` in (0, 1). Received: {level!r}")
    values = np.asarray(ratios, dtype=np.float64)
    draws = np.random.default_rng(seed).integers(0, len(values), (resamples, len(values)))
    medians = np.median(values[draws], axis=1)
    lo, hi = np.quantile(medians, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def turns(names: list[str], rounds: int):
    """``(round, name)`` in the order paired pipelines take their epochs: every name once
    per round, the order flipped each round, ``rounds`` rounds after a warm-up round 0
    (whose epochs are not kept)."""
    for r in range(rounds + 1):
        for name in names if r % 2 == 0 else names[::-1]:
            yield r, name


def paired_epochs(x: np.ndarray, y: np.ndarray, sources: dict, rounds: int) -> dict:
    """One model fitted one epoch at a time on the NumPy arrays and on each source in
    ``sources``, in turn (the order flips each round; round 0 traces and warms up, not
    kept). Returns, per pipeline (``"numpy"`` and each source's name), the wall and CPU
    seconds (all threads) of each kept epoch."""
    import keras

    model = keras.Sequential(
        [keras.Input(x.shape[1:]), keras.layers.Flatten(), keras.layers.Dense(10)]
    )
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    last: dict[str, float] = {}

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_epoch_end(self, epoch, logs=None):
            last["wall"] = time.perf_counter() - self.t0
            last["cpu"] = time.process_time() - self.c0

    names = ["numpy", *sources]
    out: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": []} for n in names}
    for r, n in turns(names, rounds):
        if n == "numpy":
            model.fit(x, y, batch_size=BATCH, shuffle=True, epochs=1, verbose=0,
                      callbacks=[Timer()])  # fmt: skip
        else:
            model.fit(sources[n], epochs=1, verbose=0, callbacks=[Timer()])
        if r:
            out[n]["wall"].append(last["wall"])
            out[n]["cpu"].append(last["cpu"])
    return out


def worker(data: str, rounds: str) -> dict:
    import keras

    from keras_tfr import TFRecordSequenceSource

    x, y = np.load(os.path.join(data, "x.npy")), np.load(os.path.join(data, "y.npy"))
    src = TFRecordSequenceSource(os.path.join(data, "ktfr"), batch_size=BATCH, seed=0)
    epochs = paired_epochs(x, y, {"keras-tfr": src}, int(rounds))
    return {
        "rates": {p: [len(x) / w for w in e["wall"]] for p, e in epochs.items()},
        "cpus": {p: e["cpu"] for p, e in epochs.items()},
        "backend": keras.backend.backend(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES))
    ap.add_argument("--backend", default="tensorflow", choices=["tensorflow", "jax", "torch"])
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    samples, shape = SHAPES[args.shape]
    with tempfile.TemporaryDirectory(prefix="keras-tfr-fit-paired-") as data:
        generate(data, samples, shape)
        res = run_worker(__file__, [data, str(args.rounds)], args.backend, 3600)
    if res is None:
        return 1
    ours, theirs = res["rates"]["keras-tfr"], res["rates"]["numpy"]
    ratios = [a / b for a, b in zip(ours, theirs)]
    print(
        f"fit under {res['backend']}, {args.shape}: {samples} x {shape} float32, batch "
        f"{BATCH}, {args.rounds} rounds of one epoch each, alternated in one process"
    )
    lo, hi = median_interval(ratios)
    print(
        f"keras-tfr / in-memory NumPy, median of the rounds: {statistics.median(ratios):.3f}x "
        f"(95 % bootstrap interval {lo:.3f}x-{hi:.3f}x)"
    )
    for p in ("keras-tfr", "numpy"):
        print(
            f"  {p:10s} {statistics.median(res['rates'][p]):10,.0f} ex/s, "
            f"{statistics.median(res['cpus'][p]):.3f} CPU-s per epoch"
        )
    print("  ratios:", [round(v, 3) for v in ratios])
    return 0


if __name__ == "__main__":
    serve(worker, main)
