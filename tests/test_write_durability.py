"""A manifest on disk means every shard it names is on disk: each shard and the
directory are fsynced before the manifest is written, and the manifest itself is synced
before and after its rename."""

from __future__ import annotations

import errno
import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from keras_tfr import ArraysToRecords, TFRecordSequenceSource
from keras_tfr.manifest import MANIFEST_NAME, PROGRESS_NAME, Manifest
from keras_tfr.verifier import verify

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


# ------------------------------------------------- a compressed shard the disk refuses


def _mostly_incompressible(n, zero_samples):
    """Random samples whose first `zero_samples` are zeros: shards that compress to
    little, then shards that do not."""
    x = np.random.default_rng(0).standard_normal((n, 16)).astype(np.float32)
    x[:zero_samples] = 0
    return x


def _assert_resumes_to_one_write(d, ref, x, layout):
    """`resume=True` finishes the data set as one uninterrupted write would have."""
    ArraysToRecords.from_arrays(x, d, resume=True, **layout)
    ArraysToRecords.from_arrays(x, ref, **layout)
    manifests = [Manifest.load(p) for p in (d, ref)]
    assert manifests[0].shards == manifests[1].shards
    for s in manifests[0].shards:
        with open(os.path.join(d, s.file), "rb") as a, open(os.path.join(ref, s.file), "rb") as b:
            assert a.read() == b.read(), s.file
    assert verify(d).ok


