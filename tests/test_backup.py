"""`keras_tfr.BackupAndRestore`: exact mid-epoch resume inside ``fit``.

The subprocess tests run ``tests/_backup_child.py`` (a small model, 40 training samples
in batches of 4, 3 epochs, a validation source) and SIGKILL it at chosen points: the
first step, mid-epoch, while a backup is being written, an epoch's last step and during
validation. The same command is started again after each kill, and the finished run must
equal one that was never interrupted: weights and optimizer variables bit for bit (CPU),
the History, the optimizer's step count (which drives the learning-rate schedule), and
every training sample counted exactly once per epoch by the model itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).resolve().parent / "_backup_child.py"
STEPS, EPOCHS = 10, 3  # 40 samples, batches of 4
BASE = dict(train=40, val=12, batch_size=4, seed=0, epochs=EPOCHS, data="standin")


def _run(out: Path, backend: str, **config) -> int:
    out.mkdir(parents=True, exist_ok=True)
    cfg = out / "config.json"
    cfg.write_text(json.dumps({**BASE, **config, "out": str(out)}))
    env = {
        **os.environ,
        "KERAS_BACKEND": backend,
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, str(CHILD), str(cfg)], env=env, capture_output=True, text=True
    )
    if proc.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.returncode


def _result(out: Path):
    with np.load(out / "result.npz") as f:
        arrays = {k: f[k] for k in f.files}
    return arrays, json.loads((out / "result.json").read_text())


def _batches(out: Path) -> list[tuple[int, int, int]]:
    lines = (out / "batches.txt").read_text().split("\n")
    return [tuple(int(v) for v in line.split()) for line in lines if line]


def _backup_points(save_freq, hook, epoch, step):
    """The (epoch, step) the run killed at this point must resume from: the newest
    backup complete when it died (None: no backup yet, start over)."""
    points = []
    for e in range(EPOCHS):
        for s in range(STEPS):
            g = e * STEPS + s + 1
            if save_freq != "epoch" and g % save_freq == 0:
                # A backup due at an epoch's last step is written at its end instead.
                points.append((e + 1, 0, ("epoch_end", e)) if s + 1 == STEPS else (e, s + 1, g))
        if save_freq == "epoch":
            points.append((e + 1, 0, ("epoch_end", e)))

    def written(point):
        e, s, when = point
        if isinstance(when, tuple):  # at epoch `when[1]`'s end, after its validation
            return when[1] < epoch
        if hook == "train_batch_begin":
            return (e, s) <= (epoch, step)
        if hook == "train_batch_end":
            return (e, s) <= (epoch, step + 1)
        if hook == "test_batch_end":
            return (e, s) <= (epoch, STEPS)
        if hook == "backup":  # dies while writing the backup at (epoch, step + 1)
            return (e, s) < (epoch, step + 1)
        raise AssertionError(hook)

    done = [p[:2] for p in points if written(p)]
    return max(done) if done else None


def _check_same_as_uninterrupted(out: Path, baseline: Path):
    arrays, result = _result(out)
    base_arrays, base_result = _result(baseline)
    assert sorted(arrays) == sorted(base_arrays)
    for key in base_arrays:
        np.testing.assert_array_equal(arrays[key], base_arrays[key], err_msg=key)
    # Every training sample trained once per epoch, counting all processes from each
    # backup on (the counts are model state: restored with the backup).
    counts = arrays["counts"]
    np.testing.assert_array_equal(counts[: BASE["train"]], np.full(BASE["train"], EPOCHS))
    np.testing.assert_array_equal(counts[BASE["train"] :], 0)  # validation never trains
    assert result["iterations"] == base_result["iterations"] == EPOCHS * STEPS
    assert result["epoch"] == base_result["epoch"] == list(range(EPOCHS))
    assert result["history"] == base_result["history"]
    assert result.get("orders") == base_result.get("orders")


def _check_resumes(out: Path, kills: list[dict], save_freq):
    """Each process after a kill trains first the step after the backup it resumed from,
    and the steps trained from each backup on cover each epoch exactly once."""
    rows = _batches(out)
    pids = [pid for pid, e, _ in rows if e == -1]
    rows = [r for r in rows if r[1] >= 0]
    first = {pid: next(((e, s) for p, e, s in rows if p == pid), None) for pid in pids}
    assert len(pids) == len(kills) + 1
    for kill, pid in zip(kills, pids[1:]):
        resume = _backup_points(save_freq, kill["hook"], kill["epoch"], kill["step"])
        assert first[pid] == (resume or (0, 0)), (kill, first[pid], resume)
    # Keep, of each process, only the steps before the backup the next one resumed from.
    kept = []
    for i, pid in enumerate(pids):
        upto = first[pids[i + 1]] if i + 1 < len(pids) else (EPOCHS, 0)
        kept += [(e, s) for p, e, s in rows if p == pid and (e, s) < upto]
    assert sorted(kept) == [(e, s) for e in range(EPOCHS) for s in range(STEPS)]


@pytest.fixture(scope="module")
def baselines(tmp_path_factory):
    """Uninterrupted runs, one per backend (backups do not change training)."""
    made = {}

    def get(backend):
        if backend not in made:
            out = tmp_path_factory.mktemp(f"baseline-{backend}")
            assert _run(out, backend, save_freq=3) == 0
            made[backend] = out
        return made[backend]

    return get


def _chain(out: Path, backend: str, kills: list[dict], **config) -> None:
    for i, _ in enumerate(kills):
        assert _run(out, backend, kill=kills, **config) == -signal.SIGKILL, f"kill {i}"
    assert _run(out, backend, kill=kills, **config) == 0
    killed = (out / "killed.txt").read_text().split()
    assert killed == [k["id"] for k in kills]


def _kill(hook, epoch, step):
    return {"id": f"{hook}-{epoch}-{step}", "hook": hook, "epoch": epoch, "step": step}


@pytest.mark.slow
@pytest.mark.subprocess
def test_sigkill_at_many_points_resumes_exactly_tensorflow(tmp_path, baselines):
    kills = [
        _kill("train_batch_begin", 0, 0),  # the very first step: nothing to restore
        _kill("train_batch_end", 0, 4),  # mid-epoch, after the backup at step 3
        _kill("backup", 1, 4),  # while the backup of (1, 5) is written: falls back to (1, 2)
        _kill("train_batch_end", 1, STEPS - 1),  # an epoch's last step
        _kill("test_batch_end", 2, 1),  # during validation
    ]
    _chain(tmp_path, "tensorflow", kills, save_freq=3)
    _check_resumes(tmp_path, kills, 3)
    _check_same_as_uninterrupted(tmp_path, baselines("tensorflow"))
