"""Reading never fails silently: opening checks the manifest and every shard, a damaged
record is named with its shard and byte offset, skip mode drops, logs, counts and limits
while keeping the step count, and `verify` names every bad shard."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import warnings
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_tfr import ArraysToRecords, TFRecordSequenceSource
from keras_tfr.errors import (
    CorruptRecordError,
    IncompleteDatasetError,
    ManifestError,
    ShardError,
)
from keras_tfr.manifest import MANIFEST_NAME, Manifest
from keras_tfr.schema import encode_block
from keras_tfr.verifier import verify

pytestmark = pytest.mark.usefixtures("reader")  # every test runs with both read paths

SPR = 4  # samples per record
N = 240  # 60 records
RECORDS_PER_SHARD = 15


@pytest.fixture
def dataset(tmp_path):
    """240 samples, 4 per record, 4 shards of 15 records; y is the sample's index."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((N, 6)).astype(np.float32)
    y = np.arange(N, dtype=np.int64)
    d = str(tmp_path / "ds")
    ArraysToRecords.from_arrays(x, y, d, samples_per_record=SPR, min_shards=4, verbose=0)
    m = Manifest.load(d)
    assert [s.records for s in m.shards] == [RECORDS_PER_SHARD] * 4
    return d, x, y, m


def _frame(m):
    return m.record_bytes + 16  # TFRecord framing: length, its CRC, data, its CRC


def _flip(path, pos, bit=0x04):
    raw = bytearray(Path(path).read_bytes())
    raw[pos] ^= bit
    Path(path).write_bytes(raw)


def _cut(path, length):
    raw = Path(path).read_bytes()
    Path(path).write_bytes(raw[:length])


def _edit_manifest(d, fn):
    p = os.path.join(d, MANIFEST_NAME)
    obj = json.loads(Path(p).read_text())
    fn(obj)
    Path(p).write_text(json.dumps(obj))


def _drain(src):
    out = []
    for batch in src:
        out.append(tf.nest.map_structure(lambda t: t.numpy(), batch))
    return out


def _check_samples(batches, x):
    """Every sample that came through is the original one (y is its index)."""
    n = 0
    for bx, by in batches:
        assert np.array_equal(bx, x[by]), "wrong data passed on as good"
        n += len(by)
    return n


# ------------------------------------------------------------------ opening checks everything


def test_open_refuses_unknown_format_version(dataset):
    d = dataset[0]
    _edit_manifest(d, lambda o: o.update(format_version=2))
    with pytest.raises(ManifestError, match="format_version 2 is not supported"):
        TFRecordSequenceSource(d, batch_size=8)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("dtype", "complex64", "dtype"),
        ("dtype", "object", "dtype"),
        ("shape", [-1], "shape"),
        ("shape", [2.5], "shape"),
        ("shape", [1 << 20, 1 << 20], "exceed"),
        ("role", "z", "role"),
    ],
)
def test_open_refuses_bad_feature_specs(dataset, field, value, match):
    d = dataset[0]
    _edit_manifest(d, lambda o: o["features"][0].update({field: value}))
    with pytest.raises(ManifestError, match=match):
        TFRecordSequenceSource(d, batch_size=8)


def test_open_refuses_a_spec_that_does_not_fit_the_shards(dataset):
    d = dataset[0]
    # Claims 1000x bigger samples than the files can hold.
    _edit_manifest(d, lambda o: o["features"][0].update(shape=[6000]))
    with pytest.raises(ManifestError, match="cannot hold"):
        TFRecordSequenceSource(d, batch_size=8)


def test_open_names_every_missing_or_wrong_shard(dataset):
    d, _, _, m = dataset
    os.remove(os.path.join(d, m.shards[1].file))
    _cut(os.path.join(d, m.shards[3].file), 100)
    with pytest.raises(ShardError) as e:
        TFRecordSequenceSource(d, batch_size=8)
    msg = str(e.value)
    assert f"{m.shards[1].file}: missing" in msg
    assert f"{m.shards[3].file}: 100 bytes, the manifest records {m.shards[3].bytes}" in msg
    assert m.shards[0].file not in msg and m.shards[2].file not in msg


