"""Shared fixtures: small synthetic data sets written into `tmp_path`."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest


@pytest.fixture
def small_xy():
    """34 samples (does not divide by 4, 8 or 16): float32 images and int64 labels."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((34, 5, 3)).astype(np.float32)
    y = np.arange(34, dtype=np.int64)
    return x, y


@pytest.fixture
def make_dataset(tmp_path):
    """Writes arrays to `tmp_path/name` and returns the directory (as a str)."""
    from keras_tfr import ArraysToRecords

    def make(x, y=None, name="ds", sample_weight=None, **kwargs):
        kwargs.setdefault("verbose", 0)
        directory = str(tmp_path / name)
        ArraysToRecords.from_arrays(x, y, directory, sample_weight=sample_weight, **kwargs)
        return directory

    return make


@pytest.fixture(params=["mapped", "mapped-tf.data", "graph"])
def reader(request, monkeypatch):
    """Runs a test with each reader of `TFRecordSequenceSource` (``KERAS_TFR_READER``): the
    memory-mapped reader of sample mode (`keras_tfr.read.mapped`), whose eager iterators
    hand out tensors straight from it; the same reader through tf.data's iterator (the
    pipeline `fit` runs: ``mapped-tf.data``); and the tf.data graph reader of block mode
    (`keras_tfr.read.graph`)."""
    mode = request.param.split("-")[0]
    monkeypatch.setenv("KERAS_TFR_READER", mode)
    if request.param == "mapped-tf.data":
        tf_data_iterators(monkeypatch)
    return mode


def tf_data_iterators(monkeypatch):
    """Makes every eager iterator of a source tf.data's own (no `TensorBatches`)."""
    from keras_tfr import TFRecordSequenceSource

    monkeypatch.setattr(TFRecordSequenceSource, "_tensor_direct", lambda self: False)


@pytest.fixture
def tf_data_iterator(monkeypatch):
    """The tf.data pipeline behind every eager iterator of a source, as `fit` reads it."""
    tf_data_iterators(monkeypatch)


@pytest.fixture
def run_script():
    """Runs ``python -c script *args`` in a new process (TensorFlow's logs off); fails the
    test with the child's stderr if it fails, else returns its stdout."""
    import subprocess
    import sys

    def run(script: str, *args: str, timeout: float = 300) -> str:
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
        out = subprocess.run(
            [sys.executable, "-c", script, *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout

    return run


@pytest.fixture
def write_sorted(tmp_path):
    """Writes 1,003 class-sorted samples ((7, 5) float32, int64 labels, float32 weights)
    in records of ``samples_per_record`` (37: too small for the lattice's padding; 300:
    on a lattice), at least 3 shards; returns ``(directory, x, y, w, manifest)``."""
    import numpy as np

    from keras_tfr import ArraysToRecords

    def write(samples_per_record: int):
        n = 1003
        rng = np.random.default_rng(5)
        x = rng.standard_normal((n, 7, 5)).astype(np.float32)
        y = np.repeat(np.arange(10), -(-n // 10))[:n].astype(np.int64)
        w = rng.random(n).astype(np.float32)
        d = str(tmp_path / "ds")
        m = ArraysToRecords.from_arrays(
            x, y, d, sample_weight=w, samples_per_record=samples_per_record, min_shards=3,
            verbose=0,
        )  # fmt: skip
        return d, x, y, w, m

    return write
