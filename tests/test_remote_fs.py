"""Data sets on file systems other than the local disk, through `tf.io.gfile`.

TensorFlow's ``ram://`` file system stands in for ``gs://``, ``s3://`` and ``hdfs://``: the
same code path (`keras_tfr._io` with a URL) serves all of them. A guard makes every local
file function (``open``, ``os.replace``, ...) fail on a URL, so a stray local access in the
writer, the manifest, the source or `verify` shows up as an error, not as a silent local
file named ``ram:``.
"""

from __future__ import annotations

import builtins
import errno
import os
import uuid

import numpy as np
import pytest
import tensorflow as tf

from keras_tfr import ArraysToRecords, TFRecordSequenceSource, _io
from keras_tfr.manifest import MANIFEST_NAME, Manifest
from keras_tfr.verifier import verify


@pytest.fixture
def no_local_io_for_urls(monkeypatch):
    """Makes local file functions raise when handed a path with a URL scheme."""

    def guard(name, fn):
        def wrapper(path, *args, **kwargs):
            if "://" in os.fspath(path) if isinstance(path, (str, os.PathLike)) else False:
                raise AssertionError(f"{name}({path!r}): a URL went to a local file function")
            return fn(path, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(builtins, "open", guard("open", builtins.open))
    for name in ("open", "replace", "remove", "makedirs", "listdir", "stat", "rename"):
        monkeypatch.setattr(os, name, guard(f"os.{name}", getattr(os, name)))
    for name in ("exists", "isdir", "isfile", "getsize"):
        monkeypatch.setattr(os.path, name, guard(f"os.path.{name}", getattr(os.path, name)))


def _ram_dir() -> str:
    return f"ram://keras-tfr-test/{uuid.uuid4().hex}/train"


def _arrays(n: int = 203):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((n, 4, 3)).astype(np.float32)
    x.reshape(-1)[:4] = [np.nan, np.inf, -np.inf, -0.0]  # bit patterns must survive
    y = rng.integers(-(2**62), 2**62, size=n, dtype=np.int64)
    w = rng.random(n).astype(np.float64)
    return x, y, w


def _read_all(source):
    xs, ys, ws = [], [], []
    for xb, yb, wb in source:
        xs.append(xb.numpy())
        ys.append(yb.numpy())
        ws.append(wb.numpy())
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(ws)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("compression", [None, "GZIP"])
def test_ram_filesystem_round_trip_bit_for_bit(no_local_io_for_urls, compression):
    directory = _ram_dir()
    x, y, w = _arrays()
    manifest = ArraysToRecords.from_arrays(
        x,
        y,
        directory,
        sample_weight=w,
        samples_per_record=8,
        min_shards=4,
        compression=compression,
        verbose=0,
    )
    assert manifest.total_samples == len(x)
    assert len(manifest.shards) >= 4
    assert tf.io.gfile.exists(f"{directory}/{MANIFEST_NAME}")
    for shard in manifest.shards:
        assert tf.io.gfile.exists(f"{directory}/{shard.file}")
    assert not os.path.exists("ram:"), "a URL was written as a local path"

    loaded = Manifest.load(directory)
    assert loaded.total_samples == len(x)
    source = TFRecordSequenceSource(directory, batch_size=16, shuffle=False)
    assert len(source) == -(-len(x) // 16)
    rx, ry, rw = _read_all(source)
    assert _same_bits(rx, x) and _same_bits(ry, y) and _same_bits(rw, w)

    report = verify(directory)
    assert report.ok, report.summary()
    assert report.samples_checked == len(x)


def test_ram_filesystem_shuffled_epoch_is_a_permutation(no_local_io_for_urls):
    directory = _ram_dir()
    x, y, w = _arrays(150)
    ArraysToRecords.from_arrays(x, y, directory, sample_weight=w, samples_per_record=4, verbose=0)
    source = TFRecordSequenceSource(directory, batch_size=32, shuffle=True, seed=3)
    rx, ry, rw = _read_all(source)
    order = np.argsort(ry)
    expect = np.argsort(y)
    assert _same_bits(rx[order], x[expect]) and _same_bits(rw[order], w[expect])
    assert not np.array_equal(ry, y), "shuffle=True returned the written order"


def test_verify_finds_damage_on_ram_filesystem(no_local_io_for_urls):
    directory = _ram_dir()
    x, y, _ = _arrays(64)
    manifest = ArraysToRecords.from_arrays(x, y, directory, samples_per_record=8, verbose=0)
    path = f"{directory}/{manifest.shards[0].file}"
    with tf.io.gfile.GFile(path, "rb") as f:
        data = bytearray(f.read())
    data[len(data) // 2] ^= 0xFF
    _rewrite(path, bytes(data))
    report = verify(directory)
    assert not report.ok
    assert manifest.shards[0].file in report.problems
    assert any("corrupt" in p for p in report.problems[manifest.shards[0].file])
    # A shard cut inside its first record: named as the truncation it is (TensorFlow's
    # own message, "truncated record at 0' failed with ", is not passed on as it is).
    cut = f"{directory}/{manifest.shards[1].file}"
    with tf.io.gfile.GFile(cut, "rb") as f:
        _rewrite(cut, f.read()[:100])
    problems = verify(directory).problems[manifest.shards[1].file]
    assert "record 0 at byte offset 0: the file ends inside this record (truncated)" in problems
    assert not any("failed with" in p for p in problems)


def _rewrite(path: str, data: bytes) -> None:
    """Writes ``path`` anew (TensorFlow's ``ram://`` appends on ``"wb"``: remove first)."""
    tf.io.gfile.remove(path)
    with tf.io.gfile.GFile(path, "wb") as f:
        f.write(data)


def test_manifest_read_from_file_url_goes_through_gfile(tmp_path, monkeypatch):
    x, y, w = _arrays(90)
    local = str(tmp_path / "train")
    ArraysToRecords.from_arrays(x, y, local, sample_weight=w, samples_per_record=8, verbose=0)
    url = "file://" + os.path.abspath(local)
    assert _io.is_remote(url)

    calls = []
    real = _io._gfile

    def spy():
        calls.append(1)
        return real()

    monkeypatch.setattr(_io, "_gfile", spy)
    manifest = Manifest.load(url)
    assert calls, "a file:// directory did not go through tf.io.gfile"
    assert manifest.shard_path(manifest.shards[0]).startswith("file://")
    source = TFRecordSequenceSource(url, batch_size=16, shuffle=False)
    rx, ry, rw = _read_all(source)
    assert _same_bits(rx, x) and _same_bits(ry, y) and _same_bits(rw, w)
    assert verify(url).ok


def test_write_to_file_url_and_read_locally(tmp_path, no_local_io_for_urls):
    x, y, w = _arrays(70)
    url = "file://" + os.path.abspath(str(tmp_path / "via-url"))
    ArraysToRecords.from_arrays(x, y, url, sample_weight=w, samples_per_record=8, verbose=0)
    local = str(tmp_path / "via-url")
    names = tf.io.gfile.listdir(local)
    assert MANIFEST_NAME in names
    assert not any(n.endswith(".tmp") for n in names)
    source = TFRecordSequenceSource(local, batch_size=16, shuffle=False)
    rx, ry, rw = _read_all(source)
    assert _same_bits(rx, x) and _same_bits(ry, y) and _same_bits(rw, w)


def test_url_join_and_listdir():
    assert _io.join("gs://bucket/data/", "manifest.json") == "gs://bucket/data/manifest.json"
    assert _io.join("ram://a/b", "c") == "ram://a/b/c"
    directory = _ram_dir()
    _io.makedirs(directory)
    _io.write_atomic(_io.join(directory, "f.bin"), b"abc")
    assert _io.listdir(directory) == ["f.bin"]
    assert _io.read_bytes(_io.join(directory, "f.bin")) == b"abc"
    assert _io.size(_io.join(directory, "f.bin")) == 3
    _io.remove(_io.join(directory, "f.bin"))
    assert not _io.exists(_io.join(directory, "f.bin"))


def test_url_errors_are_the_os_errors_of_a_local_path():
    """`tf.io.gfile` raises `tf.errors.NotFoundError` for a missing file; `_io` raises
    what `os` raises for a local path, so callers handle both alike."""
    directory = _ram_dir()
    _io.makedirs(directory)
    missing = _io.join(directory, "missing")
    _io.remove(missing)  # missing_ok
    with pytest.raises(FileNotFoundError):
        _io.remove(missing, missing_ok=False)
    with pytest.raises(FileNotFoundError):
        _io.read_bytes(missing)
    with pytest.raises(FileNotFoundError):
        _io.size(missing)


@pytest.mark.parametrize(
    "error, message, code",
    [
        (tf.errors.ResourceExhaustedError, "gs://b/s.tmp; No space left on device", errno.ENOSPC),
        (tf.errors.OutOfRangeError, "/d/s.tmp; File too large", errno.EFBIG),
        (tf.errors.UnknownError, "the connection broke", errno.EIO),
    ],
)
def test_writer_errors_become_os_errors_of_their_errno(error, message, code):
    """A shard written through TensorFlow (a URL, or GZIP/ZLIB) that the disk refuses
    raises the `OSError` of the errno TensorFlow's text names, as `os.writev` would."""
    with pytest.raises(OSError) as got, _io.os_errors():
        raise error(None, None, message)
    assert got.value.errno == code and got.value.filename is None
    assert type(got.value) is OSError and message.rsplit("; ", 1)[-1] in str(got.value)


@pytest.mark.parametrize("fresh", [False, True])
def test_overwrite_on_a_url(no_local_io_for_urls, fresh):
    """``overwrite=True`` on a URL, over a data set or into a directory that never held
    one, replaces it (it raised `NotFoundError` after deleting the old data set)."""
    x, y, w = _arrays(60)
    url = _ram_dir()
    if not fresh:
        ArraysToRecords.from_arrays(x[::-1], y, url, samples_per_record=8, verbose=0)
    for _ in range(2):
        ArraysToRecords.from_arrays(x, y, url, sample_weight=w, overwrite=True, verbose=0)
        rx, ry, rw = _read_all(TFRecordSequenceSource(url, batch_size=16, shuffle=False))
        assert _same_bits(rx, x) and _same_bits(ry, y) and _same_bits(rw, w)


def test_resume_on_a_url_rewrites_a_missing_shard(no_local_io_for_urls, caplog):
    """docs/reliability.md: a resume rewrites a shard its journal lists but that is gone,
    on a URL as on a local path."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2_000, 64)).astype(np.float32)
    y = np.arange(2_000)

    def batches(fail_at=None):
        for i in range(0, 2_000, 125):
            if i == fail_at:
                raise RuntimeError("interrupted")
            yield x[i : i + 125], y[i : i + 125]

    url = _ram_dir()
    kw = dict(verbose=0, shard_size="64KB", record_size="16KB")
    with pytest.raises(RuntimeError, match="interrupted"):
        ArraysToRecords.from_arrays(batches(fail_at=1_500), directory=url, **kw)
    shards = sorted(n for n in tf.io.gfile.listdir(url) if n.startswith("shard-"))
    assert len(shards) >= 3 and MANIFEST_NAME not in tf.io.gfile.listdir(url)
    tf.io.gfile.remove(f"{url}/{shards[1]}")
    with caplog.at_level("WARNING", logger="keras_tfr"):
        ArraysToRecords.from_arrays(batches(), directory=url, resume=True, **kw)
    assert f"not resuming from {shards[1]}: missing" in caplog.text
    source = TFRecordSequenceSource(url, batch_size=500, shuffle=False)
    got = [(b[0].numpy(), b[1].numpy()) for b in source]
    assert _same_bits(np.concatenate([g[0] for g in got]), x)
    assert np.array_equal(np.concatenate([g[1] for g in got]), y)


def test_a_file_url_is_read_in_block_mode(tmp_path, caplog):
    """docs/scaling.md: every URL, `file://` included, is read in block mode; the plain
    path of the same data set reads in sample mode."""
    x, y, _ = _arrays(64)
    local = str(tmp_path / "ds")
    ArraysToRecords.from_arrays(x, y, local, verbose=0)
    url = "file://" + os.path.abspath(local)
    with caplog.at_level("INFO", logger="keras_tfr"):
        source = TFRecordSequenceSource(url, batch_size=16, shuffle=False)
    assert source.access == "blocks"
    assert "reads in blocks mode: it is not on a local file system" in caplog.text
    with pytest.raises(ValueError, match="not on a local file system"):
        TFRecordSequenceSource(url, batch_size=16, access="samples")
    assert TFRecordSequenceSource(local, batch_size=16).access == "samples"
    rx, ry = (np.concatenate(a) for a in zip(*[(b[0].numpy(), b[1].numpy()) for b in source]))
    assert _same_bits(rx, x) and _same_bits(ry, y)
