"""The real `keras-tfr` entry point, run in subprocesses: help, exit codes, outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from keras_tfr.cli import main

pytestmark = pytest.mark.subprocess

EXE = os.path.join(os.path.dirname(sys.executable), "keras-tfr")


def run(*args, timeout=240):
    cmd = [EXE] if os.path.exists(EXE) else [sys.executable, "-m", "keras_tfr.cli"]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize(
    "command",
    ["convert", "info", "verify", "bench", "convert-tfrecords", "parallel", "tune", "serve"],
)
def test_help_of_each_subcommand(command):
    r = run(command, "--help")
    assert r.returncode == 0, r.stderr
    assert "usage: keras-tfr " + command in r.stdout and len(r.stdout) > 300


def test_no_command_is_bad_usage():
    r = run()
    assert r.returncode == 2 and "COMMAND" in r.stdout


def test_info_does_not_import_tensorflow(make_dataset, small_xy):
    d = make_dataset(*small_xy)
    code = (
        "import sys; from keras_tfr.cli import main; rc = main(['info', sys.argv[1]]); "
        "assert 'tensorflow' not in sys.modules, 'tensorflow imported'; sys.exit(rc)"
    )
    r = subprocess.run([sys.executable, "-c", code, d], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "samples     34" in r.stdout and "shard-00000.tfrecord" in r.stdout


def test_verify_of_compressed_shards_prints_no_deprecation_warning(make_dataset, small_xy):
    """GZIP shards are checked record by record by TensorFlow's `tf_record_iterator`,
    which logs that it is deprecated: held back."""
    d = make_dataset(*small_xy, compression="GZIP", samples_per_record=4)
    r = run("verify", d)
    assert r.returncode == 0, r.stderr
    assert "deprecat" not in r.stderr.lower(), r.stderr
    assert "OK" in r.stdout or "ok" in r.stdout.lower(), r.stdout


def test_a_closed_stdout_ends_a_command_quietly(make_dataset, small_xy):
    """``keras-tfr info DIR | head``: the reader of stdout goes away; the command ends with
    141, as a shell reports a process ended by SIGPIPE, and prints no error."""
    d = make_dataset(*small_xy)
    code = "import sys; from keras_tfr.cli import main; sys.exit(main(['info', sys.argv[1]]))"
    read_end, write_end = os.pipe()
    os.close(read_end)  # gone before the command prints anything
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, d], stdout=write_end, stderr=subprocess.PIPE
        )
    finally:
        os.close(write_end)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "error" not in err and "Broken pipe" not in err, err


def test_info_names_the_layout(tmp_path):
    from keras_tfr import ArraysToRecords
    from keras_tfr.schema import BlockEncoder

    x = np.zeros((600, 256), np.float32)
    lat = ArraysToRecords.from_arrays(x, None, str(tmp_path / "lat"), verbose=0)
    ArraysToRecords.from_arrays(x, None, str(tmp_path / "plain"), verbose=0, lattice=False)
    plain_bytes = BlockEncoder(lat.features).fixed_layout(lat.samples_per_record)[2]
    share = (lat.record_bytes - plain_bytes) / plain_bytes
    r = run("info", str(tmp_path / "lat"))
    assert r.returncode == 0, r.stderr
    assert f"layout      lattice (period {lat.lattice.period} B; rows: x 1024 B;" in r.stdout
    assert f"padding {share:.1%})" in r.stdout
    r = run("info", str(tmp_path / "plain"))
    assert "layout      plain" in r.stdout
    assert "order       as given" in r.stdout


def test_info_lists_max_shards_rows_and_says_how_many_more(tmp_path, capsys):
    """docs/cli.md: ``--max-shards`` rows (default 50), 0 for all, then "... and K more"."""
    from keras_tfr import ArraysToRecords
    from keras_tfr.cli import main

    d = str(tmp_path / "ds")
    m = ArraysToRecords.from_arrays(
        np.arange(60 * 4, dtype=np.float32).reshape(60, 4),
        None,
        d,
        samples_per_record=1,
        min_shards=60,
        verbose=0,
    )
    names = [s.file for s in m.shards]
    assert len(names) == 60

    def rows(*flags):
        assert main(["info", d, *flags]) == 0
        out = capsys.readouterr().out
        return [n for n in names if f"  {n} " in out], out

    listed, out = rows()
    assert listed == names[:50] and "  ... and 10 more (--max-shards 0 lists all)" in out
    listed, out = rows("--max-shards", "2")
    assert listed == names[:2] and "  ... and 58 more" in out
    for flags in (("--max-shards", "0"), ("--max-shards", "60")):
        listed, out = rows(*flags)
        assert listed == names and "more" not in out
    assert main(["info", d, "--max-shards", "-1"]) == 2
    assert "`--max-shards` >= 0" in capsys.readouterr().err


@pytest.mark.slow
def _no_startup_noise(r: subprocess.CompletedProcess) -> None:
    from keras_tfr import _quiet

    noise = [ln for ln in r.stderr.splitlines() if _quiet.is_startup_noise(ln, 3)]
    assert noise == [], (r.args, r.stderr)


def test_convert_info_verify_bench(tmp_path):
    """The data commands end to end. `convert`, `verify` and `bench` import TensorFlow
    (Keras' progress bar does): its Abseil start-up lines, which `TF_CPP_MIN_LOG_LEVEL`
    does not reach, are filtered as in the examples (`keras_tfr._quiet`); the commands'
    own output stays."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 4, 2)).astype(np.float32)
    y = np.arange(300, dtype=np.int64)
    np.save(tmp_path / "x.npy", x)
    y.tofile(tmp_path / "y.bin")  # a raw memmap
    d = str(tmp_path / "ds")
    r = run(
        "convert",
        d,
        "--x",
        str(tmp_path / "x.npy"),
        "--y",
        f"{tmp_path}/y.bin:int64",
        "--record-size",
        "1KB",
    )
    assert r.returncode == 0, r.stderr
    _no_startup_noise(r)
    assert "wrote 300 samples in" in r.stdout
    assert "wrote" not in r.stderr, r.stderr  # once: the command's summary, not the log's too
    from keras_tfr import TFRecordSequenceSource

    xb, yb = next(iter(TFRecordSequenceSource(d, batch_size=300, shuffle=False)))
    assert xb.numpy().tobytes() == x.tobytes() and np.array_equal(yb.numpy(), y)

    r = run("info", d, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["total_samples"] == 300
    assert main(["verify", d, "--quiet"]) == 0  # in-process: TensorFlow is loaded here
    r = run("bench", d, "--batch-size", "64", "--json")
    assert r.returncode == 0, r.stderr
    _no_startup_noise(r)
    assert json.loads(r.stdout)["samples"] == 300  # a whole epoch, after a warm-up batch

    # Damage one shard: verify exits 1 and names it.
    shard = sorted(f for f in os.listdir(d) if f.endswith(".tfrecord"))[1]
    with open(os.path.join(d, shard), "r+b") as f:
        f.seek(30)
        f.write(b"\xff\xff\xff")
    r = run("verify", d)
    assert r.returncode == 1 and shard in r.stdout
    _no_startup_noise(r)


def test_convert_hdf5_and_npz(tmp_path, capsys):
    h5py = pytest.importorskip("h5py")
    x = np.arange(60, dtype=np.float32).reshape(20, 3)
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["g/x"] = x
    np.savez(tmp_path / "y.npz", labels=np.arange(20))
    d = str(tmp_path / "ds")
    rc = main(
        ["convert", d, "--x", f"{tmp_path}/d.h5:g/x", "--y", f"{tmp_path}/y.npz:labels", "--quiet"]
    )
    assert rc == 0
    from keras_tfr import TFRecordSequenceSource

    xb, yb = next(iter(TFRecordSequenceSource(d, batch_size=20, shuffle=False)))
    assert np.array_equal(xb.numpy(), x) and np.array_equal(yb.numpy(), np.arange(20))


@pytest.mark.parametrize(
    "args",
    [
        ["convert", "{tmp}/out", "--x", "{tmp}/missing.npy"],
        ["convert", "{tmp}/out", "--x", "{tmp}/raw.bin"],  # raw without dtype
        ["info", "{tmp}/nothing"],
        ["verify", "{tmp}/nothing"],
        ["bench", "{tmp}/nothing"],
        ["convert-tfrecords", "{tmp}/none-*.tfrecord", "{tmp}/out"],
        ["info"],
    ],
)
def test_bad_input_exits_2_with_a_message(tmp_path, args, capsys):
    (tmp_path / "raw.bin").write_bytes(b"\0" * 16)
    try:
        rc = main([a.format(tmp=tmp_path) for a in args])
    except SystemExit as e:  # argparse's own usage errors
        rc = e.code
    assert rc == 2
    assert "error" in capsys.readouterr().err
    assert not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.parametrize("shape", ["-8", "0", "4,0"])
def test_a_raw_spec_with_a_dimension_below_1_names_the_spec(tmp_path, capsys, shape):
    (tmp_path / "raw.bin").write_bytes(b"\0" * 64)
    spec = f"{tmp_path}/raw.bin:float32:{shape}"
    assert main(["convert", str(tmp_path / "out"), "--x", spec]) == 2
    err = capsys.readouterr().err
    assert f"{spec!r}: bad shape {shape!r}: every dimension must be a positive int" in err
    assert not (tmp_path / "out").exists()


def test_bad_input_exit_code_in_a_subprocess(tmp_path):
    r = run("convert", str(tmp_path / "out"), "--x", str(tmp_path / "missing.npy"))
    assert r.returncode == 2 and "missing.npy" in r.stderr


@pytest.mark.slow
def test_convert_tfrecords_command(tmp_path):
    import tensorflow as tf

    os.makedirs(tmp_path / "old")
    images = np.random.default_rng(0).standard_normal((10, 3, 3)).astype(np.float32)
    with tf.io.TFRecordWriter(str(tmp_path / "old" / "a.tfrecord")) as w:
        for i, im in enumerate(images):
            f = {
                "image": tf.train.Feature(
                    bytes_list=tf.train.BytesList(value=[tf.io.serialize_tensor(im).numpy()])
                ),
                "label": tf.train.Feature(float_list=tf.train.FloatList(value=[float(i)])),
            }
            w.write(tf.train.Example(features=tf.train.Features(feature=f)).SerializeToString())
    d = str(tmp_path / "new")
    r = run(
        "convert-tfrecords",
        str(tmp_path / "old" / "*.tfrecord"),
        d,
        "--y",
        "label",
        "--feature",
        "image=tensor:float32:3,3",
        "--feature",
        "label=float32",
        "--quiet",
    )
    assert r.returncode == 0, r.stderr
    assert "wrote 10 samples" in r.stdout
    r = run("verify", d, "--quiet")
    assert r.returncode == 0


def _subparsers():
    import argparse

    from keras_tfr.cli import build_parser

    (action,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def test_bench_times_whole_epochs_after_a_warm_up_batch(make_dataset, small_xy, capsys):
    """docs/cli.md: a warm-up iterator reads one batch untimed; then every epoch is timed
    whole, from its first batch (where a shuffle buffer fills: timing epochs from their
    second batch overstated the rate of small data sets many times over)."""
    d = make_dataset(*small_xy)  # 34 samples
    for epochs, timed in (("1", 34), ("3", 3 * 34)):
        assert main(["bench", d, "--batch-size", "8", "--epochs", epochs, "--json"]) == 0
        result = json.loads(capsys.readouterr().out)
        assert (result["samples"], result["warmup_samples"]) == (timed, 8)
    help_text = " ".join(_subparsers()["bench"].format_help().split())
    assert "warm-up" in help_text and "not timed" in help_text
    assert "every epoch is timed whole" in help_text
    assert main(["bench", d, "--batch-size", "64", "--json"]) == 0  # one batch an epoch
    result = json.loads(capsys.readouterr().out)
    assert (result["samples"], result["warmup_samples"]) == (34, 34)


def test_cli_doc_lists_every_subcommand_with_its_real_options():
    import re
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "cli.md").read_text()
    parsers = _subparsers()
    rows = re.findall(r"^\| `keras-tfr ([a-z-]+)([^`]*)` \|", doc, flags=re.M)
    assert sorted(name for name, _ in rows) == sorted(parsers)
    convert_extra = re.search(r"`convert` also takes (.*?)\.\n\n", doc, flags=re.S).group(1)
    for name, usage in [*rows, ("convert", convert_extra)]:
        options = set(parsers[name]._option_string_actions)
        for flag in re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", usage):
            assert flag in options, f"docs/cli.md: `{name} {flag}` is no option of {name}"
    for name, parser in parsers.items():  # every long option is in the doc
        for option in parser._option_string_actions:
            if option.startswith("--") and option != "--help":
                pattern = rf"(?<![\w-]){re.escape(option)}(?![\w-])"
                assert re.search(pattern, doc), f"docs/cli.md does not show `{name} {option}`"
    defaults = {
        ("convert", "min_shards"): 8,
        ("tune", "workers"): 2,
        ("serve", "workers"): 2,
        ("serve", "port"): 5050,
    }
    for (name, dest), value in defaults.items():
        assert parsers[name].get_default(dest) == value, (name, dest)


def test_the_table_is_the_parser_and_help_loads_no_framework():
    from keras_tfr.cli import SUBCOMMANDS

    assert list(_subparsers()) == list(SUBCOMMANDS)
    code = (
        "import contextlib, io, sys\n"
        "from keras_tfr.cli import SUBCOMMANDS, main\n"
        "for argv in [['--help']] + [[name, '--help'] for name in SUBCOMMANDS]:\n"
        "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "        try:\n"
        "            main(argv)\n"
        "        except SystemExit as e:\n"
        "            assert e.code == 0, (argv, e.code)\n"
        "    assert 'usage: keras-tfr' in out.getvalue(), argv\n"
        "print(sorted(m for m in ('tensorflow', 'keras', 'keras_tuner', 'jax') "
        "if m in sys.modules))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERAS_TFR_GPU")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "command, stopped_in",
    [
        (["info", "{d}"], "keras_tfr.manifest.Manifest.load"),
        (["verify", "{d}"], "keras_tfr.verifier.verify"),
        (["bench", "{d}", "--batch-size", "8"], "keras_tfr.source.TFRecordSequenceSource"),
        (
            ["convert-tfrecords", "{d}/*.tfrecord", "{d}/new"],
            "keras_tfr.tfrecords.convert_tfrecords",
        ),
    ],
    ids=lambda v: v[0] if isinstance(v, list) else None,
)
def test_data_commands_stop_on_sigterm_as_on_ctrl_c(
    tmp_path, monkeypatch, capsys, command, stopped_in
):
    """docs/cli.md: `convert-tfrecords`, `verify`, `bench` and `info` take SIGTERM as they
    take Ctrl-C: status 143 and one line, no traceback. The SIGTERM comes while each
    command works (this process sends it to itself)."""
    import signal
    import time

    def terminated_here(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the command's handler raises in here
        raise AssertionError("no SIGTERM came")

    def not_ours(signum, frame):
        raise AssertionError("the SIGTERM reached the test's handler, not the command's")

    monkeypatch.setattr(stopped_in, terminated_here)
    previous = signal.signal(signal.SIGTERM, not_ours)
    try:
        code = main([part.format(d=tmp_path) for part in command])
    finally:
        signal.signal(signal.SIGTERM, previous)
    err = capsys.readouterr().err
    assert code == 143 and err.strip().endswith("keras-tfr: terminated (SIGTERM)"), err
    assert "Traceback" not in err
