"""Data larger than memory: each reader in a cgroup whose memory limit is below the data.

The case keras-tfr is for, measured for real: a container (here a memory cgroup) whose
limit holds a fraction of the data set, so that every epoch reads most of it from disk.
The page cache of what a process reads is charged to its cgroup, and keras-tfr's
``shuffle_window="auto"`` sees the cgroup's limit (`keras_tfr.source.cgroup_memory_limit`).
Each reader runs in a process of its own inside the cgroup, after the page cache is
dropped, for one epoch or ``--seconds``, whichever ends first, batch 256, shuffled:

* ``window``: keras-tfr's default here: sample mode, shuffled window by window (windows
  of an eighth of the limit, read ahead a record at a time, dropped once read);
* ``global``: sample mode with ``shuffle_window=None``: one order over all samples, so
  that nearly every sample read is a page fault that goes to the disk;
* ``blocks``: ``access="blocks"``: whole records in sequence, shuffled in a buffer;
* ``memmap``: the peer, a memory-mapped ``.npy`` gathered by a sorted random index in
  4 threads (`run_all.py`'s).

It prints each reader's rate, the megabytes the data's block device served per megabyte
of samples delivered (read amplification: 1.0 reads each byte once), the requests, and the
peak of the cgroup's memory use and of the process's RSS. Root only (cgroup v1 or v2,
``/proc/sys/vm/drop_caches``)::

    python benchmarks/larger_than_memory.py --data-dir /work/bench-data [--scale 6] \\
        [--limit-mb 1536] [--seconds 45] [--readers window,global,blocks,memmap]

``--no-limit --window 256MB`` runs the same readers where the data fits in memory (no
cgroup, the page cache warm after a first epoch): what windows cost there. The ``-fit``
readers train Flatten + Dense 10 (`run_all.py`'s model, the small shape) on the same
data for one epoch or ``--seconds`` (the ``memmap`` one through a ``keras.utils.PyDataset``
with 4 workers), from a cold page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cold_read import device_stat_path, drop_page_cache, run_counted
from run_all import BATCH, PEER_THREADS, SHAPES, _paths, work_gen

READERS = {
    "window": "keras-tfr, sample mode, windows (default)",
    "global": "keras-tfr, sample mode, shuffle_window=None",
    "blocks": 'keras-tfr, access="blocks"',
    "memmap": f"memmap + {PEER_THREADS} threads (sorted gather)",
    "window-fit": "fit: keras-tfr, sample mode, windows",
    "blocks-fit": 'fit: keras-tfr, access="blocks"',
    "memmap-fit": f"fit: memmap + PyDataset(workers={PEER_THREADS})",
}

_CHILD = r"""
import json, os, resource, sys, time
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
from concurrent.futures import ThreadPoolExecutor

import numpy as np

here, reader, p, seconds = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), float(sys.argv[4])
window, warm = sys.argv[5], sys.argv[6] == "warm"
sys.path.insert(0, here)
from run_all import BATCH, PEER_THREADS, _memmap_batches

FIT = reader.endswith("-fit")
kind = reader[: -len("-fit")] if FIT else reader


def epoch():
    if kind == "memmap":
        batch, steps = _memmap_batches(p, 0)
        return ThreadPoolExecutor(PEER_THREADS).map(batch, range(steps))
    return SRC.as_numpy_iterator() if SRC.access == "samples" else iter(SRC)


info = {}
if kind != "memmap":
    from keras_tfr import TFRecordSequenceSource

    kw = {"access": "blocks"} if kind == "blocks" else {}
    if kind == "global":
        kw["shuffle_window"] = None
    elif kind == "window" and window != "auto":
        kw["shuffle_window"] = window
    SRC = TFRecordSequenceSource(p["ktfr"], batch_size=BATCH, seed=0, **kw)
    info = {"access": SRC.access, "window_records": getattr(SRC._order, "window_records", None)}
