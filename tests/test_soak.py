"""Soak and fault injection: epochs of `fit` over scattered damage, and shards truncated or
replaced while a source reads them (each reader; the process must live and name the file)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from keras_tfr import ArraysToRecords, TFRecordSequenceSource
from keras_tfr.manifest import Manifest

N = 20_000
SPR = 50


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _flip(path: str, pos: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, pos)
        os.pwrite(fd, bytes([b[0] ^ 0x08]), pos)
    finally:
        os.close(fd)


@pytest.mark.slow
def test_fit_soak_with_scattered_damage(tmp_path):
    """Several epochs of `fit` with on_corrupt="skip": the step count holds, every good
    sample is trained on in every epoch, the skip count is right, and RSS stays flat."""
    import keras
    import tensorflow as tf

    rng = np.random.default_rng(0)
    ids = np.arange(N, dtype=np.float32)[:, None]
    x = np.concatenate([ids, rng.standard_normal((N, 31)).astype(np.float32)], axis=1)
    y = (x[:, 1] > 0).astype(np.int64)
    d = str(tmp_path / "ds")
    ArraysToRecords.from_arrays(x, y, d, samples_per_record=SPR, min_shards=4, verbose=0)
    m = Manifest.load(d)
    frame = m.record_bytes + 16
    first = np.cumsum([0] + [s.records for s in m.shards])
    damaged = []
    for k, shard in enumerate(m.shards):  # two damaged records per shard, scattered
        for j in (3 + k, shard.records // 2 + k):
            _flip(m.shard_path(shard), j * frame + 100)
            damaged.append(int(first[k]) + j)
    bad_ids = {i for r in damaged for i in range(r * SPR, (r + 1) * SPR)}
    good = np.array(sorted(set(range(N)) - bad_ids))

    class Seen(keras.layers.Layer):
        """Counts the sample ids it is trained on (column 0), inside the graph."""

        def build(self, shape):
            self.counts = self.add_weight(shape=(N,), initializer="zeros", trainable=False)

        def call(self, inputs, training=None):
            if training:
                batch_ids = tf.cast(inputs[:, 0], tf.int32)
                self.counts.assign_add(
                    tf.math.bincount(batch_ids, minlength=N, maxlength=N, dtype=tf.float32)
                )
            return inputs[:, 1:]

    class Check(keras.callbacks.Callback):
        def __init__(self, layer):
            super().__init__()
            self.layer, self.rss, self.missed, self.steps = layer, [], [], []

        def on_epoch_begin(self, epoch, logs=None):
            self.layer.counts.assign(np.zeros(N, np.float32))
            self.batches = 0

        def on_train_batch_end(self, batch, logs=None):
            self.batches += 1

        def on_epoch_end(self, epoch, logs=None):
            counts = self.layer.counts.numpy()
            self.missed.append(int((counts[good] == 0).sum()))
            assert counts[sorted(bad_ids)].sum() == 0, "a damaged sample was trained on"
            self.steps.append(self.batches)
            self.rss.append(_rss_mb())

    src = TFRecordSequenceSource(d, batch_size=128, seed=0, on_corrupt="skip")
    seen = Seen()
    model = keras.Sequential([keras.Input((32,)), seen, keras.layers.Dense(2)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    check = Check(seen)
    model.fit(src, epochs=6, verbose=0, callbacks=[check])
    assert check.steps == [len(src)] * 6
    assert check.missed == [0] * 6, "good samples left out of an epoch"
    assert src.corrupt_records == len(damaged)
    assert max(check.rss[1:]) - check.rss[1] < 60, check.rss


_DURING = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    from keras_tfr import CorruptRecordError, TFRecordSequenceSource
    from keras_tfr.manifest import Manifest

    d, how, reader = sys.argv[1], sys.argv[2], sys.argv[3]
    os.environ["KERAS_TFR_READER"] = reader
    m = Manifest.load(d)
    victim = m.shard_path(m.shards[1])
    src = TFRecordSequenceSource(d, batch_size=64, seed=0)
    frame = m.record_bytes + 16
    named = False
    for epoch in range(3):
        try:
            for i, batch in enumerate(src):
                if epoch == 0 and i == 5:  # mid-epoch, while reader threads run ahead
                    if how == "replaced":
                        with open(victim, "rb") as f:
                            raw = bytearray(f.read())
                        raw[frame + 50] ^= 1
                        with open(victim + ".tmp", "wb") as f:
                            f.write(raw)
                        os.replace(victim + ".tmp", victim)
                    else:  # cut at a record boundary between epochs' reads
                        os.truncate(victim, 2 * frame)
        except CorruptRecordError as e:
            assert e.file == victim, (e.file, victim)
            named = True
            break
    print("NAMED" if named else "NOT NAMED")
    """
)


@pytest.mark.subprocess
@pytest.mark.parametrize("reader", ["mapped", "graph"])
@pytest.mark.parametrize("how", ["replaced", "truncated"])
def test_shard_changed_while_reading_is_named_and_the_process_lives(tmp_path, reader, how):
    x = np.random.default_rng(1).standard_normal((4000, 16)).astype(np.float32)
    d = str(tmp_path / "ds")
    ArraysToRecords.from_arrays(x, np.arange(4000), d, samples_per_record=40, min_shards=4)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run(
        [sys.executable, "-c", _DURING, d, how, reader],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, f"the process died ({out.returncode}): {out.stderr[-2000:]}"
    assert out.stdout.strip().splitlines()[-1] == "NAMED", out.stdout + out.stderr[-2000:]