def test_open_refuses_a_shard_grown_by_appended_bytes(dataset):
    d, _, _, m = dataset
    with open(os.path.join(d, m.shards[2].file), "ab") as f:
        f.write(b"\0" * 7)
    with pytest.raises(ShardError, match=m.shards[2].file):
        TFRecordSequenceSource(d, batch_size=8)


def test_open_refuses_missing_or_incomplete_dataset(tmp_path, dataset):
    with pytest.raises(ManifestError, match="does not exist"):
        TFRecordSequenceSource(str(tmp_path / "nowhere"), batch_size=8)
    with pytest.raises(ManifestError, match=f"{MANIFEST_NAME}', which is a file"):
        TFRecordSequenceSource(os.path.join(dataset[0], MANIFEST_NAME), batch_size=8)
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ManifestError, match="has none"):
        TFRecordSequenceSource(str(tmp_path / "empty"), batch_size=8)
    d = dataset[0]
    os.remove(os.path.join(d, MANIFEST_NAME))
    Path(os.path.join(d, ".keras-tfr-progress.json")).write_text("{}")
    with pytest.raises(IncompleteDatasetError, match="resume=True"):
        TFRecordSequenceSource(d, batch_size=8)


def test_a_data_set_being_written_is_named_so(tmp_path):
    """A reader opened while a conversion writes the directory is told that it is being
    written (by which process), not that a conversion "did not finish"."""
    d = str(tmp_path / "live")
    x = np.zeros((400, 256), np.float32)
    with ArraysToRecords(d, shard_size="64KB", record_size="16KB", verbose=0) as w:
        w.write(x[:300])  # shards complete, no manifest yet
        with pytest.raises(IncompleteDatasetError, match=f"being written.*pid {os.getpid()}"):
            TFRecordSequenceSource(d, batch_size=8)
        w.write(x[300:])
    assert TFRecordSequenceSource(d, batch_size=8).num_samples == 400


# ------------------------------------------------------------------ corruption, raise mode


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("shard, record", [(0, 0), (1, 7), (3, 14)])
def test_flipped_byte_is_reported_with_file_and_offset(dataset, shard, record, shuffle):
    d, x, _, m = dataset
    path = os.path.join(d, m.shards[shard].file)
    src = TFRecordSequenceSource(d, batch_size=8, shuffle=shuffle, seed=0)
    _flip(path, record * _frame(m) + 30)  # inside the record's data
    good = []
    with pytest.raises(CorruptRecordError) as e:
        for batch in src:
            good.append(tf.nest.map_structure(lambda t: t.numpy(), batch))
    assert not isinstance(e.value, tf.errors.DataLossError)
    msg = e.value.message
    assert f"corrupt record in {path} at byte offset {record * _frame(m)} (record {record} " in msg
    assert "keras-tfr verify" in msg
    _check_samples(good, x)


@pytest.mark.parametrize("where", ["length", "length_crc", "data_crc"])
def test_damaged_framing_is_reported_too(dataset, where):
    d, _x, _, m = dataset
    path = os.path.join(d, m.shards[2].file)
    record = 5
    pos = record * _frame(m) + {"length": 1, "length_crc": 9, "data_crc": _frame(m) - 2}[where]
    _flip(path, pos)
    with pytest.raises(CorruptRecordError, match=f"byte offset {record * _frame(m)}"):
        _drain(TFRecordSequenceSource(d, batch_size=8, shuffle=False))


@pytest.mark.parametrize("cut_in_record", [0, 3, 9, 14])
def test_truncated_shard_is_reported_with_file_and_offset(dataset, cut_in_record):
    """Truncated after the source was opened (the size check at opening passed)."""
    d, x, _, m = dataset
    path = os.path.join(d, m.shards[1].file)
    src = TFRecordSequenceSource(d, batch_size=8, shuffle=False)
    for extra in (0, 10):  # on a record boundary, and inside a record
        _cut(path, cut_in_record * _frame(m) + extra)
        good = []
        with pytest.raises(CorruptRecordError) as e:
            for batch in src:
                good.append(tf.nest.map_structure(lambda t: t.numpy(), batch))
        offset = cut_in_record * _frame(m)
        assert f"corrupt record in {path} at byte offset {offset} (record {cut_in_record} " in (
            e.value.message
        )
        _check_samples(good, x)  # what came through before the error is intact


