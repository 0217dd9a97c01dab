"""A conversion killed with SIGKILL mid-way: the directory is refused as incomplete, by
readers and by writers without `resume`, and `resume=True` completes it bit for bit,
keeping the shards that were already complete."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from keras_tfr import ArraysToRecords, TFRecordSequenceSource
from keras_tfr.errors import IncompleteDatasetError
from keras_tfr.manifest import MANIFEST_NAME, PROGRESS_NAME, Manifest
from keras_tfr.verifier import verify

N, FEATURES = 2000, 64
# 8 samples per record (about 2 KB), 3 records per shard: about 84 small shards.
LAYOUT = dict(samples_per_record=8, shard_size="8KB", chunk_size="16KB", verbose=0)

CHILD = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from keras_tfr import ArraysToRecords

    class SlowMemmap:
        # A memmap read slowly (a network disk): the parent has time to kill us mid-way.
        def __init__(self, a):
            self.a, self.shape, self.dtype = a, a.shape, a.dtype
        def __getitem__(self, s):
            time.sleep(0.05)
            return self.a[s]

    x = np.load(sys.argv[1], mmap_mode="r")
    y = np.load(sys.argv[2], mmap_mode="r")
    layout = dict(samples_per_record=8, shard_size="8KB", chunk_size="16KB", verbose=0)
    ArraysToRecords.from_arrays(SlowMemmap(x), SlowMemmap(y), sys.argv[3], **layout)
    print("finished")  # the test fails if the child got this far
    """
)


def _journal_shards(d):
    try:
        return json.loads(Path(d, PROGRESS_NAME).read_text())["shards"]
    except (OSError, ValueError, KeyError):
        return []


@pytest.mark.subprocess
def test_sigkill_mid_conversion_then_resume_bit_for_bit(tmp_path):
    rng = np.random.default_rng(7)
    xp, yp = str(tmp_path / "x.npy"), str(tmp_path / "y.npy")
    x = np.lib.format.open_memmap(xp, mode="w+", dtype=np.float32, shape=(N, FEATURES))
    x[:] = rng.standard_normal((N, FEATURES)).astype(np.float32)
    x.flush()
    np.save(yp, np.arange(N, dtype=np.int64))
    x = np.load(xp, mmap_mode="r")
    y = np.load(yp, mmap_mode="r")
    d = str(tmp_path / "ds")

    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, xp, yp, d],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while len(_journal_shards(d)) < 3:
            assert child.poll() is None, child.communicate()[1].decode()[-2000:]
            assert time.monotonic() < deadline, "the child wrote no shard in time"
            time.sleep(0.02)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        if child.poll() is None:
            child.kill()
        out, _ = child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL
    assert b"finished" not in out

    # Killed mid-way: complete shards and a journal, no manifest.
    done = _journal_shards(d)
    assert 3 <= len(done) < 60, "killed mid-way"
    assert not os.path.exists(os.path.join(d, MANIFEST_NAME))
    assert os.path.exists(os.path.join(d, ".keras-tfr.lock")), "the killed writer's lock stays"

    # Refused as incomplete: by readers, by verify, by writers without resume.
    with pytest.raises(IncompleteDatasetError, match="resume=True"):
        TFRecordSequenceSource(d, batch_size=32)
    with pytest.raises(IncompleteDatasetError):
        verify(d)
    with pytest.raises(IncompleteDatasetError, match="resume=True"):
        ArraysToRecords.from_arrays(x, y, d, **LAYOUT)
    with pytest.raises(IncompleteDatasetError), ArraysToRecords(d, verbose=0) as w:
        w.write(x[:10], y[:10])

    # A shard is journaled before its rename: a kill in between leaves the newest entry
    # without its file (resume rewrites it); every earlier one is on disk.
    on_disk = [s["file"] for s in done if os.path.exists(os.path.join(d, s["file"]))]
    assert on_disk in ([s["file"] for s in done], [s["file"] for s in done[:-1]]), on_disk

    # Resume (takes over the dead writer's lock, keeps the complete shards).
    kept = {name: os.stat(os.path.join(d, name)) for name in on_disk}
    m = ArraysToRecords.from_arrays(x, y, d, resume=True, **LAYOUT)
    for name, st in kept.items():
        now = os.stat(os.path.join(d, name))
        assert (now.st_ino, now.st_mtime_ns) == (st.st_ino, st.st_mtime_ns), f"{name} rewritten"

    # Bit for bit the data set an uninterrupted conversion writes.
    ref = str(tmp_path / "ref")
    ArraysToRecords.from_arrays(x, y, ref, **LAYOUT)
    ref_manifest = json.loads(Path(ref, MANIFEST_NAME).read_text())
    got_manifest = json.loads(Path(d, MANIFEST_NAME).read_text())
    ref_manifest.pop("created"), got_manifest.pop("created")
    assert got_manifest == ref_manifest
    for s in Manifest.load(ref).shards:
        assert Path(d, s.file).read_bytes() == Path(ref, s.file).read_bytes(), s.file
    assert sorted(os.listdir(d)) == sorted([MANIFEST_NAME] + [s.file for s in m.shards])
    assert verify(d).ok

    src = TFRecordSequenceSource(d, batch_size=256, shuffle=False)
    xs = np.concatenate([bx.numpy() for bx, _ in src])
    ys = np.concatenate([by.numpy() for _, by in src])
    assert np.array_equal(xs.view(np.uint32), np.asarray(x).view(np.uint32))
    assert np.array_equal(ys, np.arange(N))


