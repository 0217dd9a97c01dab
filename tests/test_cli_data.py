"""`keras-tfr info`, `verify` and `bench` on damaged data sets: the exit codes
docs/cli.md promises (1: the command ran and found a problem; 2: bad input), in text and
JSON output alike."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from keras_tfr import ArraysToRecords
from keras_tfr.cli import main
from keras_tfr.manifest import MANIFEST_NAME


@pytest.fixture
def damaged(tmp_path):
    """A data set of 4 shards whose shard 1 is deleted and shard 2 cut short."""
    d = str(tmp_path / "ds")
    x = np.arange(400 * 6, dtype=np.float32).reshape(400, 6)
    m = ArraysToRecords.from_arrays(x, None, d, samples_per_record=10, min_shards=4, verbose=0)
    assert len(m.shards) == 4
    return d, m


@pytest.mark.parametrize("as_json", [False, True])
def test_info_exits_1_on_a_missing_or_resized_shard(damaged, capsys, as_json):
    d, m = damaged
    extra = ["--json"] if as_json else []
    assert main(["info", d, *extra]) == 0
    capsys.readouterr()
    os.remove(m.shard_path(m.shards[1]))
    os.truncate(m.shard_path(m.shards[2]), 100)
    assert main(["info", d, *extra]) == 1
    out, err = capsys.readouterr()
    assert "2 shard(s) missing or of the wrong size: run `keras-tfr verify`" in err
    if as_json:  # the manifest as JSON all the same
        assert json.loads(out)["total_samples"] == 400
    else:
        lines = {line.split()[0]: line for line in out.splitlines() if "shard-" in line}
        assert lines[m.shards[1].file].endswith("MISSING")
        assert lines[m.shards[2].file].endswith("SIZE 100")
        assert lines[m.shards[0].file].endswith("ok")


@pytest.mark.parametrize("command", ["info", "verify", "bench"])
def test_an_invalid_manifest_is_bad_input(damaged, capsys, command):
    d, _ = damaged
    with open(os.path.join(d, MANIFEST_NAME), "w") as f:
        f.write("{not json")
    assert main([command, d]) == 2
    assert MANIFEST_NAME in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["flipped byte", "missing shard", "cut short"])
def test_bench_exits_1_on_damage_as_info_and_verify_do(damaged, capsys, damage):
    d, m = damaged
    assert main(["bench", d, "--batch-size", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == 400  # the warm-up not counted
    path = m.shard_path(m.shards[2])
    if damage == "flipped byte":
        with open(path, "r+b") as f:
            f.seek(200)
            byte = f.read(1)
            f.seek(200)
            f.write(bytes([byte[0] ^ 1]))
    elif damage == "missing shard":
        os.remove(path)
    else:
        os.truncate(path, 100)
    assert main(["bench", d, "--batch-size", "8", "--json"]) == 1
    out, err = capsys.readouterr()
    assert out == ""  # no result for a run that did not read every sample
    assert err.startswith("keras-tfr bench: damaged data set: ")
    assert m.shards[2].file in err


@pytest.mark.parametrize("tty", [False, True])
def test_the_progress_bar_is_drawn_on_a_terminal_only(tmp_path, capsys, monkeypatch, tty):
    """docs/cli.md: `convert` and `verify` draw Keras' progress bar on a terminal; piped
    or redirected, only their summary line (the bar's redraw codes would stay in a log)."""
    import sys

    np.save(tmp_path / "x.npy", np.zeros((300, 4), np.float32))
    monkeypatch.setattr(sys.stdout, "isatty", lambda: tty)
    d = str(tmp_path / "ds")
    assert main(["convert", d, "--x", str(tmp_path / "x.npy")]) == 0
    assert main(["verify", d]) == 0
    out = capsys.readouterr().out
    assert "300 samples" in out  # the summary, either way
    assert ("/sample" in out or "\r" in out or "\x1b[" in out) == tty, out