def test_deleted_shard_after_opening_is_named_not_a_hang(dataset):
    """TensorFlow's reader retries a file it cannot open forever under `ignore_errors`."""
    d, _, _, m = dataset
    path = os.path.join(d, m.shards[2].file)
    sources = {
        on_corrupt: TFRecordSequenceSource(d, batch_size=8, shuffle=False, on_corrupt=on_corrupt)
        for on_corrupt in ("raise", "skip")
    }
    os.remove(path)
    for on_corrupt, src in sources.items():
        result = {}

        def drain(src=src, result=result):
            try:
                result["batches"] = _drain(src)
            except Exception as e:
                result["error"] = e

        t = threading.Thread(target=drain, daemon=True)
        t.start()
        t.join(60)
        assert not t.is_alive(), "the reader hung on a deleted shard"
        if on_corrupt == "raise":
            assert isinstance(result.get("error"), CorruptRecordError)
            assert f"in {path} at byte offset 0" in result["error"].message
        else:
            assert len(result["batches"]) == len(src)
            assert src.corrupt_records == RECORDS_PER_SHARD


@pytest.mark.parametrize("what", ["deleted", "a directory"])
def test_shard_that_cannot_be_opened_or_mapped_is_named_with_the_reason(dataset, reader, what):
    """A shard gone, or replaced by something that opens but cannot be read as a file,
    after the source was built: raise mode names the file and (sample mode) why; skip mode
    drops its records and keeps the step count."""
    d, _, _, m = dataset
    path = os.path.join(d, m.shards[1].file)
    sources = {
        mode: TFRecordSequenceSource(d, batch_size=8, seed=0, on_corrupt=mode)
        for mode in ("raise", "skip")
    }
    os.remove(path)
    if what == "a directory":
        os.mkdir(path)
    with pytest.raises(CorruptRecordError) as e:
        _drain(sources["raise"])
    assert e.value.file == path and e.value.offset == 0
    if reader != "graph":
        why = "cannot be opened (No such file" if what == "deleted" else "cannot be memory-mapped"
        assert f"the file {why}" in e.value.message
    batches = _drain(sources["skip"])
    assert len(batches) == len(sources["skip"])
    assert sources["skip"].corrupt_records == RECORDS_PER_SHARD


# ------------------------------------------------------------------ corruption, skip mode


def test_skip_drops_logs_counts_and_keeps_the_step_count(dataset, caplog, reader):
    d, x, _, m = dataset
    # The direct reader drops just the damaged record; TensorFlow's reader cannot resume
    # after a bad record, so the rest of the shard goes.
    lost_records = 1 if reader == "mapped" else RECORDS_PER_SHARD - 10
    path = os.path.join(d, m.shards[1].file)
    src = TFRecordSequenceSource(d, batch_size=8, shuffle=False, on_corrupt="skip")
    steps = len(src)
    _flip(path, 10 * _frame(m) + 50)
    with caplog.at_level(logging.WARNING, logger="keras_tfr"):
        for _epoch in range(3):
            batches = _drain(src)
            assert len(batches) == steps == N // 8, "the epoch is filled to the announced length"
            # Filled sample by sample: every batch full, as in an epoch without damage.
            assert [len(b[1]) for b in batches] == [8] * steps
            assert _check_samples(batches, x) == N
            assert src.corrupt_records == lost_records, "counted once, not per pass"
            seen = np.concatenate([b[1] for b in batches])
            first_lost = (RECORDS_PER_SHARD + 10) * SPR
            lost = np.arange(first_lost, first_lost + lost_records * SPR)
            assert not np.isin(lost, seen).any()
            kept = np.setdiff1d(np.arange(N), lost)
            assert np.isin(kept, seen).all(), "nothing but the damaged record is lost"
    warnings_ = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings_) == 1, "logged once per damaged record"
    assert f"{path} at byte offset {10 * _frame(m)} (record 10 of 15)" in warnings_[0].getMessage()


