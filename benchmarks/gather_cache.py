"""What a random gather from the page cache costs with the destination in the CPU's cache
and without: one thread, one epoch of the small shape (160,000 samples of 3,136 bytes,
0.5 GB) from a memory-mapped ``.npy``, batch 256, the samples of each batch sorted.

* ``fancy, dropped at once``: what the memmap + threads peer of ``run_all.py`` does with a
  consumer that only reads the shape: each batch ``x[idx]`` is freed before the next is
  made, so malloc hands the same, still cached, 800 KB back.
* ``fancy, N batches held``: the same with the last N batches kept alive, as a pipeline
  that reads ahead (or a consumer that keeps its batches) does.
* ``np.take per unit of 10 batches``: the Python loop's reader (`MappedPlan.gather_batches`
  with ``aligned``): one 8 MB destination per unit.

Usage::

    python benchmarks/gather_cache.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections import deque

import numpy as np

N, SAMPLE, BATCH, UNIT = 160_000, 3136, 256, 10


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="keras-tfr-gather-") as tmp:
        path = os.path.join(tmp, "x.npy")
        out = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(N, SAMPLE))
        for a in range(0, N, 10_000):  # written in pieces: the array never sits in memory
            out[a : a + 10_000] = np.random.default_rng(a).integers(0, 255, (10_000, SAMPLE))
        out.flush()
        del out
        x = np.load(path, mmap_mode="r")
        x[np.arange(0, N, 1)].sum()  # page cache warm
        order = np.random.default_rng(0).permutation(N)
        batches = [np.sort(order[a : a + BATCH]) for a in range(0, N, BATCH)]

        def fancy(held: int) -> None:
            kept: deque = deque()
            for idx in batches:
                kept.append(x[idx])
                if len(kept) > held:
                    kept.popleft()

        def take_units() -> None:
            kept: deque = deque()
            for u in range(0, len(batches), UNIT):
                idx = np.concatenate(batches[u : u + UNIT])
                dst = np.empty((len(idx), SAMPLE), np.uint8)
                np.take(x, idx, axis=0, out=dst, mode="clip")
                kept.append(dst)
                if len(kept) > 3:  # units in flight: the reader's look-ahead
                    kept.popleft()

        ways = {
            "fancy, dropped at once": lambda: fancy(0),
            "fancy, 4 batches held": lambda: fancy(4),
            "fancy, 30 batches held": lambda: fancy(30),
            "np.take per unit of 10 batches": take_units,
        }
        times: dict[str, list[float]] = {k: [] for k in ways}
        for _ in range(args.rounds):  # interleaved: the host's load hits every way alike
            for name, fn in ways.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        for name, t in times.items():
            t.sort()
            print(f"{name:32s} median {1e3 * t[len(t) // 2]:6.1f} ms  best {1e3 * t[0]:6.1f} ms")


if __name__ == "__main__":
    main()
