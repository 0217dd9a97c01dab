"""Where a tf.data read's private memory goes, epoch by epoch: live heap vs malloc's keep.

``python benchmarks/heap_retention.py [--samples N] [--epochs E]`` writes N samples of
28x28x1 float32 (default 160,000, 0.5 GB) as a memmap and as keras-tfr records, then reads
E epochs (batch 256, shuffle on) through three pipelines, each in its own process:

* ``keras-tfr``: `TFRecordSequenceSource` read by tf.data's iterator
  (``tf.data.Dataset.__iter__``: the pipeline ``fit`` runs);
* ``keras-tfr python``: the same source in a plain Python loop (tensors straight from
  the memory-mapped reader);
* ``keras-arrays``: Keras' own tf.data pipeline for arrays in RAM (what
  ``model.fit(x, y, shuffle=True)`` iterates under TensorFlow);
* ``keras-tfr numpy``: the same source's ``as_numpy_iterator()``.

After each epoch it prints private memory (``RssAnon``), its peak, and glibc's
``mallinfo2()``: the heap in use (bytes handed out and not freed) and the freed bytes
malloc keeps in its arenas for reuse. Private memory that rises while the heap in use
stays flat is malloc's keep of freed batches (TensorFlow allocates every batch anew, in
whichever thread runs the gather, and each thread's arena keeps what it freed), not
data the reader holds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np

PIPELINES = ("keras-tfr", "keras-tfr python", "keras-arrays", "keras-tfr numpy")


def _private_mb() -> float:
    from run_all import _PrivatePeak  # benchmarks/run_all.py

    return _PrivatePeak.now_kb() / 1024


def worker(data: str, pipeline: str, epochs: int) -> None:
    from run_all import mallinfo2 as get_mallinfo2  # benchmarks/run_all.py

    mallinfo2 = get_mallinfo2()
    peak = [0.0]

    def watch() -> None:
        while True:
            peak[0] = max(peak[0], _private_mb())
            time.sleep(0.02)

    threading.Thread(target=watch, daemon=True).start()
    from keras_tfr import TFRecordSequenceSource

    if pipeline == "keras-arrays":
        from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter

        x, y = np.load(f"{data}/x.npy"), np.load(f"{data}/y.npy")
        ds = ArrayDataAdapter(x, y, batch_size=256, shuffle=True).get_tf_dataset()
        epoch_iter = lambda: iter(ds)  # noqa: E731
    else:
        src = TFRecordSequenceSource(f"{data}/ktfr", batch_size=256, shuffle=True, seed=0)
        import tensorflow as tf

        epoch_iter = {  # type: ignore[assignment]
            "keras-tfr": lambda: tf.data.Dataset.__iter__(src),
            "keras-tfr python": lambda: iter(src),
            "keras-tfr numpy": src.as_numpy_iterator,
        }[pipeline]
    for e in range(epochs):
        n = sum(1 for _ in epoch_iter())
        row = {"epoch": e, "batches": n, "private_mb": _private_mb(), "peak_mb": peak[0]}
        if mallinfo2 is not None:
            info = mallinfo2()
            row["heap_in_use_mb"] = (info.uordblks + info.hblkhd) / (1 << 20)
            row["kept_free_mb"] = info.fordblks / (1 << 20)
        print("@@ROW " + json.dumps(row), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=160_000)
    parser.add_argument("--epochs", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="keras-tfr-heap-") as data:
        from keras_tfr import ArraysToRecords

        rng = np.random.default_rng(0)
        x = np.lib.format.open_memmap(
            f"{data}/x.npy", mode="w+", dtype=np.float32, shape=(args.samples, 28, 28, 1)
        )
        for a in range(0, args.samples, 20_000):
            b = min(a + 20_000, args.samples)
            x[a:b] = rng.standard_normal((b - a, 28, 28, 1), dtype=np.float32)
        x.flush()
        np.save(f"{data}/y.npy", rng.integers(0, 10, args.samples).astype(np.int32))
        del x
        ArraysToRecords.from_arrays(
            np.load(f"{data}/x.npy", mmap_mode="r"),
            np.load(f"{data}/y.npy", mmap_mode="r"),
            f"{data}/ktfr",
            verbose=0,
        )
        print(
            f"{'pipeline':16s} {'epoch':>5s} {'private MB':>10s} {'peak':>6s} "
            f"{'heap in use':>11s} {'malloc keeps':>12s}"
        )
        for pipeline in PIPELINES:
            out = subprocess.run(
                [sys.executable, __file__, "--_worker", data, pipeline, str(args.epochs)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            for line in out.splitlines():
                if not line.startswith("@@ROW "):
                    continue
                r = json.loads(line[6:])
                print(
                    f"{pipeline:16s} {r['epoch']:5d} {r['private_mb']:10.0f} {r['peak_mb']:6.0f} "
                    f"{r.get('heap_in_use_mb', 0):11.0f} {r.get('kept_free_mb', 0):12.0f}"
                )
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--_worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        sys.exit(main())