_COMPRESSED_FILE_SIZE_LIMIT = """
import json, resource, sys, traceback
from keras_tfr import ArraysToRecords, TFRecordSequenceSource
sys.path.insert(0, sys.argv[1])
from test_write_durability import _mostly_incompressible

d, compression = sys.argv[2], sys.argv[3]
limit, shard_size, samples_per_record, zero_samples, n = map(int, sys.argv[4:])
x = _mostly_incompressible(n, zero_samples)
# Writes past `limit` bytes fail with EFBIG (Python ignores SIGXFSZ), as on a full disk.
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
try:
    ArraysToRecords.from_arrays(x, d, samples_per_record=samples_per_record,
                                shard_size=shard_size, compression=compression,
                                min_shards=1, verbose=0)
    print(json.dumps(None))
except OSError as e:
    cause = e.__cause__ if e.__cause__ is not None else e
    frames = [f.name for f in traceback.extract_tb(cause.__traceback__)]
    print(json.dumps([type(e).__name__, e.errno, str(e), frames]))
"""


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "compression, limit, shard_size, samples_per_record, refused_in",
    [
        # About 8 KB a shard: TensorFlow's writer buffers it, its `close` is refused.
        ("GZIP", 4000, 8192, 4, "close"),
        ("ZLIB", 4000, 8192, 4, "close"),
        # About 2 MB a shard: a `write` is refused, in the writing thread.
        ("GZIP", 100_000, 2_000_000, 64, "write_many"),
    ],
)
def test_a_compressed_shard_over_the_file_size_limit_names_the_shard(
    tmp_path, compression, limit, shard_size, samples_per_record, refused_in
):
    """TensorFlow's writer said a file size limit as `OutOfRangeError` (a full disk:
    `ResourceExhaustedError`), which is no OSError: the CLI printed a traceback. It is the
    OSError of EFBIG that names the shard, as for an uncompressed one; the complete shards
    and the journal stay, nothing partial, no manifest, and `resume=True` finishes."""
    layout = dict(
        samples_per_record=samples_per_record,
        shard_size=shard_size,
        compression=compression,
        min_shards=1,
        verbose=0,
    )
    # A sample takes at least 64 bytes: 3 * shard_size // 64 samples fill 3 shards.
    probe = np.zeros((3 * shard_size // 64, 16), np.float32)
    m = ArraysToRecords.from_arrays(probe, str(tmp_path / "probe"), **layout)
    per_shard = m.shards[0].records * samples_per_record
    zero_samples, n = 2 * per_shard, 3 * per_shard  # shards 0 and 1 fit, shard 2 does not
    d, ref = str(tmp_path / "ds"), str(tmp_path / "ref")
    here = os.path.dirname(os.path.abspath(__file__))
    args = [limit, shard_size, samples_per_record, zero_samples, n]
    child = subprocess.run(
        [sys.executable, "-c", _COMPRESSED_FILE_SIZE_LIMIT, here, d, compression]
        + [str(a) for a in args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    kind, code, said, frames = json.loads(child.stdout.splitlines()[-1])
    assert (kind, code) == ("OSError", errno.EFBIG), said
    shard = os.path.join(d, "shard-00002.tfrecord.tmp")
    assert said == f"[Errno 27] Could not write the shard {shard}: File too large"
    assert [f for f in ("write_many", "close") if f in frames] == [refused_in], frames
    assert sorted(os.listdir(d)) == [PROGRESS_NAME, "shard-00000.tfrecord", "shard-00001.tfrecord"]
    x = _mostly_incompressible(n, zero_samples)
    _assert_resumes_to_one_write(d, ref, x, layout)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (ENOSPC)")
@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_a_compressed_shard_on_a_full_disk_names_the_shard(tmp_path, monkeypatch, compression):
    """The same for a full disk: TensorFlow writes the third shard to /dev/full, which
    refuses every write with ENOSPC."""
    from keras_tfr.write import sink

    real_open = sink.open_record_file

    def third_shard_on_a_full_disk(path, compression):
        if os.path.basename(path) == "shard-00002.tfrecord.tmp":
            os.symlink("/dev/full", path)
        return real_open(path, compression)

    monkeypatch.setattr(sink, "open_record_file", third_shard_on_a_full_disk)
    layout = dict(samples_per_record=4, shard_size=1000, compression=compression, verbose=0)
    x = _mostly_incompressible(200, 0)
    d, ref = str(tmp_path / "ds"), str(tmp_path / "ref")
    with pytest.raises(OSError) as e:
        ArraysToRecords.from_arrays(x, d, **layout)
    assert e.value.errno == errno.ENOSPC
    shard = os.path.join(d, "shard-00002.tfrecord.tmp")
    assert str(e.value) == f"[Errno 28] Could not write the shard {shard}: No space left on device"
    assert sorted(os.listdir(d)) == [PROGRESS_NAME, "shard-00000.tfrecord", "shard-00001.tfrecord"]
    monkeypatch.setattr(sink, "open_record_file", real_open)
    _assert_resumes_to_one_write(d, ref, x, layout)


_PIECE = 2 << 20


def _spy_writev(monkeypatch, most: int | None = None) -> list[tuple[int, int]]:
    """Records ``(file offset, bytes written)`` of each `os.writev` of the writer;
    ``most``: each call writes at most that many bytes (a short write)."""
    from keras_tfr.write import sink

    calls: list[tuple[int, int]] = []
    real = os.writev

    def spy(fd, parts):
        at = os.lseek(fd, 0, os.SEEK_CUR)
        if most is not None:
            data = b"".join(parts)[:most]
            n = os.write(fd, data)
        else:
            n = real(fd, parts)
        calls.append((at, n))
        return n

    monkeypatch.setattr(sink.os, "writev", spy)
    return calls


def test_a_local_shard_is_written_in_whole_aligned_2_mb_pieces(tmp_path, monkeypatch):
    """Written record by record (about 1 MB each, at any offset), a shard was cached in
    small pieces that the reader cannot map as huge pages. Each `writev` now starts at a
    multiple of 2 MB, and all but a shard's last cover whole 2 MB pieces."""
    calls = _spy_writev(monkeypatch)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3000, 1000)).astype(np.float32)  # 12 MB, records of 1 MB
    y = np.arange(3000, dtype=np.int64)
    d = str(tmp_path / "ds")
    m = ArraysToRecords.from_arrays(x, y, d, shard_size="5MB", min_shards=1, verbose=0)
    assert len(m.shards) >= 3 and m.record_bytes > 900_000
    assert calls and all(at % _PIECE == 0 and n > 0 for at, n in calls), calls
    partial = [c for c in calls if c[1] % _PIECE]
    assert len(partial) <= len(m.shards), calls  # one closing write per shard at most
    assert sum(n for _, n in calls) == sum(s.bytes for s in m.shards)
    got = TFRecordSequenceSource(d, batch_size=500, shuffle=False).as_numpy_iterator()
    xs, ys = zip(*got)
    assert np.concatenate(xs).tobytes() == x.tobytes()
    assert np.array_equal(np.concatenate(ys), y)


def test_short_writes_still_write_every_byte_in_order(tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3000, 1000)).astype(np.float32)
    y = np.arange(3000, dtype=np.int64)
    layout = dict(shard_size="5MB", min_shards=1, verbose=0)
    ArraysToRecords.from_arrays(x, y, str(tmp_path / "ref"), **layout)
    calls = _spy_writev(monkeypatch, most=(1 << 20) + 3)
    ArraysToRecords.from_arrays(x, y, str(tmp_path / "short"), **layout)
    assert any(n == (1 << 20) + 3 for _, n in calls), calls  # short writes did happen
    ref, short = Manifest.load(str(tmp_path / "ref")), Manifest.load(str(tmp_path / "short"))
    assert [s.bytes for s in short.shards] == [s.bytes for s in ref.shards]
    for s in ref.shards:
        with open(ref.shard_path(s), "rb") as a, open(short.shard_path(s), "rb") as b:
            assert a.read() == b.read(), s.file


def test_releasing_a_memmap_drops_only_whole_aligned_2_mb_pieces(tmp_path, monkeypatch):
    """`MADV_DONTNEED` on part of a huge page split it; converting from a memmap, the
    shards written after the first were then cached in small pieces. Released record by
    record (about 1 MB each), the rows go in whole 2 MB pieces, each once, and every
    row but the last piece's is dropped in the end."""
    import mmap

    from keras_tfr.write import inputs

    advised: list[tuple[int, int, int]] = []

    class Libc:
        def madvise(self, addr, length, advice):
            advised.append((addr.value, length.value, advice))
            return 0

    monkeypatch.setattr(inputs, "libc", lambda: Libc())
    path = str(tmp_path / "x.npy")
    arr = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(4096, 1000))
    arr.flush()
    arr = np.load(path, mmap_mode="r")[7:]  # rows start inside a page
    base = arr.__array_interface__["data"][0]
    end = base + arr.nbytes
    first = -(-base // mmap.PAGESIZE) * mmap.PAGESIZE
    for start in range(0, len(arr), 250):
        inputs.release_pages(arr, start, min(start + 250, len(arr)))
    assert advised and {a for _, _, a in advised} == {mmap.MADV_DONTNEED}
    ranges = [(lo, lo + n) for lo, n, _ in advised]
    assert ranges[0][0] == first  # never before the array's first page
    for (_, hi), (lo, _) in itertools.pairwise(ranges):
        assert lo == hi and lo % _PIECE == 0  # each piece once, in order
    assert ranges[-1][1] == end // _PIECE * _PIECE  # all but the last piece's rows
    assert end - ranges[-1][1] < _PIECE


@pytest.mark.parametrize("size", [1, 1000, 70_000, 3 << 20])
def test_records_of_any_size_are_framed_byte_for_byte_in_aligned_pieces(
    tmp_path, monkeypatch, size
):
    """Records much smaller than 2 MB wait in the tail together; one larger than 2 MB
    spans pieces. Either way the file is TensorFlow's framing of the records, in order."""
    import tensorflow as tf

    from keras_tfr.write.sink import _FramedFile

    calls = _spy_writev(monkeypatch)
    rng = np.random.default_rng(size)
    count = max(3, min(20_000, (7 << 20) // (size + 16)))
    records = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(count)]
    path = str(tmp_path / "f.tfrecord")
    f = _FramedFile(path)
    for k in range(0, count, 7):  # several records per call, as the writer's thread does
        f.write_many([(r, None) for r in records[k : k + 7]])
    f.close()
    assert all(at % _PIECE == 0 for at, _ in calls)
    assert all(n % _PIECE == 0 for _, n in calls[:-1])  # only the last is partial
    ref = str(tmp_path / "ref.tfrecord")
    with tf.io.TFRecordWriter(ref) as w:
        for r in records:
            w.write(r)
    with open(path, "rb") as a, open(ref, "rb") as b:
        assert a.read() == b.read()
