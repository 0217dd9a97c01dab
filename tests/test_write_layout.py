"""The writer's package layout: one home for the options, a core without Keras, the
framing imported from `keras_tfr.format.framing`."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

from keras_tfr import ArraysToRecords
from keras_tfr.format import framing
from keras_tfr.manifest import Manifest
from keras_tfr.write.options import WriteOptions
from keras_tfr.write.writer import RecordWriter


@pytest.mark.subprocess
def test_core_writer_imports_no_keras(tmp_path):
    code = (
        "import sys, numpy as np\n"
        "from keras_tfr.write.writer import RecordWriter\n"
        "from keras_tfr.write.options import WriteOptions\n"
        f"with RecordWriter({str(tmp_path / 'ds')!r}, WriteOptions(verbose=1)) as w:\n"
        "    w.write(np.arange(12, dtype=np.float32).reshape(6, 2))\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('keras', 'tensorflow')]\n"
        "print(heavy, w.manifest.total_samples)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.split() == ["[]", "6"]


def test_options_are_normalized_once_and_replace_checks_again():
    o = WriteOptions(shard_size="1KB", compression="gzip", variable_length="x", verbose=True)
    assert (o.shard_bytes, o.compression, o.verbose) == (1000, "GZIP", 1)
    assert o.variable_length == frozenset({"x"}) and o.metadata == {}
    assert dataclasses.replace(o, record_size=64).record_bytes == 64
    with pytest.raises(ValueError, match="`min_shards`"):
        dataclasses.replace(o, min_shards=0)
    with pytest.raises(TypeError, match="`samples_per_record`"):
        WriteOptions(samples_per_record=2.0)


@pytest.mark.parametrize(
    "kwargs",
    [dict(samples_per_record=2.5), dict(compression="lz4"), dict(overwrite=True, resume=True)],
)
def test_every_entry_point_refuses_an_option_alike(tmp_path, kwargs):
    d = str(tmp_path / "ds")
    with pytest.raises((TypeError, ValueError)) as expected:
        WriteOptions(**kwargs)
    with pytest.raises(type(expected.value)) as got:
        ArraysToRecords(d, **kwargs)
    assert str(got.value) == str(expected.value)
    with pytest.raises(type(expected.value)) as got:
        ArraysToRecords.from_arrays(np.zeros((4, 2), np.float32), directory=d, **kwargs)
    assert str(got.value) == str(expected.value)
    assert not os.path.exists(d)


def test_core_writer_and_adapter_write_the_same_bytes(tmp_path):
    x = np.arange(300, dtype=np.float32).reshape(100, 3)
    y = np.arange(100, dtype=np.int64)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    with RecordWriter(a, WriteOptions(samples_per_record=8, verbose=0)) as w:
        w.write(x[:37], y[:37])
        w.write(x[37:], y[37:])
    ArraysToRecords.from_arrays(x, y, b, samples_per_record=8, min_shards=1, verbose=0)
    ma, mb = Manifest.load(a), Manifest.load(b)
    assert [s.checksum for s in ma.shards] == [s.checksum for s in mb.shards]
    for s in ma.shards:
        with open(os.path.join(a, s.file), "rb") as fa, open(os.path.join(b, s.file), "rb") as fb:
            assert fa.read() == fb.read()


def test_shard_frames_match_the_framing_module(tmp_path):
    x = np.arange(40, dtype=np.float32).reshape(10, 4)
    m = ArraysToRecords.from_arrays(x, str(tmp_path / "ds"), samples_per_record=5, verbose=0)
    with open(os.path.join(m.directory, m.shards[0].file), "rb") as f:
        data = f.read()
    length = int.from_bytes(data[:8], "little")
    assert data[: framing.HEADER_BYTES] == framing.header(length)
    end = framing.HEADER_BYTES + length
    from keras_tfr import _crc

    body = data[framing.HEADER_BYTES : end]
    assert data[end : end + framing.FOOTER_BYTES] == framing.masked_bytes(_crc.crc32c([body]))
    assert len(data) == m.shards[0].records * framing.frame_size(length)
