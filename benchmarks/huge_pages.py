"""Huge pages: how much of the mapped shards Linux maps in 2 MB pages, and what it buys.

A random gather of 3 KB samples from 0.5 GB misses the TLB on nearly every sample when
the pages are 4 KB; NumPy's arrays in RAM get 2 MB pages (NumPy asks for them), and so
does the tensor Keras makes of them for `fit`. keras-tfr maps each shard on a 2 MB
boundary (where that costs at most twice the address space) and writes shards in whole,
aligned 2 MB pieces, so that the page cache holds them in huge pages the kernel can map
whole (`keras_tfr.read.mapped._Region`,
`keras_tfr.write.sink._FramedFile`).

The data set is written as `make bench` writes it (from a memory-mapped ``.npy``). Then,
in one process: the share of the shards' mapping that is mapped in 2 MB pages
(``FilePmdMapped`` in ``/proc/self/smaps``) with shards on 2 MB boundaries (the
default) and without (``mapped._HUGE_ALIGN = False``, as before), and `fit` epochs
alternated between in-memory NumPy and the two sources (as `fit_paired.py`), each
source's epoch divided by the NumPy epoch of its round.

Usage::

    python benchmarks/huge_pages.py --rounds 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from backend_fit import generate, run_worker, serve
from fit_paired import BATCH, SHAPES, paired_epochs


def mapped_in_huge_pages(lo: int, hi: int) -> tuple[int, int]:
    """Bytes resident, and bytes mapped in 2 MB pages, of the file mappings in [lo, hi)."""
    rss = pmd = 0
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                a, b = (int(v, 16) for v in head.split("-"))
                inside = lo <= a and b <= hi
            elif inside and head == "Rss:":
                rss += int(line.split()[1]) << 10
            elif inside and head == "FilePmdMapped:":
                pmd += int(line.split()[1]) << 10
    return rss, pmd


def worker(data: str, rounds: str) -> dict:
    import keras

    from keras_tfr import TFRecordSequenceSource
    from keras_tfr.read import mapped

    x, y = np.load(os.path.join(data, "x.npy")), np.load(os.path.join(data, "y.npy"))
    sources, coverage = {}, {}
    for name, huge in (("2 MB boundaries", True), ("4 KB boundaries", False)):
        mapped._HUGE_ALIGN = huge
        mapped._REGIONS.clear()  # a region of its own, not the other source's
        src = TFRecordSequenceSource(os.path.join(data, "ktfr"), batch_size=BATCH, seed=0)
        for _ in src.as_numpy_iterator():
            pass
        region = src._mapped_plan.region()
        coverage[name] = mapped_in_huge_pages(region.base, region.base + region.total)
        sources[name] = src
    walls = {n: e["wall"] for n, e in paired_epochs(x, y, sources, int(rounds)).items()}
    return {
        "walls": walls,
        "coverage": coverage,
        "samples": len(x),
        "backend": keras.backend.backend(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES))
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if not sys.platform.startswith("linux"):
        ap.error("huge pages of the page cache are mapped so on Linux only")
    samples, shape = SHAPES[args.shape]
    with tempfile.TemporaryDirectory(prefix="keras-tfr-huge-pages-") as data:
        generate(data, samples, shape)
        res = run_worker(__file__, [data, str(args.rounds)], "tensorflow", 3600)
    if res is None:
        return 1
    print(f"{args.shape}: {samples} x {shape} float32, batch {BATCH}, {args.rounds} rounds")
    for name, (rss, pmd) in res["coverage"].items():
        share = pmd / rss if rss else 0.0
        print(
            f"  shards on {name}: {pmd >> 20} of {rss >> 20} MB mapped in 2 MB pages ({share:.0%})"
        )
    walls = res["walls"]
    for name in walls:
        if name == "numpy":
            continue
        ratios = [b / a for a, b in zip(walls[name], walls["numpy"])]
        rate = res["samples"] / statistics.median(walls[name])
        print(
            f"  fit from shards on {name}: {rate:,.0f} ex/s, "
            f"{statistics.median(ratios):.3f}x of in-memory NumPy (median of rounds)"
        )
    huge, small = walls["2 MB boundaries"], walls["4 KB boundaries"]
    paired = statistics.median(b / a for a, b in zip(huge, small))
    print(f"  2 MB boundaries against 4 KB, median of rounds: {paired:.3f}x")
    return 0


if __name__ == "__main__":
    serve(worker, main)
