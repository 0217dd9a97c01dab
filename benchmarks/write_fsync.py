"""What syncing shards to disk before the manifest costs the writer.

Writes the same data set with `ArraysToRecords.from_arrays`, with the shard fsyncs (the
default) and without them (`_sync_shards` replaced by a no-op; the manifest's own fsync
stays), alternating, best of `--repeats` each. Before every run the page cache's dirty
data is written back (`os.sync`, not timed), so no run pays for the one before it.

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
    real_sync = ArraysToRecords._sync_shards
    times: dict[str, list[float]] = {"without fsync": [], "with fsync": []}
    try:
        for _ in range(args.repeats):
            for name in times:
                d = os.path.join(root, "ds")
                shutil.rmtree(d, ignore_errors=True)
                os.sync()
                ArraysToRecords._sync_shards = (
                    real_sync if name == "with fsync" else (lambda self: None)
                )
                start = time.perf_counter()
                ArraysToRecords.from_arrays(x, y, d, verbose=0)
                times[name].append(time.perf_counter() - start)
    finally:
        ArraysToRecords._sync_shards = real_sync
        shutil.rmtree(root, ignore_errors=True)
    nbytes = x.nbytes + y.nbytes
    result = {
        "samples": n,
        "megabytes": round(nbytes / 1e6, 1),
        **{
            name: {
                "best_s": round(min(t), 3),
                "MB_per_s": round(nbytes / 1e6 / min(t), 1),
                "all_s": [round(v, 3) for v in t],
            }
            for name, t in times.items()
        },
    }
    result["cost_percent"] = round(
        100 * (min(times["with fsync"]) / min(times["without fsync"]) - 1), 1
    )
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
