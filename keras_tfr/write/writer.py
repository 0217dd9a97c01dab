"""`RecordWriter`: batches of samples -> a sharded TFRecord data set, without Keras.

Memory stays bounded by one chunk (``chunk_size``, 16 MB by default) plus one partial
block, whatever the size of the input: arrays are sliced chunk by chunk, so a memmap or
an h5py data set larger than RAM converts with flat memory.

Crash safety: shards are written under temporary names (``*.tmp``) and renamed when
complete; a journal (``.keras-tfr-progress.json``) lists the completed shards; every
shard is synced to disk, then the manifest is written last, atomically and synced, so a
manifest on disk names only shards that are on disk too, after a power loss as well. An
exception inside ``with ArraysToRecords(...)``, Ctrl-C or a killed process leaves no
manifest, so no reader mistakes the partial data for a data set, and ``resume=True``
continues from the last complete shard.

The pieces: `keras_tfr.write.inputs` (input -> `Batch`), `keras_tfr.write.options`,
`keras_tfr.write.plan` (records and shards), `keras_tfr.write.journal` (the directory,
resume, overwrite), `keras_tfr.write.sink` (shard files, framing, durability). The Keras
adapter, `ArraysToRecords`, is in `keras_tfr.write.arrays_to_records`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, TypeVar

import numpy as np

from keras_tfr import _crc, _io
from keras_tfr._version import __version__
from keras_tfr.manifest import PROGRESS_NAME, Manifest, ShardInfo
from keras_tfr.schema import BlockEncoder, to_le_bytes
from keras_tfr.write import inputs
from keras_tfr.write.inputs import Batch, join_payload, validate_batch
from keras_tfr.write.journal import inspect_directory, remove_old
from keras_tfr.write.options import WriteOptions, check_directory
from keras_tfr.write.plan import Layout, plan_layout
from keras_tfr.write.sink import ShardFiles

log = logging.getLogger("keras_tfr")

_W = TypeVar("_W", bound="RecordWriter")


class RecordWriter:
    """Writes samples to a sharded TFRecord data set, chunk by chunk, with bounded memory.

    The core of `ArraysToRecords` (see it for the options and the guarantees), without
    Keras: its progress is silent unless a subclass returns a bar from `_make_progress`.

    Example:
        >>> with RecordWriter("data/train", WriteOptions(verbose=0)) as writer:
        ...     writer.write(x, y)
        >>> writer.manifest.total_samples
    """

    def __init__(self, directory: Any, options: WriteOptions):
        self.directory = check_directory(directory)
        self.options = options
        # Mutable: `convert_tfrecords` learns which features vary as it reads them.
        self.variable_length = frozenset(options.variable_length)
        self.manifest: Manifest | None = None
        self.resumed_samples = 0
        self._opened = False
        self._closed = False
        self._lock = _io.DirectoryLock(self.directory)
        self._made_directory = False  # `_open` created it: `abort` removes it when empty
        self._old_files: list[str] | None = None
        self._layout: Layout | None = None
        self._encoder: BlockEncoder | None = None
        self._files: ShardFiles | None = None
        self._pending: list[list[Any]] = []
        self._pending_count = 0
        self._samples_written = 0
        self._zero_copy = False  # records written as parts, payloads not joined
        self._borrowed = False  # queued records point into the caller's arrays
        self._progbar: Any = None

    # ------------------------------------------------------------------ public API

    @property
    def samples_written(self) -> int:
        """Samples accepted so far, including those of resumed shards."""
        return self._samples_written + self._pending_count

    def __enter__(self: _W) -> _W:
        self._open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def write(self, x: Any, y: Any = None, sample_weight: Any = None) -> None:
        """Appends a batch of samples.

        Args:
            x: inputs: an array-like (first axis = samples), a dict of them (named inputs)
                or a list of them.
            y: targets, structured the same ways, or None.
            sample_weight: per-sample weights, or None.

        Raises:
            ValueError, TypeError: the batch does not fit (different lengths, unsupported
                dtype, a shape or structure that differs from earlier batches, empty input).
                Nothing is written when this is raised.
        """
        if self._closed:
            raise RuntimeError(f"This writer for {self.directory} is already closed.")
        self._write_validated(validate_batch(x, y, sample_weight, self.variable_length))

    def close(self) -> Manifest:
        """Flushes the last block, closes the last shard and writes the manifest.

        Returns:
            The data set's `Manifest`.
        """
        if self._closed:
            if self.manifest is None:
                raise RuntimeError("This writer was aborted; no data set was written.")
            return self.manifest
        try:
            manifest = self._finish()
        except BaseException:
            self.abort()
            raise
        self._closed = True
        if self._files is not None:
            self._files.stop()
        self._lock.release()
        log.info(
            "keras-tfr: wrote %d samples in %d shards to %s",
            manifest.total_samples,
            len(manifest.shards),
            self.directory,
        )
        return manifest

    def abort(self) -> None:
        """Stops without a manifest: removes the unfinished shard and keeps the completed
        ones (and their journal) so that ``resume=True`` can continue. A directory this
        writer created is removed when nothing is left in it."""
        if self._closed:
            return
        self._closed = True
        if self._files is not None:
            self._files.abort()
        self._lock.release()
        if self._made_directory:
            _io.remove_empty_directory(self.directory)

    # ------------------------------------------------------------------ internals

    def _make_progress(self, total: int | None) -> Any:
        """A progress bar with ``update(samples, finalize=False)``, or None (silent)."""
        return None

    def _finish(self) -> Manifest:
        self._open()
        if self._layout is None or self._files is None or self.samples_written == 0:
            raise ValueError(
                f"No samples were written to {self.directory}: call `write` with at least "
                "one sample before closing."
            )
        self._remove_old_once()
        if self._pending_count:
            self._flush_pending()
        self._files.close_shard()
        self._files.sync()
        layout = self._layout
        manifest = Manifest(
            structure=dict(layout.structure),
            features=list(layout.specs),
            samples_per_record=layout.samples_per_record,
            record_bytes=layout.record_bytes,
            compression=layout.compression,
            lattice=layout.lattice,
            shuffle_seed=layout.shuffle_seed,
            key_order={role: list(names) for role, names in layout.key_order.items()},
            shards=list(self._files.shards),
            writer_version=__version__,
            user_metadata=dict(self.options.metadata or {}),
        )
        manifest.save(self.directory)  # the data set exists from here on
        _io.remove(_io.join(self.directory, PROGRESS_NAME))
        self.manifest = manifest
        if self._progbar is not None:
            self._progbar.update(self.samples_written, finalize=True)
        return manifest

    def _open(self) -> None:
        if self._opened:
            return
        if self._closed:
            raise RuntimeError(f"This writer for {self.directory} is already closed.")
        self._made_directory = not _io.exists(self.directory)
        _io.makedirs(self.directory)
        try:
            self._lock.acquire()
        except FileNotFoundError:  # an aborted writer removed the empty directory
            _io.makedirs(self.directory)
            self._lock.acquire()
        try:
            state = inspect_directory(self.directory, self.options)
        except BaseException:
            self._lock.release()
            raise
        self._opened = True
        self._old_files = state.old_files
        if state.layout is not None:
            self._adopt(state.layout, state.shards)
            self.resumed_samples = sum(s.samples for s in state.shards)
            self._samples_written = self.resumed_samples
        if self.options.verbose:
            self._progbar = self._make_progress(self.options.expected_samples)
        if self._progbar is not None and self.resumed_samples:
            self._progbar.update(self.resumed_samples)

    def _adopt(self, layout: Layout, shards: list[ShardInfo]) -> None:
        self._layout = layout
        self._encoder = BlockEncoder(layout.specs, layout.lattice)
        fixed = all(s.kind == "fixed" for s in layout.specs)
        self._zero_copy = layout.compression is None and _crc.hardware() and fixed
        self._files = ShardFiles(self.directory, layout, shards)

    def _remove_old_once(self) -> None:
        if self._old_files is not None:
            old, self._old_files = self._old_files, None
            remove_old(self.directory, old)

    def _write_validated(self, batch: Batch, start: int = 0) -> None:
        self._open()
        if self._layout is None:
            # May refuse the sizes: before the old data set goes.
            self._adopt(plan_layout(batch, self.options), [])
        else:
            inputs.check_same_schema((self._layout.structure, self._layout.specs), batch)
        self._remove_old_once()
        if any(s.kind != "fixed" for s in batch.specs):
            self._append_variable(batch, start)
            return
        try:
            self._append_fixed(batch, start)
        finally:
            if self._borrowed:
                # Queued records may point into the caller's arrays: written before
                # `write` returns (or raises), so the caller may reuse them.
                self._borrowed = False
                assert self._files is not None
                self._files.wait()

    def _append_fixed(self, batch: Batch, start: int) -> None:
        assert self._layout is not None
        spr = self._layout.samples_per_record
        n = batch.n
        i = start
        if self._pending_count:
            take = min(spr - self._pending_count, n - i)
            self._queue(batch, i, i + take)
            i += take
            if self._pending_count == spr:
                self._flush_pending()
        sample_bytes = sum(s.sample_bytes for s in batch.specs)
        chunk_blocks = max(1, self.options.chunk_bytes // max(1, sample_bytes * spr))
        while n - i >= spr:
            nblocks = min(chunk_blocks, (n - i) // spr)
            self._write_blocks(batch, i, nblocks)
            i += nblocks * spr
        if i < n:
            self._queue(batch, i, n)
            self._progress()

    def _write_blocks(self, batch: Batch, start: int, nblocks: int) -> None:
        """Writes `nblocks` whole records from rows ``start...`` of the arrays in place."""
        assert self._layout is not None and self._files is not None
        spr = self._layout.samples_per_record
        end = start + nblocks * spr
        for arr in batch.arrays:
            inputs.populate_pages(arr, start, end)
        views = [
            (to_le_bytes(arr[start:end], spec).data.cast("B"), spr * spec.sample_bytes)
            for spec, arr in zip(batch.specs, batch.arrays)
        ]
        for b in range(nblocks):
            self._emit(spr, [mv[b * size : (b + 1) * size] for mv, size in views])
        del views
        self._files.release(batch.arrays, start, end)
        self._samples_written += nblocks * spr
        self._progress()

    def _append_variable(self, batch: Batch, start: int) -> None:
        """Block by block, through the pending lists: records differ in size."""
        assert self._layout is not None
        spr = self._layout.samples_per_record
        i = start
        while i < batch.n:
            take = min(spr - self._pending_count, batch.n - i)
            self._queue(batch, i, i + take)
            i += take
            if self._pending_count == spr:
                self._flush_pending()
        self._progress()

    def _queue(self, batch: Batch, start: int, stop: int) -> None:
        """Copies samples ``[start, stop)`` into the pending (partial) record."""
        if not self._pending:
            self._pending = [[] for _ in batch.specs]
        for slot, (spec, arr) in enumerate(zip(batch.specs, batch.arrays)):
            part = arr[start:stop]
            self._pending[slot].append(
                part if spec.kind != "fixed" else to_le_bytes(part, spec).copy()
            )
        self._pending_count += stop - start

    def _flush_pending(self) -> None:
        assert self._layout is not None
        count = self._pending_count
        specs = self._layout.specs
        payloads = [join_payload(s, parts) for s, parts in zip(specs, self._pending)]
        self._pending = [[] for _ in specs]
        self._pending_count = 0
        self._emit(count, payloads)
        self._samples_written += count

    def _emit(self, count: int, payloads: list[Any]) -> None:
        assert self._encoder is not None and self._files is not None
        if self._zero_copy:
            # The payloads are written straight from the caller's arrays (a memmap's pages
            # included): no joined copy of the record; `write` waits for the sink before
            # it returns, so the caller may reuse its arrays afterwards.
            record: Any = self._encoder.encode_parts(count, payloads)
            self._borrowed = True
        else:
            record = self._encoder.encode(count, payloads)
        # Checksummed here, while the record is hot in the cache; the sink only writes.
        record_crc = _crc.crc32c(record if self._zero_copy else [record])
        self._files.add(record, record_crc, count)

    def _progress(self) -> None:
        if self._progbar is not None:
            self._progbar.update(self.samples_written)


def write_arrays(
    make: Callable[[str, WriteOptions], RecordWriter],
    directory: Any,
    x: Any,
    y: Any,
    sample_weight: Any,
    options: WriteOptions,
    min_shards: int | None,
) -> Manifest:
    """`ArraysToRecords.from_arrays`: `make` builds the writer from validated options."""
    directory = check_directory(directory)
    if inputs.is_batch_iterable(x):
        if options.shuffle_seed is not None:
            raise ValueError(
                "Expected arrays with `shuffle_seed`: writing in a shuffled order reads the "
                "input at random, and an iterable of batches is read once, in its order. "
                f"Received: shuffle_seed={options.shuffle_seed} and an iterable of batches."
            )
        return _write_iterable(make, directory, x, y, sample_weight, options, min_shards)
    # Validate everything before anything is touched on disk.
    options = dataclasses.replace(
        options, min_shards=8 if min_shards is None else min_shards, expected_samples=0
    )
    batch = validate_batch(x, y, sample_weight, frozenset(options.variable_length))
    if not options.resume:  # sizes that cannot work (a resumed conversion keeps its journal's)
        plan_layout(batch, options)
    with make(directory, dataclasses.replace(options, expected_samples=batch.n)) as writer:
        start = writer.resumed_samples
        if writer._layout is not None:  # the layout of the journal of the conversion resumed
            _check_resumed(writer, batch)
        if start > batch.n:
            raise ValueError(
                f"The unfinished conversion in {directory} already holds {start} samples, "
                f"more than the {batch.n} given: resume it with the same input."
            )
        if start < batch.n and options.shuffle_seed is None:
            writer._write_validated(batch, start)
        elif start < batch.n:
            _write_shuffled(writer, batch, start, options)
    assert writer.manifest is not None
    return writer.manifest


@contextlib.contextmanager
def _naming_batch(index: int, writer: RecordWriter) -> Iterator[None]:
    """Says which batch of an iterable a `ValueError` or `TypeError` is about (a batch
    whose shape or dtype changed mid-way): its index and the samples accepted before it,
    so that a generator's bad batch can be found."""
    try:
        yield
    except (ValueError, TypeError) as e:
        if type(e) not in (ValueError, TypeError):
            raise
        where = (
            f" (batch {index} of the iterable, counted from 0, after "
            f"{writer.samples_written} samples were accepted)"
        )
        raise type(e)(f"{e}{where}") from e