if FIT:  # Flatten + Dense 10, as `run_all.py`'s fit; one epoch or `seconds`
    import keras

    model = keras.Sequential(
        [keras.Input((28, 28, 1)), keras.layers.Flatten(), keras.layers.Dense(10)]
    )
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if kind == "memmap":

        class Peer(keras.utils.PyDataset):
            def __init__(self):
                super().__init__(workers=PEER_THREADS, use_multiprocessing=False)
                self.batch, self.steps = _memmap_batches(p, 0)

            def __len__(self):
                return self.steps

            def __getitem__(self, i):
                return self.batch(i)

        data = Peer()
    else:
        data = SRC
    state = {"steps": 0}

    class Stop(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            state["steps"] = batch + 1
            if time.perf_counter() - t > seconds:
                self.model.stop_training = True

total = len(np.load(p["y"], mmap_mode="r"))
if warm and not FIT:  # an epoch first: the page cache and the checks warm
    for _ in epoch():
        pass
print("READY", flush=True)
sys.stdin.readline()
t = time.perf_counter()
n = nbytes = 0
if FIT:
    model.fit(data, epochs=1, verbose=0, callbacks=[Stop()])
    n = min(state["steps"] * BATCH, total)
    nbytes = n * (28 * 28 * 4 + 4)
else:
    for b in epoch():
        x, y = np.asarray(b[0]), np.asarray(b[1])  # block mode: tensors, copied here
        n += int(y.shape[0])
        nbytes += int(x.nbytes) + int(y.nbytes)
        if time.perf_counter() - t > seconds:
            break
elapsed = time.perf_counter() - t
print("DONE", flush=True)
sys.stdin.readline()
info.update(samples=n, mb=nbytes / 1e6, seconds=elapsed,
            peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
print("RESULT " + json.dumps(info), flush=True)
os._exit(0)
"""


class Cgroup:
    """A memory cgroup of its own (v2 where mounted so, else v1), removed at the end."""

    def __init__(self, limit: int):
        v2 = os.path.exists("/sys/fs/cgroup/cgroup.controllers")
        base = "/sys/fs/cgroup" if v2 else "/sys/fs/cgroup/memory"
        self.path = os.path.join(base, f"keras_tfr_bench_{os.getpid()}")
        self.v2 = v2
        try:
            os.makedirs(self.path, exist_ok=True)
            name = "memory.max" if v2 else "memory.limit_in_bytes"
            with open(os.path.join(self.path, name), "w") as f:
                f.write(str(limit))
        except OSError as e:
            raise SystemExit(
                f"cannot make a memory cgroup at {self.path} ({e}): run as root"
            ) from e

    def join(self) -> None:  # in the child, before exec
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    def peak_mb(self) -> float:
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        try:
            with open(os.path.join(self.path, name)) as f:
                return int(f.read()) / 1e6
        except (OSError, ValueError):
            return float("nan")

    def reset_peak(self) -> None:
        if not self.v2:
            with open(os.path.join(self.path, "memory.max_usage_in_bytes"), "w") as f:
                f.write("0")

    def remove(self) -> None:
        try:
            os.rmdir(self.path)
        except OSError:
            pass


def run_reader(
    reader: str, p: dict[str, str], stat: str, group: Cgroup | None, seconds: float, window: str
) -> dict:
    if group is not None:
        drop_page_cache()
        group.reset_peak()
    here = os.path.dirname(os.path.abspath(__file__))
    warm = "cold" if group is not None else "warm"
    args = [sys.executable, "-c", _CHILD, here, reader, json.dumps(p), str(seconds), window, warm]
    res, before, after = run_counted(
        reader, args, stat, preexec_fn=group.join if group is not None else None
    )
    res.update(
        requests=after[0] - before[0],
        mb_read=(after[1] - before[1]) * 512 / 1e6,
        cgroup_peak_mb=group.peak_mb() if group is not None else float("nan"),
    )
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--shape", default="small", choices=["small", "large"])
    ap.add_argument("--scale", type=int, default=6, help="times the shape's 0.5-0.8 GB")
    ap.add_argument("--limit-mb", type=int, default=1536, help="the cgroup's memory limit")
    ap.add_argument("--seconds", type=float, default=45.0, help="per reader, at most")
    ap.add_argument("--readers", default=",".join(READERS))
    ap.add_argument(
        "--window", default="auto", help="the window reader's shuffle_window (default auto)"
    )
    ap.add_argument(
        "--no-limit",
        action="store_true",
        help="no cgroup and no dropped page cache: an epoch first, then the timed one "
        "(what windows cost where the data fits in memory)",
    )
    args = ap.parse_args(argv)
    readers = args.readers.split(",")
    unknown = sorted(set(readers) - set(READERS))
    if unknown:
        ap.error(f"unknown readers {unknown}; choose from {list(READERS)}")
    shape = SHAPES[args.shape]
    n = shape["samples"] * args.scale
    p = _paths(args.data_dir, args.shape, args.scale)
    if not os.path.exists(os.path.join(p["ktfr"], "manifest.json")):
        print(f"writing {n:,} x {shape['shape']} float32 to {p['base']} ...", flush=True)
        work_gen(p, n, shape["shape"])
        from keras_tfr import ArraysToRecords

        x, y = np.load(p["x"], mmap_mode="r"), np.load(p["y"], mmap_mode="r")
        ArraysToRecords.from_arrays(x, y, p["ktfr"], verbose=0)
    stat = device_stat_path(p["ktfr"])
    data_mb = sum(os.path.getsize(os.path.join(p["ktfr"], f)) for f in os.listdir(p["ktfr"])) / 1e6
    group = None if args.no_limit else Cgroup(args.limit_mb << 20)
    try:
        results = {r: run_reader(r, p, stat, group, args.seconds, args.window) for r in readers}
    finally:
        if group is not None:
            group.remove()
    where = (
        "no memory limit, a warm-up epoch first (page cache warm)"
        if group is None
        else f"in a cgroup of {args.limit_mb:,} MiB; page cache dropped before each reader"
    )
    print(
        f"{args.shape} x{args.scale}: {n:,} x {shape['shape']} float32 ({data_mb:,.0f} MB of "
        f"shards), batch {BATCH}, shuffled, {where}; one epoch or {args.seconds:.0f} s"
    )
    print(
        f"{'reader':44s} {'ex/s':>9s} {'read/MB':>8s} {'requests':>9s} {'cgroup peak':>12s} "
        f"{'peak RSS':>9s}  notes"
    )
    for r in readers:
        res = results[r]
        rate = res["samples"] / res["seconds"]
        amp = res["mb_read"] / max(res["mb"], 1e-9)
        note = f"{res['samples']:,} samples in {res['seconds']:.0f} s"
        if res.get("window_records"):
            note += f"; windows of {res['window_records']} records"
        print(
            f"{READERS[r]:44s} {rate:9,.0f} {amp:8.2f} {res['requests']:9,} "
            f"{res['cgroup_peak_mb']:10,.0f}MB {res['peak_rss_mb']:7,.0f}MB  {note}"
        )
    print("JSON " + json.dumps({"limit_mb": args.limit_mb, "data_mb": data_mb, **results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
