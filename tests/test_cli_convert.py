"""What docs/cli.md promises of `convert`, `convert-tfrecords --feature`, `bench
--no-shuffle` and `serve`: each claim run through the command line."""

from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from _serve import free_ports, serving

from keras_tfr.cli import data, main
from keras_tfr.manifest import MANIFEST_NAME, PROGRESS_NAME, Manifest

EXE = os.path.join(os.path.dirname(sys.executable), "keras-tfr")


def _bits(a) -> tuple[str, tuple, bytes]:
    a = np.asarray(a)
    return a.dtype.str, a.shape, a.tobytes()


def _read_all(directory, **kwargs):
    """Every batch of ``directory`` in written order, concatenated per part."""
    from keras_tfr import TFRecordSequenceSource

    batches = list(TFRecordSequenceSource(directory, batch_size=16, shuffle=False, **kwargs))

    def cat(parts):
        if isinstance(parts[0], dict):
            return {k: cat([p[k] for p in parts]) for k in parts[0]}
        if hasattr(parts[0], "flat_values"):  # tf.RaggedTensor: one list per sample
            return [sample for p in parts for sample in p.to_list()]
        return np.concatenate([p.numpy() for p in parts])

    if isinstance(batches[0], tuple):
        return tuple(cat(list(part)) for part in zip(*batches))
    return cat(batches)


@pytest.fixture
def arrays(tmp_path):
    """Two named inputs, targets and weights, saved as .npy files in ``tmp_path``."""
    rng = np.random.default_rng(5)
    out = {
        "image": rng.integers(0, 256, size=(37, 4, 3), dtype=np.uint8),
        "meta": rng.standard_normal((37, 6)).astype(np.float32),
        "y": np.arange(37, dtype=np.int64) * 3,
        "w": rng.random(37).astype(np.float32),
    }
    out["meta"][0, :3] = [-0.0, np.inf, np.nan]  # bit for bit, not merely equal
    for name, a in out.items():
        np.save(tmp_path / f"{name}.npy", a)
    return out


# ------------------------------------------------------------------------ convert


