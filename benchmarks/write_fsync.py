"""What making shards durable before the manifest costs the writer.

Writes the same data set with `ArraysToRecords.from_arrays` in three ways, in turn, best
of `--repeats` each:

- ``durable`` (the default): write-back of each shard is started as it closes
  (`sync_file_range`), and every shard and the directory are fsynced before the manifest;
- ``fsync only``: no early write-back, the fsyncs before the manifest;
- ``not durable``: neither (what the writer did before; the manifest's own fsync stays).

Before every run the page cache's dirty data is written back (`os.sync`, not timed), so
no run pays for the one before it.

    python benchmarks/write_fsync.py --megabytes 512 --repeats 3 [--dir /tmp/x]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np

from keras_tfr import ArraysToRecords
from keras_tfr.write import sink

MODES = {"durable": (True, True), "fsync only": (True, False), "not durable": (False, False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=512, help="MiB of 28x28 float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    n = args.megabytes * (1 << 20) // (28 * 28 * 4)
    x = np.random.default_rng(0).standard_normal((n, 28, 28), dtype=np.float32)
    y = np.arange(n, dtype=np.int64)
    root = tempfile.mkdtemp(dir=args.dir, prefix="keras-tfr-fsync-")
    real_sync, real_writeback = sink.ShardFiles.sync, sink.start_writeback
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    try:
        for _ in range(args.repeats):
            for mode, (sync, writeback) in MODES.items():
                d = os.path.join(root, "ds")
                shutil.rmtree(d, ignore_errors=True)
                os.sync()
                sink.ShardFiles.sync = real_sync if sync else (lambda self: None)
                sink.start_writeback = real_writeback if writeback else (lambda path: None)
                start = time.perf_counter()
                ArraysToRecords.from_arrays(x, y, d, verbose=0)
                times[mode].append(time.perf_counter() - start)
    finally:
        sink.ShardFiles.sync = real_sync
        sink.start_writeback = real_writeback
        shutil.rmtree(root, ignore_errors=True)
    nbytes = x.nbytes + y.nbytes
    best = {mode: min(t) for mode, t in times.items()}
    result = {
        "samples": n,
        "megabytes": round(nbytes / 1e6, 1),
        **{
            mode: {
                "best_s": round(best[mode], 3),
                "MB_per_s": round(nbytes / 1e6 / best[mode], 1),
                "all_s": [round(v, 3) for v in t],
                "cost_percent": round(100 * (best[mode] / best["not durable"] - 1), 1),
            }
            for mode, t in times.items()
        },
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
