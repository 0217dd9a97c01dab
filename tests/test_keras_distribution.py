"""`keras.distribution` across processes: `keras_distribution_source` gives each process
a disjoint share, equal step counts and equal per-step batches; Keras' own auto-sharding
reads everything everywhere."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest

from keras_tfr import TFRecordSequenceSource
from keras_tfr import distribute as distribute_module
from keras_tfr.distribute import keras_distribution_source

N = 100  # 25 records of 4


@pytest.fixture
def ids_dataset(make_dataset):
    """x[i] = (i, 2i, 3i) / N as float32, y[i] = i: every batch names its samples."""
    x = (np.arange(N, dtype=np.float32)[:, None] * np.array([1, 2, 3], np.float32)) / N
    y = np.arange(N, dtype=np.int64)
    return make_dataset(x, y, samples_per_record=4, min_shards=5)


def _fake(processes, replicas, index, auto_shard=False):
    """The public attributes of a `keras.distribution.Distribution` the helper reads."""
    return SimpleNamespace(
        num_processes=processes,
        num_model_replicas=replicas,
        data_shard_id=index if replicas >= processes else index // (processes // replicas),
        auto_shard_dataset=auto_shard,
    )


@pytest.fixture
def gather_in_process(monkeypatch):
    """Stands in for the cross-process gather: every process's share, built here."""

    def install(directory, per_process, shards, **kwargs):
        counts = [
            TFRecordSequenceSource(
                directory, per_process, num_workers=shards, worker_index=w, **kwargs
            ).num_samples
            for w in range(shards)
        ]
        monkeypatch.setattr(distribute_module, "_gather_counts", lambda count, p: counts)
        return counts

    return install


def _batches(dataset) -> list[list[int]]:
    return [yb.numpy().tolist() for _, yb in dataset]


@pytest.mark.parametrize("shuffle", [False, True])
def test_processes_get_disjoint_equal_shares(ids_dataset, gather_in_process, shuffle):
    counts = gather_in_process(ids_dataset, 5, 2, shuffle=shuffle, seed=3)
    per_process = [
        _batches(keras_distribution_source(
            ids_dataset, 10, distribution=_fake(2, 2, p), shuffle=shuffle, seed=3
        ))
        for p in range(2)
    ]  # fmt: skip
    sizes = [[len(b) for b in batches] for batches in per_process]
    # Same step count, and the same batch size at every step, on both processes.
    assert sizes[0] == sizes[1]
    kept = min(counts)
    assert sizes[0] == [5] * (kept // 5) + ([kept % 5] if kept % 5 else [])
    ids = [[i for b in batches for i in b] for batches in per_process]
    assert set(ids[0]).isdisjoint(ids[1])
    assert len(set(ids[0] + ids[1])) == len(ids[0] + ids[1]) == 2 * kept
    assert set(ids[0] + ids[1]) <= set(range(N))
    if shuffle and counts[0] != counts[1]:
        # The bigger share drops its few samples over from the end of its epoch order:
        # with shuffle=True, different ones each epoch.
        big = int(np.argmax(counts))
        source = keras_distribution_source(
            ids_dataset, 10, distribution=_fake(2, 2, big), shuffle=True, seed=3
        )
        epochs = [{i for b in _batches(source) for i in b} for _ in range(2)]
        assert epochs[0] != epochs[1]


def test_equal_shares_cover_every_sample(make_dataset, gather_in_process):
    x = np.zeros((96, 1), np.float32)
    directory = make_dataset(x, np.arange(96, dtype=np.int64), samples_per_record=4)
    assert gather_in_process(directory, 5, 2) == [48, 48]
    sources = [
        keras_distribution_source(directory, 10, distribution=_fake(2, 2, p)) for p in (0, 1)
    ]
    # Equal shares need no trimming: the source itself, with its length known.
    assert all(isinstance(s, TFRecordSequenceSource) and len(s) == 10 for s in sources)
    ids = sorted(i for s in sources for b in _batches(s) for i in b)
    assert ids == list(range(96))


def test_shares_trimmed_to_whole_local_batches(ids_dataset, gather_in_process):
    # 4 replicas over 2 processes: 2 devices per process, so every local batch, the last
    # included, must split in two.
    counts = gather_in_process(ids_dataset, 6, 2)
    kept = min(counts) - min(counts) % 2
    for p in range(2):
        source = keras_distribution_source(ids_dataset, 12, distribution=_fake(2, 4, p))
        sizes = [len(b) for b in _batches(source)]
        assert sum(sizes) == kept and all(s % 2 == 0 for s in sizes)
        assert len(sizes) == len(source) == math.ceil(kept / 6) == int(source.cardinality())


def test_drop_remainder(ids_dataset, gather_in_process):
    counts = gather_in_process(ids_dataset, 7, 2, drop_remainder=True)
    for p in range(2):
        source = keras_distribution_source(
            ids_dataset, 14, distribution=_fake(2, 2, p), drop_remainder=True
        )
        assert [len(b) for b in _batches(source)] == [7] * (min(counts) // 7)


def test_one_model_replica_reads_everything_with_the_global_batch(ids_dataset):
    # Keras replicates the data when there is one model replica; so does the helper.
    for distribution in (None, _fake(1, 1, 0)):
        source = keras_distribution_source(ids_dataset, 8, distribution=distribution)
        assert isinstance(source, TFRecordSequenceSource)
        assert len(source) == math.ceil(N / 8)
        assert sorted(i for b in _batches(source) for i in b) == list(range(N))


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(distribution=_fake(2, 2, 0, auto_shard=True)), "auto_shard_dataset=False"),
        (dict(distribution=_fake(2, 4, 0), batch_size=6), "multiple of the 4 model replicas"),
        (dict(distribution=_fake(2, 2, 0), num_workers=2), "sets `num_workers`"),
        (dict(distribution=_fake(2, 2, 0), batch_size=0), "positive int"),
        (dict(distribution=_fake(2, 2, 0), batch_size=2.0), "positive int"),
    ],
)
def test_bad_arguments(ids_dataset, kwargs, error):
    kwargs.setdefault("batch_size", 8)
    with pytest.raises((ValueError, TypeError), match=error):
        keras_distribution_source(ids_dataset, **kwargs)