OVERWRITE_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    import keras_tfr._io as io
    from keras_tfr import ArraysToRecords

    remove, removed = io.remove, []

    def killed_mid_way(path, missing_ok=True):
        remove(path, missing_ok)
        removed.append(os.path.basename(path))
        if len(removed) == int(sys.argv[3]):
            print(" ".join(removed), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # a kill while the old files go

    io.remove = killed_mid_way
    x = np.load(sys.argv[1])
    ArraysToRecords.from_arrays(x, np.arange(len(x)), sys.argv[2], overwrite=True,
                                samples_per_record=8, shard_size="8KB", verbose=0)
    print("finished")  # the test fails if the child got this far
    """
)


class _FailsAt:
    """An array whose rows from `limit` on cannot be read (a disk that fails mid-way)."""

    def __init__(self, a, limit):
        self.a, self.limit, self.shape, self.dtype = a, limit, a.shape, a.dtype

    def __len__(self):
        return len(self.a)

    def __getitem__(self, s):
        if (s.stop or len(self.a)) > self.limit:
            raise OSError("the input failed")
        return self.a[s]


@pytest.mark.subprocess
@pytest.mark.parametrize("kill_after", [2, 3, 5])
def test_overwrite_of_an_unfinished_conversion_killed_mid_way_never_resumes_a_mix(
    tmp_path, kill_after
):
    """docs/reliability.md: an interrupted overwrite never leaves a mix of old and new.
    The old journal went after the old shards: a resume then kept the old conversion's
    shards that were left and wrote the new data after them."""
    rng = np.random.default_rng(3)
    old = rng.standard_normal((N, FEATURES)).astype(np.float32)
    new = old + 1
    d = str(tmp_path / "ds")
    with pytest.raises(OSError, match="the input failed"):
        ArraysToRecords.from_arrays(_FailsAt(old, N // 2), np.arange(N), d, **LAYOUT)
    kept = _journal_shards(d)
    assert len(kept) >= kill_after and not os.path.exists(os.path.join(d, MANIFEST_NAME))
    np.save(tmp_path / "new.npy", new)
    child = subprocess.run(
        [sys.executable, "-c", OVERWRITE_CHILD, str(tmp_path / "new.npy"), d, str(kill_after)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    removed = child.stdout.split()
    assert removed[:2] == [MANIFEST_NAME, PROGRESS_NAME], removed
    old_left = [s["file"] for s in kept if s["file"] not in removed]
    assert old_left  # the kill came while old shards were still there
    with pytest.raises(IncompleteDatasetError, match="no manifest or journal lists"):
        ArraysToRecords.from_arrays(new, np.arange(N), d, resume=True, **LAYOUT)
    ArraysToRecords.from_arrays(new, np.arange(N), d, overwrite=True, **LAYOUT)
    bx, by = zip(*TFRecordSequenceSource(d, batch_size=512, shuffle=False).as_numpy_iterator())
    assert np.concatenate(bx).tobytes() == new.tobytes() and np.array_equal(
        np.concatenate(by), np.arange(N)
    )
