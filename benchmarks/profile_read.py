"""Where the read path spends its CPU: both keras-tfr read paths built up stage by stage.

Each line adds one stage to the one before and reports CPU seconds per GB of shard data
(process time, all threads; less sensitive to other load on the machine than wall time)
and the bytes copied per byte read by the stages so far. The difference between two
lines is the cost of the stage added. First block mode's graph reader (TensorFlow's
TFRecord reader and tf.data ops), then sample mode's memory-mapped reader
(`keras_tfr.read.mapped`: the order, the CRC checks, the NumPy gathers), each ending with
the whole `TFRecordSequenceSource`; last, how much of a Python loop's CPU is the loop's
own thread (the rest is the reader threads').

Usage::

    python benchmarks/profile_read.py DATASET_DIR     # a data set written by ArraysToRecords
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf

from keras_tfr import TFRecordSequenceSource
from keras_tfr.manifest import Manifest
from keras_tfr.schema import COUNT_KEY, tf_decode_feature

POOL_RECORDS = 16


def cpu_per_gb(ds, total_bytes: int, reps: int = 3) -> tuple[float, float]:
    best_cpu = best_wall = float("inf")
    for _ in range(reps):
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in ds:
            pass
        best_cpu = min(best_cpu, time.process_time() - c0)
        best_wall = min(best_wall, time.perf_counter() - t0)
    return best_cpu / (total_bytes / 1e9), total_bytes / best_wall / 1e9


class _PythonStage:
    """An epoch of the mapped reader's Python side alone, iterated like a data set."""

    def __init__(self, directory: str, gather: bool):
        # The plan the source itself builds (batch 256, shuffled, seed 0).
        self.plan = _source(directory, "mapped")._mapped_plan
        self.gather = gather

    def __iter__(self):
        from keras_tfr.read import mapped

        epoch = mapped.Epoch(self.plan, 0)
        try:
            for i in range(epoch.num_units):
                if self.gather:
                    yield epoch.unit(i)
                else:
                    # The reader's own order pieces (a few units' positions at once).
                    yield self.plan.good_samples(epoch._ids(*epoch.span(i)), 0, i)
        finally:
            epoch.close()


def _source(directory: str, reader: str):
    os.environ["KERAS_TFR_READER"] = reader
    try:
        return TFRecordSequenceSource(directory, batch_size=256, shuffle=True, seed=0)
    finally:
        del os.environ["KERAS_TFR_READER"]


class _TFDataIterator:
    """Epochs of a source read by tf.data's own iterator (the pipeline `fit` runs), where
    a Python loop over the source itself gets tensors straight from the mapped reader."""

    def __init__(self, source: TFRecordSequenceSource):
        self.source = source

    def __iter__(self):
        return tf.data.Dataset.__iter__(self.source)


def main(directory: str) -> None:
    m = Manifest.load(directory)
    specs = sorted(m.features, key=lambda s: s.key)
    spr = m.samples_per_record
    files = [m.shard_path(s) for s in m.shards]
    total = sum(os.path.getsize(f) for f in files)
    fs = {s.key: tf.io.FixedLenFeature([], tf.string) for s in specs}
    fs[COUNT_KEY] = tf.io.FixedLenFeature([], tf.int64)

    def records():
        return tf.data.TFRecordDataset(files, buffer_size=1 << 20, num_parallel_reads=2)

    def decode(serialized):
        parsed = tf.io.parse_example(serialized, fs)
        return {s.key: tf_decode_feature(parsed[s.key], s, spr) for s in specs}

    def shuffle_pool(serialized):
        out = decode(serialized)
        n = tf.shape(out[specs[0].key], out_type=tf.int64)[0]
        idx = tf.random.shuffle(tf.range(n))
        return {k: tf.gather(v, idx) for k, v in out.items()}

    from keras_tfr.read import mapped

    # Samples of at most `_CHUNK_BYTES / 5` go through a cache-sized temporary (two copies);
    # counted for the largest feature, which holds most of the bytes.
    gather_copies = 2 if max(s.sample_bytes for s in specs) * 5 <= mapped._CHUNK_BYTES else 1
    auto = tf.data.AUTOTUNE
    stages = [
        ("read records (file -> buffer -> record, CRC)", 2, records()),
        ("+ batch records into pools", 3, records().batch(POOL_RECORDS)),
        (
            "+ parse_example",
            4,
            records().batch(POOL_RECORDS).map(lambda s: tf.io.parse_example(s, fs)),
        ),
        ("+ decode_raw + bitcast", 5, records().batch(POOL_RECORDS).map(decode)),
        ("+ permute samples (gather)", 6, records().batch(POOL_RECORDS).map(shuffle_pool)),
        (
            "+ rebatch(256), parallel map, prefetch",
            7,
            records()
            .batch(POOL_RECORDS)
            .map(shuffle_pool, num_parallel_calls=auto)
            .rebatch(256)
            .prefetch(auto),
        ),
        ("TFRecordSequenceSource, graph reader", 7, _source(directory, "graph")),
        ("mapped: order + CRC-32C checks (first read)", 0, _PythonStage(directory, False)),
        ("+ gather shuffled units from the map", gather_copies, _PythonStage(directory, True)),
        (
            "TFRecordSequenceSource, mapped, tf.data iterator",
            gather_copies,
            _TFDataIterator(_source(directory, "mapped")),
        ),
        ("TFRecordSequenceSource, mapped, Python loop", 1, _source(directory, "mapped")),
    ]
    print(f"{directory}: {total / 1e6:.0f} MB in {len(files)} shards, {m.total_records} records")
    print(f"{'stage':48s} {'copies/byte':>11s} {'CPU s/GB':>9s} {'GB/s wall':>9s}")
    for name, copies, ds in stages:
        cpu, rate = cpu_per_gb(ds, total)
        print(f"{name:48s} {copies:>11d} {cpu:>9.3f} {rate:>9.2f}", flush=True)
    print(f"TensorFlow's eager iteration alone: {eager_cost_us():.0f} µs of CPU per element")
    src = _source(directory, "mapped")
    for name, epochs in (
        ("Python loop", lambda: iter(src)),
        ("as_numpy_iterator()", src.as_numpy_iterator),
    ):
        wall, cpu, main_cpu = main_thread_share(epochs)
        print(
            f"{name}: an epoch in {wall * 1e3:.0f} ms, {cpu * 1e3:.0f} ms of CPU, "
            f"{main_cpu * 1e3:.0f} ms of it in the loop's own thread"
        )


def main_thread_share(epochs, reps: int = 3) -> tuple[float, float, float]:
    """Fastest epoch's wall time, process CPU and CPU of the thread that loops (the rest
    is the reader threads'), with the loop touching each batch's shape."""
    best = (float("inf"), 0.0, 0.0)
    for _ in range(reps):
        t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
        for batch in epochs():
            batch[0].shape[0]
        took = (time.perf_counter() - t0, time.process_time() - c0, time.thread_time() - m0)
        best = min(best, took)
    return best


def eager_cost_us(elements: int = 2000) -> float:
    """CPU per element of a Python loop over an empty pipeline (one batch, repeated)."""
    batch = (tf.zeros([256, 28, 28, 1]), tf.zeros([256], tf.int32))
    ds = tf.data.Dataset.from_tensors(batch).repeat(elements).prefetch(2)
    best = float("inf")
    for _ in range(3):
        c0 = time.process_time()
        for _ in ds:
            pass
        best = min(best, time.process_time() - c0)
    return best / elements * 1e6


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