def test_check_files_false_skips_the_shard_check(ids_dataset, gather_in_process):
    from keras_tfr import ShardError

    shard = sorted(f for f in os.listdir(ids_dataset) if f.endswith(".tfrecord"))[-1]
    with open(os.path.join(ids_dataset, shard), "ab") as f:
        f.write(b"x")  # the size no longer matches the manifest
    with pytest.raises(ShardError, match=shard):
        keras_distribution_source(ids_dataset, 8, distribution=_fake(2, 2, 0))
    gather_in_process(ids_dataset, 4, 2, check_files=False)
    source = keras_distribution_source(
        ids_dataset, 8, distribution=_fake(2, 2, 0), check_files=False
    )
    assert len(source) > 0


def test_keras_auto_sharding_reads_every_batch_in_every_process():
    """Why the helper exists: pins what Keras 3's `distribute_tf_dataset` does.

    With auto-sharding on, each process rebatches the dataset it is given to the
    per-process batch and keeps every N-th batch (`Dataset.shard`): it reads the whole
    data set. When Keras changes this, this test fails: revisit the design.
    """
    import keras
    import tensorflow as tf

    class TwoReplicas(keras.distribution.DataParallel):
        num_model_replicas = 2

    dataset = tf.data.Dataset.range(20).batch(4)
    kept = []
    for process in range(2):
        distribution = TwoReplicas(devices=["cpu:0"])
        # Pretend to be one of two processes (private attributes: a test of Keras'
        # behaviour, not of keras-tfr's code).
        distribution._num_processes, distribution._process_id = 2, process
        distribution._is_multi_process = True
        kept.append([b.numpy().tolist() for b in distribution.distribute_dataset(dataset)])
    # Element-wise: process 0 kept batches 0, 2, 4, ... of the rebatched whole stream.
    assert kept == [
        [[0, 1], [4, 5], [8, 9], [12, 13], [16, 17]],
        [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19]],
    ]


# ----------------------------------------------------------------- two JAX processes

