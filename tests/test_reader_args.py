"""The reader's arguments: every bad value refused by `SourceOptions` with an error that
names the argument, before the directory is opened; the defaults the README and
docs/reliability.md state are the signature's; block mode's split needs 2 records while
sample mode splits a single one. (`verify`'s default: tests/test_mapped.py.)"""

from __future__ import annotations

import ast
import inspect
import os
import re
from pathlib import Path

import numpy as np
import pytest

from keras_tfr import ArraysToRecords, TFRecordSequenceSource
from keras_tfr.errors import ManifestError
from keras_tfr.manifest import Manifest
from keras_tfr.read.options import SourceOptions

ROOT = Path(__file__).parent.parent
SPLIT = dict(validation_split=0.2, subset="training", seed=1)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    """40 samples of 3 float32 in 5 records: a valid data set every good argument reads."""
    d = str(tmp_path_factory.mktemp("args") / "ds")
    x = np.arange(120, dtype=np.float32).reshape(40, 3)
    y = np.arange(40, dtype=np.int64)
    ArraysToRecords.from_arrays(x, y, d, samples_per_record=8, min_shards=1, verbose=0)
    return d


# ------------------------------------------------------------------ argument checks

# (keyword arguments, exception type, the backticked text the message must hold)
BAD_ARGS = [
    (dict(SPLIT, validation_split=0), ValueError, "`validation_split`"),
    (dict(SPLIT, validation_split=1), ValueError, "`validation_split`"),
    (dict(SPLIT, validation_split=-0.1), ValueError, "`validation_split`"),
    (dict(SPLIT, validation_split=1.5), ValueError, "`validation_split`"),
    (dict(SPLIT, validation_split="0.2"), TypeError, "`validation_split`"),
    (dict(SPLIT, validation_split=True), TypeError, "`validation_split`"),
    (dict(validation_split=0.2, seed=1), ValueError, "`subset`"),
    (dict(SPLIT, subset="train"), ValueError, "`subset`"),
    (dict(SPLIT, subset="test"), ValueError, "`subset`"),
    (dict(SPLIT, seed=None), ValueError, "`seed`"),
    (dict(subset="training"), ValueError, "`subset='training'` needs `validation_split`"),
    (dict(subset="validation", seed=1), ValueError, "`subset='validation'`"),
    (dict(verify="always"), ValueError, "`verify`"),
    (dict(verify=None), ValueError, "`verify`"),
    (dict(on_corrupt="ignore"), ValueError, "`on_corrupt`"),
    (dict(access="mmap"), ValueError, "`access`"),
    (dict(batch_size=0), ValueError, "`batch_size`"),
    (dict(batch_size=-4), ValueError, "`batch_size`"),
    (dict(batch_size=8.0), TypeError, "`batch_size`"),
    (dict(batch_size="32"), TypeError, "`batch_size`"),
    (dict(batch_size=True), TypeError, "`batch_size`"),
    (dict(max_corrupt_records=-1), ValueError, "`max_corrupt_records`"),
    (dict(max_corrupt_records=1.5), TypeError, "`max_corrupt_records`"),
    (dict(shuffle_memory="lots"), ValueError, "`shuffle_memory`"),
    (dict(shuffle_memory="-1MB"), ValueError, "`shuffle_memory`"),
    (dict(shuffle_memory=0), ValueError, "`shuffle_memory`"),
    (dict(shuffle_memory=True), TypeError, "`shuffle_memory`"),
    (dict(shuffle_memory=1.5), TypeError, "`shuffle_memory`"),
    (dict(shuffle_window="lots"), ValueError, "`shuffle_window`"),
    (dict(shuffle_window=0), ValueError, "`shuffle_window`"),
    (dict(shuffle_window=-5), ValueError, "`shuffle_window`"),
    (dict(shuffle_window=True), TypeError, "`shuffle_window`"),
    (dict(shuffle_window=1.5), TypeError, "`shuffle_window`"),
    (dict(num_parallel_reads=0), ValueError, "`num_parallel_reads`"),
    (dict(num_parallel_reads=-2), ValueError, "`num_parallel_reads`"),
    (dict(shuffle=1), TypeError, "`shuffle`"),
    (dict(shuffle="yes"), TypeError, "`shuffle`"),
    (dict(drop_remainder=1), TypeError, "`drop_remainder`"),
    (dict(deterministic="no"), TypeError, "`deterministic`"),
    (dict(check_files=0), TypeError, "`check_files`"),
]
IDS = [",".join(f"{k}={v!r}" for k, v in kw.items()) for kw, _, _ in BAD_ARGS]


