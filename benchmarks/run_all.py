"""keras-tfr benchmarks: read, fit and write, side by side with the usual alternatives.

One command runs everything (``make bench`` or ``python benchmarks/run_all.py``) and prints
one table with ratios to keras-tfr, plus ``benchmarks/results/results.json``,
``results.md`` and ``results.png`` (a chart, where matplotlib is installed).

Every measurement runs in its own Python process, so peak RSS
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``) belongs to that measurement alone and
one pipeline's caches or thread pools cannot help or hurt the next one. Files are read
once before each read measurement (page cache warm). All pipelines use batch 256 and
shuffle.

Pipelines (read benchmark, one epoch, no model):

* ``keras-tfr``: `TFRecordSequenceSource(..., shuffle=True, seed=0)`, iterated in a
  Python loop (``for x, y in source``: tensors; in sample mode straight from the
  memory-mapped reader, handed to TensorFlow through DLPack).
* ``keras-tfr through tf.data's iterator``: the same source read by TensorFlow's own
  iterator (``tf.data.Dataset.__iter__``: the tf.data pipeline that ``fit`` runs, and
  what a loop over ``source.map(...)`` or inside a ``tf.function`` reads).
* ``keras-tfr as_numpy_iterator()``: the same source's NumPy batches, straight from the
  memory-mapped reader (what a Python loop that wants NumPy uses).
* ``tutorial``: one ``tf.train.Example`` per sample holding ``tf.io.serialize_tensor``
  bytes; ``shuffle(3000)``, ``map(parse_single_example + parse_tensor, 8)``, ``batch``,
  ``prefetch`` (the pipeline of most TFRecord tutorials).
* ``per-sample raw``: one Example per sample with raw bytes; ``shuffle(3000)``, ``batch``,
  then one batched ``parse_example`` + ``decode_raw``.
* ``from_tensor_slices``: the arrays in RAM, ``shuffle(3000)``, ``batch``, ``prefetch``.
* ``grain+ArrayRecord``: one ArrayRecord record per sample (raw bytes), grain
  ``MapDataset`` with a global shuffle, threads for reading.
* ``tf.data save/load``: ``Dataset.save`` of per-sample elements, ``Dataset.load``,
  ``shuffle(3000)``, ``batch``, ``prefetch``.
* ``raw page-cache read``: ``readinto`` of the keras-tfr shard files into one buffer
  (the physical limit of reading these bytes on this machine).
* ``memmap + threads`` (the strongest simple peer): ``np.save``, ``np.load(mmap_mode="r")``,
  a random permutation per epoch, and per batch a sorted fancy-index gather, 4 threads.

Fit benchmark: the same pipelines into ``model.fit`` (Flatten + Dense 10), against
``model.fit(x, y)`` on in-memory NumPy and ``memmap + PyDataset`` (the peer above as a
``keras.utils.PyDataset`` with ``workers=4``). Every row also gives the CPU-seconds the
process spent per GB delivered (``time.process_time``, all threads).

Paired benchmarks (``--only paired``, shapes ``small`` and ``large``): on a shared VM a
process's speed moves by 10-20 % within minutes, more than the few percent between
keras-tfr, in-memory NumPy and memmap + ``PyDataset`` in ``fit``. So one process fits one
model one epoch at a time on each of the three in turn (group ``paired``:
`fit_paired.paired_epochs`, the order flipped each round, the first round a warm-up), and
another reads an epoch at a time of keras-tfr in a Python loop, of its
``as_numpy_iterator()`` and of memmap + threads (group ``paired-read``: `paired_reads`).
The report gives, per round, the ratio of keras-tfr's epoch to the others' in that
round: the median of the ratios and its 95 % bootstrap interval (``--paired-rounds``, 20
by default).

Usage::

    python benchmarks/run_all.py            # full sizes (10-15 minutes on 2 cores)
    python benchmarks/run_all.py --quick    # a quarter of the samples
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
BATCH = 256
TUTORIAL_SHUFFLE = 3000

SHAPES = {
    "small": {"samples": 160_000, "shape": (28, 28, 1)},  # 0.5 GB
    "large": {"samples": 16_384, "shape": (64, 64, 3)},  # 0.8 GB
    "large2g": {"samples": 43_690, "shape": (64, 64, 3)},  # 2.1 GB (GlobalAveragePooling2D)
}
PEER_THREADS = 4
# The rss group also reads in windows of this size (`shuffle_window`, what "auto" does for
# data larger than half of memory): the mapped pages it keeps do not grow with the data.
RSS_WINDOW = "128MB"

# Rounds of the paired groups (`PAIRED_GROUPS`): one epoch of each pipeline per round.
PAIRED_ROUNDS = 20
PAIRED_SHAPES = ("small", "large")  # Flatten + Dense(10), the model of `fit_paired`

READ_PIPELINES = [
    "keras-tfr",
    "keras-tfr-tfdata",
    "keras-tfr-numpy",
    "tutorial",
    "per-sample-raw",
    "from_tensor_slices",
    "grain-arrayrecord",
    "tf-save-load",
    "raw-read",
    "memmap-threads",
    "keras-arrays",
    "tf-data-floor",
]
FIT_PIPELINES = ["keras-tfr", "numpy", "memmap-pydataset", "tutorial"]
# The pipelines that read the formats `gen_formats` writes (the tutorial's: the write group).
FORMAT_PIPELINES = {"per-sample-raw", "grain-arrayrecord", "tf-save-load"}
WRITE_PIPELINES = ["keras-tfr", "np.save", "np.save-fsync", "tutorial"]
# The data each writer makes, by the read and fit pipelines that read it (without the
# write group, `--only` writes only what its pipelines read).
_DATA_READ_BY = {
    "keras-tfr": {"keras-tfr", "keras-tfr-tfdata", "keras-tfr-numpy", "raw-read"},
    "tutorial": {"tutorial"},
}

LABELS = {
    "keras-tfr": "keras-tfr",
    "keras-tfr-tfdata": "keras-tfr through tf.data's iterator",
    "keras-tfr-numpy": "keras-tfr as_numpy_iterator()",
    "tutorial": "tutorial (per-sample serialize_tensor)",
    "per-sample-raw": "per-sample raw bytes, batched parse",
    "from_tensor_slices": "from_tensor_slices (in RAM)",
    "grain-arrayrecord": "grain + ArrayRecord",
    "tf-save-load": "tf.data save/load",
    "raw-read": "raw page-cache read (limit)",
    "numpy": "model.fit(x, y) in-memory NumPy",
    "np.save": "np.save from memmap (limit)",
    "np.save-fsync": "np.save from memmap + fsync (durable)",
    "memmap-threads": "memmap + threads (sorted gather)",
    "memmap-pydataset": "memmap + PyDataset(workers=4)",
    "keras-arrays": "Keras' tf.data for in-memory arrays",
    "tf-data-floor": "tf.data floor (one batch repeated)",
    "keras-tfr-windows": f"keras-tfr, shuffle_window={RSS_WINDOW!r}",
}


# ============================================================== worker side (one process each)


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def _paths(data: str, shape_name: str, scale: int = 1) -> dict[str, str]:
    base = os.path.join(data, f"{shape_name}-x{scale}")
    return {
        "base": base,
        "x": os.path.join(base, "x.npy"),
        "y": os.path.join(base, "y.npy"),
        "ktfr": os.path.join(base, "ktfr"),
        "tutorial": os.path.join(base, "tutorial"),
        "raw": os.path.join(base, "raw"),
        "arrayrecord": os.path.join(base, "arrayrecord"),
        "tfsave": os.path.join(base, "tfsave"),
        "npsave": os.path.join(base, "npsave"),
    }


def shape_name_of(p: dict[str, str]) -> str:
    return os.path.basename(p["base"]).rsplit("-x", 1)[0]


def _load_xy(p: dict[str, str], in_memory: bool = False):
    mode = None if in_memory else "r"
    return np.load(p["x"], mmap_mode=mode), np.load(p["y"], mmap_mode=mode)


def _warm(path: str) -> int:
    """Reads every file under `path` once (page cache warm); returns the bytes read."""
    total = 0
    buf = bytearray(8 << 20)
    for root, _, files in os.walk(path):
        for name in sorted(files):
            with open(os.path.join(root, name), "rb", buffering=0) as f:
                while True:
                    n = f.readinto(buf)
                    if not n:
                        break
                    total += n
    return total


def _shard_files(directory: str, suffix: str = "") -> list[str]:
    return sorted(
        os.path.join(directory, n)
        for n in os.listdir(directory)
        if n.endswith(suffix) and not n.endswith(".json") and not n.startswith(".")
    )


def work_gen(p: dict[str, str], n: int, shape: tuple[int, ...]) -> dict[str, Any]:
    os.makedirs(p["base"], exist_ok=True)
    x = np.lib.format.open_memmap(p["x"], mode="w+", dtype=np.float32, shape=(n, *shape))
    y = np.lib.format.open_memmap(p["y"], mode="w+", dtype=np.int32, shape=(n,))
    rng = np.random.default_rng(0)
    step = max(1, (32 << 20) // (4 * int(np.prod(shape))))
    for i in range(0, n, step):
        j = min(n, i + step)
        x[i:j] = rng.random((j - i, *shape), dtype=np.float32)
        y[i:j] = rng.integers(0, 10, j - i, dtype=np.int32)
    x.flush()
    y.flush()
    return {}


def _tutorial_example(xi: np.ndarray, yi: int, tf) -> bytes:
    feature = {
        "x": tf.train.Feature(
            bytes_list=tf.train.BytesList(value=[tf.io.serialize_tensor(xi).numpy()])
        ),
        "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(yi)])),
    }
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


# The CPU-bound tutorial writer (~50 MB/s) is timed once; the two fast writers best of N.
WRITE_REPEATS = 3
# Fastest of several epochs for every pipeline alike: this kind of shared 2-core VM gives
# +-25 % from one epoch to the next.
READ_EPOCHS = 5
FIT_EPOCHS = 6


def work_write(
    p: dict[str, str], pipeline: str, out: str | None = None, repeats: int = WRITE_REPEATS
) -> dict[str, Any]:
    x, y = _load_xy(p)
    _warm(p["x"])
    n = int(x.shape[0])
    if pipeline == "keras-tfr":
        from keras_tfr import ArraysToRecords

        out = out or p["ktfr"]
        dt = float("inf")
        for _ in range(repeats):  # best of N: the kernel's write-back makes single runs noisy
            shutil.rmtree(out, ignore_errors=True)
            t0 = time.perf_counter()
            ArraysToRecords.from_arrays(x, y, out, verbose=0)
            dt = min(dt, time.perf_counter() - t0)
    elif pipeline in ("np.save", "np.save-fsync"):
        # Unsynced, `np.save` returns once the page cache holds the data (the kernel writes
        # it back later): the limit of writing these bytes. Synced (each file, then the
        # directory), it is on disk when the call returns, as keras-tfr's shards are.
        durable = pipeline == "np.save-fsync"
        out = out or p["npsave"]
        dt = float("inf")
        for _ in range(repeats):
            shutil.rmtree(out, ignore_errors=True)
            os.makedirs(out)
            t0 = time.perf_counter()
            for name, arr in (("x.npy", x), ("y.npy", y)):
                with open(os.path.join(out, name), "wb") as f:
                    np.save(f, arr)
                    if durable:
                        f.flush()
                        os.fsync(f.fileno())
            if durable:
                fd = os.open(out, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            dt = min(dt, time.perf_counter() - t0)
    elif pipeline == "tutorial":
        import tensorflow as tf

        out = out or p["tutorial"]
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        t0 = time.perf_counter()
        with tf.io.TFRecordWriter(os.path.join(out, "data.tfrecord")) as w:
            for i in range(n):
                w.write(_tutorial_example(x[i], y[i], tf))
        dt = time.perf_counter() - t0
    else:
        raise ValueError(pipeline)
    return {"seconds": dt, "examples": n}


def work_gen_formats(p: dict[str, str]) -> dict[str, Any]:
    """Per-sample raw TFRecords, ArrayRecord and tf.data save (untimed)."""
    import tensorflow as tf

    x, y = _load_xy(p)
    n = int(x.shape[0])
    shutil.rmtree(p["raw"], ignore_errors=True)
    os.makedirs(p["raw"])
    with tf.io.TFRecordWriter(os.path.join(p["raw"], "data.tfrecord")) as w:
        for i in range(n):
            ex = tf.train.Example(
                features=tf.train.Features(
                    feature={
                        "x": tf.train.Feature(
                            bytes_list=tf.train.BytesList(value=[x[i].tobytes()])
                        ),
                        "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(y[i])])),
                    }
                )
            )
            w.write(ex.SerializeToString())
    result: dict[str, Any] = {}
    try:
        from array_record.python.array_record_module import ArrayRecordWriter

        shutil.rmtree(p["arrayrecord"], ignore_errors=True)
        os.makedirs(p["arrayrecord"])
        w = ArrayRecordWriter(os.path.join(p["arrayrecord"], "data.array_record"), "group_size:1")
        for i in range(n):
            w.write(x[i].tobytes() + y[i].tobytes())
        w.close()
    except ImportError as e:
        result["arrayrecord_error"] = str(e)
    shutil.rmtree(p["tfsave"], ignore_errors=True)
    chunk = 4096

    def gen():
        for i in range(0, n, chunk):
            yield np.asarray(x[i : i + chunk]), np.asarray(y[i : i + chunk])

    spec = (
        tf.TensorSpec((None, *x.shape[1:]), tf.float32),
        tf.TensorSpec((None,), tf.int32),
    )
    tf.data.Dataset.from_generator(gen, output_signature=spec).unbatch().save(p["tfsave"])
    return result


def _iterate(ds, epochs: int = READ_EPOCHS) -> tuple[int, float, float]:
    """Examples in one epoch, the fastest of `epochs` epochs (each a new iterator, as
    Keras makes one per epoch: start-up is included, one-off hiccups are not) and the CPU
    seconds of that epoch (all threads)."""
    best, cpu = float("inf"), 0.0
    count = 0
    for _ in range(epochs):
        t0, c0 = time.perf_counter(), time.process_time()
        count = 0
        for batch in ds:
            count += int(batch[0].shape[0])
        dt = time.perf_counter() - t0
        if dt < best:
            best, cpu = dt, time.process_time() - c0
    return count, best, cpu


def _memmap_batches(p: dict[str, str], seed: int):
    """The peer: per epoch a permutation; per batch a sorted fancy-index gather."""
    x, y = _load_xy(p)
    n = int(y.shape[0])
    perm = np.random.default_rng(seed).permutation(n)

    def batch(i: int):
        idx = np.sort(perm[i * BATCH : (i + 1) * BATCH])
        return x[idx], y[idx]

    return batch, -(-n // BATCH)


def _memmap_epoch(p: dict[str, str], pool: Any, epoch: int) -> int:
    """One epoch of the memmap + threads peer on ``pool``: the examples it read."""
    batch, steps = _memmap_batches(p, epoch)
    return sum(int(b[0].shape[0]) for b in pool.map(batch, range(steps)))


def _memmap_read(p: dict[str, str]) -> dict[str, Any]:
    from concurrent.futures import ThreadPoolExecutor

    _warm(p["base"])
    best, cpu, count = float("inf"), 0.0, 0
    with ThreadPoolExecutor(PEER_THREADS) as pool:
        for epoch in range(READ_EPOCHS):
            t0, c0 = time.perf_counter(), time.process_time()
            count = _memmap_epoch(p, pool, epoch)
            dt = time.perf_counter() - t0
            if dt < best:
                best, cpu = dt, time.process_time() - c0
    return {"seconds": best, "examples": count, "cpu_seconds": cpu}


def _tf_read_pipeline(p: dict[str, str], pipeline: str, shape: tuple[int, ...]):
    import tensorflow as tf

    autotune = tf.data.AUTOTUNE
    if pipeline == "keras-tfr":
        from keras_tfr import TFRecordSequenceSource

        _warm(p["ktfr"])
        return TFRecordSequenceSource(p["ktfr"], batch_size=BATCH, shuffle=True, seed=0)
    if pipeline == "keras-tfr-windows":  # the rss group: what windows bound
        from keras_tfr import TFRecordSequenceSource

        _warm(p["ktfr"])
        return TFRecordSequenceSource(
            p["ktfr"], batch_size=BATCH, shuffle=True, seed=0, shuffle_window=RSS_WINDOW
        )
    if pipeline == "tutorial":
        _warm(p["tutorial"])
        feats = {
            "x": tf.io.FixedLenFeature([], tf.string),
            "y": tf.io.FixedLenFeature([], tf.int64),
        }

        def parse(record):
            ex = tf.io.parse_single_example(record, feats)
            xi = tf.io.parse_tensor(ex["x"], tf.float32)
            xi = tf.ensure_shape(xi, shape)
            return xi, ex["y"]

        ds = tf.data.TFRecordDataset(_shard_files(p["tutorial"]))
        ds = ds.shuffle(TUTORIAL_SHUFFLE, seed=0).map(parse, num_parallel_calls=8)
        return ds.batch(BATCH).prefetch(autotune)
    if pipeline == "per-sample-raw":
        _warm(p["raw"])
        feats = {
            "x": tf.io.FixedLenFeature([], tf.string),
            "y": tf.io.FixedLenFeature([], tf.int64),
        }

        def parse_batch(records):
            ex = tf.io.parse_example(records, feats)
            xb = tf.reshape(tf.io.decode_raw(ex["x"], tf.float32), [-1, *shape])
            return xb, ex["y"]

        ds = tf.data.TFRecordDataset(_shard_files(p["raw"]), buffer_size=1 << 20)
        ds = ds.shuffle(TUTORIAL_SHUFFLE, seed=0).batch(BATCH)
        return ds.map(parse_batch, num_parallel_calls=autotune).prefetch(autotune)
    if pipeline == "from_tensor_slices":
        x, y = _load_xy(p, in_memory=True)
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        return ds.shuffle(TUTORIAL_SHUFFLE, seed=0).batch(BATCH).prefetch(autotune)
    if pipeline == "keras-arrays":
        # The tf.data pipeline `model.fit(x, y, shuffle=True)` builds from in-memory arrays
        # (TensorFlow backend): a permutation, then a parallel `tf.gather` per batch.
        from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter

        x, y = _load_xy(p, in_memory=True)
        return ArrayDataAdapter(x, y, batch_size=BATCH, shuffle=True).get_tf_dataset()
    if pipeline == "tf-data-floor":
        # Nothing to read: one batch handed out as often as an epoch has batches. What a
        # Python loop over any tf.data pipeline costs per batch, whatever it reads.
        x, y = _load_xy(p)
        n = int(y.shape[0])
        one = (tf.constant(np.asarray(x[:BATCH])), tf.constant(np.asarray(y[:BATCH])))
        steps = n // BATCH
        last = n - steps * BATCH
        ds = tf.data.Dataset.from_tensors(one).repeat(steps)
        if last:
            ds = ds.concatenate(tf.data.Dataset.from_tensors((one[0][:last], one[1][:last])))
        return ds.prefetch(autotune)
    if pipeline == "tf-save-load":
        _warm(p["tfsave"])
        ds = tf.data.Dataset.load(p["tfsave"])
        return ds.shuffle(TUTORIAL_SHUFFLE, seed=0).batch(BATCH).prefetch(autotune)
    raise ValueError(pipeline)


def work_read(p: dict[str, str], pipeline: str, shape: tuple[int, ...]) -> dict[str, Any]:
    if pipeline == "raw-read":
        _warm(p["ktfr"])
        dt, cpu = float("inf"), 0.0
        for _ in range(READ_EPOCHS):
            t0, c0 = time.perf_counter(), time.process_time()
            nbytes = _warm(p["ktfr"])
            if time.perf_counter() - t0 < dt:  # the CPU of the fastest epoch, as `_iterate`
                dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        n = int(np.load(p["y"], mmap_mode="r").shape[0])
        return {"seconds": dt, "examples": n, "file_bytes": nbytes, "cpu_seconds": cpu}
    if pipeline == "grain-arrayrecord":
        return _grain_read(p, shape)
    if pipeline == "memmap-threads":
        return _memmap_read(p)
    if pipeline in ("keras-tfr-numpy", "keras-tfr-tfdata"):
        import tensorflow as tf

        src = _tf_read_pipeline(p, "keras-tfr", shape)

        class Epochs:
            def __iter__(self):
                if pipeline == "keras-tfr-tfdata":
                    return tf.data.Dataset.__iter__(src)
                return src.as_numpy_iterator()

        count, dt, cpu = _iterate(Epochs())
        return {"seconds": dt, "examples": count, "cpu_seconds": cpu}
    ds = _tf_read_pipeline(p, pipeline, shape)
    count, dt, cpu = _iterate(ds)
    return {"seconds": dt, "examples": count, "cpu_seconds": cpu}


def _grain_read(p: dict[str, str], shape: tuple[int, ...]) -> dict[str, Any]:
    try:
        import grain
    except ImportError as e:
        return {"error": f"grain not installed: {e}"}
    files = _shard_files(p["arrayrecord"])
    if not files:
        return {"error": "no ArrayRecord files (array-record not installed?)"}
    _warm(p["arrayrecord"])
    xbytes = 4 * int(np.prod(shape))

    def batch_fn(records):
        buf = np.frombuffer(b"".join(records), np.uint8).reshape(len(records), -1)
        xb = buf[:, :xbytes].copy().view(np.float32).reshape(len(records), *shape)
        yb = buf[:, xbytes:].copy().view(np.int32).reshape(-1)
        return xb, yb

    source = grain.sources.ArrayRecordDataSource(files)
    ds = grain.MapDataset.source(source).shuffle(seed=0).batch(BATCH, batch_fn=batch_fn)
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=8, prefetch_buffer_size=500))
    count, dt, cpu = _iterate(it, epochs=1)
    return {"seconds": dt, "examples": count, "cpu_seconds": cpu}


class _EpochTimer:
    def __init__(self):
        import keras

        class CB(keras.callbacks.Callback):
            def __init__(cb):
                super().__init__()
                cb.times = []
                cb.cpu = []

            def on_epoch_begin(cb, epoch, logs=None):
                cb.t0, cb.c0 = time.perf_counter(), time.process_time()

            def on_epoch_end(cb, epoch, logs=None):
                cb.times.append(time.perf_counter() - cb.t0)
                cb.cpu.append(time.process_time() - cb.c0)

        self.cb = CB()


def work_fit(
    p: dict[str, str], pipeline: str, shape: tuple[int, ...], reader: Any = None
) -> dict[str, Any]:
    """One ``fit`` of `FIT_EPOCHS` epochs: its fastest epoch after the first. ``reader``
    (as `_tf_read_pipeline`) makes the data of the pipelines that are not NumPy arrays
    or the PyDataset peer (`gpu_fit.py` passes one that needs no TensorFlow)."""
    import keras

    keras.utils.set_random_seed(0)
    if shape_name_of(p) == "large2g":
        head = keras.layers.GlobalAveragePooling2D()
    else:
        head = keras.layers.Flatten()
    model = keras.Sequential([keras.Input(shape), head, keras.layers.Dense(10)])
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    timer = _EpochTimer().cb
    if pipeline == "numpy":
        x, y = _load_xy(p, in_memory=True)
        n = int(x.shape[0])
        model.fit(
            x, y, batch_size=BATCH, epochs=FIT_EPOCHS, shuffle=True, verbose=0, callbacks=[timer]
        )
    elif pipeline == "memmap-pydataset":
        _warm(p["base"])
        n = int(np.load(p["y"], mmap_mode="r").shape[0])
        model.fit(_memmap_pydataset(p), epochs=FIT_EPOCHS, verbose=0, callbacks=[timer])
    else:
        ds = (reader or _tf_read_pipeline)(p, pipeline, shape)
        n = int(np.load(p["y"], mmap_mode="r").shape[0])
        model.fit(ds, epochs=FIT_EPOCHS, verbose=0, callbacks=[timer])
    # Fastest of epochs 2 and later: compiled, caches warm; epoch 1 also holds tracing.
    k = 1 + int(np.argmin(timer.times[1:]))
    return {
        "seconds": timer.times[k],
        "cpu_seconds": timer.cpu[k],
        "examples": n,
        "first_epoch_seconds": timer.times[0],
    }


def _memmap_pydataset(p: dict[str, str]) -> Any:
    """The peer as a ``keras.utils.PyDataset`` (``workers=4``, threads): `_memmap_batches`,
    a new permutation each epoch."""
    import keras

    class MemmapBatches(keras.utils.PyDataset):
        def __init__(self):
            super().__init__(workers=PEER_THREADS, use_multiprocessing=False)
            self.epoch = 0
            self.batch, self.steps = _memmap_batches(p, 0)

        def __len__(self):
            return self.steps

        def __getitem__(self, i):
            return self.batch(i)

        def on_epoch_end(self):
            self.epoch += 1
            self.batch, self.steps = _memmap_batches(p, self.epoch)

    return MemmapBatches()


def work_paired(p: dict[str, str], shape: tuple[int, ...], rounds: int) -> dict[str, Any]:
    """`fit_paired.paired_epochs` over keras-tfr and memmap + ``PyDataset`` beside
    in-memory NumPy: per pipeline, the wall and CPU seconds of each kept epoch."""
    from fit_paired import paired_epochs  # benchmarks/fit_paired.py

    _warm(p["ktfr"])
    _warm(p["base"])
    x, y = _load_xy(p, in_memory=True)
    sources = {
        "keras-tfr": _tf_read_pipeline(p, "keras-tfr", shape),
        "memmap-pydataset": _memmap_pydataset(p),
    }
    return {"examples": int(y.shape[0]), "epochs": paired_epochs(x, y, sources, rounds)}


def work_paired_read(p: dict[str, str], shape: tuple[int, ...], rounds: int) -> dict[str, Any]:
    """The read group's keras-tfr (a Python loop), keras-tfr `as_numpy_iterator()` and
    memmap + threads, one epoch of each in turn in one process (`paired_reads`)."""
    from concurrent.futures import ThreadPoolExecutor

    src = _tf_read_pipeline(p, "keras-tfr", shape)  # warms the shards
    _warm(p["base"])
    n = int(np.load(p["y"], mmap_mode="r").shape[0])
    with ThreadPoolExecutor(PEER_THREADS) as pool:
        epochs = paired_reads(
            {
                "keras-tfr": lambda _: sum(int(b[0].shape[0]) for b in src),
                "keras-tfr-numpy": lambda _: sum(
                    int(b[0].shape[0]) for b in src.as_numpy_iterator()
                ),
                "memmap-threads": lambda epoch: _memmap_epoch(p, pool, epoch),
            },
            rounds,
            n,
        )
    return {"examples": n, "epochs": epochs}


def paired_reads(epoch_of: dict[str, Any], rounds: int, examples: int) -> dict[str, Any]:
    """Per pipeline of ``epoch_of`` (a name -> a function that reads epoch ``r`` and
    returns the examples read), the wall and CPU seconds of one epoch per round, the
    pipelines in turn (the order flips each round; round 0 warms up and is not kept), as
    `fit_paired.paired_epochs` does for `fit`. Raises if an epoch reads another count."""
    from fit_paired import turns  # benchmarks/fit_paired.py

    names = list(epoch_of)
    out: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": []} for n in names}
    for r, name in turns(names, rounds):
        t0, c0 = time.perf_counter(), time.process_time()
        count = epoch_of[name](r)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if count != examples:
            raise RuntimeError(f"{name} read {count} examples in epoch {r}, not {examples}")
        if r:
            out[name]["wall"].append(wall)
            out[name]["cpu"].append(cpu)
    return out


# Per paired group: its pipelines, keras-tfr's among them (whose rows hold the per-round
# ratios) and the others they are compared with.
PAIRED_GROUPS = {
    "paired": (
        ["keras-tfr", "numpy", "memmap-pydataset"],
        ["keras-tfr"],
        ["numpy", "memmap-pydataset"],
    ),
    "paired-read": (
        ["keras-tfr", "keras-tfr-numpy", "memmap-threads"],
        ["keras-tfr", "keras-tfr-numpy"],
        ["memmap-threads"],
    ),
}


def paired_rows(res: dict[str, Any], group: str) -> dict[str, dict[str, Any]]:
    """A paired group's rows from `work_paired`'s or `work_paired_read`'s result: per
    pipeline its median epoch (wall and CPU seconds) and, on each keras-tfr row
    (``"vs"``), for each pipeline it is compared with the per-round ratios of rates
    (keras-tfr's over the other's, same round), their median and its 95 % bootstrap
    interval (`fit_paired.median_interval`)."""
    import statistics

    from fit_paired import median_interval

    pipelines, ours, others = PAIRED_GROUPS[group]
    if "epochs" not in res:
        return {p: res for p in pipelines}
    epochs, n = res["epochs"], res["examples"]
    rows = {
        p: {
            "seconds": statistics.median(e["wall"]),
            "cpu_seconds": statistics.median(e["cpu"]),
            "examples": n,
            "round_seconds": e["wall"],
        }
        for p, e in epochs.items()
    }
    for mine in ours:
        vs = {}
        for p in others:
            walls = zip(epochs[mine]["wall"], epochs[p]["wall"])
            ratios = [theirs / own for own, theirs in walls]
            lo, hi = median_interval(ratios)
            vs[p] = {"median": statistics.median(ratios), "interval": [lo, hi], "ratios": ratios}
        rows[mine]["vs"] = vs
    return rows


class _PrivatePeak:
    """Peak private (anonymous) memory and peak heap in use, sampled every 20 ms.

    ``ru_maxrss`` also counts the pages of memory-mapped files a process touched: page
    cache, shared and reclaimable, which grows with the data a memory map reads (sample
    mode, and the memmap peers). Private memory (``RssAnon`` in /proc/self/status) is
    what the process itself allocates, including what glibc's malloc keeps of freed
    memory for reuse. The heap in use (glibc's ``mallinfo2()``: bytes handed out and not
    freed, in its arenas and in its own memory maps) leaves that retention out: the
    live allocations alone (0 where ``mallinfo2`` is missing).
    """

    def __init__(self) -> None:
        import threading

        self.peak_kb = 0
        self.peak_heap = 0
        self._mallinfo = mallinfo2()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def now_kb() -> int:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        return int(line.split()[1])
        except OSError:
            pass
        return 0

    def heap_now(self) -> int:
        if self._mallinfo is None:
            return 0
        info = self._mallinfo()
        return int(info.uordblks + info.hblkhd)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak_kb = max(self.peak_kb, self.now_kb())
            self.peak_heap = max(self.peak_heap, self.heap_now())

    def stop(self) -> tuple[float, float]:
        """(peak private MB, peak heap in use MB)."""
        self._stop.set()
        self._thread.join()
        heap = max(self.peak_heap, self.heap_now())
        return max(self.peak_kb, self.now_kb()) / 1024.0, heap / (1 << 20)


def mallinfo2() -> Any:
    """glibc's ``mallinfo2`` (2.33 and later) through ctypes, or None."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in [
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            ]
        ]

    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = MallInfo2
    fn.argtypes = []
    return fn