def test_skip_stops_past_the_limit(dataset, reader):
    d, _, _, m = dataset
    for shard in (0, 2):
        _flip(os.path.join(d, m.shards[shard].file), 12 * _frame(m) + 40)
    lost = 2 if reader == "mapped" else 6  # the graph reader loses the 3 records left each
    src = TFRecordSequenceSource(d, batch_size=8, on_corrupt="skip", max_corrupt_records=lost - 1)
    with pytest.raises(CorruptRecordError, match=f"more than max_corrupt_records={lost - 1}") as e:
        _drain(src)
    msg = str(e.value)
    assert "byte offset" in msg and (m.shards[0].file in msg or m.shards[2].file in msg)
    ok = TFRecordSequenceSource(d, batch_size=8, on_corrupt="skip", max_corrupt_records=lost)
    assert len(_drain(ok)) == len(ok)
    assert ok.corrupt_records == lost


def test_skip_with_shuffle_and_validation_split(dataset, reader):
    """Skipping keeps each subset's step count, passes on only good samples of that
    subset (fills never leak the other subset's samples) and loses only what it must.
    (Block mode splits this small data set by sample.)"""
    _skip_with_split(dataset, reader)


@pytest.mark.parametrize("reader", ["graph"], indirect=True)
def test_skip_with_a_split_by_record(dataset, reader, monkeypatch):
    """The same in block mode on a data set it splits by whole records."""
    from keras_tfr.read import order

    monkeypatch.setattr(order, "SAMPLE_SPLIT_RECORDS", 10)
    seen = _skip_with_split(dataset, reader)
    for ids in seen.values():  # whole records on each side
        records = {i // SPR for i in ids}
        assert len(ids) == SPR * len(records)


def _skip_with_split(dataset, reader):
    d, x, _, m = dataset
    _flip(os.path.join(d, m.shards[3].file), 2 * _frame(m) + 20)
    record = 3 * RECORDS_PER_SHARD + 2  # global index of the damaged record
    damaged = set(range(record * SPR, (record + 1) * SPR))
    # The graph reader cannot resume inside a shard: the rest of shard 3 goes too.
    last = record + 1 if reader == "mapped" else 4 * RECORDS_PER_SHARD
    lost = set(range(record * SPR, last * SPR))
    seen = {}
    for subset in ("training", "validation"):
        src = TFRecordSequenceSource(
            d,
            batch_size=8,
            shuffle=True,
            seed=4,
            validation_split=0.25,
            subset=subset,
            on_corrupt="skip",
        )
        batches = _drain(src)
        assert len(batches) == len(src)
        n = _check_samples(batches, x)
        ids = set(np.concatenate([b[1] for b in batches]).tolist())
        assert not ids & damaged
        assert n == src.num_samples  # filled to the subset's size, in both modes
        if reader == "mapped":
            members = set(src.sample_order(0).tolist())
            assert ids <= members, "a fill came from outside the subset"
        seen[subset] = ids
    assert not seen["training"] & seen["validation"]
    assert seen["training"] | seen["validation"] == set(range(N)) - lost
    return seen


@pytest.mark.parametrize("reader", ["mapped", "mapped-tf.data"], indirect=True)  # samples
@pytest.mark.parametrize("split", [None, "training"])
def test_skip_fills_come_from_the_same_worker_share(dataset, reader, split):
    """docs/reliability.md: sample mode fills a dropped record's places with other samples
    of the same subset and worker share, so each worker keeps its step count and never
    reads another worker's samples."""
    d, x, _, m = dataset
    _flip(os.path.join(d, m.shards[1].file), 4 * _frame(m) + 20)
    record = RECORDS_PER_SHARD + 4
    damaged = set(range(record * SPR, (record + 1) * SPR))
    kw = dict(batch_size=8, shuffle=True, seed=6, num_workers=3, on_corrupt="skip")
    if split:
        kw.update(validation_split=0.25, subset=split)
    shares = []
    for w in range(3):
        src = TFRecordSequenceSource(d, worker_index=w, **kw)
        assert src.access == "samples"
        share = set(src.sample_order(0).tolist())
        batches = _drain(src)
        assert len(batches) == len(src)
        assert _check_samples(batches, x) == src.num_samples  # holes filled one for one
        ids = np.concatenate([b[1] for b in batches]).tolist()
        assert set(ids) <= share - damaged, f"worker {w} read outside its share"
        if share & damaged:
            assert src.corrupt_records == 1
            assert len(ids) > len(set(ids)), "the holes were filled with repeats"
        shares.append(share)
    assert any(share & damaged for share in shares), "the damage hit some worker's share"
    assert not (shares[0] & shares[1] or shares[0] & shares[2] or shares[1] & shares[2])


@pytest.mark.parametrize("reader", ["graph"], indirect=True)
def test_block_mode_fills_a_worker_share_to_its_size_with_a_partial_last_batch(dataset, reader):
    """Block mode with ``on_corrupt="skip"`` fills each worker's epoch from that worker's
    next pass, sample by sample: as many samples and batches as without the damage, only
    the last batch partial, nothing of another worker's share."""
    d, x, _, m = dataset
    kw = dict(batch_size=7, shuffle=True, seed=3, num_workers=3)
    sound = [TFRecordSequenceSource(d, worker_index=w, **kw) for w in range(3)]
    shares = [set(np.concatenate([b[1] for b in _drain(s)]).tolist()) for s in sound]
    _flip(os.path.join(d, m.shards[1].file), 4 * _frame(m) + 20)
    lost = set(range((RECORDS_PER_SHARD + 4) * SPR, 2 * RECORDS_PER_SHARD * SPR))
    hit = 0
    for w in range(3):
        src = TFRecordSequenceSource(d, worker_index=w, on_corrupt="skip", **kw)
        assert src.access == "blocks" and len(src) == len(sound[w])
        for _epoch in range(2):
            batches = _drain(src)
            sizes = [len(b[1]) for b in batches]
            own = sound[w].num_samples
            assert sum(sizes) == own == src.num_samples
            assert sizes[:-1] == [7] * (len(sizes) - 1) and sizes[-1] == own - 7 * (len(sizes) - 1)
            assert len(batches) == len(src)
            assert _check_samples(batches, x) == own
            ids = np.concatenate([b[1] for b in batches]).tolist()
            assert set(ids) <= shares[w] - lost, f"worker {w} read outside its share"
        if shares[w] & lost:
            hit += 1
            assert len(ids) > len(set(ids)), "the lost samples' places were filled with repeats"
            assert src.corrupt_records == RECORDS_PER_SHARD - 4  # its reader read them all
        else:
            assert sorted(ids) == sorted(shares[w]) and src.corrupt_records == 0
    assert hit == 2  # records 19-29: the end of worker 0's share, the start of worker 1's


def _bytes_read() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="Linux's per-process I/O counts")
@pytest.mark.parametrize("reader", ["graph"], indirect=True)
def test_block_mode_skip_reads_no_more_than_raise_without_damage(dataset, reader):
    """The fill of block mode's skip mode does not open the next pass where the epoch is
    whole: an epoch reads the same bytes as with ``on_corrupt="raise"``."""
    d, _, _, m = dataset
    shard_bytes = m.shards[0].bytes
    read = {}
    for mode in ("raise", "skip"):
        src = TFRecordSequenceSource(d, batch_size=7, shuffle=True, seed=1, on_corrupt=mode)
        assert src.access == "blocks"
        _drain(src)  # traced and warm
        before = _bytes_read()
        for _epoch in range(3):
            assert sum(len(b[1]) for b in _drain(src)) == N
        read[mode] = _bytes_read() - before
    assert read["raise"] >= 3 * N * 6 * 4  # every shard read each epoch
    assert abs(read["skip"] - read["raise"]) < shard_bytes, read


