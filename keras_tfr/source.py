"""`TFRecordSequenceSource`: a data set's shards streamed into `fit`, `evaluate`, `predict`.

It is a `tf.data.Dataset` (built like TensorFlow's own `TFRecordDatasetV2`: the pipeline's
variant tensor is handed to ``Dataset.__init__``), so the whole read path runs in
tf.data's C++ runtime and Keras takes it as it takes any data set, with the TensorFlow,
JAX and torch backends alike.

Two read paths give the same batches, checks and step counts:

* the **direct reader** (`keras_tfr._direct`), used for uncompressed data sets of
  fixed-size features on a local file system: records are read with `os.preadv` straight
  into per-feature pools, checked with hardware CRC-32C and gathered into batches with
  NumPy (a third to a fifth of the CPU per byte of the graph path);
* the **graph reader** below, used for everything else (GZIP/ZLIB shards, variable-length
  features, `gs://` and other `tf.io.gfile` URLs, the tf.data service, platforms without
  `os.preadv`), or everywhere with the environment variable ``KERAS_TFR_READER=graph``.

The graph pipeline, stage by stage (each stage works on records, i.e. blocks of samples,
or on pools of blocks, never on single samples, so the per-element overhead of tf.data is
paid once per block):

1. shard list from the manifest (shuffled each epoch when ``shuffle=True``);
2. parallel interleave of `TFRecordDataset` readers, one per shard; a scan counts records
   and byte offsets so that a damaged record is reported with its file and offset;
3. the validation split keeps or drops whole records (seeded, disjoint, complete);
4. shuffle: a buffer of records sized in bytes (``shuffle_memory``);
5. pools of records are parsed with one batched `parse_example`, decoded with one
   `decode_raw` and a zero-copy `bitcast` per feature, and permuted inside the pool;
6. `rebatch` to ``batch_size`` without going through single samples; prefetch;
7. the step count is asserted from the manifest, so Keras knows it before epoch 1.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from typing import Any

import numpy as np
import tensorflow as tf

from keras_tfr import distribute as _distribute
from keras_tfr.manifest import Manifest, parse_size
from keras_tfr.schema import (
    COUNT_KEY,
    FeatureSpec,
    check_host_byte_order,
    tf_bytes_to_feature,
    tf_decode_feature,
    tf_decode_variable,
)

__all__ = ["TFRecordSequenceSource"]

log = logging.getLogger("keras_tfr")

DEFAULT_SHUFFLE_MEMORY = "64MB"
_POOL_BYTES = 16 << 20
_READ_BUFFER = 1 << 20
_CORRUPT_HINT = (
    "the record failed its TFRecord CRC check, or the file is truncated or unreadable; "
    "run `keras-tfr verify` on the data set"
)


class TFRecordSequenceSource(tf.data.Dataset):
    """Streams a keras-tfr data set as batches for Keras, with bounded memory.

    Args:
        directory: the data set's directory (written by `ArraysToRecords`); local or any
            `tf.io.gfile` URL (``gs://``, ``s3://``, ``hdfs://``, ``ram://``).
        batch_size: samples per batch.
        shuffle: shuffle records and the samples inside pools of records, anew each
            epoch (direct reader: a permutation of all records, read in pools of a quarter
            of ``shuffle_memory``; graph reader: shard order, a buffer of records, pools).
            Default True, as in Keras' own ``*_dataset_from_directory`` utilities; pass
            False to read in written order.
        seed: makes shuffling and the validation split reproducible. Required with
            ``validation_split``, and the same for both subsets.
        drop_remainder: drop the last, partial batch.
        validation_split: fraction (0 to 1) of the data reserved for validation; whole
            records are assigned, so the two subsets are disjoint and together complete.
        subset: ``"training"`` or ``"validation"``; required with ``validation_split``.
        shuffle_memory: the shuffle's memory budget in bytes (``"64MB"`` or an int).
        on_corrupt: ``"raise"`` (default) stops on a damaged record with its file and byte
            offset; ``"skip"`` logs it, drops it (with the graph reader the rest of that
            shard goes too: TensorFlow's reader cannot resume inside a shard), and fills
            the epoch from the next pass so that the step count stays the one Keras was
            given.
        max_corrupt_records: with ``on_corrupt="skip"``, stop with an error once more than
            this many records were dropped in this process.
        num_parallel_reads: reader threads (direct reader, default 2-4) or shards read
            at once (graph reader, default up to 8).
        deterministic: element order reproducible across runs; default True unless
            ``shuffle=True`` without a ``seed``.
        check_files: check at construction that every shard exists with its size.
        ragged: for variable-length features: ``"pad"`` (default) pads each batch with
            zeros to its longest sample; ``"ragged"`` yields `tf.RaggedTensor` batches.
        decode: ``{feature key: fn}``: a TensorFlow function applied to each sample of
            that feature inside the pipeline, e.g. ``{"x": tf.io.decode_png}`` for a
            ``bytes`` feature of PNG files. Its outputs must share one shape within a
            batch (resize inside `fn` when images differ in size).
        num_workers, worker_index: read only this worker's share of the records (a
            disjoint, balanced run of shards) with the same step count on every worker;
            see `keras_tfr.distribute_source` for `tf.distribute` strategies.
        service: ``"grpc://host:port"`` of a tf.data service dispatcher: reading and
            decoding run on its workers (`keras-tfr serve` starts some).
        service_mode: ``"distributed_epoch"`` (each sample once per epoch across the
            service's workers) or ``"parallel_epochs"`` (each worker sends a full epoch).
        service_job_name: share one service job between several trainers.
        manifest: a `Manifest` already in memory (what `replace` passes), so the
            directory's manifest is not read again.

    Example:
        >>> train = TFRecordSequenceSource("data/train", batch_size=256, shuffle=True,
        ...                                seed=0, validation_split=0.1, subset="training")
        >>> val = TFRecordSequenceSource("data/train", batch_size=256, shuffle=False,
        ...                              seed=0, validation_split=0.1, subset="validation")
        >>> model.fit(train, validation_data=val, epochs=5)
        >>> len(train)  # steps per epoch, known before the first one
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        batch_size: int = 32,
        *,
        shuffle: bool = True,
        seed: int | None = None,
        drop_remainder: bool = False,
        validation_split: float | None = None,
        subset: str | None = None,
        shuffle_memory: int | str = DEFAULT_SHUFFLE_MEMORY,
        on_corrupt: str = "raise",
        max_corrupt_records: int = 100,
        num_parallel_reads: int | None = None,
        deterministic: bool | None = None,
        check_files: bool = True,
        ragged: str = "pad",
        decode: dict[str, Any] | None = None,
        num_workers: int | None = None,
        worker_index: int | None = None,
        service: str | None = None,
        service_mode: str = "distributed_epoch",
        service_job_name: str | None = None,
        manifest: Manifest | None = None,
    ):
        check_host_byte_order()
        self._worker = _distribute.check_worker_args(num_workers, worker_index)
        _distribute.check_service_args(service, service_mode, service_job_name)
        if service is not None and on_corrupt == "skip":
            raise ValueError(
                "`on_corrupt='skip'` runs Python code in the pipeline, which the tf.data "
                "service cannot ship to its workers. Received: service="
                f"{service!r} with on_corrupt='skip'; use on_corrupt='raise'."
            )
        self._service = (service, service_mode, service_job_name) if service else None
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)):
            raise TypeError(f"Expected `batch_size` to be a positive int. Received: {batch_size!r}")
        if batch_size < 1:
            raise ValueError(f"Expected `batch_size` to be a positive int. Received: {batch_size}")
        if not isinstance(shuffle, (bool, np.bool_)):
            raise TypeError(f"Expected `shuffle` to be a bool. Received: {shuffle!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
            raise TypeError(f"Expected `seed` to be an int or None. Received: {seed!r}")
        if validation_split is not None:
            if isinstance(validation_split, bool) or not isinstance(
                validation_split, (int, float, np.floating)
            ):
                raise TypeError(
                    f"Expected `validation_split` to be a float. Received: {validation_split!r}"
                )
            if not 0 < float(validation_split) < 1:
                raise ValueError(
                    "Expected `validation_split` to be between 0 and 1 (exclusive). "
                    f"Received: {validation_split}"
                )
            if subset not in ("training", "validation"):
                raise ValueError(
                    "Expected `subset` to be 'training' or 'validation' when "
                    f"`validation_split` is set. Received: subset={subset!r}"
                )
            if seed is None:
                raise ValueError(
                    "Expected a `seed` with `validation_split`: both subsets must use the same "
                    "seed to be disjoint. Received: seed=None"
                )
        elif subset is not None:
            raise ValueError(
                f"`subset={subset!r}` needs `validation_split`. Received: validation_split=None"
            )
        if on_corrupt not in ("raise", "skip"):
            raise ValueError(
                f"Expected `on_corrupt` to be 'raise' or 'skip'. Received: {on_corrupt!r}"
            )
        if (
            isinstance(max_corrupt_records, bool)
            or not isinstance(max_corrupt_records, int)
            or max_corrupt_records < 0
        ):
            raise ValueError(
                "Expected `max_corrupt_records` to be a non-negative int. "
                f"Received: {max_corrupt_records!r}"
            )
        if num_parallel_reads is not None and (
            not isinstance(num_parallel_reads, int) or num_parallel_reads < 1
        ):
            raise ValueError(
                "Expected `num_parallel_reads` to be a positive int or None. "
                f"Received: {num_parallel_reads!r}"
            )
        shuffle_bytes = parse_size(shuffle_memory, argument="shuffle_memory")

        if manifest is None:
            manifest = Manifest.load(os.fspath(directory), check_files=check_files)
        from keras_tfr.tfrecords import check_decode_options

        self._ragged, self._decode = check_decode_options(
            ragged, decode, [f.key for f in manifest.features]
        )
        self._manifest = manifest
        self._config = dict(
            directory=os.fspath(directory),
            batch_size=int(batch_size),
            shuffle=bool(shuffle),
            seed=None if seed is None else int(seed),
            drop_remainder=bool(drop_remainder),
            validation_split=None if validation_split is None else float(validation_split),
            subset=subset,
            shuffle_memory=shuffle_memory,
            on_corrupt=on_corrupt,
            max_corrupt_records=max_corrupt_records,
            num_parallel_reads=num_parallel_reads,
            deterministic=deterministic,
            ragged=ragged,
            decode=decode,
            num_workers=num_workers,
            worker_index=worker_index,
            service=service,
            service_mode=service_mode,
            service_job_name=service_job_name,
        )
        self._batch_size = int(batch_size)
        self._shuffle = bool(shuffle)
        self._seed = None if seed is None else int(seed)
        self._drop_remainder = bool(drop_remainder)
        self._shuffle_bytes = shuffle_bytes
        self._on_corrupt = on_corrupt
        self._max_corrupt = max_corrupt_records
        self._corrupt_lock = threading.Lock()
        self.corrupt_records = 0
        self._corrupt_seen: set[tuple[str, int]] = set()
        self._num_parallel_reads = num_parallel_reads
        if deterministic is None:
            deterministic = not (self._shuffle and self._seed is None)
        self._deterministic = bool(deterministic)

        self._keep = self._select_records(validation_split, subset)
        self._num_samples = self._count_samples()
        if self._num_samples == 0:
            raise ValueError(
                f"The {subset or 'selected'} subset of {directory} holds no samples "
                f"(validation_split={validation_split}); use a smaller split or more data."
            )
        if self._drop_remainder:
            self._steps = self._num_samples // self._batch_size
        else:
            self._steps = math.ceil(self._num_samples / self._batch_size)
        if self._steps == 0:
            raise ValueError(
                f"`batch_size={batch_size}` with `drop_remainder=True` leaves no batch: the "
                f"subset holds only {self._num_samples} samples."
            )
        self._pad_batches = 0
        if self._worker is not None:
            # This worker's balanced share, and the step count every worker agrees on.
            self._keep, self._num_samples, self._steps, self._pad_batches = (
                _distribute.worker_share(
                    self._keep,
                    self._record_samples(),
                    *self._worker,
                    self._batch_size,
                    self._drop_remainder,
                )
            )
        self._direct_plan = None  # the direct reader's plan, when it reads this source
        with _only_op_seeds():
            self._impl = self._build()
        super().__init__(self._impl._variant_tensor)

    # ----------------------------------------------------------- tf.data.Dataset API

    def _inputs(self) -> list:
        return [self._impl]

    @property
    def element_spec(self) -> Any:
        return self._impl.element_spec

    def __len__(self) -> int:
        return self._steps

    def __repr__(self) -> str:
        return (
            f"<TFRecordSequenceSource {self._config['directory']!r}: {self._num_samples} "
            f"samples, batch_size={self._batch_size}, {self._steps} steps, "
            f"shuffle={self._shuffle}>"
        )

    # ----------------------------------------------------------- public extras

    @property
    def manifest(self) -> Manifest:
        """The data set's `Manifest` (read once, when this source was built)."""
        return self._manifest

    @property
    def num_samples(self) -> int:
        """Samples per epoch in this subset."""
        return self._num_samples

    @property
    def steps(self) -> int:
        """Batches per epoch (``len(source)``)."""
        return self._steps

    @property
    def batch_size(self) -> int:
        return self._batch_size

    def replace(self, **changes: Any) -> TFRecordSequenceSource:
        """A copy with some arguments changed, built from the manifest already in memory.

        Example:
            >>> bigger = source.replace(batch_size=512, shuffle_memory="256MB")
        """
        unknown = set(changes) - set(self._config)
        if unknown:
            raise TypeError(
                f"`replace` got unknown arguments {sorted(unknown)}; expected some of "
                f"{sorted(self._config)}"
            )
        config = {**self._config, **changes}
        directory = config.pop("directory")
        return TFRecordSequenceSource(directory, manifest=self._manifest, **config)

    def with_batch_size(self, batch_size: int) -> TFRecordSequenceSource:
        """A copy with another batch size (no re-reading of the manifest)."""
        return self.replace(batch_size=batch_size)

    @staticmethod
    def from_tfrecords(paths_or_glob: Any, features: Any = None, batch_size: int = 32, **kwargs):
        """Streams TFRecord files written by other tools (one `tf.train.Example` per sample).

        See `keras_tfr.tfrecords.from_tfrecords` for the arguments. Returns a
        `tf.data.Dataset` of known cardinality (records are counted once; the count is
        cached beside the files).

        Example:
            >>> ds = TFRecordSequenceSource.from_tfrecords(
            ...     "old/*.tfrecord", features={"image": TensorFeature(tf.float32, (28, 28)),
            ...     "label": tf.io.FixedLenFeature([], tf.float32)}, y="label", batch_size=256)
        """
        from keras_tfr.tfrecords import from_tfrecords

        return from_tfrecords(paths_or_glob, features, batch_size, **kwargs)

    # ----------------------------------------------------------- selection

    def _record_samples(self) -> np.ndarray:
        """Samples in each global record (only the data set's last record can be short)."""
        m = self._manifest
        counts = np.full(m.total_records, m.samples_per_record, dtype=np.int64)
        if m.total_records:
            counts[-1] = m.total_samples - (m.total_records - 1) * m.samples_per_record
        return counts

    def _select_records(self, split: float | None, subset: str | None) -> np.ndarray | None:
        """Boolean mask over global records, or None for all of them.

        Like Keras' ``validation_split``: a seeded permutation of the records; the first
        ``round(split * records)`` of it (at least one, at most all but one) are validation.
        """
        if split is None:
            return None
        total = self._manifest.total_records
        if total < 2:
            raise ValueError(
                f"`validation_split` needs at least 2 records; {self._config['directory']} "
                f"holds {total}. Write with a smaller `samples_per_record`."
            )
        n_val = min(max(1, round(split * total)), total - 1)
        perm = np.random.default_rng(self._seed).permutation(total)
        is_val = np.zeros(total, dtype=bool)
        is_val[perm[:n_val]] = True
        return is_val if subset == "validation" else ~is_val

    def _count_samples(self) -> int:
        counts = self._record_samples()
        if self._keep is None:
            return int(counts.sum())
        return int(counts[self._keep].sum())

    # ----------------------------------------------------------- pipeline

    def _build(self) -> tf.data.Dataset:
        m = self._manifest
        spr = m.samples_per_record
        specs = sorted(m.features, key=lambda s: s.key)
        record_bytes = max(1, m.record_bytes)
        seed = self._seed

        def op_seed(k: int) -> int | None:
            return None if seed is None else seed * 7919 + k

        if self._direct_ok(specs):
            return self._finish(self._build_direct(specs), specs, direct=True)

        files = [m.shard_path(s) for s in m.shards]
        first = np.cumsum([0] + [s.records for s in m.shards])[:-1].astype(np.int64)
        counts = np.array([s.records for s in m.shards], dtype=np.int64)
        if self._keep is not None:
            # Shards with no selected record are not opened at all.
            keep_per_shard = [bool(self._keep[f : f + c].any()) for f, c in zip(first, counts)]
            files = [f for f, k in zip(files, keep_per_shard) if k]
            first = first[keep_per_shard]
            counts = counts[keep_per_shard]
        shards = tf.data.Dataset.from_tensor_slices(
            (tf.constant(files, tf.string), tf.constant(first), tf.constant(counts))
        )
        if self._shuffle:
            shards = shards.shuffle(len(files), seed=op_seed(1), reshuffle_each_iteration=True)

        keep = None if self._keep is None else tf.constant(self._keep)
        compression = m.compression or ""

        # Every full record of a fixed-layout data set has the same size and only the data
        # set's last record can be short, so record i of a shard starts at i * frame: an
        # `enumerate` replaces the scan of lengths, and one filter per record (instead of
        # four functions) checks the shard's end and the split. Yields (index, record).
        frame = m.record_bytes + 16
        fixed_layout = m.record_bytes > 0 and all(s.kind == "fixed" for s in specs)

        def read_fixed_shard(path, first_record, n_records):
            records = _records_or_empty(path, compression)
            end = tf.data.Dataset.from_tensors(tf.constant(b""))  # records are never empty
            indexed = records.ignore_errors().concatenate(end).enumerate()

            def keep_record(i, record):
                def at_end():
                    ok = self._check_shard_end(path, i, i * frame, n_records, tf.constant(True))
                    return tf.logical_and(ok, tf.equal(tf.strings.length(record), -1))

                if keep is None:
                    keep_it = lambda: tf.constant(True)  # noqa: E731
                else:
                    keep_it = lambda: tf.gather(keep, first_record + i)  # noqa: E731
                return tf.cond(tf.strings.length(record) > 0, keep_it, at_end)

            return indexed.filter(keep_record)

        def read_shard(path, first_record, n_records):
            if fixed_layout:
                return read_fixed_shard(path, first_record, n_records)
            records = _records_or_empty(path, compression)
            # TensorFlow's reader ends a shard at its first bad record; ignore_errors turns
            # that into a short shard, which the scan below detects, names and counts.
            records = records.ignore_errors().map(lambda r: (r, False))
            sentinel = tf.data.Dataset.from_tensors((tf.constant(b""), True))

            def scan_fn(state, elem):
                index, offset = state
                record, is_end = elem
                if_end_ok = self._check_shard_end(path, index, offset, n_records, is_end)
                length = tf.cast(tf.strings.length(record), tf.int64) + 16
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
            return scanned.map(lambda i, r, e, ok: (i, r))

        cycle = self._num_parallel_reads or min(8, max(2, os.cpu_count() or 2))
        cycle = max(1, min(cycle, len(files)))
        if self._shuffle:
            records = shards.interleave(
                read_shard,
                cycle_length=cycle,
                block_length=1,
                num_parallel_calls=cycle,  # not AUTOTUNE: it ramps up from one reader
                deterministic=self._deterministic,
            )
            buffer_records = max(1, (self._shuffle_bytes // 4) // record_bytes)
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

        pool_records = max(1, self._pool_bytes() // record_bytes)
        records = records.batch(pool_records).map(lambda _, r: r)  # drop the indices

        feature_spec = {s.key: tf.io.FixedLenFeature([], tf.string) for s in specs}
        feature_spec[COUNT_KEY] = tf.io.FixedLenFeature([], tf.int64)
        fixed_specs = [s for s in specs if s.kind == "fixed"]
        variable_specs = [s for s in specs if s.kind != "fixed"]
        for s in variable_specs:
            feature_spec[s.lengths_key] = tf.io.FixedLenFeature([], tf.string)
        has_short_record = m.total_samples % spr != 0
        shuffle = self._shuffle

        def parse_pool(serialized):
            parsed = tf.io.parse_example(serialized, feature_spec)
            decoded = {s.key: tf_decode_feature(parsed[s.key], s, spr) for s in fixed_specs}
            return decoded, parsed

        fast_decode = None
        if fixed_layout and not variable_specs:
            fast_decode = _fixed_layout_decoder(specs, spr, m.record_bytes, parse_pool)

        def decode_pool(serialized, rand):
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
            if shuffle:
                if has_short_record:
                    valid = tf.reshape(tf.sequence_mask(counts_, spr), [-1])
                    idx = tf.where(valid)[:, 0]
                else:
                    idx = tf.range(tf.shape(counts_, out_type=tf.int64)[0] * spr)
                if variable:
                    # The same permutation as stateless_shuffle(idx), applied to both.
                    perm = tf.random.experimental.stateless_shuffle(
                        tf.range(tf.size(idx, out_type=tf.int64)), seed=rand
                    )
                    idx = tf.gather(idx, perm)
                    variable = {k: tf.gather(v, perm) for k, v in variable.items()}
                else:
                    idx = tf.random.experimental.stateless_shuffle(idx, seed=rand)
                decoded = {k: tf.gather(v, idx) for k, v in decoded.items()}
            elif has_short_record:
                n = tf.reduce_sum(counts_)
                decoded = {k: v[:n] for k, v in decoded.items()}
            decoded.update(variable)
            return decoded

        # A fixed parallelism starts the first epoch at full speed (AUTOTUNE ramps up from
        # one call, which costs Keras a slow start at every epoch's new iterator).
        decoders = max(2, os.cpu_count() or 2)
        if shuffle:
            rng = tf.data.Dataset.random(seed=op_seed(3), rerandomize_each_iteration=True)
            rng = rng.batch(2)
            pools = tf.data.Dataset.zip((records, rng)).map(
                decode_pool, num_parallel_calls=decoders, deterministic=self._deterministic
            )
        else:
            pools = records.map(
                lambda s: decode_pool(s, None), num_parallel_calls=decoders, deterministic=True
            )
        if self._service is not None:
            # Reading, parsing and decoding run on the tf.data service workers; batches are
            # cut here, so an epoch keeps exactly the step count Keras was given.
            pools = _distribute.via_service(pools, *self._service)
        batches = pools.rebatch(self._batch_size, drop_remainder=self._drop_remainder)
        return self._finish(batches, specs, direct=False)

    def _pool_bytes(self) -> int:
        """Bytes of records whose samples are permuted together (both read paths): at
        least two batches, at most a quarter of ``shuffle_memory`` when shuffling."""
        m = self._manifest
        pool_bytes = max(_POOL_BYTES, 2 * self._batch_size * m.sample_bytes)
        if self._shuffle:
            pool_bytes = min(pool_bytes, max(m.record_bytes, self._shuffle_bytes // 4))
        return pool_bytes

    def _direct_ok(self, specs: list[FeatureSpec]) -> bool:
        """Whether the direct read path (`keras_tfr._direct`) can read this data set."""
        m = self._manifest
        choice = os.environ.get("KERAS_TFR_READER", "auto").strip().lower()
        if choice not in ("auto", "direct", "graph"):
            raise ValueError(
                f"Expected KERAS_TFR_READER to be 'auto', 'direct' or 'graph'. Received: {choice!r}"
            )
        if choice == "graph":
            return False
        from keras_tfr import _direct

        reasons = []
        if m.compression:
            reasons.append(f"the shards are {m.compression}-compressed")
        if m.record_bytes <= 0 or any(s.kind != "fixed" for s in specs):
            reasons.append("it has variable-length features")
        elif _direct.frame_bytes(specs, m.samples_per_record) != m.record_bytes + 16:
            reasons.append("its manifest's record size does not match the record layout")
        if self._service is not None:
            reasons.append("the tf.data service runs the pipeline on its own workers")
        if "://" in self._config["directory"]:
            reasons.append("it is not on a local file system")
        if not _direct.available():
            reasons.append("this platform lacks os.preadv")
        if reasons and choice == "direct":
            raise ValueError(
                "KERAS_TFR_READER=direct, but the direct reader cannot read "
                f"{self._config['directory']}: " + "; ".join(reasons)
            )
        return not reasons

    def _build_direct(self, specs: list[FeatureSpec]) -> tf.data.Dataset:
        from keras_tfr import _direct

        m = self._manifest
        if self._keep is None:
            kept = np.arange(m.total_records, dtype=np.int64)
        else:
            kept = np.flatnonzero(self._keep).astype(np.int64)

        def skip(path: str, offset: int, index: int, n_records: int, problem: str) -> None:
            self._report_skip(path, offset, index, n_records, lost=1, problem=problem)

        plan = _direct.DirectPlan(
            specs=specs,
            files=[m.shard_path(s) for s in m.shards],
            shard_records=[s.records for s in m.shards],
            samples_per_record=m.samples_per_record,
            total_samples=m.total_samples,
            kept_records=kept,
            num_samples=self._num_samples,
            num_batches=self._steps - self._pad_batches,
            batch_size=self._batch_size,
            shuffle=self._shuffle,
            seed=self._seed,
            pool_bytes=self._pool_bytes(),
            readers=self._num_parallel_reads or min(4, max(2, os.cpu_count() or 2)),
            skip=skip if self._on_corrupt == "skip" else None,
        )
        self._direct_plan = plan
        raw = _direct.dataset(plan)
        # One map decodes and (without `decode=` steps in between) builds Keras' structure:
        # each stage costs the iterator made at every epoch's start a few milliseconds.
        structure = self._structure_fn(specs) if not self._decode else (lambda d: d)
        rows = self._batch_size if self._drop_remainder else None

        def decode(*u8):
            return structure(
                {
                    s.key: tf_bytes_to_feature(tf.ensure_shape(t, [rows, s.sample_bytes]), s)
                    for s, t in zip(specs, u8)
                }
            )

        return raw.map(decode)

    def _finish(self, batches: tf.data.Dataset, specs: list[FeatureSpec], direct: bool):
        """The stages after batching, shared by both read paths."""
        variable_specs = [s for s in specs if s.kind != "fixed"]
        skip_mode = self._on_corrupt == "skip"
        if variable_specs or self._decode:
            from keras_tfr.tfrecords import finish_features

            finish = finish_features(self._decode, self._ragged)
            batches = batches.map(finish, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        if not direct or self._decode:
            batches = batches.map(self._structure_fn(specs))
        if self._pad_batches:
            batches = _distribute.pad_with_empty_batches(batches, self._pad_batches)
        if skip_mode and not direct:
            # Dropped records would shorten the epoch: fill it from the next pass instead,
            # so Keras always gets exactly the step count it was given.
            batches = batches.repeat().take(self._steps)
        batches = batches.prefetch(tf.data.AUTOTUNE)
        if self._service is None or self._service[1] == "distributed_epoch":
            # (in "parallel_epochs" mode every service worker sends an epoch of its own)
            batches = batches.apply(tf.data.experimental.assert_cardinality(self._steps))
        options = tf.data.Options()
        options.deterministic = self._deterministic
        if self._worker is not None:
            # This source already holds only its worker's share: no second sharding.
            off = tf.data.experimental.AutoShardPolicy.OFF
            options.experimental_distribute.auto_shard_policy = off
        options.experimental_optimization.map_parallelization = True
        if direct:
            options.experimental_optimization.apply_default_optimizations = False
        batches = batches.with_options(options)
        return batches

    def _check_shard_end(self, path, index, offset, n_records, is_end):
        """At a shard's end marker: True if all records were read, else raise or skip."""
        complete = tf.logical_or(tf.logical_not(is_end), tf.equal(index, n_records))
        if self._on_corrupt == "raise":
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
                    "): " + _CORRUPT_HINT,
                ]
            )
            assert_op = tf.debugging.Assert(complete, [message], summarize=1)
            with tf.control_dependencies([assert_op]):
                return tf.identity(tf.constant(True))

        def report(p, off, idx, n):
            return np.bool_(self._report_skip(p.numpy().decode(), int(off), int(idx), int(n)))

        return tf.cond(
            complete,
            lambda: tf.constant(True),
            lambda: tf.py_function(report, [path, offset, index, n_records], tf.bool),
        )

    def _report_skip(
        self,
        path: str,
        offset: int,
        index: int,
        n_records: int,
        lost: int | None = None,
        problem: str | None = None,
    ) -> bool:
        """Counts and logs a skipped record; ``lost`` records go (default: the rest of the
        shard, as TensorFlow's reader cannot resume after a bad record)."""
        if lost is None:
            lost = n_records - index
        with self._corrupt_lock:
            # Counted once per damaged record, not once per pass: filling the epoch and
            # every later epoch read the same damage again.
            new = (path, index) not in self._corrupt_seen
            if new:
                self._corrupt_seen.add((path, index))
                self.corrupt_records += lost
            total = self.corrupt_records
        if new and problem is not None:
            log.warning(
                "keras-tfr: skipped a corrupt record in %s at byte offset %d (record %d of %d): "
                "%s; %d record(s) skipped so far",
                path,
                offset,
                index,
                n_records,
                problem,
                total,
            )
        elif new:
            log.warning(
                "keras-tfr: skipped a corrupt record in %s at byte offset %d (record %d of %d) "
                "and the %d record(s) after it in that shard; %d record(s) skipped so far",
                path,
                offset,
                index,
                n_records,
                lost - 1,
                total,
            )
        if total > self._max_corrupt:
            raise RuntimeError(
                f"keras-tfr: {total} corrupt records skipped, more than "
                f"max_corrupt_records={self._max_corrupt}; last in {path} at byte offset "
                f"{offset}. Run `keras-tfr verify` on the data set."
            )
        return True

    def _structure_fn(self, specs: list[FeatureSpec]):
        structure = self._manifest.structure

        def role_value(decoded, role):
            kind = structure[role]
            role_specs = [s for s in specs if s.role == role]
            if kind == "array":
                return decoded[role_specs[0].key]
            if kind == "dict":
                return {s.name: decoded[s.key] for s in role_specs}
            return tuple(decoded[s.key] for s in sorted(role_specs, key=lambda s: int(s.name)))

        roles = [r for r in ("x", "y", "sample_weight") if r in structure]

        def fn(decoded):
            values = tuple(role_value(decoded, r) for r in roles)
            return values[0] if len(values) == 1 else values

        return fn


@contextlib.contextmanager
def _only_op_seeds():
    """Lets `seed=` alone decide the source's order.

    TensorFlow combines an op's seed with the global seed (`tf.random.set_seed`, which
    `keras.utils.set_random_seed` calls), so the same `seed=` would shuffle differently
    in a program that set one. While the pipeline is built (eagerly), the global seed is
    hidden; it is not reset (`tf.random.set_seed` would restart the user's own random
    sequence).
    """
    from tensorflow.python.eager import context

    ctx = context.context()
    saved = getattr(ctx, "_seed", None)
    if saved is None or not tf.executing_eagerly():
        yield
        return
    ctx._seed = None
    try:
        yield
    finally:
        ctx._seed = saved


def _fixed_layout_decoder(specs: list[FeatureSpec], spr: int, record_bytes: int, parse_pool):
    """Decodes pools of full records by offset: one `decode_raw` of the whole records,
    then per feature a slice and a zero-copy bitcast, instead of `parse_example` (which
    copies every payload out) followed by a `decode_raw` per feature.

    All full records of a data set share one layout (`BlockEncoder.fixed_layout`); every
    non-payload byte is checked against it, so a record that is not what the manifest
    says fails loudly. A pool holding the short last record takes the `parse_example` path.
    Returns None when the manifest's record size does not match the layout.
    """
    from keras_tfr.schema import BlockEncoder

    offsets, headers, length = BlockEncoder(specs).fixed_layout(spr)
    if length != record_bytes:
        return None
    header_positions = np.concatenate([np.arange(o, o + len(b)) for o, b in headers])
    header_bytes = np.frombuffer(b"".join(b for _, b in headers), dtype=np.uint8)

    def fast(serialized):
        u8 = tf.io.decode_raw(serialized, tf.uint8)  # [k, record_bytes]
        got = tf.gather(u8, header_positions, axis=1)
        ok = tf.reduce_all(tf.equal(got, header_bytes[None, :]))
        check = tf.debugging.Assert(
            ok,
            [
                "keras-tfr: a record passed its CRC check but does not have the layout its "
                "manifest describes; the data set was modified after it was written"
            ],
        )
        with tf.control_dependencies([check]):
            decoded = {}
            for s in specs:
                seg = u8[:, offsets[s.key] : offsets[s.key] + spr * s.sample_bytes]
                decoded[s.key] = tf_bytes_to_feature(seg, s)
        k = tf.shape(serialized, out_type=tf.int64)[0]
        return decoded, tf.fill([k], tf.constant(spr, tf.int64))

    def slow(serialized):
        decoded, parsed = parse_pool(serialized)
        return decoded, parsed[COUNT_KEY]

    def decode(serialized):
        full = tf.reduce_all(tf.equal(tf.strings.length(serialized), record_bytes))
        return tf.cond(full, lambda: fast(serialized), lambda: slow(serialized))

    return decode


def _records_or_empty(path, compression: str):
    """`TFRecordDataset` of one shard; empty when the file does not exist.

    A file that cannot be opened makes `ignore_errors` retry it forever (TensorFlow's
    reader moves on after a bad record, not after a failed open), so a shard deleted after
    the source was built would hang the pipeline. Reading nothing instead lets the
    shard-end check name it, at byte offset 0. One glob per shard and epoch, with the
    path's wildcard characters escaped.
    """
    pattern = tf.strings.regex_replace(path, r"([*?\[\]\\])", r"\\\1")
    found = tf.io.matching_files(pattern)[:1]
    return tf.data.TFRecordDataset(found, compression, buffer_size=_READ_BUFFER)