@pytest.mark.parametrize("kwargs, error, named", BAD_ARGS, ids=IDS)
def test_bad_argument_is_refused_naming_it(small_dir, kwargs, error, named):
    with pytest.raises(error, match=re.escape(named)) as info:
        TFRecordSequenceSource(small_dir, **kwargs)
    assert "Received" in str(info.value)
    # The same check, in the same words, where the options are built on their own.
    with pytest.raises(error, match=re.escape(named)):
        SourceOptions(small_dir, **kwargs)


@pytest.mark.parametrize(
    "kwargs, error, named",
    [
        (dict(ragged="pad2"), ValueError, "`ragged` to be 'pad' or 'ragged'"),
        (dict(ragged=None), ValueError, "`ragged` to be 'pad' or 'ragged'"),
        (dict(decode=[1]), TypeError, "`decode` to be a dict"),
        (dict(decode={"nope": len}), ValueError, "keys of `decode` to be feature keys"),
        (dict(decode={"x": 3}), TypeError, "`decode['x']` to be callable"),
    ],
)
def test_ragged_and_decode_are_checked_against_the_data_set(small_dir, kwargs, error, named):
    """docs/existing_data.md: ``ragged`` is "pad" or "ragged"; ``decode`` maps the data
    set's feature keys to functions (checked once the manifest is read)."""
    with pytest.raises(error, match=re.escape(named)) as info:
        TFRecordSequenceSource(small_dir, **kwargs)
    assert "Received" in str(info.value)


@pytest.mark.parametrize("kwargs, error, named", BAD_ARGS, ids=IDS)
def test_arguments_are_checked_before_the_directory_is_opened(tmp_path, kwargs, error, named):
    missing = str(tmp_path / "no-such-data-set")
    # Good arguments on a missing directory: the manifest's error, naming `directory`.
    with pytest.raises(ManifestError, match="`directory`"):
        TFRecordSequenceSource(missing)
    # A bad argument on it: the argument's error, not the manifest's.
    with pytest.raises(error, match=re.escape(named)) as info:
        TFRecordSequenceSource(missing, **kwargs)
    assert not isinstance(info.value, ManifestError)


def test_good_arguments_are_kept(small_dir):
    src = TFRecordSequenceSource(
        small_dir, batch_size=np.int64(8), num_parallel_reads=2, max_corrupt_records=0,
        shuffle_memory="1KiB", verify="every_epoch", on_corrupt="skip", **SPLIT,
    )  # fmt: skip
    opts = src._cfg
    assert type(opts.batch_size) is int and opts.batch_size == 8
    assert (opts.num_parallel_reads, opts.max_corrupt_records) == (2, 0)
    assert opts.shuffle_bytes == 1024
    assert (opts.validation_split, opts.subset, opts.seed) == (0.2, "training", 1)


# ------------------------------------------------------------------ stated defaults


