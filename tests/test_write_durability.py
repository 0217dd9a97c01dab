"""A manifest on disk means every shard it names is on disk: each shard and the
directory are fsynced before the manifest is written, and the manifest itself is synced
before and after its rename."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from keras_tfr import ArraysToRecords
from keras_tfr.manifest import MANIFEST_NAME

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/fd"), reason="maps file descriptors to paths via /proc"
)


@pytest.fixture
def syscalls(monkeypatch):
    """Records, in order, each `os.fsync` (as the path of its file) and each `os.replace`."""
    calls = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        calls.append(("rename", os.path.realpath(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return calls


def _check_order(calls, directory, shard_files):
    directory = os.path.realpath(directory)
    manifest = os.path.join(directory, MANIFEST_NAME)
    shards = [os.path.join(directory, f) for f in shard_files]
    manifest_rename = calls.index(("rename", manifest))
    manifest_sync = max(
        i for i, (op, p) in enumerate(calls[:manifest_rename]) if op == "fsync" and "manifest" in p
    )
    renamed = [s for s in shards if ("rename", s) in calls]  # resumed ones were earlier
    last_shard_rename = max(calls.index(("rename", s)) for s in renamed)
    for s in shards:
        # Synced under its final name, before the manifest's bytes.
        assert calls.index(("fsync", s)) < manifest_sync, s
    for s in renamed:
        assert calls.index(("fsync", s)) > calls.index(("rename", s)), s
    dir_syncs = [i for i, c in enumerate(calls) if c == ("fsync", directory)]
    assert any(last_shard_rename < i < manifest_sync for i in dir_syncs), "renames synced"
    assert any(i > manifest_rename for i in dir_syncs), "the manifest's rename synced"


@pytest.mark.parametrize("compression", [None, "GZIP"])
def test_every_shard_is_synced_before_the_manifest(tmp_path, syscalls, compression):
    x = np.arange(400, dtype=np.float32).reshape(100, 4)
    d = str(tmp_path / "ds")
    m = ArraysToRecords.from_arrays(
        x, d, samples_per_record=4, min_shards=5, compression=compression, verbose=0
    )
    assert len(m.shards) >= 5
    _check_order(syscalls, d, [s.file for s in m.shards])


def test_incremental_and_resumed_shards_are_synced_before_the_manifest(tmp_path, syscalls):
    x = np.arange(400, dtype=np.float32).reshape(100, 4)
    d = str(tmp_path / "ds")
    with (
        pytest.raises(KeyboardInterrupt),
        ArraysToRecords(d, samples_per_record=4, shard_size=300, verbose=0) as w,
    ):
        w.write(x[:60])
        raise KeyboardInterrupt
    syscalls.clear()
    with ArraysToRecords(d, samples_per_record=4, resume=True, verbose=0) as w:
        assert w.resumed_samples > 0
        w.write(x[w.resumed_samples :])
    assert len(w.manifest.shards) > len(
        [c for c in syscalls if c[0] == "rename" and c[1].endswith(".tfrecord")]
    ), "some shards come from the interrupted run"
    _check_order(syscalls, d, [s.file for s in w.manifest.shards])


def test_a_shard_that_cannot_be_synced_leaves_no_manifest(tmp_path, monkeypatch):
    import errno

    real_fsync = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("shard-00001.tfrecord"):
            raise OSError(errno.EIO, "Input/output error")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    x = np.arange(400, dtype=np.float32).reshape(100, 4)
    d = str(tmp_path / "ds")
    with pytest.raises(OSError, match=r"Could not sync the shard .*shard-00001\.tfrecord"):
        ArraysToRecords.from_arrays(x, d, samples_per_record=4, verbose=0)
    assert not os.path.exists(os.path.join(d, MANIFEST_NAME))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_write_back_of_each_shard_starts_as_it_closes(tmp_path, monkeypatch):
    from keras_tfr.write import sink

    started = []
    real = sink.start_writeback

    def start(path):
        started.append((os.path.basename(path), real(path)))
        return started[-1][1]

    monkeypatch.setattr(sink, "start_writeback", start)
    x = np.arange(400, dtype=np.float32).reshape(100, 4)
    m = ArraysToRecords.from_arrays(x, str(tmp_path / "ds"), samples_per_record=4, verbose=0)
    assert started == [(s.file + ".tmp", True) for s in m.shards]
