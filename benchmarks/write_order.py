"""What writing in a seeded order costs: `from_arrays(..., shuffle_seed=0)` against the
order given, on the same memory-mapped `.npy`, each run in its own process (so that its
peak RSS, `getrusage(RUSAGE_SELF).ru_maxrss`, is its own), the rounds interleaved.

The shuffled write reads the memmap at random, a chunk at a time in increasing index
order, and drops the memmap's pages every few hundred rows (a page fault maps 64 KB
around it, so random reads would otherwise map most of the file). Prints the write rate,
the peak RSS and its private part (``RssAnon``) for both, and the ratios.

Usage::

    python benchmarks/write_order.py [--samples 160000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, os, resource, sys, threading, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np
from keras_tfr import ArraysToRecords

data, out, seed = sys.argv[1], sys.argv[2], sys.argv[3]
x = np.load(os.path.join(data, "x.npy"), mmap_mode="r")
y = np.load(os.path.join(data, "y.npy"), mmap_mode="r")
peak = [0]
done = threading.Event()


def watch():
    while not done.is_set():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon"):
                    peak[0] = max(peak[0], int(line.split()[1]))
        time.sleep(0.01)


threading.Thread(target=watch, daemon=True).start()
t = time.perf_counter()
ArraysToRecords.from_arrays(
    x, y, out, shuffle_seed=None if seed == "none" else int(seed), verbose=0
)
wall = time.perf_counter() - t
done.set()
print(json.dumps({
    "rate": len(x) / wall,
    "mb_s": (x.nbytes + y.nbytes) / wall / 1e6,
    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "peak_private_mb": peak[0] / 1024,
}))
"""


def _run(data: str, out: str, seed: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, data, out, seed],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=160_000, help="samples of 28x28x1 float32")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    if args.samples < 1 or args.rounds < 1:
        ap.error("--samples and --rounds must be at least 1")
    import numpy as np

    with tempfile.TemporaryDirectory(prefix="keras-tfr-write-order-") as tmp:
        rng = np.random.default_rng(0)
        x = np.lib.format.open_memmap(
            os.path.join(tmp, "x.npy"), mode="w+", dtype=np.float32, shape=(args.samples, 28, 28, 1)
        )
        for lo in range(0, args.samples, 8192):  # in pieces: memory stays flat
            hi = min(lo + 8192, args.samples)
            x[lo:hi] = rng.random((hi - lo, 28, 28, 1), dtype=np.float32)
        x.flush()
        del x
        np.save(
            os.path.join(tmp, "y.npy"),
            np.repeat(np.arange(10), -(-args.samples // 10))[: args.samples],
        )
        runs: dict[str, list[dict]] = {"none": [], "0": []}
        for r in range(args.rounds):
            for seed in ("none", "0") if r % 2 == 0 else ("0", "none"):
                runs[seed].append(_run(tmp, os.path.join(tmp, f"out-{seed}-{r}"), seed))
    med = {s: {k: statistics.median(v[k] for v in rs) for k in rs[0]} for s, rs in runs.items()}
    print(
        f"{args.samples:,} x 28x28x1 float32 from a memmapped .npy, {args.rounds} rounds (medians)"
    )
    for seed, name in (("none", "order given"), ("0", "shuffle_seed=0")):
        m = med[seed]
        print(
            f"  {name:15s} {m['rate']:10,.0f} ex/s  {m['mb_s']:6,.0f} MB/s  peak RSS "
            f"{m['peak_rss_mb']:6,.0f} MB  peak private {m['peak_private_mb']:5,.0f} MB"
        )
    a, b = med["0"], med["none"]
    print(
        f"  shuffled / order given: rate {a['rate'] / b['rate']:.2f}x, peak RSS "
        f"{a['peak_rss_mb'] / b['peak_rss_mb']:.2f}x, private "
        f"{a['peak_private_mb'] / b['peak_private_mb']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
