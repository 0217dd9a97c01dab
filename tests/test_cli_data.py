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


# ------------------------------------------------------------------ convert's SPECs


@pytest.fixture
def raw(tmp_path, monkeypatch):
    """``raw.bin`` (200 float32, 800 bytes) and ``x.npy`` in the working directory;
    `np.memmap` fails the test if it is called (a memmap of an object dtype reads the
    file's bytes as pointers: it crashed the process with a segmentation fault)."""
    monkeypatch.chdir(tmp_path)
    np.arange(200, dtype=np.float32).tofile("raw.bin")
    np.save("x.npy", np.zeros((50, 3), np.float32))

    def memmap(*args, **kwargs):
        raise AssertionError(f"np.memmap{args} was built for a SPEC to refuse")

    monkeypatch.setattr(np, "memmap", memmap)
    return tmp_path


@pytest.mark.parametrize("dtype", ["object", "O", "complex64", "S4", "datetime64[s]"])
def test_convert_refuses_a_raw_dtype_the_writer_cannot_store_before_any_memmap(raw, capsys, dtype):
    """``raw.bin:object`` (or ``:O``) ended the process with a segmentation fault (exit
    139); other dtypes the writer refuses were memory-mapped first. Exit 2, one line
    naming the flag, the SPEC and the dtypes a raw file may have."""
    spec = f"raw.bin:{dtype}"
    assert main(["convert", "ds", "--x", spec, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"keras-tfr convert: error: cannot read --x spec {spec!r}: "), err
    assert "Expected a raw file's dtype to be one of [" in err and "'float32'" in err, err
    assert f"Received: {dtype!r}" in err and err.count("\n") == 1, err
    assert not os.path.exists(raw / "ds")


@pytest.mark.parametrize(
    "shape, said",
    [
        # Was an OverflowError's traceback (exit 1).
        ("99999999999999999999", "less than one sample of 399999999999999999996 bytes"),
        # Was "samples of -9786976294838206464 bytes": the product wrapped around in int64.
        ("4000000000,4000000000", "less than one sample of 64000000000000000000 bytes"),
        ("1000", "less than one sample of 4000 bytes"),
        ("3", "not a whole number of samples of 12 bytes"),
    ],
)
def test_convert_refuses_a_raw_shape_larger_than_the_file_in_python_ints(raw, capsys, shape, said):
    spec = f"raw.bin:float32:{shape}"
    assert main(["convert", "ds", "--x", spec, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"keras-tfr convert: error: cannot read --x spec {spec!r}: "), err
    assert f"raw.bin holds 800 bytes, {said}" in err and err.count("\n") == 1, err
    assert not os.path.exists(raw / "ds")


def _unreadable(name: str) -> None:
    """Writes the file of an unreadable SPEC in the working directory."""
    good = np.zeros((50, 3), np.float32)
    if name == "trunc.npy":
        np.save("full.npy", good)
        with open("full.npy", "rb") as f:
            head = f.read(100)
        with open(name, "wb") as f:
            f.write(head)
    elif name == "obj.npy":
        np.save(name, np.array([b"a"] * 50, dtype=object), allow_pickle=True)
    elif name == "zip.npy":  # an .npz named .npy: np.load gave an archive, not an array
        np.savez("zip.npz", a=good)
        os.rename("zip.npz", name)
    elif name == "trunc.npz":
        np.savez("full.npz", a=good)
        with open("full.npz", "rb") as f:
            head = f.read(200)
        with open(name, "wb") as f:
            f.write(head)
    elif name == "one.npz":  # an .npy named .npz: np.load gave an array, not an archive
        np.save("one.npy", good)
        os.rename("one.npy", name)
    elif name.startswith("empty"):
        open(name, "wb").close()
    else:
        with open(name, "w") as f:
            f.write("garbage\n")


@pytest.mark.parametrize(
    "spec, said",
    [
        ("trunc.npy", "EOF: reading array header, expected 118 bytes got 90"),
        ("garbage.npy", "garbage.npy is not a .npy file (it does not start with NumPy's header)"),
        ("empty.npy", "empty.npy is not a .npy file (it is empty)"),  # was an EOFError
        ("zip.npy", "zip.npy is not a .npy file"),
        ("obj.npy", "Array can't be memory-mapped: Python objects in dtype."),
        ("trunc.npz:a", "File is not a zip file"),  # was a zipfile.BadZipFile traceback
        ("one.npz", "one.npz holds one array, not a .npz archive"),  # was an AttributeError
        ("garbage.h5:x", "file signature not found"),
        ("empty.bin:float32", "empty.bin is empty: no samples"),  # "cannot mmap an empty file"
    ],
)
@pytest.mark.parametrize("flag", ["--y", "--x", "--sample-weight"])
def test_convert_errors_of_an_unreadable_file_name_its_flag_and_spec(
    tmp_path, monkeypatch, capsys, spec, said, flag
):
    """With several files given, "EOF: reading array header ..." or "cannot mmap an empty
    file" did not tell which was bad: the error names the flag and the SPEC (a named
    input's ``NAME=SPEC`` as given), exit 2, one line, before anything is written."""
    if spec.endswith(".h5:x"):
        pytest.importorskip("h5py")
    monkeypatch.chdir(tmp_path)
    np.save("x.npy", np.zeros((50, 3), np.float32))
    np.save("y.npy", np.arange(50))
    _unreadable(spec.split(":")[0])
    given = {
        "--x": ["--x", "a=x.npy", "--x", f"b={spec}", "--y", "y.npy"],
        "--y": ["--x", "x.npy", "--y", spec],
        "--sample-weight": ["--x", "x.npy", "--y", "y.npy", "--sample-weight", spec],
    }[flag]
    assert main(["convert", "ds", *given, "--quiet"]) == 2
    err = capsys.readouterr().err
    shown = f"b={spec}" if flag == "--x" else spec
    assert err.startswith(f"keras-tfr convert: error: cannot read {flag} spec {shown!r}: "), err
    assert said in err and err.count("\n") == 1, err
    assert not os.path.exists(tmp_path / "ds")


def test_running_out_of_memory_reading_a_spec_is_not_called_bad_input(tmp_path, monkeypatch):
    """An .npz member too large to load raises `MemoryError`, not "cannot read --x spec"
    with exit 2 (which says the file is bad)."""
    monkeypatch.chdir(tmp_path)
    np.savez("big.npz", a=np.zeros((50, 3), np.float32))
    np.save("y.npy", np.arange(50))

    def no_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate 80.0 GiB")

    monkeypatch.setattr(np.lib.npyio.NpzFile, "__getitem__", no_memory)
    with pytest.raises(MemoryError, match=r"80\.0 GiB"):
        main(["convert", "ds", "--x", "big.npz:a", "--y", "y.npy", "--quiet"])
    assert not os.path.exists(tmp_path / "ds")


def test_convert_names_the_flag_of_a_missing_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    np.save("x.npy", np.zeros((50, 3), np.float32))
    assert main(["convert", "ds", "--x", "x.npy", "--y", "nope.npy", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == "keras-tfr convert: error: cannot read --y spec 'nope.npy': 'nope.npy' does not exist\n"
    )
