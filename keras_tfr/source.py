"""`TFRecordSequenceSource`: a data set's shards streamed into `fit`, `evaluate`, `predict`.

It is a `tf.data.Dataset` (built like TensorFlow's own `TFRecordDatasetV2`: the pipeline's
variant tensor is handed to ``Dataset.__init__``), so Keras takes it as it takes any data
set, with the TensorFlow, JAX and torch backends alike, and its step count is known
before the first epoch.

This module only turns options into a plan and a plan into a pipeline; the parts live in
`keras_tfr.read`:

* `keras_tfr.read.options`: every argument, checked once (a frozen dataclass);
* `keras_tfr.read.order`: which samples an epoch reads, in which order (split, shares,
  shuffle), as a pure function of the seed and the epoch number;
* `keras_tfr.read.mapped`: sample mode's reader (memory-mapped shards, CRC-32C checked
  in place, gathered straight from the page cache);
* `keras_tfr.read.graph`: block mode's reader (tf.data's `TFRecordDataset`, for remote,
  compressed or variable-length data and the tf.data service).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import math
import os
import re
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import tensorflow as tf

from keras_tfr._compat import tf as compat_tf
from keras_tfr._compat.tf import OwnedIterator
from keras_tfr._seeds import drawn_seed, only_op_seeds
from keras_tfr.errors import CorruptRecordError
from keras_tfr.format import framing
from keras_tfr.manifest import Manifest, parse_size
from keras_tfr.read import order as _order
from keras_tfr.read import split as _distribute
from keras_tfr.read.options import DEFAULT_SHUFFLE_MEMORY, SourceOptions
from keras_tfr.schema import FeatureSpec, check_host_byte_order, tf_bytes_to_feature

__all__ = ["TFRecordSequenceSource"]

log = logging.getLogger("keras_tfr")

_POOL_BYTES = 16 << 20
# Sample mode's prefetch: batches ready ahead of the consumer, sized in bytes (at least 2,
# at most 32 batches). TensorFlow's AUTOTUNE grows a prefetch buffer while it runs, up to
# half of the machine's RAM, and never shrinks it: a longer epoch (a larger data set)
# then held more batches (measured: peak heap in use 151 MB reading 0.5 GB, 218 MB for
# 2 GB, docs/benchmarks.md). 2 MB, not more: a batch the model reads soon after it was
# gathered is still in the CPU's cache. `fit` of the small benchmark shape (800 KB
# batches) ran 3-8 % faster with 2 batches ahead than with 32; an eager Python loop over
# tf.data's own iterator (not the source's, which bypasses tf.data) read 25-30 % slower
# (docs/benchmarks.md, 2026-12-04).
_PREFETCH_BYTES = 2 << 20
_PREFETCH_BATCHES = (2, 32)
_READERS = ("auto", "mapped", "direct", "graph")  # "direct": the old name of "mapped"
# keras-tfr's damage message inside a TensorFlow error: bare (raised in Python, e.g. by a
# py_function), or, from a `tf.debugging.Assert` (block mode's checks, sample mode's
# units), in the brackets TensorFlow wraps around each value it prints ("assertion
# failed: [keras-tfr: ...]"), C-escaped: the brackets and escapes are TensorFlow's, not
# part of the message.
_CORRUPT = re.compile(r"\[(keras-tfr: corrupt record[^\n]*)\]|(keras-tfr: corrupt record[^\n]*)")
_CORRUPT_AT = re.compile(r"in (.+?) at byte offset (\d+)")


class TFRecordSequenceSource(tf.data.Dataset):
    """Streams a keras-tfr data set as batches for Keras, with bounded memory.

    Args:
        directory: the data set's directory (written by `ArraysToRecords`); local or any
            `tf.io.gfile` URL (``gs://``, ``s3://``, ``hdfs://``, ``ram://``).
        batch_size: samples per batch.
        shuffle: a new order every epoch, as ``fit(x, y, shuffle=True)`` (default True, as
            in Keras' ``*_dataset_from_directory`` utilities; False reads in written order,
            a split's subset included: the samples the split picked, in increasing
            written index, in either mode).
            What is shuffled depends on ``access``: single samples (sample mode) or
            records, then samples inside pools of records (block mode).
        seed: makes the split and the shuffle reproducible: the order of epoch ``e`` is a
            function of ``(seed, e)`` alone. Any int from -2**63 to 2**63 - 1 (TensorFlow's
            int64); each gives its own order. Required with ``validation_split``, and the
            same for both subsets. ``None``: a seed drawn from NumPy's global random state
            when the source is made, so that `keras.utils.set_random_seed` makes the order
            reproducible, as it makes Keras' shuffle of NumPy arrays (in block mode, with
            ``deterministic=True``).
        drop_remainder: drop the last, partial batch. The batch dimension of
            `element_spec` is ``batch_size`` where every batch is full: with
            ``drop_remainder=True``, and in sample mode also where the subset (or this
            worker's share) is whole batches, as Keras' pipeline for arrays gives them;
            else None.
        validation_split: fraction (0 to 1) of the data reserved for validation. Sample
            mode, and block mode on data sets of up to 64 records (and 4 million samples):
            ``int(validation_split * n)`` samples (at least one) drawn across the whole
            data set, the same ones in both modes. Block mode on larger data sets: whole
            records. The subsets are disjoint and together complete.
        subset: ``"training"`` or ``"validation"``; required with ``validation_split``.
        access: ``"samples"`` reads single samples at random through memory-mapped
            shards (local, uncompressed, fixed-size features); ``"blocks"`` reads whole
            records in sequence (remote storage, compressed shards, variable-length
            features, the tf.data service, spinning disks). ``"auto"`` (default) takes
            samples where they can be read and blocks elsewhere; `access` tells which was
            taken, and the log says why.
        verify: sample mode: ``"first_read"`` (default) checks each record's CRC-32C and
            layout the first time this source reads it, and again when its shard changes
            on disk; ``"every_epoch"`` checks every record again every epoch. Block mode
            checks every record as it is read, every epoch.
        shuffle_memory: block mode's shuffle budget in bytes (``"64MB"`` or an int).
        shuffle_window: sample mode: how much of the data one epoch shuffles at a time.
            None: all of it, one order over every sample. A size (``"4GB"`` or an int of
            bytes): each epoch permutes the records, cuts them into windows of that many
            bytes (at most 4,194,304 samples), and reads the windows one after the other,
            each in a new order of its samples; the window's records are read ahead
            from disk a record at a time and dropped from the mapping once read. What
            a data set larger than memory needs: the pages an epoch needs at a time are
            about one window's, and a batch still mixes samples of many records drawn
            from the whole data set. With a window, ``shuffle=False`` reads a split's
            subset as a scan, read ahead and dropped the same way. ``"auto"``
            (default): None when the data set fits in half of this machine's memory (or
            of its cgroup's limit, where lower), else an eighth of it, rounded down to a
            power of two. The split is the same either way.
        on_corrupt: ``"raise"`` (default) stops at a damaged record with a
            `CorruptRecordError` naming its file and byte offset; ``"skip"`` logs it, drops
            it and fills the epoch with other samples, so the step count stays the one
            Keras was given (block mode drops the rest of that shard: TensorFlow's reader
            cannot resume inside a shard).
        max_corrupt_records: with ``on_corrupt="skip"``, stop with a `CorruptRecordError`
            once more than this many records were dropped.
        num_parallel_reads: units of batches gathered at once (sample mode, default one
            per core, 2 to 8: calls in TensorFlow's threads, or the threads of an
            `as_numpy_iterator`) or shards read at once (block mode, default up to 8).
        deterministic: block mode: element order reproducible across runs; default True
            unless ``shuffle=True`` without a ``seed``. Sample mode is always ordered.
        check_files: check at construction that every shard exists with its size.
        ragged: for variable-length features: ``"pad"`` (default) pads each batch with
            zeros to its longest sample; ``"ragged"`` yields `tf.RaggedTensor` batches.
        decode: ``{feature key: fn}``: a TensorFlow function applied to each sample of
            that feature, e.g. ``{"x": tf.io.decode_png}`` for a ``bytes`` feature.
        num_workers, worker_index: read only this worker's share (disjoint, balanced, the
            same step count on every worker); see `keras_tfr.distribute_source`.
        service: ``"grpc://host:port"`` of a tf.data service dispatcher (block mode).
        service_mode: ``"distributed_epoch"`` or ``"parallel_epochs"``.
        service_job_name: share one service job between several trainers.
        manifest: a `Manifest` already in memory (what `replace` passes).

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
        access: str = "auto",
        verify: str = "first_read",
        shuffle_memory: int | str = DEFAULT_SHUFFLE_MEMORY,
        shuffle_window: int | str | None = "auto",
        on_corrupt: str = "raise",
        max_corrupt_records: int = 100,
        num_parallel_reads: int | None = None,
        deterministic: bool | None = None,
        check_files: bool = True,
        ragged: str = "pad",
        decode: Mapping[str, Callable] | None = None,
        num_workers: int | None = None,
        worker_index: int | None = None,
        service: str | None = None,
        service_mode: str = "distributed_epoch",
        service_job_name: str | None = None,
        manifest: Manifest | None = None,
    ):
        from keras_tfr.gpu import keep_tensorflow_off_gpus

        keep_tensorflow_off_gpus()  # before TensorFlow starts: no GPU for it under JAX/torch
        check_host_byte_order()
        from keras_tfr._compat import (
            keras_build,
            keras_errors,
            keras_numpy,
            keras_shuffle,
            keras_split,
        )

        keras_errors.install_corrupt_record_errors(corrupt_record_error)
        keras_shuffle.install_shuffle_warning_filter()  # Keras' shuffle warning: wrong for a source
        keras_numpy.install_numpy_batches()  # JAX/torch fit: NumPy batches without tf.data
        keras_split.install_split_hint()  # fit(source, validation_split=...): how to split
        keras_build.install_build_hook()  # JAX/torch build from a batch: not an epoch
        opts = SourceOptions(
            directory=directory,  # type: ignore[arg-type]
            batch_size=batch_size,
            shuffle=shuffle,
            seed=seed,
            drop_remainder=drop_remainder,
            validation_split=validation_split,
            subset=subset,
            access=access,
            verify=verify,
            shuffle_memory=shuffle_memory,
            shuffle_window=shuffle_window,
            on_corrupt=on_corrupt,
            max_corrupt_records=max_corrupt_records,
            num_parallel_reads=num_parallel_reads,
            deterministic=deterministic,
            check_files=check_files,
            ragged=ragged,
            decode=decode,
            num_workers=num_workers,
            worker_index=worker_index,
            service=service,
            service_mode=service_mode,
            service_job_name=service_job_name,
        )
        if manifest is None:
            manifest = Manifest.load(opts.directory, check_files=opts.check_files)
        from keras_tfr.tfrecords import check_decode_options

        self._ragged, self._decode = check_decode_options(
            opts.ragged, opts.decode, [f.key for f in manifest.features]
        )
        self._cfg = opts
        self._manifest = manifest
        self._specs = sorted(manifest.features, key=lambda s: s.key)
        self._access, why = _choose_access(opts, manifest, self._specs)
        if why:
            log.info("keras-tfr: %s reads in %s mode: %s", opts.directory, self._access, why)
        self._corrupt_lock = threading.Lock()
        self.corrupt_records = 0
        self._corrupt_seen: set[tuple[str, int]] = set()
        self._clock = _EpochClock(opts.directory)
        # `seed=None`: a seed drawn from NumPy's global state (`keras.utils.set_random_seed`
        # makes it reproducible, as for NumPy inputs); the service's workers draw their own.
        self._seed = opts.seed
        if opts.seed is None and opts.shuffle and opts.service is None:
            self._seed = drawn_seed()
        if opts.validation_split is not None and manifest.total_samples < 2:
            raise ValueError(
                f"`validation_split` needs at least 2 samples; {opts.directory} holds "
                f"{manifest.total_samples}."
            )
        if self._access == "samples":
            self._order: _order.SampleOrder | None = self._sample_plan()
        else:
            self._order = None
            self._block_plan()
        if self._num_samples == 0:
            raise ValueError(
                f"The {opts.subset or 'selected'} subset of {opts.directory} holds no samples "
                f"(validation_split={opts.validation_split}); use a smaller split or more data."
            )
        # TensorFlow keeps the Python functions of this source's pipeline for the process's
        # life (`_py_funcs_of`): taken out of its list when the source is collected.
        self._py_funcs: set[int] = set()
        forget = weakref.finalize(self, _forget_py_funcs, self._py_funcs)
        forget.atexit = False
        # Its functions prepared without Grappler for each new iterator
        # (`keras_tfr._compat.tf.one_device_functions`).
        with only_op_seeds(), _py_funcs_of(self._py_funcs), compat_tf.one_device_functions():
            self._impl = self._build()
        super().__init__(self._impl._variant_tensor)

    # ----------------------------------------------------------- tf.data.Dataset API

    def _inputs(self) -> list:
        return [self._impl]

    @property
    def element_spec(self) -> Any:
        return self._impl.element_spec

    def __len__(self) -> int:
        cfg = self._cfg
        if cfg.service is not None and cfg.service_mode == "parallel_epochs":
            # As tf.data's own `len()` for a data set of unknown length.
            raise TypeError(
                "The length of a source with service_mode='parallel_epochs' is unknown: "
                "each of the tf.data service's workers sends a whole epoch of its own. "
                "Use service_mode='distributed_epoch' for a known step count."
            )
        return self._steps

    def __iter__(self) -> OwnedIterator:
        """An iterator over one epoch's batches (`tf.Tensor`s, the structure of
        `element_spec`).

        Read eagerly in sample mode on a lattice (a Python loop, Keras' `predict` under
        TensorFlow), the batches come straight from the memory-mapped reader, handed to
        TensorFlow through DLPack, not through tf.data's iterator: the same order, epochs,
        checks and `CorruptRecordError`, at about twice the rate. TensorFlow's iterator is
        made when a `tf.function` first reads this iterator (what `fit` does); an iterator
        already read in Python then raises `RuntimeError` (make a new one).

        Example:
            >>> for x, y in source:  # x: tf.Tensor [batch_size, *shape]
            ...     loss = train_step(x, y)
        """
        if not tf.inside_function():
            return _Iterator(self)
        return super().__iter__()

    def as_numpy_iterator(self) -> Iterator[Any]:
        """An iterator over one epoch's batches as NumPy arrays (the structure of
        `element_spec`, as `tf.data.Dataset.as_numpy_iterator` gives).

        In sample mode (`access`) the batches come straight from the memory-mapped
        reader, without tf.data in between: the same order, epochs, CRC and layout
        checks and damage handling (`CorruptRecordError`) as iterating the source, at
        the cost of the gather alone. Use it for loops that want NumPy (a custom
        training loop, JAX, torch); Keras' JAX and torch backends read a source in
        sample mode this way in `fit`, `evaluate` and `predict`. Each batch is an array
        per feature, copied once from the page cache, yours to keep; on a lattice (the
        writer's default) each starts on a 64-byte boundary, so JAX takes it on the CPU
        without a copy.
        In block mode this is `tf.data.Dataset.as_numpy_iterator`.

        Example:
            >>> for x, y in source.as_numpy_iterator():
            ...     loss = train_step(x, y)  # x: np.ndarray [batch_size, *shape]
        """
        if not self._numpy_direct():
            return super().as_numpy_iterator()
        from keras_tfr.read.numpy_iter import NumpyBatches

        return self._direct_batches(NumpyBatches)

    def _tensor_direct(self) -> bool:
        """Whether iterating eagerly gives `TensorBatches` (sample mode on a lattice)."""
        return self._numpy_direct() and self._mapped_plan.lattice_rows is not None

    def _tensor_batches(self) -> Any:
        from keras_tfr.read.numpy_iter import TensorBatches

        return self._direct_batches(TensorBatches)

    def _direct_batches(self, kind: Any) -> Any:
        """One epoch of `NumpyBatches` (or its `TensorBatches`) from the mapped reader."""
        return kind(
            self._mapped_plan,
            self._clock.take,
            self._structure_fn(),
            self._pad_batches,
            corrupt_record_error,
        )

    def _numpy_direct(self) -> bool:
        """Whether `as_numpy_iterator` reads straight from the memory-mapped reader."""
        return getattr(self, "_mapped_plan", None) is not None and not self._decode

    def __reduce__(self) -> Any:
        """Refuses pickling (and `copy.deepcopy`, which pickles) with what to do instead:
        a source holds a memory map, threads and TensorFlow's state, so it failed deep
        inside, as "cannot pickle '_thread.lock' object"."""
        raise TypeError(
            f"keras-tfr: a TFRecordSequenceSource ({self._cfg.directory}) cannot be pickled "
            "or deep-copied: it holds a memory map, threads and TensorFlow's state. In "
            "another process, make one from its arguments: c = source.config (picklable), "
            "then TFRecordSequenceSource(c.directory, **c.as_kwargs()) there (give seed= "
            "for the same orders); in this process, source.replace(...) makes a copy."
        )

    def __copy__(self) -> TFRecordSequenceSource:
        """`copy.copy`: a new object sharing this one's state (its epochs included), as
        Python's default shallow copy made before `__reduce__` refused pickling."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        # The original lives as long as the copy: it takes its pipeline's Python functions
        # out of TensorFlow's list when it is collected (`_forget_py_funcs`), and the copy
        # runs the same pipeline.
        new._copy_of = self
        return new

    def __repr__(self) -> str:
        return (
            f"<TFRecordSequenceSource {self._cfg.directory!r}: {self._num_samples} "
            f"samples, batch_size={self.batch_size}, {self._steps} steps, "
            f"shuffle={self._cfg.shuffle}, access={self._access!r}>"
        )

    # ----------------------------------------------------------- public extras

    @property
    def manifest(self) -> Manifest:
        """The data set's `Manifest` (read once, when this source was built)."""
        return self._manifest

    @property
    def config(self) -> SourceOptions:
        """The source's arguments, checked (a frozen dataclass; `options()` is
        `tf.data.Dataset`'s own method)."""
        return self._cfg

    @property
    def access(self) -> str:
        """``"samples"`` or ``"blocks"``: the mode this source reads in."""
        return self._access

    @property
    def num_samples(self) -> int:
        """Samples per epoch in this subset (this worker's share)."""
        return self._num_samples

    @property
    def steps(self) -> int:
        """Batches per epoch (``len(source)``)."""
        return self._steps

    @property
    def batch_size(self) -> int:
        return self._cfg.batch_size

    def set_epoch(self, epoch: int, step: int = 0) -> None:
        """Makes the next iterator read epoch ``epoch`` from batch ``step`` on.

        Each iterator that starts reading is otherwise the next epoch (0, 1, 2, ...; Keras
        makes one per epoch), and each later one goes on from there. The order of epoch
        ``e`` depends on ``(seed, e)`` alone, so a job that restarts can go on with the
        same order (what `keras_tfr.BackupAndRestore` does). On the tf.data service
        (``service=``) it has no effect, and logs a warning saying so: the service's
        workers draw each iterator's order (a new one each epoch, which ``seed`` does not
        fix).

        ``step`` applies to the source's own iterators (``iter(source)``, ``fit(source)``,
        `as_numpy_iterator`). A data set made from the source (``source.map(f)``,
        ``.take(n)``, the ``map`` Keras adds for ``class_weight``) counts whole epochs of
        ``len(source)`` batches, fixed when it was made: it reads that epoch from its first
        batch, and logs a warning saying so.

        Example:
            >>> train.set_epoch(3, step=120)  # the next iterator yields epoch 3's batch 120 on
        """
        from keras_tfr import _checks

        epoch = _checks.non_negative_int("epoch", epoch)
        step = _checks.non_negative_int("step", step)
        if step > self._steps:
            raise ValueError(
                f"Expected `step` in [0, {self._steps}] (the source's steps per epoch). "
                f"Received: {step}"
            )
        if self._cfg.service is not None:
            log.warning(
                "keras-tfr: set_epoch(%d, step=%d) has no effect with `service=`: the "
                "tf.data service's workers draw each iterator's order, from its first batch",
                epoch,
                step,
            )
        self._clock.set(epoch, step)

    def sample_order(self, epoch: int) -> np.ndarray:
        """Written indices of the samples epoch ``epoch`` reads, in order (sample mode).

        Example:
            >>> first_batch = source.sample_order(0)[: source.batch_size]
        """
        if self._order is None:
            raise ValueError(
                "`sample_order` needs access='samples'; this source reads in block mode, "
                "whose order is decided inside tf.data."
            )
        return self._order.epoch(int(epoch))[: self._rows]

    def replace(self, **changes: Any) -> TFRecordSequenceSource:
        """A copy with some arguments changed (the manifest in memory is reused unless
        ``directory`` changes). A source made with ``seed=None`` passes on the seed it
        drew: the copy reads the same orders in sample mode (in block mode with
        ``deterministic=True``; without it, block mode's interleave may differ), and the
        same split.

        Example:
            >>> bigger = source.replace(batch_size=512, shuffle_memory="256MB")
        """
        names = {f.name for f in dataclasses.fields(SourceOptions)}
        unknown = set(changes) - names
        if unknown:
            raise TypeError(
                f"`replace` got unknown arguments {sorted(unknown)}; expected some of "
                f"{sorted(names)}"
            )
        if "seed" not in changes and self._cfg.seed is None and self._seed is not None:
            changes["seed"] = self._seed  # the one drawn for `seed=None`
        opts = dataclasses.replace(self._cfg, **changes)
        same_data = os.fspath(opts.directory) == self._cfg.directory
        return TFRecordSequenceSource(
            opts.directory, manifest=self._manifest if same_data else None, **opts.as_kwargs()
        )

    def with_batch_size(self, batch_size: int) -> TFRecordSequenceSource:
        """A copy with another batch size (no re-reading of the manifest).

        Example:
            >>> big = source.with_batch_size(1024)
        """
        return self.replace(batch_size=batch_size)

    def repeat(self, count: Any = None, name: str | None = None) -> tf.data.Dataset:
        """`tf.data.Dataset.repeat`: each pass is the source's next epoch, in that epoch's
        order. The repeated data set still shuffles itself, so Keras' "`shuffle=True` ...
        will be ignored" warning stays off for it too (`fit(source.repeat(),
        steps_per_epoch=...)`).

        Example:
            >>> model.fit(source.repeat(), steps_per_epoch=100, epochs=10)
        """
        from keras_tfr._compat import keras_shuffle

        return keras_shuffle.mark_self_shuffling(super().repeat(count, name=name))

    @staticmethod
    def from_tfrecords(
        paths_or_glob: Any, features: Any = None, batch_size: int = 32, **kwargs: Any
    ) -> tf.data.Dataset:
        """Streams TFRecord files written by other tools (one `tf.train.Example` per sample).

        See `keras_tfr.tfrecords.from_tfrecords` for the arguments. Returns a
        `tf.data.Dataset` of known cardinality.

        Example:
            >>> ds = TFRecordSequenceSource.from_tfrecords(
            ...     "old/*.tfrecord", features={"image": TensorFeature(tf.float32, (28, 28)),
            ...     "label": tf.io.FixedLenFeature([], tf.float32)}, y="label", batch_size=256)
        """
        from keras_tfr.tfrecords import from_tfrecords

        return from_tfrecords(paths_or_glob, features, batch_size, **kwargs)

    # ----------------------------------------------------------- planning

    def _steps_of(self, shares: list[int], own: int) -> tuple[int, int]:
        """(steps every worker runs, empty batches this worker pads with)."""
        b = self.batch_size
        if self._cfg.drop_remainder:
            steps = min(n // b for n in shares)
            if steps == 0:
                raise ValueError(
                    f"`batch_size={b}` with `drop_remainder=True` leaves no batch: the "
                    f"{'smallest worker share' if len(shares) > 1 else 'subset'} holds only "
                    f"{min(shares)} samples."
                )
            return steps, 0
        steps = max(math.ceil(n / b) for n in shares)
        return steps, steps - math.ceil(own / b)

    def _sample_plan(self) -> _order.SampleOrder:
        opts = self._cfg
        m = self._manifest

        window = shuffle_window_bytes(opts.shuffle_window, m.total_bytes)
        window_records = None if window is None else max(1, window // max(1, m.record_bytes))

        def share(worker: int | None) -> _order.SampleOrder:
            return _order.SampleOrder(
                m.total_samples,
                seed=self._seed,
                validation_split=opts.validation_split,
                subset=opts.subset,
                num_workers=opts.num_workers,
                worker_index=worker,
                shuffle=opts.shuffle,
                batch_size=opts.batch_size,
                samples_per_record=m.samples_per_record,
                window_records=window_records,
            )

        order = share(opts.worker_index)
        if order.windowed and self._access == "samples":
            assert order.window_records is not None and window is not None
            why = ""
            if opts.shuffle_window == "auto":
                why = (
                    f": it is larger than half of the memory ({_memory_bytes() / 1e9:.1f} GB, "
                    "the machine's or its cgroup's limit)"
                )
            log.info(
                "keras-tfr: %s is shuffled in windows of %d records (%.2f GB, of %.2f GB)%s",
                opts.directory,
                order.window_records,
                order.window_records * m.record_bytes / 1e9,
                m.total_bytes / 1e9,
                why,
            )
        self._num_samples = order.size
        if opts.num_workers is None:
            shares = [order.size]
        else:
            shares = [share(w).size for w in range(opts.num_workers)]
            if min(shares) == 0 and sum(shares) > 0:
                raise ValueError(
                    f"`num_workers={opts.num_workers}` leaves a worker without samples: the "
                    f"subset holds {sum(shares)}."
                )
        if order.size == 0:
            self._steps = self._pad_batches = self._rows = 0
            return order
        self._steps, self._pad_batches = self._steps_of(shares, order.size)
        self._rows = min(order.size, (self._steps - self._pad_batches) * opts.batch_size)
        return order

    def _block_plan(self) -> None:
        opts = self._cfg
        m = self._manifest
        self._sample_keep: np.ndarray | None = None
        small = (
            m.total_records <= _order.SAMPLE_SPLIT_RECORDS
            and m.total_samples <= _order.SAMPLE_SPLIT_SAMPLES
        )
        if small and (opts.validation_split is not None or opts.num_workers is not None):
            # The samples sample mode would read (split, worker share, step count), picked
            # out of the records as they are decoded; records without any are not read.
            self._sample_keep = self._sample_plan().mask()
            starts = np.arange(0, m.total_samples, m.samples_per_record)
            self._keep: np.ndarray | None = np.add.reduceat(self._sample_keep, starts) > 0
            self._rows = self._num_samples
            return
        counts = np.full(m.total_records, m.samples_per_record, dtype=np.int64)
        if m.total_records:
            counts[-1] = m.total_samples - (m.total_records - 1) * m.samples_per_record
        keep = None
        if opts.validation_split is not None:
            assert opts.subset is not None and opts.seed is not None
            keep = _order.block_split(
                m.total_records, opts.validation_split, opts.subset, opts.seed, opts.directory
            )
        self._num_samples = int(counts.sum() if keep is None else counts[keep].sum())
        self._pad_batches = 0
        self._rows = self._num_samples
        if self._num_samples == 0:
            self._keep, self._steps = keep, 0
            return
        self._steps, _ = self._steps_of([self._num_samples], self._num_samples)
        if opts.num_workers is not None and opts.worker_index is not None:
            keep, self._num_samples, self._steps, self._pad_batches = _distribute.worker_share(
                keep,
                counts,
                opts.num_workers,
                opts.worker_index,
                opts.batch_size,
                opts.drop_remainder,
            )
        self._keep = keep
        self._rows = self._num_samples

    def _pool_bytes(self) -> int:
        """Block mode: bytes of records whose samples are permuted together: at least two
        batches, at most a quarter of ``shuffle_memory`` when shuffling."""
        m = self._manifest
        pool_bytes = max(_POOL_BYTES, 2 * self.batch_size * m.sample_bytes)
        if self._cfg.shuffle:
            pool_bytes = min(pool_bytes, max(m.record_bytes, self._cfg.shuffle_bytes // 4))
        return pool_bytes

    # ----------------------------------------------------------- pipeline

    def _build(self) -> tf.data.Dataset:
        """The pipeline this data set is: what `fit` and a data set made from the source
        (``source.map(...)``, Keras' ``class_weight``) read. Its count is a whole epoch's
        (``len(source)``), so its iterators read whole epochs (`_EpochClock.take_whole`);
        this source's own iterators read an epoch `set_epoch` started mid-way from another
        pipeline (`_resumed`)."""
        direct = self._access == "samples"
        batches_of = self._mapped_batches() if direct else self._graph_batches()

        def uncounted(next_epoch: Callable[[], tuple[int, int]]) -> tf.data.Dataset:
            return self._finish(batches_of(next_epoch), direct)

        self._uncounted = uncounted
        self._resumable: tf.data.Dataset | None = None
        batches = uncounted(self._clock.take_whole)
        if self._counted():
            batches = batches.apply(tf.data.experimental.assert_cardinality(self._steps))
        return batches.with_options(self._tf_options(direct))

    def _counted(self) -> bool:
        """Whether the pipeline knows its count (the service's parallel epochs do not)."""
        return self._cfg.service is None or self._cfg.service_mode == "distributed_epoch"

    def _graph_batches(self) -> Callable[[Callable[[], tuple[int, int]]], tf.data.Dataset]:
        """Block mode: the batches of each iterator's epoch, for a given ``next_epoch``."""
        from keras_tfr.read.graph import GraphReader

        opts = self._cfg
        deterministic = opts.deterministic
        if deterministic is None:
            deterministic = not (opts.shuffle and opts.seed is None)
        reader = GraphReader(
            manifest=self._manifest,
            specs=self._specs,
            keep=self._keep,
            sample_keep=self._sample_keep,
            shuffle=opts.shuffle,
            seed=self._seed,
            deterministic=deterministic,
            shuffle_bytes=opts.shuffle_bytes,
            pool_bytes=self._pool_bytes(),
            batch_size=opts.batch_size,
            drop_remainder=opts.drop_remainder,
            num_parallel_reads=opts.num_parallel_reads,
            on_corrupt=opts.on_corrupt,
            # Weakly: the pipeline's functions live in TensorFlow's graph for the process's
            # life, and a bound method would keep this source alive with them.
            report_skip=_weakly(self._report_skip),
            service=(opts.service, opts.service_mode, opts.service_job_name)
            if opts.service
            else None,
            fill_rows=self._fill_rows() if opts.on_corrupt == "skip" else None,
        )
        return reader.dataset

    def _fill_rows(self) -> int:
        """Block mode: the samples of one epoch's batches (``len(self)`` of them, the
        workers' empty batches left out)."""
        data_batches = self._steps - self._pad_batches
        if self._cfg.drop_remainder:
            return data_batches * self.batch_size
        return min(self._num_samples, data_batches * self.batch_size)

    def _mapped_batches(self) -> Callable[[Callable[[], tuple[int, int]]], tf.data.Dataset]:
        """Sample mode: the batches of each iterator's epoch, for a given ``next_epoch``."""
        from keras_tfr.read import mapped

        m = self._manifest
        opts = self._cfg
        specs = self._specs
        assert self._order is not None

        def skip(path: str, offset: int, index: int, n_records: int, problem: str) -> None:
            self._report_skip(path, offset, index, n_records, lost=1, problem=problem)

        plan = mapped.MappedPlan(
            specs=specs,
            files=[m.shard_path(s) for s in m.shards],
            shard_records=[s.records for s in m.shards],
            shard_bytes=[s.bytes for s in m.shards],
            samples_per_record=m.samples_per_record,
            total_samples=m.total_samples,
            order=self._order,
            num_batches=self._steps - self._pad_batches,
            batch_size=opts.batch_size,
            readers=opts.num_parallel_reads or min(8, max(2, os.cpu_count() or 2)),
            verify=opts.verify,
            skip=skip if opts.on_corrupt == "skip" else None,
            lattice=m.lattice,
            checksums=[s.checksum for s in m.shards],
            written_again=functools.partial(_written_again, m),
        )
        self._mapped_plan = plan
        structure = self._structure_fn() if not self._decode else (lambda d: d)
        # Every batch full (``drop_remainder``, or a subset of whole batches): a static
        # batch dimension, as Keras' own pipeline for arrays gives such batches.
        full = opts.drop_remainder or (self._rows % opts.batch_size == 0 and not self._pad_batches)
        rows = opts.batch_size if full else None
        region = None
        if m.lattice is not None:
            try:
                region = plan.lattice_tensors()
            except mapped.MapLimitError:
                raise  # not DLPack's: the shards cannot be mapped at all
            except Exception as e:  # a platform where DLPack cannot alias the mapping
                log.warning(
                    "keras-tfr: TensorFlow cannot gather from the mapped shards of %s "
                    "(%s: %s); gathering in Python instead",
                    opts.directory,
                    type(e).__name__,
                    e,
                )
        if region is not None:
            # TensorFlow gathers each batch from the mapped shards (`lattice_dataset`).
            def finish(features: list[Any]) -> Any:
                out = {}
                for s, feature in zip(specs, features):
                    if rows is not None and feature.shape[0] != rows:
                        feature = _rows(rows)(feature)
                    out[s.key] = feature
                return structure(out)

            return functools.partial(
                mapped.lattice_dataset, plan, region, finish=finish, full_batches=rows is not None
            )
        # Decoding (a reshape and a zero-copy bitcast) and Keras' structure are applied
        # once per block of batches, so each batch then costs only its slice.

        def decode(*u8: Any) -> Any:
            out = {}
            for s, t in zip(specs, u8):
                n_batches = tf.shape(t)[0]
                flat = tf.reshape(t, [-1, s.sample_bytes])
                feature = tf_bytes_to_feature(flat, s)
                out[s.key] = tf.reshape(feature, [n_batches, -1, *s.shape])
            return structure(out)

        # tf.data hands a tuple's components as arguments, anything else as one: a
        # 1-tuple (`x` alone, a list of inputs) comes as one argument too.
        one_tuple = self._x_alone_as_tuple()

        def element(parts: tuple) -> Any:
            return parts[0] if len(parts) == 1 and not one_tuple else parts

        def cut(*block: Any) -> tf.data.Dataset:
            batches = tf.data.Dataset.from_tensor_slices(element(block))
            if rows is None:
                return batches
            return batches.map(lambda *b: tf.nest.map_structure(_rows(rows), element(b)))

        def batches(next_epoch: Callable[[], tuple[int, int]]) -> tf.data.Dataset:
            return mapped.dataset(plan, next_epoch).map(decode).flat_map(cut)

        return batches

    def _prefetch_batches(self) -> int:
        """Sample mode's prefetch depth: `_PREFETCH_BYTES` of batches, in `_PREFETCH_BATCHES`."""
        lo, hi = _PREFETCH_BATCHES
        batch_bytes = max(1, self.batch_size * self._manifest.sample_bytes)
        return max(lo, min(hi, _PREFETCH_BYTES // batch_bytes))

    def _finish(self, batches: tf.data.Dataset, direct: bool) -> tf.data.Dataset:
        """The stages after batching, shared by both modes (all but the count)."""
        if any(s.kind != "fixed" for s in self._specs) or self._decode:
            from keras_tfr.tfrecords import finish_features

            finish = finish_features(self._decode, self._ragged)
            batches = batches.map(finish, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        if not direct or self._decode:
            batches = batches.map(self._structure_fn())
        if not direct and self._cfg.num_workers is not None:
            # Block mode's shares differ by a record: with `drop_remainder`, a larger share
            # can hold a batch more than the count all workers agree on (the smallest).
            batches = batches.take(self._steps - self._pad_batches)
        if self._pad_batches:
            batches = _distribute.pad_with_empty_batches(batches, self._pad_batches)
        # Prefetch starts with an iterator's first batch, so an iterator Keras makes and
        # drops unread (it makes the next one at each epoch's end) reads nothing.
        return batches.prefetch(self._prefetch_batches() if direct else tf.data.AUTOTUNE)

    def _resumed(self, step: int) -> tf.data.Dataset:
        """This source's pipeline for an iterator whose epoch starts at batch ``step``
        (`set_epoch(epoch, step)`): the same batches, with the cardinality that epoch has
        (``len(self) - step``). Keras' multi-step loop (`steps_per_execution` > 1 under
        TensorFlow) reads one batch past an epoch's end inside its `tf.function`, where
        a whole epoch's count would fail as "expected to contain N elements". Made once,
        when first needed: its iterators honour the step `set_epoch` gave (`_EpochClock.take`),
        where this data set's own read whole epochs."""
        if self._cfg.service is not None or not 0 < step <= self._steps:
            return self  # the service reads whole epochs: `set_epoch` says it has no effect
        with only_op_seeds():
            if self._resumable is None:
                with _py_funcs_of(self._py_funcs), compat_tf.one_device_functions():
                    self._resumable = self._uncounted(self._clock.take)
            counted = self._resumable.apply(
                tf.data.experimental.assert_cardinality(self._steps - step)
            )
            return counted.with_options(self._tf_options(self._access == "samples"))

    def _tf_options(self, direct: bool) -> tf.data.Options:
        opts = self._cfg
        options = compat_tf.no_inject_prefetch(tf.data.Options())
        if direct:
            options.deterministic = True
            options.experimental_optimization.apply_default_optimizations = False
        else:
            options.deterministic = not (opts.shuffle and opts.seed is None) or bool(
                opts.deterministic
            )
            options.experimental_optimization.map_parallelization = True
            # The epoch enters the graph through one Python call per iterator; a saved
            # iterator keeps the epoch it started with, so that call's state can be left out.
            ignore = tf.data.experimental.ExternalStatePolicy.IGNORE
            options.experimental_external_state_policy = ignore
        if opts.num_workers is not None:
            # This source already holds only its worker's share: no second sharding.
            off = tf.data.experimental.AutoShardPolicy.OFF
            options.experimental_distribute.auto_shard_policy = off
        return options

    # ----------------------------------------------------------- damage

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
        if new:
            what = problem or f"the {lost - 1} record(s) after it in that shard go too"
            log.warning(
                "keras-tfr: skipped a corrupt record in %s at byte offset %d (record %d of "
                "%d): %s; %d record(s) skipped so far",
                path,
                offset,
                index,
                n_records,
                what,
                total,
            )
        if total >= self._manifest.total_records:
            raise ValueError(
                f"keras-tfr: corrupt records: all {total} records of {self._cfg.directory} are "
                f"damaged or unreadable (last in {path} at byte offset {offset}); nothing is "
                "left to train on. Run `keras-tfr verify` on the data set."
            )
        if total > self._cfg.max_corrupt_records:
            raise ValueError(
                f"keras-tfr: corrupt records: {total} skipped, more than "
                f"max_corrupt_records={self._cfg.max_corrupt_records}; last in {path} at "
                f"byte offset {offset}. Run `keras-tfr verify` on the data set."
            )
        return True

    def _x_alone_as_tuple(self) -> bool:
        """Whether each element is a 1-tuple: `x` alone, written as a list of inputs."""
        structure = self._manifest.structure
        return list(structure) == ["x"] and structure["x"] == "list"

    def _structure_fn(self) -> Callable[[dict], Any]:
        structure = self._manifest.structure
        specs = self._specs

        # A dict role's keys in the order the writer was given them (`Manifest.key_order`),
        # as `fit` keeps a dict of arrays' order.
        keys = {(s.role, s.name): s.key for s in specs}
        dict_keys = {
            role: [(name, keys[role, name]) for name in self._manifest.names_in_order(role)]
            for role, kind in structure.items()
            if kind == "dict"
        }

        def role_value(decoded: dict, role: str) -> Any:
            kind = structure[role]
            role_specs = [s for s in specs if s.role == role]
            if kind == "array":
                return decoded[role_specs[0].key]
            if kind == "dict":
                return {name: decoded[key] for name, key in dict_keys[role]}
            return tuple(decoded[s.key] for s in sorted(role_specs, key=lambda s: int(s.name)))

        roles = [r for r in ("x", "y", "sample_weight") if r in structure]
        one_tuple = self._x_alone_as_tuple()

        def fn(decoded: dict) -> Any:
            values = tuple(role_value(decoded, r) for r in roles)
            if len(values) > 1:
                return values
            # `x` alone: a list of inputs comes as a 1-tuple `((a, b),)`, which Keras reads
            # as `x`; a bare `(a, b)` would be read as `(x, y)`.
            return values if one_tuple else values[0]

        return fn


def _weakly(method: Callable[..., bool]) -> Callable[..., bool]:
    """``method`` (bound to a source) through a weak reference: calling it once the
    source is gone does nothing. A source's pipeline keeps what it calls for as long as
    TensorFlow keeps the pipeline's functions, and must not keep the source itself."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> bool:
        bound = ref()
        return True if bound is None else bound(*args, **kwargs)

    return call


def _rows(rows: int) -> Callable[[Any], Any]:
    """Sets the static batch dimension (where every batch is full)."""
    return lambda t: tf.ensure_shape(t, [rows, *t.shape[1:]])


def _written_again(manifest: Manifest) -> bool:
    """Whether ``manifest``'s directory holds another data set now (written again)."""
    from keras_tfr.manifest import written_again

    shards = [(s.file, s.bytes, s.checksum) for s in manifest.shards]
    return written_again(manifest.directory, shards) is not None


_BUILD_LOCK = threading.Lock()  # one pipeline built at a time: see `_py_funcs_of`


def _ours(func: Any) -> bool:
    """Whether a function TensorFlow registered is one of keras-tfr's (unwrapped from
    `tf.py_function`'s ``EagerFunc`` and AutoGraph's wrappers)."""
    func = inspect.unwrap(getattr(func, "_func", func))
    return str(getattr(func, "__module__", "")).startswith("keras_tfr.")


@contextlib.contextmanager
def _py_funcs_of(owned: set[int]) -> Iterator[None]:
    """Adds to ``owned`` the ids of keras-tfr's functions that `tf.numpy_function` and
    `tf.py_function` register while the block builds a pipeline.

    Outside a graph, TensorFlow 2.21 keeps each such function in the process's default
    graph for as long as the process runs (TensorFlow issue 61344), and with it what
    the function refers to: a dropped source's plan and memory map (its pages in the
    RSS, a deleted shard's disk space taken) until the process ended. The source takes
    its own functions out of that list when it is collected (`_forget_py_funcs`); by
    then nothing can run its pipeline (data sets made from it, and their iterators,
    hold it). Builds are serialized, so that the functions registered meanwhile by
    keras-tfr are this build's (other code's are told apart by their module).
    """

    funcs = compat_tf.eager_py_funcs()
    with _BUILD_LOCK:
        # By identity, not by position: a collected source may take its functions out of
        # the list meanwhile (the collector can run during a build).
        before = {id(f) for f in funcs} if funcs is not None else set()
        yield
        if funcs is not None:
            owned.update(id(f) for f in list(funcs) if id(f) not in before and _ours(f))


def _forget_py_funcs(owned: set[int]) -> None:
    """Takes the functions ``owned`` names out of TensorFlow's list (see `_py_funcs_of`).
    Run by the garbage collector: it raises nothing (at the process's end TensorFlow's
    modules may be gone, and then the list goes with them)."""
    if not owned:
        return
    try:
        from keras_tfr._compat import tf as compat_tf

        funcs = compat_tf.eager_py_funcs()
    except Exception:
        return
    if funcs is None:
        return
    for f in [f for f in funcs if id(f) in owned]:
        with contextlib.suppress(ValueError):  # already gone
            funcs.remove(f)
    owned.clear()


class _EpochClock:
    """The epoch (and first batch) of each new iterator: set by `set_epoch`, else the one
    after the last."""

    def __init__(self, directory: str) -> None:
        self._directory = directory  # for `take_whole`'s warning
        self._lock = threading.Lock()
        self._epoch = 0
        self._step = 0
        self._held = 0
        self.last_step = 0  # first batch of the last epoch handed out

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Iterators that start reading inside read the next epoch without using it up
        (Keras' JAX and torch trainers build a model from one batch of a fresh iterator,
        `keras_tfr._compat.keras_build`)."""
        with self._lock:
            self._held += 1
        try:
            yield
        finally:
            with self._lock:
                self._held -= 1

    def set(self, epoch: int, step: int) -> None:
        with self._lock:
            self._epoch, self._step = epoch, step

    @property
    def next_step(self) -> int:
        """The first batch the next iterator's epoch starts at."""
        with self._lock:
            return self._step

    def take(self, whole: bool = False) -> tuple[int, int]:
        """``(epoch, first batch)`` of the iterator that starts reading now; the next one
        reads the epoch after (unless `held`). ``whole``: from the epoch's first batch."""
        with self._lock:
            out = (self._epoch, 0 if whole else self._step)
            asked = self._step
            self.last_step = out[1]
            if not self._held:
                self._epoch += 1
                self._step = 0
        if whole and asked:
            log.warning(
                "keras-tfr: %s: set_epoch(%d, step=%d) starts epoch %d at batch %d for the "
                "source's own iterators only (iter(source), fit(source), "
                "as_numpy_iterator()). A data set made from the source (source.map(...), "
                ".take(...), Keras' class_weight) counts whole epochs of len(source) "
                "batches, so it reads epoch %d from its first batch.",
                self._directory,
                out[0],
                asked,
                out[0],
                asked,
                out[0],
            )
        return out

    def take_whole(self) -> tuple[int, int]:
        """`take` from the epoch's first batch, for the source's own pipeline (see
        `TFRecordSequenceSource._build`)."""
        return self.take(whole=True)


_READ_IN_PYTHON = (
    "This iterator over {directory} has handed out batches in Python, straight from the "
    "memory-mapped reader; it cannot also be read inside a tf.function, which needs "
    "tf.data's iterator. Make a new one with iter(source) for the tf.function."
)
_FORKED = (
    "This iterator over {directory} was started in process {parent} and is read in "
    "process {child}, a child forked from it: TensorFlow's iterator does not survive a "
    "fork (its threads stay in the parent): read on, it would wait for ever once the "
    "batches it had read ahead ran out. Make a "
    "new iterator in the child (iter(source)); in sample mode, a Python loop over "
    "source.as_numpy_iterator() started before the fork can also go on in the child."
)
# This process's id, kept up to date in forked children: what `_Iterator` compares with
# the process that made its TensorFlow iterator, without a system call per batch.
_process = [os.getpid()]
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _process.__setitem__(0, os.getpid()))


class _Iterator(OwnedIterator):
    """An iterator whose damaged-data errors are `CorruptRecordError`, whichever reader
    found them (TensorFlow reports them as its own error types), and that ends quietly
    after an epoch started mid-way by `set_epoch(epoch, step)` (the source's cardinality
    is a whole epoch's).

    Read eagerly in sample mode on a lattice (a Python loop, Keras' `predict` under
    TensorFlow), it hands out the batches of `keras_tfr.read.numpy_iter.TensorBatches`:
    tensors over arrays copied once from the page cache, without tf.data's iterator (the
    same order, epochs, checks and errors). In every mode TensorFlow's iterator is made
    only when something needs it: a read, a tf.function that reads this iterator (what
    `fit` does), a checkpoint of it; from then on every batch comes from it. Making it
    prepares every function of the pipeline again: about 30 ms in sample mode and 60-150
    ms in block mode (2-core VM), which the iterators Keras makes at each epoch's end and
    drops unread no longer cost.
    """

    _resource: Any = None  # TensorFlow's iterator resource, once made
    _pid = 0  # the process that made it

    def __init__(self, source: TFRecordSequenceSource):
        self._clock = source._clock
        self._source = source
        self._direct = source._tensor_direct()
        self._python: Any = None  # the `TensorBatches`, once read in Python
        # Reentrant: `_create_iterator` reads `_iterator_resource` while it makes it.
        self._making = threading.RLock()
        self._ready = False  # the resource is made and initialized
        # Python's `next` one call at a time: TensorFlow's `assert_cardinality` counts
        # unguarded, so threads sharing this iterator could end the epoch with "expected
        # to contain 63 elements but contained only 62" while the 63rd was on its way.
        self._next_lock = threading.Lock()
        # `OwnedIterator.__init__` but for the resource (`_iterator_resource`), made when
        # first needed, with the flat output types and shapes that reading it uses.
        super(OwnedIterator, self).__init__()
        self._dataset = source
        self._element_spec = source.element_spec
        self._get_next_call_count = 0

    @property
    def _iterator_resource(self) -> Any:
        # One resource, though several threads read first at once; the others wait until
        # it is initialized (given out as soon as it was made, a thread that shares this
        # iterator failed with "GetNext() failed because the iterator has not been
        # initialized").
        if not self._ready:
            with self._making:
                if not self._ready and self._resource is None:
                    if self._python is not None:
                        directory = self._source._cfg.directory
                        raise RuntimeError(_READ_IN_PYTHON.format(directory=directory))
                    # An epoch started mid-way is read from a pipeline that counts its
                    # own batches (see `_resumed`).
                    dataset = self._source._resumed(self._clock.next_step)
                    with tf.init_scope():  # an eager resource, even when a tf.function asks
                        self._create_iterator(dataset)
                    self._pid = _process[0]
                    self._ready = True
        return self._resource

    @_iterator_resource.setter
    def _iterator_resource(self, value: Any) -> None:
        self._resource = value

    def _in_python(self) -> bool:
        return self._direct and self._resource is None and tf.executing_eagerly()

    def _next_python(self) -> Any:
        if self._python is None:
            self._python = self._source._tensor_batches()
        try:
            return next(self._python)
        except StopIteration:
            raise tf.errors.OutOfRangeError(None, None, "End of sequence") from None

    def _next_internal(self) -> Any:
        if self._in_python():
            return self._next_python()
        _ = self._iterator_resource  # made first: it sets what `_next_internal` reads with
        if self._pid != _process[0]:
            raise RuntimeError(
                _FORKED.format(
                    directory=self._source._cfg.directory, parent=self._pid, child=_process[0]
                )
            )
        return super()._next_internal()

    def _serialize_to_tensors(self) -> Any:
        if self._source.access == "samples":  # TensorFlow fails too, on the Python calls
            raise tf.errors.FailedPreconditionError(
                None,
                None,
                f"An iterator of sample mode ({self._source._cfg.directory}) cannot be saved "
                "in a tf.train.Checkpoint: its position is (epoch, step); resume it with "
                "source.set_epoch(epoch, step) or keras_tfr.BackupAndRestore, or read in "
                'block mode (access="blocks"), whose iterator can be saved.',
            )
        return super()._serialize_to_tensors()

    def get_next_as_optional(self) -> Any:
        if self._in_python():
            try:
                return tf.experimental.Optional.from_value(self._next_python())
            except tf.errors.OutOfRangeError:
                return tf.experimental.Optional.empty(self._element_spec)
        return super().get_next_as_optional()

    def __next__(self) -> Any:
        if self._python is not None and self._in_python():
            # Already reading in Python: the short way (its end is a StopIteration already).
            return next(self._python)
        try:
            with self._next_lock:
                return super().__next__()
        except tf.errors.FailedPreconditionError as e:
            if self._clock.last_step and "expected to contain" in str(e):
                raise StopIteration from None
            raise
        except tf.errors.OpError as e:
            error: BaseException = e
        converted = corrupt_record_error(error)
        if converted is None:
            raise error
        try:
            raise converted from error
        finally:
            # No reference from this frame to the errors: the traceback holds the frame,
            # and a cycle would keep this iterator alive until the cyclic collector runs.
            del error, converted


def _c_unescaped(text: str) -> str:
    """A string value as `tf.debugging.Assert` prints it, C-escaped (``\\'`` for a
    quote, octal bytes of UTF-8 for a path's non-ASCII letters), as it was."""
    import codecs

    try:
        raw = codecs.escape_decode(text.encode("utf-8", "backslashreplace"))[0]
        return bytes(raw).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return text


def corrupt_record_error(error: BaseException) -> CorruptRecordError | None:
    """The `CorruptRecordError` a TensorFlow error stands for, or None if it is another."""
    if isinstance(error, CorruptRecordError):
        return error
    found = _CORRUPT.search(str(error))
    if found is None:
        return None
    message = found.group(2) if found.group(1) is None else _c_unescaped(found.group(1))
    where = _CORRUPT_AT.search(message)
    file = where.group(1) if where else None
    offset = int(where.group(2)) if where else None
    return CorruptRecordError(message, file=file, offset=offset)


def _choose_access(opts: SourceOptions, m: Manifest, specs: list[FeatureSpec]) -> tuple[str, str]:
    """``(mode, why)``: the access mode this source reads in, and why when not asked for."""
    # Set but empty (``KERAS_TFR_READER= python train.py``) reads as unset, as for most
    # environment variables.
    reader = os.environ.get("KERAS_TFR_READER", "").strip().lower() or "auto"
    if reader not in _READERS:
        raise ValueError(
            f"Expected KERAS_TFR_READER to be one of {', '.join(_READERS)}. Received: {reader!r}"
        )
    from keras_tfr.read import mapped

    reasons = []
    if m.compression:
        reasons.append(f"the shards are {m.compression}-compressed")
    if m.record_bytes <= 0 or any(s.kind != "fixed" for s in specs):
        reasons.append("it has variable-length features")
    elif mapped.frame_bytes(specs, m.samples_per_record, m.lattice) != framing.frame_size(
        m.record_bytes
    ):
        reasons.append("its manifest's record size does not match the record layout")
    if opts.service is not None:
        reasons.append("the tf.data service runs the pipeline on its own workers")
    if opts.is_remote:
        reasons.append("it is not on a local file system")
    if not mapped.available():
        reasons.append("this platform cannot memory-map the shards")
    if reasons and (opts.access == "samples" or reader in ("mapped", "direct")):
        asked = "access='samples'" if opts.access == "samples" else f"KERAS_TFR_READER={reader}"
        raise ValueError(
            f"{asked}, but {opts.directory} cannot be read by sample: " + "; ".join(reasons)
        )
    if reader == "graph":
        if opts.access == "samples":
            raise ValueError(
                "access='samples' needs the memory-mapped reader, but KERAS_TFR_READER=graph"
            )
        return "blocks", "KERAS_TFR_READER=graph"
    if opts.access != "auto":
        return opts.access, ""
    if reasons:
        return "blocks", "; ".join(reasons)
    return "samples", ""


def _memory_bytes() -> int:
    """The memory this process can fill with page cache: the machine's, or its cgroup's
    limit where that is lower (a container's); 0 where neither can be told."""
    try:
        physical = int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        physical = 0
    known = [m for m in (physical, cgroup_memory_limit()) if m > 0]
    return min(known) if known else 0


def cgroup_memory_limit(
    proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup"
) -> int:
    """The memory limit of this process's cgroup in bytes (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``), 0 where there is none or it cannot be read. The page
    cache of the shards a process reads is charged to its cgroup.

    Example:
        >>> cgroup_memory_limit("/nonexistent")
        0
    """
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return 0
    limits = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            base, name = root, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = os.path.join(root, "memory"), "memory.limit_in_bytes"
        else:
            continue
        # The process's own cgroup; inside a container whose cgroup namespace hides the
        # path, the root of what it sees is that cgroup.
        for file in {os.path.join(base, path.lstrip("/"), name), os.path.join(base, name)}:
            try:
                with open(file) as f:
                    text = f.read().strip()
            except OSError:
                continue
            if text.isdigit():  # v2 says "max" for no limit
                limits.append(int(text))
    return min(limits) if limits else 0


def shuffle_window_bytes(shuffle_window: int | str | None, total_bytes: int) -> int | None:
    """The bytes of records that one window of sample mode's shuffle spans (None: the
    whole data set, one order over all samples).

    ``"auto"``: the whole data set when it fits in half of this machine's memory (or of
    its cgroup's memory limit, where lower: all of it can stay in the page cache); a
    larger one in windows of an eighth of that memory, rounded down to a power of two (so
    that machines of nearly the same memory give the same order). A window and the next
    one, read ahead while the current one ends, then take at most a quarter of the
    memory: in a 1.5 GiB cgroup, windows of a quarter (256 MiB) left too little beside
    TensorFlow for `fit`, whose pages were evicted before they were read (16 bytes read
    from disk per byte delivered), and windows of an eighth read each byte once.

    Example:
        >>> shuffle_window_bytes("256MB", 10**12)
        256000000
    """
    if shuffle_window is None:
        return None
    if shuffle_window != "auto":
        return parse_size(shuffle_window, argument="shuffle_window")
    memory = _memory_bytes()
    if not memory or total_bytes <= memory // 2:
        return None
    return 1 << ((memory // 8).bit_length() - 1)
