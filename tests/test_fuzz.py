"""Fuzz test of the reader on randomly damaged shards (flipped bits, cut lengths,
overwritten ranges), seeded and bounded: every case ends in a clear error that names the
shard (and, uncompressed, the exact record offset) or in a clean skip with the announced
step count; never a crash, a hang or a wrong sample passed on as good."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from keras_tfr import ArraysToRecords, TFRecordSequenceSource
from keras_tfr.errors import ShardError
from keras_tfr.manifest import Manifest
from keras_tfr.verifier import verify

N, SPR, SHARDS = 160, 4, 4  # 40 full records, 10 per shard
TIMEOUT_S = 60  # per pipeline run; a hang fails the test instead of blocking the suite


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, 5)).astype(np.float32)
    y = np.arange(N, dtype=np.int64)
    out = {}
    for compression in (None, "GZIP"):
        d = str(tmp_path_factory.mktemp("fuzz") / f"ds-{compression}")
        ArraysToRecords.from_arrays(
            x, y, d, samples_per_record=SPR, min_shards=SHARDS, compression=compression, verbose=0
        )
        m = Manifest.load(d)
        assert [s.records for s in m.shards] == [N // SPR // SHARDS] * SHARDS
        out[compression] = d
    return out, x


def _run(fn):
    """Runs fn() in a thread; fails the test if it does not finish within TIMEOUT_S."""
    result: dict = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as e:  # handed back to the test
            result["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(TIMEOUT_S)
    if t.is_alive():
        pytest.fail(f"the reader hung for more than {TIMEOUT_S} s")
    return result


def _drain_into(src, out):
    for bx, by in src:
        out.append((bx.numpy(), by.numpy()))
    return len(out)


def _assert_all_good(batches, x):
    for bx, by in batches:
        assert np.array_equal(bx.view(np.uint32), x[by].view(np.uint32)), "wrong data passed"


def _damage(rng, d, m):
    """Damages 1 or 2 shards at random. Returns {shard file: first damaged byte} and
    {shard file: indices of the damaged records}."""
    damaged = {}
    records: dict[str, set[int]] = {}
    frame = m.record_bytes + 16
    victims = rng.choice(len(m.shards), size=rng.integers(1, 3), replace=False)
    for v in sorted(victims.tolist()):
        path = Path(d) / m.shards[v].file
        raw = bytearray(path.read_bytes())
        original = bytes(raw)
        kind = rng.choice(["flip", "cut", "overwrite"])
        if kind == "flip":
            for pos in rng.choice(len(raw), size=rng.integers(1, 9), replace=False):
                raw[pos] ^= 1 << int(rng.integers(0, 8))
        elif kind == "cut":
            raw = raw[: rng.integers(0, len(raw))]
        else:
            start = int(rng.integers(0, len(raw)))
            length = int(rng.integers(1, 64))
            raw[start : start + length] = rng.integers(0, 256, length, dtype=np.uint8).tobytes()
        raw = bytes(raw)
        if raw == original:
            continue
        path.write_bytes(raw)
        first = next(
            (i for i, (a, b) in enumerate(zip(raw, original)) if a != b),
            min(len(raw), len(original)),
        )
        damaged[m.shards[v].file] = first
        records[m.shards[v].file] = {
            j
            for j in range(m.shards[v].records)
            if raw[j * frame : (j + 1) * frame] != original[j * frame : (j + 1) * frame]
        }
    return damaged, records


def _fuzz_case(seed, pristine_dir, x, tmp_path, compression, reader="graph"):
    rng = np.random.default_rng(seed)
    d = str(tmp_path / f"case-{seed}")
    shutil.copytree(pristine_dir, d)
    m = Manifest.load(d)
    damaged, damaged_records = _damage(rng, d, m)
    if not damaged:
        return
    frame = m.record_bytes + 16
    per_shard = m.shards[0].records
    shuffle = bool(rng.integers(0, 2))

    # 1. Opening: a changed size is named at once.
    resized = {s.file for s in m.shards if os.path.getsize(os.path.join(d, s.file)) != s.bytes}
    if resized:
        with pytest.raises(ShardError) as e:
            TFRecordSequenceSource(d, batch_size=8)
        for name in resized:
            assert name in str(e.value)

    # 2. raise mode (damage reached through check_files=False): a clear error, and
    #    nothing wrong before it.
    src = TFRecordSequenceSource(d, batch_size=8, shuffle=shuffle, seed=seed, check_files=False)
    got: list = []
    r = _run(lambda: _drain_into(src, got))
    err = r.get("error")
    if err is None and compression is not None:
        # Damage confined to the GZIP header/trailer fields TensorFlow does not check:
        # the records passed their CRCs, so the whole epoch must be there, exact.
        _assert_all_good(got, x)
        assert sorted(np.concatenate([b[1] for b in got]).tolist()) == list(range(N))
        report = _run(lambda: verify(d))["value"]
        assert set(report.problems) == set(damaged), f"seed {seed}: {report.summary()}"
        return
    assert isinstance(err, tf.errors.InvalidArgumentError), f"seed {seed}: {err!r}"
    assert not isinstance(err, tf.errors.DataLossError)
    msg = err.message
    if compression is None:
        # The graph reader reads a shard in order, so it stops at the first damaged record;
        # the direct reader reads records in shuffled order and names whichever it meets.
        expected = [
            f"corrupt record in {os.path.join(d, f)} at byte offset {j * frame} "
            for f, first in damaged.items()
            for j in (damaged_records[f] if reader == "mapped" else [first // frame])
        ]
        assert any(e in msg for e in expected), f"seed {seed}: {msg[:300]} not in {expected}"
    else:
        assert any(f"corrupt record in {os.path.join(d, f)}" in msg for f in damaged), msg[:300]
    _assert_all_good(got, x)

    # 3. skip mode: every sample that comes through is good, the step count holds.
    src = TFRecordSequenceSource(
        d,
        batch_size=8,
        shuffle=shuffle,
        seed=seed,
        check_files=False,
        on_corrupt="skip",
        max_corrupt_records=10_000,
    )
    got = []
    r = _run(lambda: _drain_into(src, got))
    assert "error" not in r, f"seed {seed}: {r.get('error')!r}"
    assert r["value"] == len(src) == N // 8
    _assert_all_good(got, x)
    if compression is None and reader == "mapped":  # just the damaged records go
        assert src.corrupt_records == sum(len(r) for r in damaged_records.values())
    elif compression is None:  # TensorFlow's reader loses the rest of the shard
        assert src.corrupt_records == sum(per_shard - first // frame for first in damaged.values())
    else:
        assert src.corrupt_records >= len(damaged)

    # 4. verify names exactly the damaged shards.
    report = _run(lambda: verify(d))["value"]
    assert set(report.problems) == set(damaged), f"seed {seed}: {report.summary()}"


@pytest.mark.parametrize("block", range(4))
def test_fuzz_uncompressed(pristine, tmp_path, block, reader):
    dirs, x = pristine
    for seed in range(block * 6, block * 6 + 6):
        _fuzz_case(seed, dirs[None], x, tmp_path, None, reader)


def test_fuzz_gzip(pristine, tmp_path):
    dirs, x = pristine
    for seed in range(100, 106):
        _fuzz_case(seed, dirs["GZIP"], x, tmp_path, "GZIP")