def test_convert_named_inputs_and_sample_weight_bit_for_bit(tmp_path, arrays, monkeypatch, capsys):
    from keras_tfr.write.arrays_to_records import ArraysToRecords

    given = {}
    real = ArraysToRecords.from_arrays

    def spy(x, y, directory, **kwargs):
        given.update(x=x, y=y, sample_weight=kwargs["sample_weight"])
        return real(x, y, directory, **kwargs)

    monkeypatch.setattr(ArraysToRecords, "from_arrays", staticmethod(spy))
    d = str(tmp_path / "ds")
    rc = main(
        [
            "convert",
            d,
            "--x",
            f"image={tmp_path / 'image.npy'}",
            "--x",
            f"meta={tmp_path / 'meta.npy'}",
            "--y",
            str(tmp_path / "y.npy"),
            "--sample-weight",
            str(tmp_path / "w.npy"),
            "--quiet",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    assert "wrote 37 samples" in capsys.readouterr().out

    # `.npy` inputs are memory-mapped, read chunk by chunk, never loaded whole.
    loaded = [*given["x"].values(), given["y"], given["sample_weight"]]
    assert all(isinstance(a, np.memmap) and a.mode == "r" for a in loaded), loaded

    m = Manifest.load(d)
    assert set(m.structure) == {"x", "y", "sample_weight"} and m.structure["x"] == "dict"
    assert {(f.role, f.name) for f in m.features} == {
        ("x", "image"),
        ("x", "meta"),
        ("y", ""),
        ("sample_weight", ""),
    }
    x, y, w = _read_all(d)
    assert set(x) == {"image", "meta"}
    for name in ("image", "meta"):
        assert _bits(x[name]) == _bits(arrays[name]), name
    assert _bits(y) == _bits(arrays["y"])
    assert _bits(w) == _bits(arrays["w"])


def test_convert_reads_files_whose_names_hold_a_colon_or_an_equals_sign(tmp_path, arrays, capsys):
    """``with:colon.npy`` was read as ``with`` + ``:colon.npy``, ``a=b.npy`` as NAME=SPEC:
    a SPEC is first the longest existing file name before a ``:``."""
    import shutil

    odd = tmp_path / "odd dir"
    odd.mkdir()
    for name in ("with:colon.npy", "a=b.npy"):
        shutil.copy(tmp_path / "meta.npy", odd / name)
    raw = odd / "raw:1.bin"
    arrays["meta"].tofile(raw)
    for i, spec in enumerate(
        [
            str(odd / "with:colon.npy"),
            str(odd / "a=b.npy"),
            f"{raw}:float32:6",
            "m=" + str(odd / "a=b.npy"),
        ]
    ):
        d = str(tmp_path / f"ds{i}")
        assert main(["convert", d, "--x", spec, "--y", str(tmp_path / "y.npy"), "--quiet"]) == 0, (
            spec,
            capsys.readouterr().err,
        )
        x, y = _read_all(d)
        x = x["m"] if isinstance(x, dict) else x
        assert _bits(x) == _bits(arrays["meta"]) and _bits(y) == _bits(arrays["y"]), spec
    assert main(["convert", str(tmp_path / "no"), "--x", str(odd / "no:such.npy"), "--quiet"]) == 2
    assert f"{str(odd / 'no')!r} does not exist" in capsys.readouterr().err


def test_convert_refuses_a_name_given_twice(tmp_path, arrays, capsys):
    """``--x img=a.npy --x img=b.npy`` would keep one array of the two: a usage error."""
    d = str(tmp_path / "ds")
    image, meta = (f"img={tmp_path / n}.npy" for n in ("image", "meta"))
    assert main(["convert", d, "--x", image, "--x", meta, "--quiet"]) == 2
    assert "the name 'img' is given twice" in capsys.readouterr().err
    assert not os.path.exists(d)


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--shard-size", "0"], "Expected `--shard-size` to be a positive size"),
        (["--min-shards", "0"], "Expected `--min-shards` to be a positive int"),
        (["--record-size", "-1"], "`--record-size`"),
        (["--sample-weight", "W"], "Expected `--y` with `--sample-weight`"),
        # Shards too small for one sample: the size is named by its flag, not `shard_size=`.
        (["--shard-size", "20"], "Received: --shard-size 20 bytes."),
    ],
)
def test_convert_errors_name_the_flags(tmp_path, arrays, capsys, flags, said):
    d = str(tmp_path / "ds")
    flags = [str(tmp_path / "w.npy") if f == "W" else f for f in flags]
    assert main(["convert", d, "--x", str(tmp_path / "image.npy"), *flags, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert said in err, err
    assert "shard_size" not in err and "min_shards" not in err and "record_size" not in err
    assert not os.path.exists(d)


def test_convert_gzip_shards_are_gzip_and_read_back_bit_for_bit(tmp_path, arrays, capsys):
    x, y = str(tmp_path / "meta.npy"), str(tmp_path / "y.npy")
    plain, packed = str(tmp_path / "plain"), str(tmp_path / "gzip")
    assert main(["convert", plain, "--x", x, "--y", y, "--quiet"]) == 0
    assert main(["convert", packed, "--x", x, "--y", y, "--compression", "GZIP", "--quiet"]) == 0
    m = Manifest.load(packed)
    assert m.compression == "GZIP"
    assert Manifest.load(plain).compression is None
    for shard in m.shards:
        raw = Path(packed, shard.file).read_bytes()
        assert raw[:2] == b"\x1f\x8b", f"{shard.file} is not gzip"
        assert len(gzip.decompress(raw)) > len(raw)  # one whole gzip stream
    got_x, got_y = _read_all(packed)
    assert _bits(got_x) == _bits(arrays["meta"]) and _bits(got_y) == _bits(arrays["y"])


def test_convert_into_a_data_set_needs_overwrite_and_says_the_flag(tmp_path, arrays, capsys):
    d = str(tmp_path / "ds")
    assert main(["convert", d, "--x", str(tmp_path / "meta.npy"), "--quiet"]) == 0
    capsys.readouterr()
    # A second conversion into it: refused as bad input (2), the old data set intact.
    before = Path(d, MANIFEST_NAME).read_bytes()
    assert main(["convert", d, "--x", str(tmp_path / "image.npy"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "already holds a keras-tfr data set" in err
    assert "`--overwrite`" in err and "overwrite=True" not in err, err
    assert Path(d, MANIFEST_NAME).read_bytes() == before
    # `--resume` after a conversion that finished (a Ctrl-C at its very end): said so.
    assert main(["convert", d, "--x", str(tmp_path / "meta.npy"), "--resume", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "complete keras-tfr data set" in err and "nothing to resume" in err, err
    assert "`--overwrite`" in err and Path(d, MANIFEST_NAME).read_bytes() == before

    rc = main(["convert", d, "--x", str(tmp_path / "image.npy"), "--overwrite", "--quiet"])
    assert rc == 0, capsys.readouterr().err
    assert _bits(_read_all(d)) == _bits(arrays["image"])

    # Both flags at once: bad usage, said in flags.
    assert main(["convert", d, "--x", str(tmp_path / "image.npy"), "--overwrite", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--overwrite and --resume" in err and "=True" not in err, err


class _Interrupting:
    """An input whose second read is a Ctrl-C: the conversion stops after its first chunk."""

    def __init__(self, a):
        self.a, self.shape, self.dtype, self.reads = a, a.shape, a.dtype, 0

    def __len__(self):
        return len(self.a)

    def __getitem__(self, index):
        self.reads += 1
        if self.reads > 1:
            raise KeyboardInterrupt
        return self.a[index]


def test_convert_resume_continues_an_interrupted_conversion(tmp_path, monkeypatch, capsys):
    # 24 MB: more than one 16 MB chunk, so the interruption leaves complete shards.
    x = np.random.default_rng(1).standard_normal((24000, 256)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", np.arange(24000, dtype=np.int64))
    args = ["--x", str(tmp_path / "x.npy"), "--y", str(tmp_path / "y.npy"), "--quiet"]
    d = str(tmp_path / "ds")

    real = data.load_array
    monkeypatch.setattr(
        data,
        "load_array",
        lambda spec: _Interrupting(real(spec)) if spec.endswith("x.npy") else real(spec),
    )
    assert main(["convert", d, *args]) == 130
    assert capsys.readouterr().err.strip() == (
        f"keras-tfr: interrupted; the complete shards in {d} are kept: run the same command "
        "with --resume"
    )
    monkeypatch.setattr(data, "load_array", real)
    assert not os.path.exists(os.path.join(d, MANIFEST_NAME))
    done = json.loads(Path(d, PROGRESS_NAME).read_text())["shards"]
    assert len(done) >= 2, "interrupted before any shard was complete"
    kept = {s["file"]: os.stat(os.path.join(d, s["file"])) for s in done}
    capsys.readouterr()

    # Without --resume: refused, and told the flag (not the Python argument).
    assert main(["convert", d, *args]) == 2
    err = capsys.readouterr().err
    assert "unfinished conversion" in err and "`--resume`" in err and "`--overwrite`" in err
    assert "=True" not in err, err
    # The readers say it in the commands' words too.
    assert main(["info", d]) == 2
    err = capsys.readouterr().err
    assert "incomplete data set" in err and "`keras-tfr convert ... --resume`" in err, err
    assert "`--overwrite`" in err and "`overwrite=True`" not in err, err

    assert main(["convert", d, *args, "--resume"]) == 0, capsys.readouterr().err
    for name, st in kept.items():  # the complete shards were kept, not rewritten
        now = os.stat(os.path.join(d, name))
        assert (now.st_ino, now.st_mtime_ns) == (st.st_ino, st.st_mtime_ns), name
    ref = str(tmp_path / "ref")
    assert main(["convert", ref, *args]) == 0
    for shard in Manifest.load(ref).shards:
        assert Path(d, shard.file).read_bytes() == Path(ref, shard.file).read_bytes()
    got_x, got_y = _read_all(d)
    assert _bits(got_x) == _bits(x) and np.array_equal(got_y, np.arange(24000))


_SLOW_CONVERT = """
import faulthandler, signal, sys, time
from keras_tfr.cli import data, main

faulthandler.register(signal.SIGUSR1, all_threads=True)  # the stacks, should it hang

real = data.load_array


class Slow:  # an input read slowly (a network disk): the test has time to stop it
    def __init__(self, a):
        self.a, self.shape, self.dtype = a, a.shape, a.dtype
    def __len__(self):
        return len(self.a)
    def __getitem__(self, index):
        time.sleep(0.2)
        return self.a[index]


data.load_array = lambda spec: Slow(real(spec))
sys.exit(main(["convert", *sys.argv[1:]]))
"""


@pytest.mark.subprocess
def test_convert_stops_on_sigterm_as_on_ctrl_c_and_resumes(tmp_path, capsys):
    """docs/cli.md: SIGTERM (a preempted job) ends `convert` with 143, its complete shards
    and journal kept and no lock or partial shard left; ``--resume`` finishes it. It used
    to die by the signal, leaving the lock and the shard it was writing."""
    x = np.random.default_rng(2).standard_normal((4000, 64)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    d, ref = str(tmp_path / "ds"), str(tmp_path / "ref")
    args = ["--x", str(tmp_path / "x.npy"), "--shard-size", "64KB", "--quiet"]
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_CONVERT, d, *args, "--record-size", "16KB"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (
            Path(d, PROGRESS_NAME).exists()
            and json.loads(Path(d, PROGRESS_NAME).read_text())["shards"]
        ):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no shard was completed"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)
            time.sleep(2)
            proc.kill()
            pytest.fail(f"convert did not end after SIGTERM; its threads:\n{proc.communicate()[1]}")
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-2000:]
    assert err.strip().endswith(
        f"keras-tfr: terminated (SIGTERM); the complete shards in {d} are kept: run the same "
        "command with --resume"
    ), err[-2000:]
    left = sorted(os.listdir(d))
    assert MANIFEST_NAME not in left and ".keras-tfr.lock" not in left, left
    assert not [n for n in left if n.endswith(".tmp")], left
    kept = json.loads(Path(d, PROGRESS_NAME).read_text())["shards"]
    assert [n for n in left if n.startswith("shard-")] == [s["file"] for s in kept]
    assert main(["convert", d, *args, "--record-size", "16KB", "--resume"]) == 0
    assert main(["convert", ref, *args, "--record-size", "16KB"]) == 0
    for shard in Manifest.load(ref).shards:
        assert Path(d, shard.file).read_bytes() == Path(ref, shard.file).read_bytes()
    assert _bits(_read_all(d)) == _bits(x)


def test_convert_memory_maps_npy_and_raw_inputs(tmp_path, monkeypatch):
    """`x.npy` (memory-mapped): `np.load` is asked for a read-only memmap."""
    a = np.arange(60, dtype=np.float32).reshape(20, 3)
    np.save(tmp_path / "a.npy", a)
    a.tofile(tmp_path / "a.bin")
    calls = []
    real = np.load

    def load(*args, **kwargs):
        calls.append(kwargs.get("mmap_mode"))
        return real(*args, **kwargs)

    monkeypatch.setattr(np, "load", load)
    got = data.load_array(str(tmp_path / "a.npy"))
    assert calls == ["r"] and isinstance(got, np.memmap) and _bits(got) == _bits(a)
    raw = data.load_array(f"{tmp_path / 'a.bin'}:float32:3")
    assert isinstance(raw, np.memmap) and raw.mode == "r" and _bits(raw) == _bits(a)


# -------------------------------------------------------------- convert-tfrecords


def _feature(kind, value):
    import tensorflow as tf

    if kind == "int":
        return tf.train.Feature(int64_list=tf.train.Int64List(value=list(value)))
    if kind == "float":
        return tf.train.Feature(float_list=tf.train.FloatList(value=list(value)))
    return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))


def _values(spec, n, rng):
    """``n`` samples for a feature of ``spec``: (their Example features, the values)."""
    import tensorflow as tf

    if spec == "int64:var":
        v = [rng.integers(-99, 99, size=i % 4).astype(np.int64) for i in range(n)]
        return [_feature("int", s) for s in v], v
    if spec == "bytes":
        v = [bytes(rng.integers(0, 256, size=i + 1, dtype=np.uint8)) for i in range(n)]
        return [_feature("bytes", s) for s in v], v
    if spec == "float32:3":
        v = rng.standard_normal((n, 3)).astype(np.float32)
        return [_feature("float", s) for s in v], v
    if spec == "int64:2,2":
        v = rng.integers(-9, 9, size=(n, 2, 2)).astype(np.int64)
        return [_feature("int", s.ravel()) for s in v], v
    assert spec == "tensor:float32"
    v = rng.standard_normal((n, 2, 5)).astype(np.float32)
    return [_feature("bytes", tf.io.serialize_tensor(s).numpy()) for s in v], v


@pytest.mark.parametrize("spec", ["int64:var", "bytes", "float32:3", "int64:2,2", "tensor:float32"])
def test_convert_tfrecords_feature_specs(tmp_path, spec, capsys):
    import tensorflow as tf

    n = 11
    features, expected = _values(spec, n, np.random.default_rng(2))
    src = str(tmp_path / "old.tfrecord")
    with tf.io.TFRecordWriter(src) as w:
        for i in range(n):
            f = {"f": features[i], "label": _feature("float", [float(i)])}
            w.write(tf.train.Example(features=tf.train.Features(feature=f)).SerializeToString())
    d = str(tmp_path / "new")
    argv = ["convert-tfrecords", src, d, "--x", "f", "--y", "label", "--quiet"]
    rc = main([*argv, "--feature", f"f={spec}", "--feature", "label=float32"])
    assert rc == 0, capsys.readouterr().err
    assert "wrote 11 samples" in capsys.readouterr().out

    (feature,) = [f for f in Manifest.load(d).features if f.role == "x"]
    kind = {"int64:var": "ragged", "bytes": "bytes"}.get(spec, "fixed")
    assert getattr(feature, "kind", "fixed") == kind
    if kind == "fixed":
        assert (feature.dtype, feature.shape) == (expected.dtype.name, expected.shape[1:])
    x, y = _read_all(d, ragged="ragged")
    assert np.array_equal(y, np.arange(n, dtype=np.float32))
    if spec == "int64:var":
        assert x == [s.tolist() for s in expected]
    elif spec == "bytes":
        assert x.tolist() == expected
    else:
        assert _bits(x) == _bits(expected)


# -------------------------------------------------------------------------- bench


def test_bench_no_shuffle_reads_in_written_order(make_dataset, monkeypatch, capsys):
    import keras_tfr.source

    n = 45
    d = make_dataset(np.zeros((n, 2), np.float32), np.arange(n, dtype=np.int64))
    made = []

    class Recording(keras_tfr.source.TFRecordSequenceSource):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.kwargs, self.ys = kwargs, []
            made.append(self)

        def __iter__(self):
            for batch in super().__iter__():
                self.ys.extend(batch[1].numpy().tolist())
                yield batch

    monkeypatch.setattr(keras_tfr.source, "TFRecordSequenceSource", Recording)
    assert main(["bench", d, "--no-shuffle", "--batch-size", "8", "--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert "in order" in out and f"{2 * n} samples" in out, out
    assert made[-1].kwargs["shuffle"] is False
    # The warm-up iterator's batch, then two whole epochs.
    assert made[-1].ys == list(range(8)) + list(range(n)) * 2

    assert main(["bench", d, "--batch-size", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["shuffle"] is True and made[-1].kwargs["shuffle"] is True
    timed = made[-1].ys[8:]
    assert timed != list(range(n)) and sorted(timed) == list(range(n))
    assert made[-1].ys[:8] == timed[:8], "the warm-up read the first epoch's first batch"
    assert main(["bench", d, "--no-shuffle", "--batch-size", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["shuffle"] is False


# -------------------------------------------------------------------------- serve


def _serving(*args):
    """``keras-tfr serve ARGS``, up to its "serving" line (`_serve.serving`)."""
    cmd = [EXE] if os.path.exists(EXE) else [sys.executable, "-m", "keras_tfr.cli"]
    return serving([*cmd, "serve", *args])


def _terminate(proc) -> str:
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)  # `serve` waits at most 10 s for the servers
    assert proc.returncode == 0, err[-2000:]
    assert out.splitlines()[-1] == "stopped", out
    return out


@pytest.mark.subprocess
def test_serve_stops_on_sigterm_with_exit_0():
    with _serving("--workers", "1", "--port", "0") as (proc, lines):
        assert lines[0].startswith("dispatcher: grpc://localhost:"), lines
        assert sum(line.startswith("worker: localhost:") for line in lines) == 1, lines
        _terminate(proc)


@pytest.mark.subprocess
def test_serve_dispatcher_starts_only_workers_that_join_it(make_dataset):
    from keras_tfr import TFRecordSequenceSource
    from keras_tfr.distribute import start_service

    n = 40
    x = np.repeat(np.arange(n, dtype=np.float32)[:, None], 3, axis=1)
    d = make_dataset(x, np.arange(n, dtype=np.int64), samples_per_record=4)
    cluster = start_service(0, port=0)  # a dispatcher alone, in this process
    try:
        ports = free_ports(2)
        address = cluster.target.split("://", 1)[1]
        args = ["--workers", "2", "--dispatcher", address, "--host", "127.0.0.1"]
        with _serving(*args, "--worker-ports", *map(str, ports)) as (proc, lines):
            # Only workers: no dispatcher of its own, no address to read from.
            assert lines == [*(f"worker: 127.0.0.1:{p}" for p in ports), lines[-1]], lines
            # Both joined: each sends its own epoch to a reader of the dispatcher, which
            # has no worker of its own.
            source = TFRecordSequenceSource(
                d, batch_size=8, service=cluster.target, service_mode="parallel_epochs"
            )
            ids = [i for _, yb in source for i in yb.numpy().tolist()]
            assert sorted(ids) == sorted(list(range(n)) * 2)
            _terminate(proc)
    finally:
        stopper = threading.Thread(target=cluster.stop, daemon=True)
        stopper.start()
        stopper.join(10)


def test_convert_tfrecords_into_a_data_set_says_the_flag(tmp_path, capsys):
    import tensorflow as tf

    path = str(tmp_path / "in.tfrecord")
    with tf.io.TFRecordWriter(path) as w:
        for i in range(5):
            feature = {"x": tf.train.Feature(float_list=tf.train.FloatList(value=[i, i]))}
            w.write(
                tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()
            )
    d = str(tmp_path / "ds")
    args = ["convert-tfrecords", path, d, "--feature", "x=float32:2", "--quiet"]
    assert main(args) == 0
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "`--overwrite`" in err and "overwrite=True" not in err, err
    assert main([*args, "--overwrite"]) == 0


def test_convert_shuffle_seed_writes_the_seeded_order_and_resume_names_the_flag(
    tmp_path, arrays, capsys
):
    from keras_tfr.read.order import WRITE_ORDER, Permutation

    d = str(tmp_path / "ds")
    base = ["convert", d, "--x", str(tmp_path / "meta.npy"), "--y", str(tmp_path / "y.npy")]
    assert main([*base, "--shuffle-seed", "4", "--quiet"]) == 0, capsys.readouterr().err
    assert Manifest.load(d).shuffle_seed == 4
    capsys.readouterr()
    assert main(["info", d]) == 0
    assert "order       shuffled when written (shuffle_seed=4)" in capsys.readouterr().out
    x, y = _read_all(d)
    perm = Permutation(37, key=(4, WRITE_ORDER))(np.arange(37))
    assert _bits(x) == _bits(arrays["meta"][perm]) and _bits(y) == _bits(arrays["y"][perm])
    assert main([*base, "--shuffle-seed", "-1", "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "`--shuffle-seed`" in err and "shuffle_seed" not in err, err
    # An unfinished conversion begun with --shuffle-seed 4, resumed without it: refused,
    # naming the flag to give (the message's Python arguments become the flags).
    unfinished = str(tmp_path / "unfinished")

    class Failing:  # an input whose reads fail after one chunk (the disk went away)
        def __init__(self, a):
            self.a, self.shape, self.dtype, self.reads = a, a.shape, a.dtype, 0

        def __getitem__(self, index):
            self.reads += 1
            if self.reads > 1:
                raise OSError("disk went away")
            return self.a[index]

    from keras_tfr import ArraysToRecords

    layout = dict(samples_per_record=2, shard_size=300, chunk_size="1KB", verbose=0)
    with pytest.raises(OSError, match="disk went away"):
        ArraysToRecords.from_arrays(
            Failing(arrays["meta"]), arrays["y"], unfinished, shuffle_seed=4, **layout
        )
    assert os.path.exists(os.path.join(unfinished, PROGRESS_NAME))
    assert main(["convert", unfinished, *base[2:], "--resume"]) == 2
    err = capsys.readouterr().err
    assert "was begun with --shuffle-seed 4" in err and "Resume it with --shuffle-seed 4" in err
    assert "shuffle_seed" not in err.replace(unfinished, "DIR"), err
    assert "Received: no --shuffle-seed" in err, err


def test_serve_refuses_a_port_in_use_and_bad_ports_or_duration(capsys):
    """A port another program listens on (TensorFlow's gRPC servers would share it with
    `SO_REUSEPORT`, trainers then reaching one or the other), a port out of range (it
    was taken modulo 65536) and a duration that is not positive: exit 2, nothing
    started."""
    listener = socket.socket()
    listener.bind(("0.0.0.0", 0))
    listener.listen()
    busy = listener.getsockname()[1]
    try:
        for args, said in (
            (["--port", str(busy)], f"Port {busy} is already in use"),
            (["--workers", "1", "--port", "0", "--worker-ports", str(busy)], f"Port {busy}"),
            (["--port", "99999"], "Expected `--port` to be a TCP port (1-65535"),
            (["--workers", "1", "--worker-ports", "70000"], "`--worker-ports` to be a TCP"),
            (["--duration", "-1"], "--duration must be > 0 seconds"),
        ):
            assert main(["serve", "--workers", "0", *args]) == 2, args
            out = capsys.readouterr()
            assert said in out.err and "dispatcher:" not in out.out, (args, out)
    finally:
        listener.close()


def test_ctrl_c_while_tensorflow_loads_is_one_line_and_130(make_dataset, monkeypatch, capsys):
    """docs/cli.md: 130 after Ctrl-C. Importing TensorFlow takes seconds, so a Ctrl-C
    often lands there: "keras-tfr: interrupted", not a traceback of the import."""
    from keras_tfr import _quiet

    def interrupted():
        raise KeyboardInterrupt

    d = make_dataset(np.zeros((8, 2), np.float32), None)
    monkeypatch.delitem(sys.modules, "tensorflow")  # restored after the test
    monkeypatch.setattr(_quiet, "import_tensorflow_quietly", interrupted)
    assert main(["verify", d]) == 130
    assert capsys.readouterr().err.strip() == "keras-tfr: interrupted"


def test_errors_name_the_flags_of_every_command(tmp_path, capsys):
    """docs/cli.md: errors name the commands' flags, not the Python arguments."""
    script = tmp_path / "s.py"
    script.write_text("print(1)\n")
    for argv, flag in (
        (["parallel", "-n", "0", "--", "true"], "`--num-processes`"),
        (["parallel", "-n", "2", "--gpu-memory-fraction", "1.5", "--", "true"], "`--gpu"),
        (["tune", "--workers", "0", str(script)], "`--workers`"),
        (["tune", "--port", "70000", str(script)], "`--port`"),
        (["tune", "--timeout", "-1", str(script)], "`--timeout`"),
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert flag in err, (argv, err)
        for python_name in ("`n`", "`workers`", "`port`", "`timeout`", "`gpu_memory"):
            assert python_name not in err, (argv, err)


@pytest.mark.subprocess
def test_serve_gives_up_on_a_dispatcher_that_does_not_answer():
    """TensorFlow's workers wait for their dispatcher in a call that neither Ctrl-C nor
    ``--duration`` stops: ``serve`` starts them only once it answers, and ends with
    status 1 when ``--duration`` passes first."""
    (port,) = free_ports(1)  # nothing listens there
    cmd = [EXE] if os.path.exists(EXE) else [sys.executable, "-m", "keras_tfr.cli"]
    proc = subprocess.run(
        [*cmd, "serve", "--dispatcher", f"127.0.0.1:{port}", "--duration", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"the dispatcher at 127.0.0.1:{port} did not answer; no worker" in proc.stderr
    assert "worker:" not in proc.stdout


@pytest.mark.subprocess
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_serve_waiting_for_its_dispatcher_says_so_and_stops_on_a_signal_with_status_1(sig):
    """docs/cli.md: ``--dispatcher`` says it is waiting (after 10 s; 0.1 s here), and
    Ctrl-C or SIGTERM then end it with status 1 and no worker started."""
    from keras_tfr.cli import serve

    assert serve._WAIT_NOTICE_SECONDS == 10 and serve._STOP_SECONDS == 10  # as documented
    (port,) = free_ports(1)  # nothing listens there
    code = (
        "import sys\nfrom keras_tfr.cli import main, serve\nserve._WAIT_NOTICE_SECONDS = 0.1\n"
        f"sys.exit(main(['serve', '--dispatcher', '127.0.0.1:{port}']))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = proc.stderr.readline()
        assert line.strip() == f"waiting for the dispatcher at 127.0.0.1:{port}...", line
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1, err[-2000:]
    assert f"the dispatcher at 127.0.0.1:{port} did not answer; no worker was started" in err
    assert "worker:" not in out


def test_convert_tfrecords_errors_name_the_command_line(tmp_path, capsys):
    import tensorflow as tf

    path = str(tmp_path / "in.tfrecord")
    with tf.io.TFRecordWriter(path) as w:
        for i in range(5):
            feature = {
                "x": tf.train.Feature(float_list=tf.train.FloatList(value=[i, i])),
                "label": tf.train.Feature(float_list=tf.train.FloatList(value=[i])),
            }
            w.write(
                tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()
            )
    d = str(tmp_path / "ds")
    cases = [
        ([str(tmp_path / "nope.tfrecord"), d], "SRC '"),
        ([path, d, "--feature", "x=float32:2", "--y", "label"], "'label' has no --feature"),
        ([path, d, "--feature", "x=int64:2"], "with the given --feature (Name: <unknown>"),
        # Features inferred (no --feature): the name is not one of the files'.
        ([path, d, "--y", "nolabel"], "`--y` to name a feature of the files. Received: "),
    ]
    for args, said in cases:
        assert main(["convert-tfrecords", *args, "--quiet"]) == 2
        err = capsys.readouterr().err
        assert said in err, err
        for python in ("paths_or_glob", "`features`", "features=", "{{", "[[", "Op:"):
            assert python not in err, (python, err)
    assert not os.path.exists(d)
