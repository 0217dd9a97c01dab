"""The examples, run through their real command lines with small sizes, so they cannot rot.

Each one must succeed, print its result, and show none of TensorFlow's start-up lines
that ``TF_CPP_MIN_LOG_LEVEL`` misses (see `keras_tfr._quiet`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from keras_tfr import _quiet
from keras_tfr._compat import keras_shuffle

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")

# Keras' shuffle warning goes once TFRecordSequenceSource.__init__ calls
# `keras_shuffle.install_shuffle_warning_filter()`; until then the examples still show it.
with open(os.path.join(REPO, "keras_tfr", "source.py")) as _f:
    SOURCE_QUIETS_SHUFFLE = "install_shuffle_warning_filter()" in _f.read()

_NOISE = re.compile(r"^(\[\d+\] )?([IWE]0000 00:00:|WARNING: All log messages before absl)", re.M)

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]


def run_example(tmp_path, script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO, "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("KERAS_TFR_READER", None)
    result = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, script), *args],
        cwd=tmp_path,  # anything written to the working directory lands in tmp_path
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert not _NOISE.search(output), output
    if _quiet._no_nvidia_device():
        assert "cuInit" not in output, output
    if SOURCE_QUIETS_SHUFFLE:
        assert keras_shuffle.SHUFFLE_WARNING not in output, output
    return result


def test_demo(tmp_path):
    workdir = tmp_path / "demo_data"
    result = run_example(
        tmp_path,
        "demo.py",
        *("--size-gb", "0.002", "--epochs", "1", "--workdir", str(workdir)),
        *("--window", "64KB"),  # 2 records of 1 MB: windows of one record
    )
    out = result.stdout
    for line in ("[3/3] training on the stream for 1 epochs", "data set (TFRecord shards)"):
        assert line in out, out
    samples = re.search(r"data set \(NumPy arrays\) +: [\d.]+ GB, ([\d,]+) samples", out)
    assert samples and int(samples[1].replace(",", "")) == int(0.002e9 // (256 * 4 + 8))
    assert re.search(r"final validation +: accuracy [\d.]+, loss [\d.]+", out), out
    assert re.search(r"training \(samples mode\) .*peak private memory [\d.]+ GB", out), out
    assert not workdir.exists()  # removed without --keep


def test_demo_writes_its_data_as_npy_files_chunk_by_chunk(tmp_path):
    """The data the demo trains on: two chunks and a part of one, written with plain
    writes after each ``.npy`` header (no memmap whose pages stay mapped), are the
    teacher's data set, byte for byte."""
    import importlib.util

    import numpy as np

    spec = importlib.util.spec_from_file_location("demo", os.path.join(EXAMPLES, "demo.py"))
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    n = 2 * demo.GEN_CHUNK + 123
    demo.generate(str(tmp_path), n, seed=3)
    x = np.load(tmp_path / "x.npy", mmap_mode="r")
    y = np.load(tmp_path / "y.npy", mmap_mode="r")
    assert (x.shape, x.dtype, y.shape, y.dtype) == ((n, 256), np.float32, (n,), np.int64)
    rng = np.random.default_rng(3)
    teacher = rng.standard_normal((256, 10)).astype(np.float32)
    for i in range(0, n, demo.GEN_CHUNK):
        j = min(n, i + demo.GEN_CHUNK)
        xb = rng.standard_normal((j - i, 256), dtype=np.float32)
        np.testing.assert_array_equal(x[i:j], xb)
        np.testing.assert_array_equal(y[i:j], np.argmax(xb @ teacher, axis=1))
    assert len(np.unique(y)) == 10  # every class present


def test_four_models_one_gpu(tmp_path):
    data = tmp_path / "train"
    result = run_example(
        tmp_path, "four_models_one_gpu.py", "--models", "2", "--epochs", "1", "--data", str(data)
    )
    for trial, units in ((0, 16), (1, 32)):
        line = rf"^\[{trial}\] trial {trial}: {units} units, val_accuracy [\d.]+$"
        assert re.search(line, result.stdout, re.M), result.stdout
    assert "[2]" not in result.stdout  # --models 2 started two
    assert "all 2 process(es) succeeded" in result.stderr
    assert (data / "manifest.json").exists()  # --data is where it wrote


def test_tune_larger_than_memory(tmp_path):
    result = run_example(
        tmp_path,
        "tune_larger_than_memory.py",
        *("--samples", "4000", "--trials", "1", "--epochs", "1"),
        *("--data", str(tmp_path / "data"), "--project", str(tmp_path / "project")),
    )
    assert "Running Trial #1" in result.stdout and "Trial #2" not in result.stdout
    assert re.search(r"^best hyperparameters: \{'batch_size': \d+", result.stdout, re.M)
    assert re.search(r"^best val_accuracy: [\d.]+$", result.stdout, re.M), result.stdout
    assert (tmp_path / "project" / "search").is_dir()
