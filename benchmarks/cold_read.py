"""The first epoch from a cold page cache: its time and the disk requests each reader makes.

`make bench` reads from the page cache (warm), as every epoch after the first does while
the data set fits in memory. The first epoch, and every epoch of a data set larger than
memory, comes from the disk, where the readers differ in how they ask for the bytes:
block mode reads whole records in sequence; sample mode (and a memory-mapped ``.npy``
gathered at random) faults pages in through the map. This script drops the page cache
before each reader (``/proc/sys/vm/drop_caches``: root only), runs one epoch, shuffled,
batch 256, in a process of its own, then a second (warm) epoch in the same process, and
reads the kernel's counters for the block device that holds the data
(``/sys/dev/block/MAJ:MIN/stat``): read requests completed and sectors read. Nothing
else should use that device meanwhile; a loop device of its own is simplest::

    truncate -s 3G /tmp/disk.img && DEV=$(losetup -f --show /tmp/disk.img)
    mkfs.ext4 -q $DEV && mkdir -p /mnt/disk && mount $DEV /mnt/disk
    blockdev --setra 256 $DEV   # 128 KB read-ahead, the usual default for a disk
    python benchmarks/cold_read.py --data-dir /mnt/disk [--shape small] [--rounds 2]

Times on a VM whose disk the host caches say little about a real disk; the request counts
and sizes carry over: on a spinning disk each request that is not contiguous with the one
before costs a seek (about 8 ms), on cloud block storage each request counts against the
volume's IOPS.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_all import BATCH, PEER_THREADS, SHAPES, _paths, work_gen

READERS = {
    "raw": "raw read of the shards in sequence (limit)",
    "samples": "keras-tfr, sample mode (Python loop)",
    "samples-numpy": "keras-tfr, sample mode, as_numpy_iterator()",
    "blocks": 'keras-tfr, access="blocks"',
    "memmap": f"memmap + {PEER_THREADS} threads (sorted gather)",
}

_CHILD = r"""
import json, os, sys, time
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
from concurrent.futures import ThreadPoolExecutor

here, reader, p = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
sys.path.insert(0, here)
from run_all import BATCH, PEER_THREADS, _memmap_batches, _warm
from keras_tfr.manifest import Manifest

SAMPLES = Manifest.load(p["ktfr"]).total_samples


def epoch_of(which, epoch):
    if which == "raw":  # the shard files in sequence, as `run_all.py`'s raw read
        _warm(p["ktfr"])
        return SAMPLES
    if which == "memmap":  # the peer, as `run_all.py` reads it
        batch, steps = _memmap_batches(p, epoch)
        with ThreadPoolExecutor(PEER_THREADS) as pool:
            return sum(len(b[1]) for b in pool.map(batch, range(steps)))
    it = SOURCE.as_numpy_iterator() if which == "samples-numpy" else iter(SOURCE)
    return sum(int(b[1].shape[0]) for b in it)


if reader in ("samples", "samples-numpy", "blocks"):
    from keras_tfr import TFRecordSequenceSource

    access = "blocks" if reader == "blocks" else "samples"
    SOURCE = TFRecordSequenceSource(p["ktfr"], batch_size=BATCH, seed=0, access=access)
    assert SOURCE.access == access
out = {}
for epoch, name in enumerate(("cold", "warm")):
    print("READY" if epoch == 0 else "", flush=True)
    if epoch == 0:
        sys.stdin.readline()  # the parent reads the device's counters, then says go
    t = time.perf_counter()
    n = epoch_of(reader, epoch)
    out[name] = n / (time.perf_counter() - t)
    if epoch == 0:
        print("DONE", flush=True)
        sys.stdin.readline()