def worker_main(argv: list[str]) -> None:
    spec = json.loads(argv[0])
    kind = spec["kind"]
    private = _PrivatePeak()
    p = _paths(spec["data"], spec["shape_name"], spec.get("scale", 1))
    shape = tuple(spec.get("shape", ()))
    if kind == "gen":
        result = work_gen(p, spec["samples"], shape)
    elif kind == "gen_formats":
        result = work_gen_formats(p)
    elif kind == "write":
        result = work_write(
            p, spec["pipeline"], spec.get("out"), spec.get("repeats", WRITE_REPEATS)
        )
    elif kind == "read":
        result = work_read(p, spec["pipeline"], shape)
    elif kind == "fit":
        result = work_fit(p, spec["pipeline"], shape)
    elif kind == "paired":
        result = work_paired(p, shape, spec["rounds"])
    elif kind == "paired-read":
        result = work_paired_read(p, shape, spec["rounds"])
    else:
        raise ValueError(kind)
    result["peak_rss_mb"] = _maxrss_mb()
    result["peak_private_mb"], heap = private.stop()
    if heap:
        result["peak_heap_mb"] = heap
    print("@@RESULT " + json.dumps(result), flush=True)


# ============================================================== driver side


def run_worker(spec: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--_worker", json.dumps(spec)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    for line in proc.stdout.splitlines():
        if line.startswith("@@RESULT "):
            result = json.loads(line[len("@@RESULT ") :])
            result["wall_seconds"] = wall
            return result
    tail = (proc.stderr or proc.stdout)[-1500:]
    return {"error": f"worker failed (rc={proc.returncode}): {tail}"}


def _median_round(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median time among rounds (an error if every round failed), with every
    round's seconds beside it."""
    ok = sorted((r for r in runs if "seconds" in r), key=lambda r: r["seconds"])
    if not ok:
        return runs[-1]
    out = dict(ok[(len(ok) - 1) // 2])
    if len(runs) > 1:
        out["round_seconds"] = [r.get("seconds") for r in runs]
    return out


def _load_avg() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gb = None
    try:
        mem_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    import importlib.metadata as md

    versions = {}
    for pkg in ("tensorflow", "keras", "numpy", "grain", "array-record", "keras-tfr"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gb": mem_gb,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of the samples")
    parser.add_argument("--data-dir", default=None, help="scratch directory (default: a tmp dir)")
    parser.add_argument("--out", default=RESULTS, help="where results.json / .png / .md go")
    parser.add_argument(
        "--only", default="read,fit,paired,write,rss", help="comma-separated groups"
    )
    parser.add_argument("--shapes", default="small,large")
    parser.add_argument("--keep-data", action="store_true")
    parser.add_argument(
        "--pipelines",
        default=None,
        help="comma-separated pipelines to run (default: all of each group); the rest are "
        "left out of the table",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the read and fit pipelines this many times, interleaved (A B C A B C ...), "
        "and report each one's median round: a machine whose speed drifts then slows every "
        "pipeline alike",
    )
    parser.add_argument(
        "--paired-rounds",
        type=int,
        default=PAIRED_ROUNDS,
        help="rounds of the paired groups: one epoch of each of their pipelines per round",
    )
    args = parser.parse_args(argv)
    if args.paired_rounds < 1:
        parser.error(f"--paired-rounds must be at least 1, got {args.paired_rounds}")
    groups = set(args.only.split(","))
    wanted = set(args.pipelines.split(",")) if args.pipelines else None
    unknown = sorted((wanted or set()) - set(READ_PIPELINES) - set(FIT_PIPELINES))
    if unknown:
        parser.error(
            f"unknown pipelines {unknown}; expected some of "
            f"{sorted(set(READ_PIPELINES) | set(FIT_PIPELINES))}"
        )
    shape_names = args.shapes.split(",")
    frac = 4 if args.quick else 1
    data = args.data_dir or tempfile.mkdtemp(prefix="keras-tfr-bench-")
    os.makedirs(data, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    started = time.perf_counter()
    results: dict[str, Any] = {
        "machine": machine_info(),
        "quick": args.quick,
        "batch_size": BATCH,
        "load_avg_start": _load_avg(),
        "shapes": {},
        "rows": [],
    }

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s load {_load_avg()}] {msg}", flush=True)

    def add(group: str, shape_name: str, pipeline: str, res: dict[str, Any], scale: int = 1):
        cfg = results["shapes"][shape_name]
        row = {"group": group, "shape": shape_name, "pipeline": pipeline, "scale": scale, **res}
        if "seconds" in res and res["seconds"] > 0:
            row["examples_per_s"] = res["examples"] / res["seconds"]
            row["mb_per_s"] = row["examples_per_s"] * cfg["sample_bytes"] / 1e6
            if "cpu_seconds" in res:
                gb = res["examples"] * cfg["sample_bytes"] / 1e9
                row["cpu_s_per_gb"] = res["cpu_seconds"] / gb
        results["rows"].append(row)
        rate = f"{row.get('examples_per_s', 0):,.0f} ex/s" if "examples_per_s" in row else ""
        log(f"{group:5s} {shape_name:5s} x{scale} {pipeline:20s} {rate} {res.get('error', '')}")

    try:
        for shape_name in shape_names:
            cfg = SHAPES[shape_name]
            n = cfg["samples"] // frac
            shape = cfg["shape"]
            sample_bytes = 4 * int(np.prod(shape)) + 4
            results["shapes"][shape_name] = {
                "samples": n,
                "shape": list(shape),
                "dtype": "float32 (x), int32 (y)",
                "sample_bytes": sample_bytes,
                "data_mb": n * sample_bytes / 1e6,
            }
            base = {"data": data, "shape_name": shape_name, "shape": list(shape)}
            log(f"generating {shape_name}: {n} x {shape} float32")
            run_worker({**base, "kind": "gen", "samples": n})
            paired = "paired" in groups and shape_name in PAIRED_SHAPES
            chosen = {
                group: [p for p in pipelines if wanted is None or p in wanted]
                for group, pipelines in (("read", READ_PIPELINES), ("fit", FIT_PIPELINES))
                if group in groups
            }
            if "write" in groups:  # timed; also writes the keras-tfr and tutorial data
                for pipeline in WRITE_PIPELINES:
                    spec = {**base, "kind": "write", "pipeline": pipeline}
                    add("write", shape_name, pipeline, run_worker(spec))
            else:  # only the data the chosen pipelines read, once, untimed
                read = {p for ps in chosen.values() for p in ps}
                if paired:
                    read.add("keras-tfr")
                for pipeline, readers in _DATA_READ_BY.items():
                    if read & readers:
                        spec = {**base, "kind": "write", "pipeline": pipeline, "repeats": 1}
                        res = run_worker(spec)
                        if res.get("error"):
                            log(f"writing the {pipeline} data: {res['error']}")
            if any(p in FORMAT_PIPELINES for ps in chosen.values() for p in ps):
                res = run_worker({**base, "kind": "gen_formats"})
                if res.get("error") or res.get("arrayrecord_error"):
                    log(f"gen_formats: {res}")
            for group, pipelines in chosen.items():
                runs: dict[str, list[dict[str, Any]]] = {p: [] for p in pipelines}
                for _ in range(max(1, args.rounds)):
                    for pipeline in pipelines:
                        spec = {**base, "kind": group, "pipeline": pipeline}
                        runs[pipeline].append(run_worker(spec))
                for pipeline in pipelines:
                    add(group, shape_name, pipeline, _median_round(runs[pipeline]))
            for kind in PAIRED_GROUPS if paired else ():
                spec = {**base, "kind": kind, "rounds": args.paired_rounds}
                res = run_worker(spec, timeout=600 + 120 * args.paired_rounds)
                for pipeline, row in paired_rows(res, kind).items():
                    add(kind, shape_name, pipeline, row)
            if not args.keep_data:
                p = _paths(data, shape_name)
                for key in ("tutorial", "raw", "arrayrecord", "tfsave", "npsave"):
                    shutil.rmtree(p[key], ignore_errors=True)
        if "rss" in groups:
            shape_name = "small"
            cfg = SHAPES[shape_name]
            shape = cfg["shape"]
            if shape_name not in results["shapes"]:
                n = cfg["samples"] // frac
                results["shapes"][shape_name] = {
                    "samples": n,
                    "shape": list(shape),
                    "sample_bytes": 4 * int(np.prod(shape)) + 4,
                }
            for scale in (1, 4):
                n = scale * (cfg["samples"] // frac)
                base = {
                    "data": data,
                    "shape_name": shape_name,
                    "shape": list(shape),
                    "scale": scale,
                }
                if scale != 1 or not os.path.exists(_paths(data, shape_name)["x"]):
                    log(f"generating {shape_name} x{scale}: {n} samples")
                    run_worker({**base, "kind": "gen", "samples": n})
                add(
                    "rss",
                    shape_name,
                    "write keras-tfr",
                    run_worker({**base, "kind": "write", "pipeline": "keras-tfr"}),
                    scale,
                )
                # The memmap peer beside it: its page-cache pages count in its RSS too.
                for pipeline in ("keras-tfr", "keras-tfr-windows", "memmap-threads"):
                    add(
                        "rss",
                        shape_name,
                        f"read {pipeline}",
                        run_worker({**base, "kind": "read", "pipeline": pipeline}),
                        scale,
                    )
                if scale != 1 and not args.keep_data:
                    shutil.rmtree(_paths(data, shape_name, scale)["base"], ignore_errors=True)
    finally:
        if not args.keep_data and not args.data_dir:
            shutil.rmtree(data, ignore_errors=True)
    results["load_avg_end"] = _load_avg()
    results["total_seconds"] = time.perf_counter() - started

    from report import render  # benchmarks/report.py

    text = render(results, args.out)
    print(text)
    log(f"done; results in {args.out}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--_worker":
        worker_main(sys.argv[2:])
    else:
        sys.path.insert(0, HERE)
        sys.exit(main())