def _check_resumed(writer: RecordWriter, batch: Batch) -> None:
    """Refuses to resume a conversion with other input than it began with (its journal's
    layout), or with options that would write other records: another `compression`, or
    (fixed-size data) other samples per record or lattice (`shard_size`, `record_size`,
    `samples_per_record`, `lattice`). The data set would hold two inputs, or not be what
    the options ask for. ``batch`` is the whole input (arrays) or its first batch (an
    iterable). Shards per file (`min_shards`, `expected_samples`) stay the journal's."""
    layout = writer._layout
    assert layout is not None
    begun = f"The unfinished conversion in {writer.directory} was begun with"
    try:
        inputs.check_same_schema((layout.structure, layout.specs), batch)
    except ValueError as e:
        raise ValueError(
            f"{begun} other input: {e}. Resume it with the same input, or start over with "
            "`overwrite=True`."
        ) from None
    planned = plan_layout(batch, dataclasses.replace(writer.options, shuffle_seed=None))
    fixed = all(s.kind == "fixed" for s in layout.specs)

    def records(lay: Layout) -> str:
        kind = "on a lattice" if lay.lattice is not None else "plain"
        sized = f"{lay.samples_per_record} samples per record ({lay.record_bytes} bytes, {kind})"
        return f"compression={lay.compression}" + (f", {sized}" if fixed else "")

    if records(planned) != records(layout) or (fixed and planned.lattice != layout.lattice):
        raise ValueError(
            f"{begun} {records(layout)}; these options give {records(planned)}. Resume it "
            "with the `compression`, `shard_size`, `record_size`, `samples_per_record` and "
            "`lattice` it began with, or start over with `overwrite=True`."
        )