print("RESULT " + json.dumps(out), flush=True)
"""


def device_stat_path(path: str) -> str:
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    stat = f"/sys/dev/block/{major}:{minor}/stat"
    if major == 0 or not os.path.exists(stat):
        raise SystemExit(
            f"{path} is on a file system without a block device ({major}:{minor}: tmpfs, "
            "overlay, a network file system): its disk requests cannot be counted. Use a "
            "loop device (see the module's docstring)."
        )
    return stat


def counters(stat: str) -> tuple[int, int]:
    """Read requests completed and 512-byte sectors read, so far."""
    with open(stat) as f:
        fields = f.read().split()
    return int(fields[0]), int(fields[2])


def drop_page_cache() -> None:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as e:
        raise SystemExit(f"cannot drop the page cache ({e}): run this script as root") from e


def run_counted(
    name: str, args: list[str], stat: str, preexec_fn: Any = None
) -> tuple[dict[str, Any], tuple[int, int], tuple[int, int]]:
    """Runs a child that prints READY (set up), waits for a line, reads, prints DONE,
    waits for a line and prints ``RESULT {json}``; returns the result and the device's
    counters at READY and at DONE (what the child's imports read is not counted)."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    child = subprocess.Popen(
        args,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=preexec_fn,
    )
    assert child.stdin is not None and child.stdout is not None

    def wait_for(word: str) -> None:
        for line in child.stdout:
            if line.strip() == word:
                return
        raise SystemExit(f"{name}: the child ended before {word} (exit {child.wait()})")

    wait_for("READY")
    before = counters(stat)
    child.stdin.write("\n")
    child.stdin.flush()
    wait_for("DONE")
    after = counters(stat)
    child.stdin.write("\n")
    child.stdin.flush()
    out, _ = child.communicate(timeout=600)
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if not line:
        raise SystemExit(f"{name} failed (exit {child.returncode})")
    return json.loads(line[0][len("RESULT ") :]), before, after


def run_reader(reader: str, p: dict[str, str], stat: str) -> dict[str, float]:
    drop_page_cache()
    here = os.path.dirname(os.path.abspath(__file__))
    args = [sys.executable, "-c", _CHILD, here, reader, json.dumps(p)]
    rates, before, after = run_counted(reader, args, stat)
    requests, sectors = after[0] - before[0], after[1] - before[1]
    return {
        "cold": rates["cold"],
        "warm": rates["warm"],
        "requests": requests,
        "mb_read": sectors * 512 / 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True, help="on the device to count (see above)")
    ap.add_argument("--shape", default="small", choices=["small", "large"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--readers", default=",".join(READERS))
    args = ap.parse_args(argv)
    readers = args.readers.split(",")
    unknown = sorted(set(readers) - set(READERS))
    if unknown:
        ap.error(f"unknown readers {unknown}; choose from {list(READERS)}")
    stat = device_stat_path(args.data_dir)
    shape = SHAPES[args.shape]
    p = _paths(args.data_dir, args.shape)
    if not os.path.exists(os.path.join(p["ktfr"], "manifest.json")):
        print(f"writing {shape['samples']:,} x {shape['shape']} float32 to {p['base']} ...")
        work_gen(p, shape["samples"], shape["shape"])
        from keras_tfr import ArraysToRecords

        x, y = np.load(p["x"], mmap_mode="r"), np.load(p["y"], mmap_mode="r")
        ArraysToRecords.from_arrays(x, y, p["ktfr"], verbose=0)
    runs: dict[str, list[dict[str, float]]] = {r: [] for r in readers}
    for r in range(args.rounds):
        for reader in readers if r % 2 == 0 else readers[::-1]:
            runs[reader].append(run_reader(reader, p, stat))
    print(
        f"{args.shape}: {shape['samples']:,} x {shape['shape']} float32, batch {BATCH}, "
        f"shuffled; first epoch from a cold page cache (median of {args.rounds} rounds)"
    )
    print(
        f"{'reader':46s} {'cold ex/s':>10s} {'requests':>9s} {'mean KB':>8s} "
        f"{'MB read':>8s} {'warm ex/s':>10s}"
    )
    for reader in readers:
        med = {k: statistics.median(run[k] for run in runs[reader]) for k in runs[reader][0]}
        mean_kb = med["mb_read"] * 1e3 / max(1, med["requests"])
        print(
            f"{READERS[reader]:46s} {med['cold']:10,.0f} {med['requests']:9,.0f} "
            f"{mean_kb:8.0f} {med['mb_read']:8.0f} {med['warm']:10,.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