def _readme_signature() -> ast.FunctionDef:
    """The README's ``TFRecordSequenceSource(...)`` block, parsed as a ``def``."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(
        r"^### `TFRecordSequenceSource`\s*```python\n(TFRecordSequenceSource\(.*?\))\n```",
        readme,
        flags=re.M | re.S,
    ).group(1)
    return ast.parse(f"def {block}: pass").body[0]


def test_readme_states_the_reader_signature_and_defaults():
    fn = _readme_signature()
    params = inspect.signature(TFRecordSequenceSource.__init__).parameters
    positional = [a.arg for a in fn.args.args]
    assert positional == ["directory", "batch_size"]
    assert [n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD] == [
        "self",
        *positional,
    ]
    stated = {"batch_size": ast.literal_eval(fn.args.defaults[-1])}
    for arg, default in zip(fn.args.kwonlyargs, fn.args.kw_defaults):
        assert params[arg.arg].kind is inspect.Parameter.KEYWORD_ONLY, arg.arg
        stated[arg.arg] = ast.literal_eval(default)
    assert len(stated) == 14 and "deterministic" in stated, stated  # the whole block
    assert stated["batch_size"] == 32 and stated["verify"] == "first_read"
    assert stated["max_corrupt_records"] == 100 and stated["shuffle_memory"] == "64MB"
    assert stated["shuffle_window"] == "auto"
    assert stated["shuffle"] is True
    fields = {f.name: f.default for f in SourceOptions.__dataclass_fields__.values()}
    for name, value in stated.items():
        assert params[name].default == value, name
        assert type(params[name].default) is type(value), name
        assert fields[name] == value, f"SourceOptions.{name}"


def test_reliability_doc_states_max_corrupt_records_default():
    text = (ROOT / "docs" / "reliability.md").read_text()
    stated = re.findall(r"`max_corrupt_records` \(default (\d+)\)", text)
    assert stated, "docs/reliability.md no longer states the default"
    default = (
        inspect.signature(TFRecordSequenceSource.__init__).parameters["max_corrupt_records"].default
    )
    assert [int(s) for s in stated] == [default] * len(stated)


def test_readme_states_the_writer_chunk_size_default():
    readme = (ROOT / "README.md").read_text()
    (stated,) = re.findall(r'`chunk_size="(\w+)"`', readme)
    assert stated == "16MB"
    for fn in (ArraysToRecords.__init__, ArraysToRecords.from_arrays):
        assert inspect.signature(fn).parameters["chunk_size"].default == stated, fn


# ------------------------------------------------------------------ 1-record split


@pytest.mark.parametrize("n", [23, 3])
def test_one_record_splits_alike_in_both_modes(tmp_path, monkeypatch, n):
    monkeypatch.delenv("KERAS_TFR_READER", raising=False)
    d = str(tmp_path / "one")
    x = np.arange(n * 4, dtype=np.float32).reshape(n, 4)
    y = np.arange(n, dtype=np.int64)
    ArraysToRecords.from_arrays(x, y, d, samples_per_record=64, min_shards=1, verbose=0)
    assert Manifest.load(d).total_records == 1
    got: dict = {}
    for access in ("samples", "blocks"):
        for subset in ("training", "validation"):
            src = TFRecordSequenceSource(
                d, batch_size=4, access=access, **{**SPLIT, "subset": subset}
            )
            assert src.access == access
            got[access, subset] = np.sort(np.concatenate([by.numpy() for _, by in src]))
    n_val = max(1, int(0.2 * n))
    assert len(got["samples", "validation"]) == n_val
    assert len(got["samples", "training"]) == n - n_val
    assert sorted(
        np.concatenate([got["samples", "training"], got["samples", "validation"]])
    ) == list(range(n))
    for subset in ("training", "validation"):  # the very same samples
        assert np.array_equal(got["blocks", subset], got["samples", subset])


# ------------------------------------------------------------------ verify's default


@pytest.mark.parametrize("access", ["samples", "blocks"])
def test_a_relative_path_still_names_the_data_set_after_a_chdir(tmp_path, monkeypatch, access):
    """A source made from a relative path reads the same shards after `os.chdir` (it
    reported every record as corrupt), and so do its copies."""
    x = np.arange(300 * 4, dtype=np.float32).reshape(300, 4)
    ArraysToRecords.from_arrays(x, np.arange(300), str(tmp_path / "ds"), verbose=0)
    monkeypatch.chdir(tmp_path)
    src = TFRecordSequenceSource("ds", batch_size=64, shuffle=False, access=access)
    assert src.access == access
    monkeypatch.chdir("/")
    for s in (src, src.with_batch_size(50), src.replace(shuffle=True, seed=1)):
        ys = np.concatenate([b[1].numpy() for b in s])
        assert sorted(ys.tolist()) == list(range(300))


def test_home_in_a_path_is_expanded_and_a_file_is_no_directory(tmp_path, monkeypatch):
    """`~` is the home directory for the writer, the source and `verify` (a directory
    named `~` was created in the working directory); writing into a file is refused by
    name, before anything is written."""
    from keras_tfr.verifier import verify

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    x = np.arange(40, dtype=np.float32).reshape(10, 4)
    ArraysToRecords.from_arrays(x, np.arange(10), "~/ds", verbose=0)
    assert os.path.isfile(tmp_path / "home" / "ds" / "manifest.json")
    assert not os.path.exists(tmp_path / "~")
    src = TFRecordSequenceSource("~/ds", batch_size=4, shuffle=False)
    assert np.array_equal(np.concatenate([b[0].numpy() for b in src]), x)
    assert verify("~/ds").ok
    afile = tmp_path / "afile"
    afile.write_bytes(b"keep")
    with pytest.raises(ValueError, match=r"`directory`.*which is a file"):
        ArraysToRecords.from_arrays(x, None, str(afile), verbose=0)
    assert afile.read_bytes() == b"keep"
