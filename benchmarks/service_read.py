"""Reading through the tf.data service on localhost vs in process, as a ratio.

    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python benchmarks/service_read.py --samples 20000

Writes a data set of float32 images into a temporary directory, then reads whole epochs
(a) in this process and (b) through a dispatcher and ``--workers`` workers started in this
process (`keras_tfr.distribute.start_service`), in ``distributed_epoch`` mode. On one
machine the service adds serialization and a gRPC hop per element; it pays off when the
trainer's own CPUs are the bottleneck and the workers run on other machines.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

from keras_tfr import ArraysToRecords, TFRecordSequenceSource
from keras_tfr.distribute import start_service


def epoch_rate(source, epochs: int) -> float:
    for _ in source.take(2):  # warm up: start the pipeline (and the service job)
        pass
    start = time.perf_counter()
    n = 0
    for _ in range(epochs):
        for xb, _yb in source:
            n += int(xb.shape[0])
    return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--shape", type=int, nargs="+", default=[28, 28, 1])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        directory = f"{tmp}/train"
        with ArraysToRecords(directory, verbose=0) as writer:
            for start in range(0, args.samples, 4096):
                n = min(4096, args.samples - start)
                x = rng.standard_normal((n, *args.shape)).astype(np.float32)
                writer.write(x, np.arange(start, start + n, dtype=np.int64))
        local = TFRecordSequenceSource(directory, args.batch_size, shuffle=True, seed=0)
        local_rate = epoch_rate(local, args.epochs)
        with start_service(args.workers) as cluster:
            remote = local.replace(service=cluster.target)
            service_rate = epoch_rate(remote, args.epochs)
    mb = np.prod(args.shape) * 4 / 1e6
    print(f"samples={args.samples} shape={tuple(args.shape)} batch={args.batch_size}")
    print(f"in process:            {local_rate:10.0f} samples/s ({local_rate * mb:.0f} MB/s)")
    print(
        f"tf.data service ({args.workers} w): {service_rate:10.0f} samples/s "
        f"({service_rate * mb:.0f} MB/s)"
    )
    print(f"ratio service / in process: {service_rate / local_rate:.2f}")


if __name__ == "__main__":
    main()
