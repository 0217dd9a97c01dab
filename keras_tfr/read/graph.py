"""The graph reader: block mode, run entirely in tf.data's C++ runtime.

Used for ``access="blocks"``: GZIP/ZLIB shards, variable-length features, ``gs://`` and
other `tf.io.gfile` URLs, the tf.data service, platforms without memory maps, or any data
set when asked for. Records (blocks of samples) are read in sequence, never single
samples, so the per-element overhead of tf.data is paid once per block. Stage by stage:

1. shard list from the manifest (a seeded permutation each epoch when shuffling);
2. parallel interleave of `TFRecordDataset` readers, one per shard; a record's index (and
   so its byte offset) is known, so a damaged record is reported with file and offset;
   on a fixed layout every non-payload byte of each record is checked against the
   manifest's layout as it is read (`GraphReader._layout_check`);
3. the validation split keeps or drops whole records (`keras_tfr.read.order.block_split`),
   or, for a small data set, single samples (`keras_tfr.read.order.SampleOrder.mask`:
   the samples sample mode reads, split and worker share, picked out of each pool as it
   is decoded);
4. shuffle: a buffer of records sized in bytes (a quarter of ``shuffle_memory``);
5. pools of records are parsed with one batched `parse_example` (or cut by offset when
   every record has the fixed layout), decoded with one `decode_raw` and a zero-copy
   `bitcast` per feature, and permuted inside the pool;
6. `rebatch` to ``batch_size`` without going through single samples.

Every seed is a function of ``(seed, epoch)``: the epoch number comes from the source
when an iterator starts (one Python call per iterator), so the order of epoch ``e`` does
not depend on how many iterators were made. On the tf.data service, which cannot run
Python, the service's workers draw the order per iterator instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from keras_tfr.format import framing
from keras_tfr.manifest import Manifest, written_again
from keras_tfr.read import split as _distribute
from keras_tfr.schema import (
    COUNT_KEY,
    FeatureSpec,
    tf_bytes_to_feature,
    tf_decode_feature,
    tf_decode_variable,
)

_READ_BUFFER = 1 << 20
_CORRUPT_HINT = (
    "the record failed its TFRecord CRC check, or the file is truncated or unreadable; "
    "run `keras-tfr verify` on the data set"
)


_SMALL_SEEDS = 2**31 - 1  # seeds in [0, 2**31 - 1): op seeds derived as they always were
_HASHED = 2**62


def _hash62(seed: int) -> int:
    """A 62-bit hash of an int64 seed, for the op seeds of seeds outside [0, 2**31 - 1)."""
    state = np.random.SeedSequence(seed & 0xFFFFFFFFFFFFFFFF).generate_state(1, np.uint64)
    return int(state[0]) >> 2


class GraphReader:
    """Builds the block-mode pipeline of one source (see the module docstring)."""

    def __init__(
        self,
        *,
        manifest: Manifest,
        specs: list[FeatureSpec],
        keep: np.ndarray | None,
        shuffle: bool,
        seed: int | None,
        deterministic: bool,
        shuffle_bytes: int,
        pool_bytes: int,
        batch_size: int,
        drop_remainder: bool,
        num_parallel_reads: int | None,
        on_corrupt: str,
        report_skip: Callable[..., bool],
        service: tuple[str, str, str | None] | None,
        fill_rows: int | None = None,
        sample_keep: np.ndarray | None = None,
    ):
        self.manifest = manifest
        self.specs = specs
        self.keep = keep
        self.sample_keep = sample_keep
        self.shuffle = shuffle
        self.seed = seed
        self.deterministic = deterministic
        self.shuffle_bytes = shuffle_bytes
        self.pool_bytes = pool_bytes
        self.batch_size = batch_size
        self.drop_remainder = drop_remainder
        self.num_parallel_reads = num_parallel_reads
        self.on_corrupt = on_corrupt
        self.report_skip = report_skip
        self.service = service
        self.fill_rows = fill_rows
        self._shards = [(s.file, s.bytes, s.checksum) for s in manifest.shards]

    def dataset(self, next_epoch: Callable[[], tuple[int, int]]) -> tf.data.Dataset:
        """Batches of each new iterator's epoch, from its first batch on."""
        if self.service is not None:
            return self.epoch(None)

        def ask() -> tuple[np.int64, np.int64, bytes]:
            epoch, start = next_epoch()
            return np.int64(epoch), np.int64(start), self._written_again().encode()

        def epoch_of(epoch: Any, start: Any, problem: Any) -> tf.data.Dataset:
            # Raised in the graph, as the records' checks are: one line in the log.
            written_again = tf.debugging.Assert(tf.equal(problem, ""), [problem])
            with tf.control_dependencies([written_again]):
                epoch = tf.identity(epoch)
            return self.epoch(epoch).skip(start)

        head = tf.data.Dataset.from_tensors(np.int64(0)).map(
            lambda _: tuple(
                tf.numpy_function(ask, [], [tf.int64, tf.int64, tf.string], stateful=True)
            )
        )
        return head.flat_map(epoch_of)

    def _written_again(self) -> str:
        """At each iterator's start: "" while the data set's manifest lists the shards this
        reader reads, else why not. TensorFlow's reader would read the shards of a data set
        written again (``overwrite=True``) under the old manifest while their records pass
        their checks."""
        m = self.manifest
        why = written_again(m.directory, self._shards)
        if why is None:
            return ""
        return (
            f"keras-tfr: corrupt records: the data set in {m.directory} {why}: make a new "
            "TFRecordSequenceSource"
        )

    def epoch(self, epoch: Any) -> tf.data.Dataset:
        """One epoch's batches. With ``on_corrupt="skip"``, dropped records would shorten
        it: it is filled, sample by sample, from the next pass, so Keras gets exactly the
        steps it was given and only the epoch's last batch can be partial."""
        pools = self.pools(epoch)
        if self.fill_rows is not None:
            pools = _filled(pools, self.fill_rows)
        return pools.rebatch(self.batch_size, drop_remainder=self.drop_remainder)

    def pools(self, epoch: Any) -> tf.data.Dataset:
        """One pass's pools of decoded samples (``epoch`` a scalar tensor, or None on the
        service), each a dict of features with the pool's samples on the first axis."""
        m = self.manifest
        spr = m.samples_per_record
        specs = self.specs
        record_bytes = max(1, m.record_bytes)
        seed = self.seed

        def op_seed(k: int) -> Any:
            if seed is None or epoch is None:
                # On the service (no epoch: the workers run the graph, each epoch a new
                # job of it), fixed op seeds gave every epoch the same order: the workers
                # draw each epoch's order instead (`seed` still decides the split).
                return None
            if 0 <= seed < _SMALL_SEEDS:  # the op seeds of earlier versions, kept
                return (seed * 7919 + k + epoch * 104729) % _SMALL_SEEDS
            # Any other int64 seed: hashed to 62 bits (no two seeds congruent modulo
            # 2**31 - 1 share an order), the sum kept inside int64 for the epoch's tensor.
            return _SMALL_SEEDS + (_hash62(seed) + k + epoch * 104729) % _HASHED

        files = [m.shard_path(s) for s in m.shards]
        first = np.cumsum([0] + [s.records for s in m.shards])[:-1].astype(np.int64)
        counts = np.array([s.records for s in m.shards], dtype=np.int64)
        if self.keep is not None:
            # Shards with no selected record are not opened at all.
            keep_per_shard = [bool(self.keep[f : f + c].any()) for f, c in zip(first, counts)]
            files = [f for f, k in zip(files, keep_per_shard) if k]
            first = first[keep_per_shard]
            counts = counts[keep_per_shard]
        shards = tf.data.Dataset.from_tensor_slices(
            (tf.constant(files, tf.string), tf.constant(first), tf.constant(counts))
        )
        if self.shuffle:
            shards = shards.shuffle(len(files), seed=op_seed(1), reshuffle_each_iteration=True)

        # Every record kept: no lookup (and no `tf.cond`) per record.
        keep = None if self.keep is None or self.keep.all() else tf.constant(self.keep)
        # A split by sample: the subset's samples are picked out of each decoded pool, by
        # written index (the record's number times `spr`, plus the sample's place in it).
        sample_keep = None if self.sample_keep is None else tf.constant(self.sample_keep)
        compression = m.compression or ""

        # Every full record of a fixed-layout data set has the same size and only the data
        # set's last record can be short, so record i of a shard starts at i * frame: an
        # `enumerate` replaces the scan of lengths, and one filter per record (instead of
        # four functions) checks the shard's end and the split. Yields (index, record).
        frame = framing.frame_size(m.record_bytes)
        fixed_layout = m.record_bytes > 0 and all(s.kind == "fixed" for s in specs)
        layout_ok = self._layout_check(frame) if fixed_layout else None

        def numbered(records: Any, first_record: Any) -> Any:
            """(index in the shard, record) -> (record number in the data set, record),
            which a split by sample needs; as it is otherwise."""
            if sample_keep is None:
                return records
            return records.map(lambda i, r: (first_record + i, r))

        def read_fixed_shard(path: Any, first_record: Any, n_records: Any) -> Any:
            records = _records_or_empty(path, compression)
            end = tf.data.Dataset.from_tensors(tf.constant(b""))  # records are never empty
            indexed = records.ignore_errors().concatenate(end).enumerate()

            def keep_record(i: Any, record: Any) -> Any:
                def at_end() -> Any:
                    ok = self._check_shard_end(path, i, i * frame, n_records, tf.constant(True))
                    return tf.logical_and(ok, tf.equal(tf.strings.length(record), -1))

                def sound() -> Any:  # every non-payload byte as the manifest describes
                    if layout_ok is None:
                        return tf.constant(True)
                    return layout_ok(path, i, first_record + i, n_records, record)

                if keep is None:
                    keep_it = sound
                else:
                    keep_it = lambda: tf.cond(  # noqa: E731
                        tf.gather(keep, first_record + i), sound, lambda: tf.constant(False)
                    )
                return tf.cond(tf.strings.length(record) > 0, keep_it, at_end)

            return numbered(indexed.filter(keep_record), first_record)

        def read_shard(path: Any, first_record: Any, n_records: Any) -> Any:
            if fixed_layout:
                return read_fixed_shard(path, first_record, n_records)
            records = _records_or_empty(path, compression)
            # TensorFlow's reader ends a shard at its first bad record; ignore_errors turns
            # that into a short shard, which the scan below detects, names and counts.
            records = records.ignore_errors().map(lambda r: (r, False))
            sentinel = tf.data.Dataset.from_tensors((tf.constant(b""), True))

            def scan_fn(state: Any, elem: Any) -> Any:
                index, offset = state
                record, is_end = elem
                if_end_ok = self._check_shard_end(path, index, offset, n_records, is_end)
                length = tf.cast(tf.strings.length(record), tf.int64) + framing.OVERHEAD
                new_state = (index + 1, offset + length)
                return new_state, (index, record, is_end, if_end_ok)

            scanned = records.concatenate(sentinel).scan(
                (tf.constant(0, tf.int64), tf.constant(0, tf.int64)), scan_fn
            )
            scanned = scanned.filter(
                lambda i, r, is_end, ok: tf.logical_and(ok, tf.logical_not(is_end))
            )
            if keep is not None:
                scanned = scanned.filter(lambda i, r, e, ok: tf.gather(keep, first_record + i))
            return numbered(scanned.map(lambda i, r, e, ok: (i, r)), first_record)

        cycle = self.num_parallel_reads or min(8, max(2, os.cpu_count() or 2))
        cycle = max(1, min(cycle, len(files)))
        if self.shuffle:
            records = shards.interleave(
                read_shard,
                cycle_length=cycle,
                block_length=1,
                num_parallel_calls=cycle,  # not AUTOTUNE: it ramps up from one reader
                deterministic=self.deterministic,
            )
            buffer_records = max(1, (self.shuffle_bytes // 4) // record_bytes)
            records = records.shuffle(
                min(buffer_records, m.total_records), seed=op_seed(2), reshuffle_each_iteration=True
            )
        else:
            # block_length covers a whole shard, so shards come out one after another in
            # written order while the next ones are already being read.
            records = shards.interleave(
                read_shard,
                cycle_length=cycle,
                block_length=int(max(counts.max(initial=1), 1)),
                num_parallel_calls=cycle,
                deterministic=True,
            )

        pool_records = max(1, self.pool_bytes // record_bytes)
        pools_in = records.batch(pool_records)  # (record numbers, records)
        if sample_keep is None:
            pools_in = pools_in.map(lambda _, r: r)  # the numbers are not needed
        else:  # one element (a dict is not unpacked into arguments, a tuple is)
            pools_in = pools_in.map(lambda numbers, r: {"numbers": numbers, "records": r})

        feature_spec = {s.key: tf.io.FixedLenFeature([], tf.string) for s in specs}
        feature_spec[COUNT_KEY] = tf.io.FixedLenFeature([], tf.int64)
        fixed_specs = [s for s in specs if s.kind == "fixed"]
        variable_specs = [s for s in specs if s.kind != "fixed"]
        for s in variable_specs:
            feature_spec[s.lengths_key] = tf.io.FixedLenFeature([], tf.string)
        has_short_record = m.total_samples % spr != 0
        shuffle = self.shuffle

        def parse_pool(serialized: Any) -> Any:
            parsed = tf.io.parse_example(serialized, feature_spec)
            decoded = {s.key: tf_decode_feature(parsed[s.key], s, spr) for s in fixed_specs}
            return decoded, parsed

        fast_decode = None
        if fixed_layout and not variable_specs:
            fast_decode = _fixed_layout_decoder(specs, spr, m, parse_pool)

        def picked(numbers: Any, counts_: Any, variable: dict) -> tuple[Any, dict]:
            """The pool's samples of this subset (``sample_keep``): their places among
            the pool's ``[records * spr]`` rows, in written order, and the variable
            features' samples at those places."""
            places = tf.where(tf.reshape(tf.sequence_mask(counts_, spr), [-1]))[:, 0]
            written = tf.gather(numbers, places // spr) * spr + places % spr
            wanted = tf.gather(sample_keep, written)
            chosen = tf.where(wanted)[:, 0]  # among the pool's samples
            return tf.gather(places, chosen), {k: tf.gather(v, chosen) for k, v in variable.items()}

        def decode_pool(serialized: Any, numbers: Any, rand: Any) -> Any:
            if fast_decode is not None:
                decoded, counts_ = fast_decode(serialized)
                variable = {}
            else:
                decoded, parsed = parse_pool(serialized)
                counts_ = parsed[COUNT_KEY]
                # Non-fixed features decode to exactly the pool's samples (no padding).
                variable = {
                    s.key: tf_decode_variable(parsed[s.key], parsed[s.lengths_key], s)
                    for s in variable_specs
                }
            if sample_keep is not None:
                idx, variable = picked(numbers, counts_, variable)
            elif shuffle and has_short_record:
                idx = tf.where(tf.reshape(tf.sequence_mask(counts_, spr), [-1]))[:, 0]
            elif shuffle:
                idx = tf.range(tf.shape(counts_, out_type=tf.int64)[0] * spr)
            else:
                idx = None  # the pool's rows as they are
            if shuffle:
                if variable:
                    # The same permutation as stateless_shuffle(idx), applied to both.
                    perm = tf.random.experimental.stateless_shuffle(
                        tf.range(tf.size(idx, out_type=tf.int64)), seed=rand
                    )
                    idx = tf.gather(idx, perm)
                    variable = {k: tf.gather(v, perm) for k, v in variable.items()}
                else:
                    idx = tf.random.experimental.stateless_shuffle(idx, seed=rand)
            if idx is not None:
                decoded = {k: tf.gather(v, idx) for k, v in decoded.items()}
            elif has_short_record:
                n = tf.reduce_sum(counts_)
                decoded = {k: v[:n] for k, v in decoded.items()}
            decoded.update(variable)
            return decoded

        def decode(pool: Any, rand: Any = None) -> Any:
            if sample_keep is None:
                return decode_pool(pool, None, rand)
            return decode_pool(pool["records"], pool["numbers"], rand)

        # A fixed parallelism starts the first epoch at full speed (AUTOTUNE ramps up from
        # one call, which costs Keras a slow start at every epoch's new iterator).
        decoders = max(2, os.cpu_count() or 2)
        if shuffle:
            rng = tf.data.Dataset.random(seed=op_seed(3), rerandomize_each_iteration=True)
            rng = rng.batch(2)
            pools = tf.data.Dataset.zip((pools_in, rng)).map(
                decode, num_parallel_calls=decoders, deterministic=self.deterministic
            )
        else:
            pools = pools_in.map(decode, num_parallel_calls=decoders, deterministic=True)
        if self.service is not None:
            # Reading, parsing and decoding run on the tf.data service workers; batches are
            # cut here, so an epoch keeps exactly the step count Keras was given.
            pools = _distribute.via_service(pools, *self.service)
        return pools

    def _layout_check(self, frame: int) -> Callable[[Any, Any, Any, Any, Any], Any] | None:
        """``check(path, index, record_number, n_records, record)``: True when every
        non-payload byte of a record of a fixed-layout data set (keys, lengths, the sample
        count, the lattice's padding) is what the manifest describes, for a full record
        and for the data set's short last record alike; else raises naming the file and
        offset, or (``on_corrupt="skip"``) reports the record and returns False. A record
        rewritten with a valid CRC but another layout goes no further. None where the
        manifest's record size is not that of this layout."""
        from keras_tfr.schema import BlockEncoder

        m = self.manifest
        encoder = BlockEncoder(self.specs, m.lattice)
        last = m.total_records - 1
        last_count = m.total_samples - last * m.samples_per_record

        def expected(count: int) -> tuple[Any, Any, Any, int]:
            _, headers, length = encoder.fixed_layout(count)
            pos = tf.constant([o for o, _ in headers], tf.int64)
            lens = tf.constant([len(b) for _, b in headers], tf.int64)
            return pos, lens, tf.constant([b for _, b in headers]), length

        full = expected(m.samples_per_record)
        if full[3] != m.record_bytes:  # not this writer's layout: parse_example checks it
            return None
        short = expected(last_count) if last_count != m.samples_per_record else full

        def matches(record: Any, layout: tuple[Any, Any, Any, int]) -> Any:
            pos, lens, want, length = layout
            same_length = tf.equal(tf.strings.length(record), length)
            return tf.logical_and(
                same_length,
                tf.reduce_all(tf.equal(tf.strings.substr(record, pos, lens), want)),
            )

        problem = (
            "a record passed its CRC check but does not have the layout its manifest "
            "describes; the data set was modified after it was written"
        )

        def check(path: Any, index: Any, number: Any, n_records: Any, record: Any) -> Any:
            if short is full or m.total_records == 1:  # one layout for every record
                ok = matches(record, short)
            else:
                ok = tf.cond(
                    tf.equal(number, last),
                    lambda: matches(record, short),
                    lambda: matches(record, full),
                )
            return self._sound_or_reported(
                ok, path, index, index * frame, n_records, problem, lost=1
            )

        return check

    def _check_shard_end(
        self, path: Any, index: Any, offset: Any, n_records: Any, is_end: Any
    ) -> Any:
        """At a shard's end marker: True if all records were read, else raise or skip."""
        complete = tf.logical_or(tf.logical_not(is_end), tf.equal(index, n_records))
        return self._sound_or_reported(complete, path, index, offset, n_records, _CORRUPT_HINT)

    def _sound_or_reported(
        self,
        ok: Any,
        path: Any,
        index: Any,
        offset: Any,
        n_records: Any,
        problem: str,
        lost: int | None = None,
    ) -> Any:
        """``ok`` where a record (or a shard's end) is sound. Where it is not: raises an
        error naming the file, the offset and ``problem`` (``on_corrupt="raise"``), or
        reports the skip (``lost`` records: the rest of the shard by default) and returns
        False."""
        if self.on_corrupt == "raise":
            message = tf.strings.join(
                [
                    "keras-tfr: corrupt record in ",
                    path,
                    " at byte offset ",
                    tf.strings.as_string(offset),
                    " (record ",
                    tf.strings.as_string(index),
                    " of ",
                    tf.strings.as_string(n_records),
                    "): " + problem,
                ]
            )
            with tf.control_dependencies([tf.debugging.Assert(ok, [message], summarize=1)]):
                return tf.identity(ok)
        what = None if lost is None else problem

        def report(p: Any, off: Any, idx: Any, n: Any) -> np.bool_:
            self.report_skip(
                p.numpy().decode(), int(off), int(idx), int(n), lost=lost, problem=what
            )
            return np.bool_(False)

        return tf.cond(
            ok,
            lambda: tf.constant(True),
            lambda: tf.py_function(report, [path, offset, index, n_records], tf.bool),
        )


def _fixed_layout_decoder(
    specs: list[FeatureSpec], spr: int, m: Manifest, parse_pool: Callable
) -> Callable | None:
    """Decodes pools of full records by offset: one `decode_raw` of the whole records,
    then per feature a slice and a zero-copy bitcast, instead of `parse_example` (which
    copies every payload out) followed by a `decode_raw` per feature.

    All full records of a data set share one layout (`BlockEncoder.fixed_layout`); each
    record was checked against it as it was read (`GraphReader._layout_check`), so the
    pool is cut by offset. A pool holding the short last record takes the
    `parse_example` path. Returns None when the manifest's record size does not match
    the layout.
    """
    from keras_tfr.schema import BlockEncoder

    offsets, headers, length = BlockEncoder(specs, m.lattice).fixed_layout(spr)
    if length != m.record_bytes:
        return None

    def fast(serialized: Any) -> Any:
        u8 = tf.io.decode_raw(serialized, tf.uint8)  # [k, record_bytes]
        decoded = {}
        for s in specs:
            seg = u8[:, offsets[s.key] : offsets[s.key] + spr * s.sample_bytes]
            decoded[s.key] = tf_bytes_to_feature(seg, s)
        k = tf.shape(serialized, out_type=tf.int64)[0]
        return decoded, tf.fill([k], tf.constant(spr, tf.int64))

    def slow(serialized: Any) -> Any:
        decoded, parsed = parse_pool(serialized)
        return decoded, parsed[COUNT_KEY]

    # Every record checked has the manifest's layout (`GraphReader._layout_check`), so
    # where all records are full, or the only one is short, one path serves every pool:
    # no `tf.cond`, whose branches TensorFlow prepares again for each new iterator.
    if m.total_samples % spr == 0:
        return fast
    if m.total_records == 1:
        return slow

    # On a lattice the short last record can have a full record's length (the padding
    # rounds both up): a full record is one whose sample count field says so too.
    head = np.frombuffer(headers[0][1], dtype=np.uint8)

    def counts_full(serialized: Any) -> Any:
        got = tf.io.decode_raw(tf.strings.substr(serialized, 0, len(head)), tf.uint8)
        return tf.reduce_all(tf.equal(got, head[None, :]))

    def decode(serialized: Any) -> Any:
        full = tf.reduce_all(tf.equal(tf.strings.length(serialized), m.record_bytes))
        if m.lattice is not None:
            full = tf.cond(full, lambda: counts_full(serialized), lambda: tf.constant(False))
        return tf.cond(full, lambda: fast(serialized), lambda: slow(serialized))

    return decode


def _rows_of(pool: dict) -> Any:
    """The samples in a pool: the first axis of its first feature."""
    first = next(iter(pool.values()))
    if isinstance(first, tf.RaggedTensor):
        return first.nrows(out_type=tf.int64)
    return tf.shape(first, out_type=tf.int64)[0]


def _empty_pool(spec: dict) -> dict:
    """A pool of no sample with the element spec ``spec``."""

    def empty(s: Any) -> Any:
        if isinstance(s, tf.RaggedTensorSpec):
            values = tf.zeros([0, *s.shape[2:]], s.dtype)
            return tf.RaggedTensor.from_row_lengths(
                values, tf.zeros([0], s.row_splits_dtype), validate=False
            )
        return tf.zeros([0, *s.shape[1:]], s.dtype)

    return {k: empty(s) for k, s in spec.items()}


def _filled(pools: tf.data.Dataset, rows: int) -> tf.data.Dataset:
    """``pools`` cut to exactly ``rows`` samples, continued with further passes where one
    pass holds fewer (records dropped by ``on_corrupt="skip"``).

    Each pass is followed by an empty pool, so an epoch whose first pass holds all its
    samples stops there: `take_while` sees the empty pool, not a pool of the next pass, and
    nothing of that pass is opened or read."""
    rows_ = tf.constant(rows, tf.int64)
    marker = tf.data.Dataset.from_tensors(_empty_pool(pools.element_spec))
    stream = pools.concatenate(marker).repeat()

    def cut(before: Any, pool: Any) -> Any:
        n = _rows_of(pool)
        keep = tf.clip_by_value(rows_ - before, 0, n)
        return before + n, (before, {k: v[:keep] for k, v in pool.items()})

    cut_stream = stream.scan(tf.constant(0, tf.int64), cut)
    kept = cut_stream.take_while(lambda before, pool: before < rows_)
    return kept.map(lambda before, pool: pool)


def _records_or_empty(path: Any, compression: str) -> tf.data.Dataset:
    """`TFRecordDataset` of one shard; empty when the file does not exist.

    A file that cannot be opened makes `ignore_errors` retry it forever (TensorFlow's
    reader moves on after a bad record, not after a failed open), so a shard deleted after
    the source was built would hang the pipeline. Reading nothing instead lets the
    shard-end check name it, at byte offset 0. One glob per shard and epoch, with the
    path's wildcard characters escaped, run when the shard's first record is asked for,
    just before the file is opened: not when the interleave prepares the shard, which can
    be many batches earlier (a shard deleted in between hung the pipeline).
    """

    def open_if_there(p: Any) -> tf.data.Dataset:
        pattern = tf.strings.regex_replace(p, r"([*?\[\]\\])", r"\\\1")
        found = tf.io.matching_files(pattern)[:1]
        return tf.data.TFRecordDataset(found, compression, buffer_size=_READ_BUFFER)

    return tf.data.Dataset.from_tensors(path).flat_map(open_if_there)