class _CountBatches(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.batches = 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1

    def on_epoch_end(self, epoch, logs=None):
        self.per_epoch.append(self.batches)

    def __init__(self):
        super().__init__()
        self.per_epoch = []


def test_keras_fit_in_skip_mode_runs_the_announced_steps(dataset, reader):
    d, _, _, m = dataset
    _flip(os.path.join(d, m.shards[0].file), 3 * _frame(m) + 60)
    src = TFRecordSequenceSource(d, batch_size=16, shuffle=True, seed=1, on_corrupt="skip")
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    counter = _CountBatches()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(src, epochs=3, verbose=0, callbacks=[counter])
    assert counter.per_epoch == [len(src)] * 3 == [N // 16] * 3
    assert not [w for w in caught if "ran out of data" in str(w.message)]
    assert src.corrupt_records == (1 if reader == "mapped" else RECORDS_PER_SHARD - 3)


def test_keras_fit_in_raise_mode_stops_with_the_file_name(dataset):
    d, _, _, m = dataset
    path = os.path.join(d, m.shards[2].file)
    _flip(path, 40)
    src = TFRecordSequenceSource(d, batch_size=16, shuffle=False)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    with pytest.raises(CorruptRecordError, match=f"{path} at byte offset 0"):
        model.fit(src, epochs=1, verbose=0)


# What each reader says of a record that fails its CRC check (docs/reliability.md).
_CRC_PROBLEM = {
    "samples": "the record failed its TFRecord CRC check",
    "blocks": "the record failed its TFRecord CRC check, or the file is truncated or unreadable",
}


def _model():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    return model


_CALLS = {
    "iterate": _drain,
    "fit": lambda src: _model().fit(src, epochs=1, verbose=0),
    "evaluate": lambda src: _model().evaluate(src, verbose=0),
    "predict": lambda src: _model().predict(src, verbose=0),
}


def _assert_own_message(error, message):
    """keras-tfr's text alone: none of TensorFlow's wrapping (brackets, node, op names)."""
    assert isinstance(error, CorruptRecordError)
    assert error.message == str(error) == message
    assert message.endswith("run `keras-tfr verify` on the data set"), message
    for tf_text in ("]", "[[", "{{node", "Op:", "assertion failed", "\n"):
        assert tf_text not in message, (tf_text, message)


@pytest.mark.parametrize("call", sorted(_CALLS))
def test_corrupt_record_error_from_fit_evaluate_predict_and_iteration(dataset, reader, call):
    """The one type to catch around each entry point, in both access modes (README.md),
    with the damaged shard in `e.file` and keras-tfr's message exactly."""
    d, _, _, m = dataset
    path = os.path.join(d, m.shards[2].file)
    record = 5
    src = TFRecordSequenceSource(d, batch_size=16, shuffle=False)
    access = "blocks" if reader == "graph" else "samples"
    assert src.access == access
    _flip(path, record * _frame(m) + 30)
    with pytest.raises(CorruptRecordError) as e:
        _CALLS[call](src)
    assert e.value.file == path
    assert e.value.offset == record * _frame(m)
    if call == "iterate":  # TensorFlow's error is kept (Keras' traceback filter drops it)
        assert isinstance(e.value.__cause__, tf.errors.OpError)
    _assert_own_message(
        e.value,
        f"keras-tfr: corrupt record in {path} at byte offset {record * _frame(m)} (record "
        f"{record} of {RECORDS_PER_SHARD}): {_CRC_PROBLEM[access]}; run `keras-tfr verify` "
        "on the data set",
    )


def test_a_data_set_made_from_a_source_raises_tensorflows_type_in_a_loop(dataset, reader):
    """docs/reliability.md, "Known limits": a loop over ``source.map(f)`` (tf.data's own
    iterator) gets TensorFlow's `InvalidArgumentError` with keras-tfr's text in its
    message; `fit` on it still raises `CorruptRecordError`."""
    d, _, _, m = dataset
    path = os.path.join(d, m.shards[1].file)
    src = TFRecordSequenceSource(d, batch_size=16, shuffle=False)
    _flip(path, 3 * _frame(m) + 30)
    made = src.map(lambda a, b: (a, b))
    with pytest.raises(tf.errors.InvalidArgumentError) as e:
        for _ in made:
            pass
    assert not isinstance(e.value, CorruptRecordError)
    assert f"keras-tfr: corrupt record in {path} at byte offset {3 * _frame(m)}" in str(e.value)
    with pytest.raises(CorruptRecordError) as fitted:
        _model().fit(made, epochs=1, verbose=0, shuffle=False)
    assert fitted.value.file == path


@pytest.mark.parametrize("call", ["iterate", "fit"])
def test_corrupt_record_error_names_a_path_with_quotes_and_accents(tmp_path, reader, call):
    """The file in the error is the path itself, though TensorFlow C-escapes what its
    `Assert` prints (a quote as \\', an accent as octal bytes of UTF-8)."""
    x = np.arange(N * 6, dtype=np.float32).reshape(N, 6)
    d = str(tmp_path / "l'été données")
    m = ArraysToRecords.from_arrays(x, x[:, :1], d, samples_per_record=SPR, verbose=0)
    path = m.shard_path(m.shards[0])
    _flip(path, 3 * _frame(m) + 30)
    src = TFRecordSequenceSource(d, batch_size=16, shuffle=False)
    with pytest.raises(CorruptRecordError) as e:
        _CALLS[call](src)
    assert e.value.file == path and e.value.offset == 3 * _frame(m)
    assert e.value.message.startswith(f"keras-tfr: corrupt record in {path} at byte offset")


@pytest.mark.parametrize("reader", ["graph"], indirect=True)  # GZIP: block mode only
@pytest.mark.parametrize("call", ["iterate", "fit"])
def test_corrupt_gzip_shard_message_is_keras_tfr_text_alone(tmp_path, reader, call):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((N, 6)).astype(np.float32)
    d = str(tmp_path / "gz")
    m = ArraysToRecords.from_arrays(
        x, np.arange(N), d, samples_per_record=SPR, min_shards=4, compression="GZIP", verbose=0
    )
    path = os.path.join(d, m.shards[2].file)
    src = TFRecordSequenceSource(d, batch_size=16, shuffle=False)
    assert src.access == "blocks"
    _cut(path, os.path.getsize(path) // 2)
    with pytest.raises(CorruptRecordError) as e:
        _CALLS[call](src)
    assert e.value.file == path and e.value.offset is not None
    index = e.value.offset // _frame(m)  # offsets count bytes of the uncompressed stream
    assert e.value.offset == index * _frame(m) and 0 < index < RECORDS_PER_SHARD
    _assert_own_message(
        e.value,
        f"keras-tfr: corrupt record in {path} at byte offset {e.value.offset} (record {index} "
        f"of {RECORDS_PER_SHARD}): {_CRC_PROBLEM['blocks']}; run `keras-tfr verify` on the "
        "data set",
    )


# ------------------------------------------------------------------ verify


def test_verify_passes_a_sound_dataset(dataset):
    d, _, _, _m = dataset
    report = verify(d)
    assert report.ok and report.problems == {}
    assert (report.shards_checked, report.records_checked, report.samples_checked) == (4, 60, N)
    assert report.summary().startswith("OK")


def test_verify_names_every_bad_shard(dataset):
    d, _, _, m = dataset
    f = [s.file for s in m.shards]
    _flip(os.path.join(d, f[0]), 4 * _frame(m) + 33)  # CRC
    _cut(os.path.join(d, f[2]), 6 * _frame(m) + 5)  # truncated
    report = verify(d)
    assert not report.ok
    assert sorted(report.problems) == [f[0], f[2]]
    assert any(
        f"record 4 at byte offset {4 * _frame(m)}: corrupt" in p for p in report.problems[f[0]]
    )
    assert any("the manifest records" in p for p in report.problems[f[2]])
    assert any(
        f"record 6 at byte offset {6 * _frame(m)}: truncated" in p for p in report.problems[f[2]]
    )
    assert any("holds 6 records / 24 samples" in p for p in report.problems[f[2]])
    summary = report.summary()
    assert summary.startswith("FAILED") and f[0] in summary and f[2] in summary


def test_verify_reports_missing_shard_and_bad_checksums(dataset):
    d, _, _, m = dataset
    f = [s.file for s in m.shards]
    os.remove(os.path.join(d, f[3]))
    # Shards 0 and 1 swapped: every record passes its CRC, sizes match, checksums do not.
    a, b = (os.path.join(d, n) for n in f[:2])
    os.rename(a, a + ".x")
    os.rename(b, a)
    os.rename(a + ".x", b)
    report = verify(d)
    assert sorted(report.problems) == [f[0], f[1], f[3]]
    assert report.problems[f[3]] == ["missing"]
    for name in f[:2]:
        assert any("checksum" in p for p in report.problems[name])


@pytest.mark.parametrize("where", ["open", "tensorflow"])
def test_verify_names_a_shard_it_cannot_open_and_checks_the_others(dataset, monkeypatch, where):
    # A shard there but unreadable (chmod 000, as another user) escaped as TensorFlow's
    # PermissionDeniedError with a traceback: no report, no other shard checked.
    import tensorflow as tf

    from keras_tfr import _io

    d, _, _, m = dataset
    f = [s.file for s in m.shards]
    locked = os.path.join(d, f[1])
    if where == "open":
        real_open = _io.open_read

        def open_read(path):
            if path == locked:
                raise PermissionError(13, "Permission denied", path)
            return real_open(path)

        monkeypatch.setattr(_io, "open_read", open_read)
        want = "the file cannot be opened (Permission denied)"
    else:  # the reader TensorFlow opens itself (the compressed shards' path)
        from keras_tfr._compat import tf as compat_tf

        monkeypatch.setattr(compat_tf, "random_record_reader", None)  # its fallback
        real_iterator = tf.compat.v1.io.tf_record_iterator

        def iterator(path, options=None):
            if path == locked:
                raise tf.errors.PermissionDeniedError(None, None, f"{path}; Permission denied")
            return real_iterator(path, options)

        monkeypatch.setattr(tf.compat.v1.io, "tf_record_iterator", iterator)
        want = "Permission denied"
    report = verify(d)
    assert sorted(report.problems) == [f[1]]
    assert any(want in p for p in report.problems[f[1]]), report.problems
    assert report.shards_checked == 4


def test_verify_reports_count_mismatch(dataset):
    d, _, _, m = dataset

    def drop_a_record(o):
        o["shards"][1]["records"] -= 1
        o["shards"][1]["samples"] -= SPR
        o["total_records"] -= 1
        o["total_samples"] -= SPR

    _edit_manifest(d, drop_a_record)
    report = verify(d)
    assert list(report.problems) == [m.shards[1].file]
    assert any("holds 15 records / 60 samples" in p for p in report.problems[m.shards[1].file])


def test_verify_reports_records_that_pass_their_crc_but_break_the_schema(dataset):
    """A shard rewritten with well-framed records of the wrong content."""
    d, _, _, m = dataset
    specs = m.features
    path = os.path.join(d, m.shards[2].file)
    with tf.io.TFRecordWriter(path) as w:
        w.write(encode_block(specs, {"x": np.zeros((4, 6), np.float32), "y": np.zeros(4)}))
        # Short record in the middle of the data set: the decoder would pad it with zeros.
        w.write(encode_block(specs, {"x": np.zeros((2, 6), np.float32), "y": np.zeros(2)}))
        w.write(b"not an example at all")
    report = verify(d)
    assert list(report.problems) == [m.shards[2].file]
    assert any(
        "record 1" in p and "holds 2 samples, not 4" in p for p in report.problems[m.shards[2].file]
    )
    # The reader refuses it at opening: the size no longer matches.
    with pytest.raises(ShardError, match=m.shards[2].file):
        TFRecordSequenceSource(d, batch_size=8)


def test_verify_raises_on_a_bad_manifest(dataset, tmp_path):
    d = dataset[0]
    _edit_manifest(d, lambda o: o["shards"][0].update(file="../escape.tfrecord"))
    with pytest.raises(ManifestError, match="plain file name"):
        verify(d)
    shutil.rmtree(d)
    with pytest.raises(ManifestError):
        verify(d)


# ------------------------------------------------------------------ no runaway on damage


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


@pytest.mark.parametrize("records", [1, "all"])
def test_skip_mode_ends_with_an_error_when_every_record_is_damaged(tmp_path, records, reader):
    """Refilling the epoch must never loop without end, nor grow memory."""
    if records == 1:
        x = np.zeros((5, 3), np.float32)
        d = str(tmp_path / "one")
        ArraysToRecords.from_arrays(x, np.arange(5), d, verbose=0)
    else:  # 4,000 x 16 float32, every shard damaged
        x = np.random.default_rng(0).standard_normal((4000, 16)).astype(np.float32)
        d = str(tmp_path / "all")
        ArraysToRecords.from_arrays(x, np.arange(4000), d, samples_per_record=100, verbose=0)
    m = Manifest.load(d)
    frame = _frame(m)
    for shard in m.shards:
        for j in range(shard.records):
            _flip(os.path.join(d, shard.file), j * frame + 20)
    src = TFRecordSequenceSource(
        d, batch_size=16, seed=0, on_corrupt="skip", max_corrupt_records=10**6
    )
    before = _rss_mb()
    result = {}

    def drain():
        try:
            _drain(src)
        except Exception as e:
            result["error"] = e

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "skip mode looped on a data set with no sound record"
    assert isinstance(result.get("error"), CorruptRecordError)
    assert "damaged" in str(result["error"])
    assert _rss_mb() - before < 300
