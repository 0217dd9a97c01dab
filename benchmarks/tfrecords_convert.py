"""Speed gained by converting tutorial-layout TFRecords to keras-tfr blocks, and flat RSS
over a long `predict_to_records`.

    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python benchmarks/tfrecords_convert.py --samples 50000

Part 1 writes `--samples` 28x28 float32 images the way TensorFlow's tutorial does (one
Example per sample, `serialize_tensor` bytes, float label), reads one epoch with
`from_tfrecords` (batched parse + substr/decode_raw) and with the classic per-sample
`parse_single_example` + `parse_tensor` pipeline, converts with `convert_tfrecords` and
reads the blocks with `TFRecordSequenceSource`. Part 2 streams a model's predictions over
a source `--predict-epochs` times larger than one pass into records and samples RSS.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

import numpy as np


def epoch(ds) -> tuple[int, float]:
    n = 0
    t = time.perf_counter()
    for batch in ds:
        first = batch[0] if isinstance(batch, tuple) else batch
        n += int(first.shape[0])
    return n, time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=50_000)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--predict-samples", type=int, default=400_000)
    args = p.parse_args()

    import psutil
    import tensorflow as tf

    from keras_tfr import TFRecordSequenceSource
    from keras_tfr.predict import predict_to_records
    from keras_tfr.tfrecords import TensorFeature, convert_tfrecords, from_tfrecords

    tmp = tempfile.mkdtemp(prefix="keras-tfr-bench-")
    rng = np.random.default_rng(0)
    n = args.samples
    files = 8
    for k in range(files):
        with tf.io.TFRecordWriter(os.path.join(tmp, f"tut-{k}.tfrecord")) as w:
            for _ in range(k * n // files, (k + 1) * n // files):
                img = rng.standard_normal((28, 28)).astype(np.float32)
                f = {
                    "image": tf.train.Feature(
                        bytes_list=tf.train.BytesList(value=[tf.io.serialize_tensor(img).numpy()])
                    ),
                    "label": tf.train.Feature(float_list=tf.train.FloatList(value=[1.0])),
                }
                w.write(tf.train.Example(features=tf.train.Features(feature=f)).SerializeToString())
    pattern = os.path.join(tmp, "tut-*.tfrecord")
    feats = {
        "image": TensorFeature(tf.float32, (28, 28)),
        "label": tf.io.FixedLenFeature([], tf.float32),
    }
    bs = args.batch_size

    def tutorial():
        spec = {
            "image": tf.io.FixedLenFeature([], tf.string),
            "label": tf.io.FixedLenFeature([], tf.float32),
        }

        def parse(r):
            e = tf.io.parse_single_example(r, spec)
            return tf.reshape(tf.io.parse_tensor(e["image"], tf.float32), (28, 28)), e["label"]

        ds = tf.data.TFRecordDataset(tf.io.gfile.glob(pattern), num_parallel_reads=tf.data.AUTOTUNE)
        return (
            ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE).batch(bs).prefetch(tf.data.AUTOTUNE)
        )

    results = {}
    for name, make in [
        ("tutorial: parse_single_example + parse_tensor", tutorial),
        (
            "from_tfrecords (batched parse, substr+decode_raw)",
            lambda: from_tfrecords(pattern, feats, bs, y="label", shuffle=False),
        ),
    ]:
        epoch(make())  # warm the page cache
        got, s = epoch(make())
        results[name] = got / s
    t = time.perf_counter()
    convert_tfrecords(pattern, os.path.join(tmp, "blocks"), feats, y="label", verbose=0)
    convert_s = time.perf_counter() - t
    src = TFRecordSequenceSource(os.path.join(tmp, "blocks"), batch_size=bs, shuffle=False)
    epoch(src)
    got, s = epoch(src)
    results["converted blocks, TFRecordSequenceSource (no shuffle)"] = got / s
    src = TFRecordSequenceSource(os.path.join(tmp, "blocks"), batch_size=bs, seed=0)
    epoch(src)
    got, s = epoch(src)
    results["converted blocks, TFRecordSequenceSource (shuffled)"] = got / s
    print(f"{n} samples of 28x28 float32, batch {bs}, page cache warm, one epoch each:")
    for k, v in results.items():
        print(f"  {k:58} {v:>10,.0f} ex/s")
    print(f"  conversion took {convert_s:.1f} s ({n / convert_s:,.0f} samples/s)")

    # Part 2: flat RSS over a long predict_to_records.
    import keras

    from keras_tfr import ArraysToRecords

    m = args.predict_samples
    chunk = 10_000
    d = os.path.join(tmp, "inputs")
    with ArraysToRecords(d, verbose=0) as w:
        for i in range(0, m, chunk):
            w.write(rng.standard_normal((min(chunk, m - i), 64)).astype(np.float32))
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256)])  # 1 KB per sample
    src = TFRecordSequenceSource(d, batch_size=1024, shuffle=False)
    proc = psutil.Process()
    samples: list[tuple[float, float]] = []
    stop = threading.Event()

    def sample():
        t0 = time.perf_counter()
        while not stop.is_set():
            samples.append((time.perf_counter() - t0, proc.memory_info().rss / 1e6))
            time.sleep(0.25)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t = time.perf_counter()
    predict_to_records(model, src, os.path.join(tmp, "preds"), verbose=0)
    stop.set()
    th.join()
    secs = time.perf_counter() - t
    rss = np.array([r for _, r in samples])
    q = len(rss) // 4 or 1
    print(
        f"predict_to_records: {m} samples -> {m * 1024 / 1e6:,.0f} MB of predictions "
        f"in {secs:.1f} s; "
        f"RSS first quarter max {rss[:q].max():.0f} MB, last quarter max {rss[-q:].max():.0f} MB, "
        f"overall max {rss.max():.0f} MB"
    )


if __name__ == "__main__":
    main()