_JAX_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    os.environ["KERAS_BACKEND"] = "jax"
    import numpy as np
    import keras
    import tensorflow as tf

    directory, batch, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    # What a user writes: the cluster from KERAS_DISTRIBUTION_* environment variables.
    keras.distribution.initialize()
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(auto_shard_dataset=False))
    from keras_tfr.distribute import keras_distribution_source

    train = keras_distribution_source(directory, batch, shuffle=True, seed=0)
    share_samples = train.num_samples

    seen, traced = [], []

    def record(step, y):
        seen.append((int(step), y.numpy().tolist()))
        return y

    def spy(step, batch):
        x, y = batch
        z = tf.py_function(record, [step, y], tf.int64)
        z.set_shape(y.shape)
        return x, z

    class Recorder(keras.Model):
        def train_step(self, state, data):
            traced.append(int(data[0].shape[0]))  # at trace time: the global batch
            return super().train_step(state, data)

    marks = []

    class Marks(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            # Keras' symbolic build has read a batch of its own (and dropped it).
            marks.append((0, len(seen)))
        def on_epoch_begin(self, epoch, logs=None):
            self.steps = 0
        def on_train_batch_end(self, batch, logs=None):
            self.steps += 1
        def on_epoch_end(self, epoch, logs=None):
            marks.append((self.steps, len(seen)))

    inputs = keras.Input((3,))
    model = Recorder(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    initial = [w.tolist() for w in model.get_weights()]
    model.fit(train.enumerate().map(spy), epochs=2, verbose=0, callbacks=[Marks()])

    # What the helper prevents: local batches of different sizes in one step (4 + 4,
    # then 2 on process 0 and 3 on process 1).
    n = 6 + int(os.environ["KERAS_DISTRIBUTION_PROCESS_ID"])
    uneven = tf.data.Dataset.from_tensor_slices(
        (np.ones((n, 3), np.float32), np.ones((n,), np.float32))).batch(4)
    inputs = keras.Input((3,))
    other = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    other.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    uneven_loss = other.fit(uneven, epochs=1, verbose=0).history["loss"][0]
    with open(out, "w") as f:
        json.dump(dict(seen=seen, marks=marks, traced=sorted(set(traced)),
                       steps=len(train), share_samples=share_samples, initial=initial,
                       uneven_loss=uneven_loss,
                       final=[w.tolist() for w in model.get_weights()]), f)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _replay_sgd(initial, global_batches, lr):
    """Keras' SGD on a Dense(1) with MSE, in float64, over the given batches of ids."""
    w = np.array(initial[0], np.float64)
    b = np.array(initial[1], np.float64)
    for ids in global_batches:
        ids = np.array(ids)
        x = (ids[:, None] * np.array([1.0, 2.0, 3.0])) / 96
        error = x @ w + b - ids[:, None]  # (batch, 1)
        w -= lr * 2 * x.T @ error / len(ids)
        b -= lr * 2 * error.sum(axis=0) / len(ids)
    return [w, b]


@pytest.mark.slow
@pytest.mark.subprocess
def test_data_parallel_two_jax_processes(make_dataset, tmp_path):
    pytest.importorskip("jax")
    n, batch = 96, 10  # 24 records of 4: 48 samples per process, 9 batches of 5 and one of 3
    x = (np.arange(n, dtype=np.float32)[:, None] * np.array([1, 2, 3], np.float32)) / n
    directory = make_dataset(x, np.arange(n, dtype=np.int64), samples_per_record=4)
    script = tmp_path / "jax_worker.py"
    script.write_text(_JAX_SCRIPT)
    port = _free_port()
    procs, outs = [], []
    for i in range(2):
        env = {
            **os.environ,
            "TF_CPP_MIN_LOG_LEVEL": "2",
            "CUDA_VISIBLE_DEVICES": "",
            "JAX_PLATFORMS": "cpu",
            "KERAS_DISTRIBUTION_JOB_ADDRESSES": f"127.0.0.1:{port}",
            "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
            "KERAS_DISTRIBUTION_PROCESS_ID": str(i),
        }
        outs.append(tmp_path / f"process-{i}.json")
        cmd = [sys.executable, str(script), directory, str(batch), str(outs[-1])]
        procs.append(
            subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
            )
        )
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    results = [json.loads(o.read_text()) for o in outs]

    # Each process reads only its share (48 samples), in per-process batches of 5.
    assert [r["share_samples"] for r in results] == [48, 48]
    assert [r["steps"] for r in results] == [10, 10]
    global_batches = []
    for epoch in range(2):
        per_process = []
        for r in results:
            (_, start), (steps, end) = r["marks"][epoch : epoch + 2]
            assert steps == 10, "a process ran a different step count"
            records = r["seen"][start:end]
            assert [step for step, _ in records] == list(range(10))  # one pass, in order
            per_process.append([ids for _, ids in records])
        local_sizes = [[len(b) for b in batches] for batches in per_process]
        assert local_sizes[0] == local_sizes[1] == [5] * 9 + [3]
        ids = [[i for b in batches for i in b] for batches in per_process]
        assert set(ids[0]).isdisjoint(ids[1])
        assert sorted(ids[0] + ids[1]) == list(range(n)), "not every sample once per epoch"
        global_batches += [a + b for a, b in zip(*per_process)]
    # The global batch Keras computed on: 10 (and 6 at the end of an epoch).
    assert all(r["traced"] == [6, 10] for r in results)
    # One model: the same weights everywhere, bit for bit, and they moved.
    final = [np.array(w, np.float32) for w in results[0]["final"]]
    assert all(
        np.array_equal(a, np.array(b, np.float32)) for a, b in zip(final, results[1]["final"])
    )
    assert results[0]["initial"] == results[1]["initial"]
    # ... and they are SGD over the union of both processes' batches at every step.
    expected = _replay_sgd(results[0]["initial"], global_batches, 1e-3)
    for got, want in zip(final, expected):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert not np.allclose(final[0], results[0]["initial"][0])
    # Uneven local batches raise nothing, and the processes disagree about the step.
    assert results[0]["uneven_loss"] != results[1]["uneven_loss"]
