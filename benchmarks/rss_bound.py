"""What bounding sample mode's RSS would cost: the mapped pages dropped every N MB read.

Sample mode reads the shards through a memory map, so every page an epoch touches counts
in the process's RSS (page cache, shared and reclaimable) until the mapping goes. This
probe drops the whole mapping's pages with ``madvise(MADV_DONTNEED)`` (the page cache
keeps them; the next touch maps them again) each time the reader has gathered
``--bound-mb`` of samples, and prints the read rate, the CPU per epoch and the peak RSS
beside a run without the bound, each in its own process, the rounds interleaved.

It patches the reader from outside (`Epoch.unit` and `Epoch.row_block`); nothing in
keras-tfr does this. Usage::

    python benchmarks/run_all.py --only read --shapes small --keep-data --data-dir DIR
    python benchmarks/rss_bound.py DIR/small-x1/ktfr [--bounds 0,128,512] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_CHILD = r"""
import ctypes, json, os, resource, sys, threading, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
from keras_tfr import TFRecordSequenceSource
from keras_tfr.read import mapped

directory, bound, way = sys.argv[1], int(sys.argv[2]) << 20, sys.argv[3]
libc = ctypes.CDLL(None)
state = {"read": 0, "drops": 0}
lock = threading.Lock()


def touched(plan, nbytes):
    if bound <= 0:
        return
    with lock:
        state["read"] += nbytes
        if state["read"] < bound:
            return
        state["read"] = 0
        state["drops"] += 1
    region = plan.region()
    libc.madvise(ctypes.c_void_p(region.base), ctypes.c_size_t(region.total), 4)  # DONTNEED


def patched(fn):
    def call(self, i):
        lo, hi = self.span(i)
        touched(self.plan, (hi - lo) * sum(self.plan.sample_bytes))
        return fn(self, i)

    return call


mapped.Epoch.unit = patched(mapped.Epoch.unit)
mapped.Epoch.row_block = patched(mapped.Epoch.row_block)
src = TFRecordSequenceSource(directory, batch_size=256, shuffle=True, seed=0)
assert src.access == "samples", src.access
epochs = []
for _ in range(4):
    it = src.as_numpy_iterator() if way == "numpy" else iter(src)
    t0, c0 = time.perf_counter(), time.process_time()
    n = sum(int(b[0].shape[0]) for b in it)
    epochs.append((n / (time.perf_counter() - t0), time.process_time() - c0))
later = sorted(epochs[1:])  # the first epoch maps (and checks) the shards
print("@@" + json.dumps({
    "rate": later[1][0],
    "cpu_s": later[1][1],
    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "drops": state["drops"],
}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("directory", help="a keras-tfr data set read in sample mode")
    ap.add_argument("--bounds", default="0,128,512", help="MB read between drops (0: none)")
    ap.add_argument("--ways", default="tensor,numpy", help="for x, y in source / numpy")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    rows: dict[tuple[str, int], list[dict]] = {}
    for _ in range(args.rounds):
        for bound in (int(b) for b in args.bounds.split(",")):
            for way in args.ways.split(","):
                out = subprocess.run(
                    [sys.executable, "-c", _CHILD, args.directory, str(bound), way],
                    capture_output=True,
                    text=True,
                    check=True,
                    env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
                ).stdout
                line = next(v for v in out.splitlines() if v.startswith("@@"))
                rows.setdefault((way, bound), []).append(json.loads(line[2:]))
    print(f"{'reader':8s} {'bound':>8s} {'ex/s':>10s} {'CPU s/epoch':>12s} {'peak RSS':>9s}")
    for (way, bound), runs in rows.items():
        best = max(runs, key=lambda r: r["rate"])
        label = f"{bound} MB" if bound else "none"
        print(
            f"{way:8s} {label:>8s} {best['rate']:10,.0f} {best['cpu_s']:12.3f} "
            f"{best['peak_rss_mb']:7,.0f}MB  ({best['drops']} drops)"
        )


if __name__ == "__main__":
    main()