def _write_shuffled(writer: RecordWriter, batch: Batch, start: int, options: WriteOptions) -> None:
    """Writes positions ``start..`` of the seeded permutation of ``batch``'s samples,
    chunk by chunk: each chunk gathers its samples from the input in increasing index order
    (what h5py requires, and kind to a memmap's disk), then puts them in permuted order."""
    from keras_tfr.read.order import write_order

    assert options.shuffle_seed is not None
    order = write_order(batch.n, options.shuffle_seed)
    sample_bytes = max(1, round(sum(map(inputs.mean_sample_bytes, batch.specs, batch.arrays))))
    step = max(1, options.chunk_bytes // sample_bytes)
    for lo in range(start, batch.n, step):
        ids = order(np.arange(lo, min(lo + step, batch.n), dtype=np.int64))
        arrays = [inputs.take_rows(a, ids) for a in batch.arrays]
        writer._write_validated(Batch(batch.structure, batch.specs, arrays, batch.key_order), 0)


def _write_iterable(
    make: Callable[[str, WriteOptions], RecordWriter],
    directory: str,
    batches: Any,
    y: Any,
    sample_weight: Any,
    options: WriteOptions,
    min_shards: int | None,
) -> Manifest:
    if y is not None or sample_weight is not None:
        raise ValueError(
            "Expected `y` and `sample_weight` to be None when `x` is an iterable of "
            "batches (each batch carries its own `(x, y, sample_weight)`)."
        )
    if type(min_shards) is int and min_shards > 1:
        raise ValueError(
            f"Expected `min_shards` to be 1 or None when `x` is an iterable of batches: "
            "its total is unknown until its end, and shards are cut as data arrives. "
            f"Received: min_shards={min_shards}. Pass arrays, or write with "
            "`ArraysToRecords(directory, expected_samples=N, min_shards=...)`."
        )
    inputs.check_batched(batches)
    options = dataclasses.replace(options, min_shards=1 if min_shards is None else min_shards)
    with make(directory, options) as writer:
        skip = writer.resumed_samples
        told = False
        unchecked = writer._layout is not None  # resumed: the first batch, against its journal
        for index, item in enumerate(inputs.iterate_batches(batches)):
            with _naming_batch(index, writer):
                if not told and isinstance(item, list) and 2 <= len(item) <= 3:
                    told = True
                    log.warning(
                        "keras-tfr: the batches of `x` are lists of %d arrays, written as one "
                        "`x` of %d inputs with no `y`, as Keras reads a list. For `(x, y)` or "
                        "`(x, y, sample_weight)` batches, give tuples.",
                        len(item),
                        len(item),
                    )
                parts = inputs.split_batch(item)
                n = inputs.batch_len(parts)
                if n == 0:
                    continue  # an empty batch (a chunked reader's empty tail) holds nothing
                if unchecked:
                    unchecked = False
                    x_, y_, w_ = (*parts, None, None)[:3]
                    _check_resumed(writer, validate_batch(x_, y_, w_, writer.variable_length))
                if skip:
                    if n <= skip:
                        skip -= n
                        continue
                    parts = tuple(inputs.slice_parts(p, skip, n) for p in parts)
                    skip = 0
                writer.write(*parts)
        if skip:  # (the writer aborts: the unfinished conversion stays as it was)
            start = writer.resumed_samples
            raise ValueError(
                f"The unfinished conversion in {directory} already holds {start} samples, "
                f"more than the {start - skip} the iterable gave: resume it with the same "
                "input."
            )
    assert writer.manifest is not None
    return writer.manifest
