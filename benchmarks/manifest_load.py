"""What a large data set's manifest costs to load (the 100-host plan in docs/scaling.md).

Writes a small real data set, then a synthetic manifest of ``--shards`` shards of the
same layout (``--shard-mb`` each) with keras-tfr's own `Manifest` class, and times
`Manifest.load` (best of ``--repeat``): without the shard check, and with it against
empty files of the recorded sizes (sparse, so nothing is written), where the check is
one ``stat`` per shard.

    python benchmarks/manifest_load.py --shards 80000
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import sys
import tempfile
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=80_000)
    parser.add_argument("--shard-mb", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-files", action="store_true", help="skip the stat check")
    args = parser.parse_args(argv)

    from keras_tfr import ArraysToRecords, Manifest

    with tempfile.TemporaryDirectory() as tmp:
        seed_dir = os.path.join(tmp, "seed")
        x = np.zeros((1024, 28, 28, 1), np.float32)  # 3,136 bytes per sample
        y = np.zeros((1024,), np.int64)
        ArraysToRecords.from_arrays(x, y, seed_dir, record_size="1MB", verbose=0)
        seed = Manifest.load(seed_dir)
        spr = seed.samples_per_record
        sample_bytes = seed.sample_bytes
        records = (args.shard_mb << 20) // (spr * sample_bytes + 16 * len(seed.features) + 64)
        samples = records * spr
        nbytes = records * seed.record_bytes + records * 16
        template = seed.shards[0]
        width = len(str(args.shards))
        shards = [
            dataclasses.replace(
                template,
                file=f"shard-{i:0{width}d}-of-{args.shards:0{width}d}.tfrecord",
                samples=samples,
                records=records,
                bytes=nbytes,
            )
            for i in range(args.shards)
        ]
        big_dir = os.path.join(tmp, "big")
        os.makedirs(big_dir)
        manifest = dataclasses.replace(seed, shards=shards, directory="")
        manifest.save(big_dir)
        size = os.path.getsize(os.path.join(big_dir, "manifest.json"))

        def best(check_files: bool) -> float:
            times = []
            for _ in range(args.repeat):
                start = time.perf_counter()
                loaded = Manifest.load(big_dir, check_files=check_files)
                times.append(time.perf_counter() - start)
                assert len(loaded.shards) == args.shards
            return min(times)

        result = {
            "shards": args.shards,
            "shard_bytes": nbytes,
            "data_set_bytes": nbytes * args.shards,
            "samples": samples * args.shards,
            "records": records * args.shards,
            "manifest_bytes": size,
            "load_s": best(False),
        }
        if not args.skip_files:
            for shard in shards:
                with open(os.path.join(big_dir, shard.file), "wb") as f:
                    f.truncate(shard.bytes)
            result["load_with_check_files_s"] = best(True)
        result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
