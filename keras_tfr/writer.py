"""`ArraysToRecords`: arrays, memmaps, h5py data sets and iterables of batches -> shards.

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
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import struct
import sys
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any

import keras
import numpy as np

from keras_tfr import _crc, _io
from keras_tfr._version import __version__
from keras_tfr.errors import DatasetExistsError, IncompleteDatasetError, ManifestError
from keras_tfr.manifest import (
    COMPRESSIONS,
    DEFAULT_CHUNK_SIZE,
    DEFAULT_RECORD_SIZE,
    DEFAULT_SHARD_SIZE,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    PROGRESS_NAME,
    Manifest,
    ShardInfo,
    parse_size,
)
from keras_tfr.schema import (
    MAX_RECORD_BYTES,
    BlockEncoder,
    FeatureSpec,
    check_dtype,
    to_le_bytes,
)

__all__ = ["ArraysToRecords"]

log = logging.getLogger("keras_tfr")

_SHARD_FILE = "shard-{:05d}.tfrecord"
_SHARD_RE = re.compile(r"^shard-\d{5,}\.tfrecord(\.tmp)?$")


def _is_array_like(v: Any) -> bool:
    return hasattr(v, "shape") and hasattr(v, "dtype") and hasattr(v, "__getitem__")


def _flatten(
    role: str, value: Any, variable: frozenset = frozenset()
) -> tuple[str, list[tuple[str, Any]]] | None:
    """Returns (structure, [(name, array_like)]) for one role, or None when absent.

    `variable` holds the feature keys declared variable-length (``variable_length=``).
    """
    if value is None:
        return None
    if role in variable and isinstance(value, (list, tuple)):
        return "array", [("", _Variable.from_values(value, role))]
    if isinstance(value, Mapping):
        if not value:
            raise ValueError(f"Expected `{role}` to be a non-empty dict of arrays. Received: {{}}")
        items = []
        for k in sorted(value, key=str):
            if not isinstance(k, str) or not k or "/" in k or "\x00" in k or len(k) > 255:
                raise ValueError(
                    f"Expected the keys of `{role}` to be non-empty strings without '/'. "
                    f"Received: key {k!r}"
                )
            items.append((k, _as_array_like(value[k], f"{role}[{k!r}]", f"{role}/{k}" in variable)))
        return "dict", items
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"Expected `{role}` to be a non-empty list of arrays. Received: []")
        return "list", [
            (str(i), _as_array_like(v, f"{role}[{i}]", f"{role}/{i}" in variable))
            for i, v in enumerate(value)
        ]
    return "array", [("", _as_array_like(value, role, role in variable))]


def _as_array_like(v: Any, argument: str, variable: bool = False) -> Any:
    if variable or (isinstance(v, np.ndarray) and v.dtype == object and v.ndim == 1):
        return _Variable.from_values(v, argument)
    if _is_array_like(v):
        return v
    if isinstance(v, (int, float, bool, np.generic)):
        raise ValueError(
            f"Expected `{argument}` to be an array whose first axis indexes samples. "
            f"Received: the scalar {v!r}"
        )
    if hasattr(v, "numpy") and callable(v.numpy):  # tf / torch / jax tensors
        return np.asarray(v.numpy())
    try:
        return np.asarray(v)
    except Exception as e:
        raise TypeError(
            f"Expected `{argument}` to be a NumPy array, np.memmap, h5py data set or any "
            f"array-like with `shape`, `dtype` and slicing. Received: {type(v).__name__}"
        ) from e


class _Variable:
    """A variable-length feature's samples: arrays of varying first axis, or byte strings.

    Looks like an array of ``len(items)`` samples to the writer (``shape``, ``dtype``,
    slicing); `FeatureSpec.from_array` reads ``feature_kind`` and ``row_shape``.
    """

    def __init__(self, items: list, kind: str, dtype: np.dtype, row_shape: tuple[int, ...]):
        self.items = items
        self.feature_kind = kind
        self.dtype = dtype
        self.row_shape = row_shape
        self.shape = (len(items),)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: slice) -> _Variable:
        return _Variable(self.items[index], self.feature_kind, self.dtype, self.row_shape)

    @property
    def nbytes(self) -> int:
        if self.feature_kind == "bytes":
            return sum(len(v) for v in self.items)
        return sum(a.nbytes for a in self.items)

    @classmethod
    def from_values(cls, values: Any, argument: str) -> _Variable:
        if isinstance(values, np.ndarray) and values.dtype != object:
            if values.ndim < 2:
                raise ValueError(
                    f"Expected `{argument}` (declared variable-length) to hold samples of at "
                    f"least one dimension. Received: an array of shape {values.shape}"
                )
            values = list(values)
        items = list(values)
        if not items:
            raise ValueError(f"Expected at least one sample in `{argument}`. Received: none.")
        if all(isinstance(v, (bytes, bytearray, memoryview, np.bytes_)) for v in items):
            items = [bytes(v) if not isinstance(v, bytes) else v for v in items]
            return cls(items, "bytes", np.dtype(np.uint8), ())
        arrays = []
        first = None
        for i, v in enumerate(items):
            if isinstance(v, (str, bytes, bytearray, memoryview, dict)) or v is None:
                raise TypeError(
                    f"Expected `{argument}` to be a list (or 1-D object array) of NumPy arrays "
                    "of at least one dimension, or of byte strings (all of one kind). "
                    f"Received: element {i} of type {type(v).__name__}"
                    + (" (encode strings to bytes first)" if isinstance(v, str) else "")
                )
            a = np.asarray(v)
            if a.dtype == object or a.ndim == 0:
                raise TypeError(
                    f"Expected `{argument}` to be a list (or 1-D object array) of NumPy arrays "
                    "of at least one dimension, or of byte strings. Received: element "
                    f"{i} of dtype {a.dtype} and shape {a.shape}"
                )
            if first is None:
                first = a
                dt = check_dtype(a.dtype, argument=argument)
            elif a.dtype != first.dtype or a.shape[1:] != first.shape[1:]:
                raise ValueError(
                    f"Expected every sample of `{argument}` to have dtype {first.dtype} and "
                    f"shape (length, *{first.shape[1:]}). Received: element {i} of dtype "
                    f"{a.dtype} and shape {a.shape}"
                )
            arrays.append(a)
        assert first is not None  # `items` is not empty (checked above)
        le = dt.newbyteorder("<") if dt.itemsize > 1 else dt
        if dt == np.bool_:
            arrays = [np.ascontiguousarray(a, dtype=np.bool_).view(np.uint8) for a in arrays]
        else:
            arrays = [np.ascontiguousarray(a, dtype=le) for a in arrays]
        return cls(arrays, "ragged", dt, tuple(int(d) for d in first.shape[1:]))

    def payload(self) -> tuple[bytes, bytes]:
        """The block's values back to back, and per sample its length (rows or bytes)."""
        if self.feature_kind == "bytes":
            lengths = [len(v) for v in self.items]
        else:
            lengths = [a.shape[0] for a in self.items]
            values = b"".join(a.reshape(-1).view(np.uint8) for a in self.items)
            return values, np.asarray(lengths, dtype="<i8").tobytes()
        return b"".join(self.items), np.asarray(lengths, dtype="<i8").tobytes()


def _join_payload(spec: FeatureSpec, parts: list[Any]) -> Any:
    """One block's payload of `spec` from the parts pending for it."""
    if spec.kind == "fixed":
        return b"".join(memoryview(a).cast("B") for a in parts)
    items = [item for part in parts for item in part.items]
    return _Variable(items, spec.kind, np.dtype(spec.dtype), spec.shape).payload()


def _mean_sample_bytes(spec: FeatureSpec, array: Any) -> float:
    if spec.kind == "fixed":
        return float(spec.sample_bytes)
    return array.nbytes / max(1, len(array)) + 8


class _Batch:
    """One validated `write` call: specs in key order, their arrays and the sample count."""

    def __init__(self, structure: dict[str, str], specs: list[FeatureSpec], arrays: list[Any]):
        self.structure = structure
        self.specs = specs
        self.arrays = arrays
        self.n = int(arrays[0].shape[0])


class ArraysToRecords(keras.callbacks.Callback):
    """Writes samples to a sharded TFRecord data set, chunk by chunk, with bounded memory.

    Use it as a context manager and call `write` any number of times, or call
    `ArraysToRecords.from_arrays` once. The data set is complete (its ``manifest.json``
    exists) only after the ``with`` block ends without an exception (or `close` returns).

    It is also a `keras.callbacks.Callback`: attached to ``model.predict(..., callbacks=[w])``
    it writes each batch's outputs as they come (see `keras_tfr.predict_to_records` for a
    version that does not gather outputs in memory).

    Args:
        directory: where the data set goes (local path, or a ``gs://``, ``s3://``,
            ``hdfs://`` or ``ram://`` URL). Created if missing.
        shard_size: most bytes per shard file, e.g. ``"128MB"`` or an int. A shard holds
            whole records: when `record_size` is larger, records shrink to fit one shard
            (at least one sample each); a sample that does not fit is refused. Records of
            variable-length features differ in size, so their shards may exceed it.
        record_size: target bytes per record (a block of consecutive samples). Larger blocks
            cut per-element overhead when reading; smaller ones shuffle more finely.
        samples_per_record: fixes the samples per record instead of `record_size` (a
            record of that many samples must fit in `shard_size`).
        compression: ``None``, ``"GZIP"`` or ``"ZLIB"``.
        overwrite: replace a data set (or an unfinished conversion) in `directory`.
        resume: continue an unfinished conversion from its last complete shard. The
            samples to skip are in `resumed_samples`; `from_arrays` skips them itself.
        expected_samples: total samples, when known: sizes the progress bar.
        min_shards: split into at least this many shards (when there are that many
            records; file-based sharding across workers needs several shards per worker).
            Shards are cut as data arrives, so a value above 1 needs `expected_samples`.
        chunk_size: bytes of input read and converted at a time (bounds memory).
        verbose: 1 shows a `keras.utils.Progbar`, 0 is silent.
        metadata: a JSON-serializable dict stored in the manifest as ``user_metadata``.
        variable_length: feature keys (``"x"``, ``"y"``, ``"x/tokens"``, ...) whose samples
            vary in length: give them as lists of arrays (varying first axis) or of byte
            strings (e.g. encoded PNGs). A 1-D object array of such values is detected
            without being declared. Records then differ in size.

    Example:
        >>> with ArraysToRecords("data/train", shard_size="64MB") as writer:
        ...     for xb, yb in chunks:
        ...         writer.write(xb, yb)
        >>> writer.manifest.total_samples
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        shard_size: int | str = DEFAULT_SHARD_SIZE,
        record_size: int | str = DEFAULT_RECORD_SIZE,
        samples_per_record: int | None = None,
        compression: str | None = None,
        overwrite: bool = False,
        resume: bool = False,
        expected_samples: int | None = None,
        min_shards: int = 1,
        chunk_size: int | str = DEFAULT_CHUNK_SIZE,
        verbose: int = 1,
        metadata: dict[str, Any] | None = None,
        variable_length: Iterable[str] = (),
    ):
        super().__init__()
        if isinstance(variable_length, str):
            variable_length = (variable_length,)
        self.variable_length = frozenset(variable_length)
        if not isinstance(directory, (str, os.PathLike)) or not str(directory):
            raise TypeError(
                f"Expected `directory` to be a path or URL string. Received: {directory!r}"
            )
        self.directory = os.fspath(directory)
        self.shard_size = parse_size(shard_size, argument="shard_size")
        self.record_size = parse_size(record_size, argument="record_size")
        self.chunk_size = parse_size(chunk_size, argument="chunk_size")
        if self.record_size > MAX_RECORD_BYTES:
            raise ValueError(
                f"Expected `record_size` to be below 2 GiB (the protobuf limit). "
                f"Received: {record_size!r}"
            )
        if samples_per_record is not None and (
            isinstance(samples_per_record, bool)
            or not isinstance(samples_per_record, int)
            or samples_per_record < 1
        ):
            raise ValueError(
                "Expected `samples_per_record` to be a positive int or None. "
                f"Received: {samples_per_record!r}"
            )
        if isinstance(compression, str):
            compression = compression.upper() or None
        if compression not in COMPRESSIONS:
            raise ValueError(
                f"Expected `compression` to be one of {COMPRESSIONS}. Received: {compression!r}"
            )
        if overwrite and resume:
            raise ValueError(
                "`overwrite=True` and `resume=True` contradict each other: pass one of them."
            )
        if expected_samples is not None and (
            not isinstance(expected_samples, int) or expected_samples < 0
        ):
            raise ValueError(
                "Expected `expected_samples` to be a non-negative int or None. "
                f"Received: {expected_samples!r}"
            )
        if isinstance(min_shards, bool) or not isinstance(min_shards, int) or min_shards < 1:
            raise ValueError(
                f"Expected `min_shards` to be a positive int. Received: {min_shards!r}"
            )
        if min_shards > 1 and expected_samples is None:
            raise ValueError(
                f"Expected `expected_samples` with `min_shards={min_shards}`: shards are cut "
                "as data arrives, so the writer can split into at least `min_shards` only "
                "when it knows the total in advance. Received: expected_samples=None"
            )
        if verbose not in (0, 1, 2, True, False):
            raise ValueError(f"Expected `verbose` to be 0, 1 or 2. Received: {verbose!r}")
        if metadata is not None and not isinstance(metadata, dict):
            raise TypeError(f"Expected `metadata` to be a dict or None. Received: {metadata!r}")
        if metadata is not None:
            import json

            try:  # checked now, not when the manifest is written after all the data
                json.dumps(metadata, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise TypeError(
                    "Expected `metadata` to be a JSON-serializable dict (str keys; str, "
                    f"number, bool, None, list or dict values). Received: {metadata!r:.200} ({e})"
                ) from e
        self.samples_per_record_arg = samples_per_record
        self.compression = compression
        self.overwrite = bool(overwrite)
        self.resume = bool(resume)
        self.expected_samples = expected_samples
        self.min_shards = min_shards
        self.verbose = int(verbose)
        self.metadata = dict(metadata or {})

        self.manifest: Manifest | None = None
        self.resumed_samples = 0
        self._opened = False
        self._closed = False
        self._lock = _io.DirectoryLock(self.directory)
        self._old_files: list[str] = []
        self._cleared_old = False
        self._structure: dict[str, str] | None = None
        self._specs: list[FeatureSpec] | None = None
        self._encoder: BlockEncoder | None = None
        self._spr = 0
        self._record_bytes = 0
        self._records_per_shard = 0
        self._shards: list[ShardInfo] = []
        self._pending: list[list[np.ndarray]] = []
        self._pending_count = 0
        self._samples_written = 0
        self._shard_writer = None
        self._sink: _RecordSink | None = None
        self._shard_tmp = ""
        self._shard_samples = 0
        self._shard_records = 0
        self._shard_crc = 0
        self._zero_copy = False  # records written as parts, payloads not joined
        self._borrowed = False  # queued records point into the caller's arrays
        self._progbar: Any = None  # a keras.utils.Progbar with verbose > 0

    # ------------------------------------------------------------------ public API

    @property
    def samples_written(self) -> int:
        """Samples accepted so far, including those of resumed shards."""
        return self._samples_written + self._pending_count

    def __enter__(self) -> ArraysToRecords:
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
        batch = self._validate(x, y, sample_weight)
        self._open()
        if self._specs is None:
            self._set_schema(batch)  # may refuse the sizes: before the old data set goes
        self._clear_old_once()
        self._append(batch)

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
            self._open()
            if self._specs is None or self.samples_written == 0:
                raise ValueError(
                    f"No samples were written to {self.directory}: call `write` with at least "
                    "one sample before closing."
                )
            self._clear_old_once()
            if self._pending_count:
                self._flush_pending()
            self._close_shard()
            self._sync_shards()
            manifest = Manifest(
                structure=dict(self._structure or {}),
                features=list(self._specs),
                samples_per_record=self._spr,
                record_bytes=self._record_bytes,
                compression=self.compression,
                shards=list(self._shards),
                writer_version=__version__,
                user_metadata=self.metadata,
            )
            manifest.save(self.directory)  # the data set exists from here on
            _io.remove(_io.join(self.directory, PROGRESS_NAME))
            self.manifest = manifest
            if self._progbar is not None:
                self._progbar.update(self.samples_written, finalize=True)
        except BaseException:
            self.abort()
            raise
        self._closed = True
        if self._sink is not None:
            self._sink.stop()
            self._sink = None
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
        ones (and their journal) so that ``resume=True`` can continue."""
        if self._closed:
            return
        self._closed = True
        if self._sink is not None:
            self._sink.stop()
            self._sink = None
        if self._shard_writer is not None:
            try:
                self._shard_writer.close()
            except Exception:
                pass
            self._shard_writer = None
            _io.remove(self._shard_tmp)
        self._lock.release()

    @classmethod
    def from_arrays(
        cls,
        x: Any,
        y: Any = None,
        directory: str | os.PathLike | None = None,
        *,
        sample_weight: Any = None,
        shard_size: int | str = DEFAULT_SHARD_SIZE,
        record_size: int | str = DEFAULT_RECORD_SIZE,
        samples_per_record: int | None = None,
        compression: str | None = None,
        overwrite: bool = False,
        resume: bool = False,
        min_shards: int | None = None,
        chunk_size: int | str = DEFAULT_CHUNK_SIZE,
        verbose: int = 1,
        metadata: dict[str, Any] | None = None,
        variable_length: Iterable[str] = (),
    ) -> Manifest:
        """Converts arrays (or an iterable of batches) in one call.

        Args:
            x: an array-like, a dict or list of them, or an iterable of batches where each
                batch is ``x``, ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)``.
            y: targets (arrays only; an iterable carries its own targets).
            directory: where the data set goes. ``from_arrays(x, "dir")`` also works.
            sample_weight: per-sample weights (arrays only).
            min_shards: write at least this many shards (when there are that many
                records); default 8 for arrays. An iterable of batches does not tell how
                many samples it holds, so it is written in shards of `shard_size` and
                refuses a `min_shards` above 1 (use `ArraysToRecords` with
                ``expected_samples=``).
            Other arguments: as for `ArraysToRecords`.

        Returns:
            The written data set's `Manifest`.

        Example:
            >>> x = np.load("x.npy", mmap_mode="r"); y = np.load("y.npy", mmap_mode="r")
            >>> ArraysToRecords.from_arrays(x, y, "data/train")
        """
        if directory is None and isinstance(y, (str, os.PathLike)):
            directory, y = y, None
        if directory is None:
            raise TypeError("Expected `directory` (the data set's path). Received: None")
        kwargs: dict[str, Any] = dict(
            shard_size=shard_size,
            record_size=record_size,
            samples_per_record=samples_per_record,
            compression=compression,
            overwrite=overwrite,
            resume=resume,
            min_shards=min_shards,
            chunk_size=chunk_size,
            verbose=verbose,
            metadata=metadata,
            variable_length=variable_length,
        )
        if _is_batch_iterable(x):
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
            kwargs["min_shards"] = 1 if min_shards is None else min_shards
            with cls(directory, **kwargs) as writer:
                skip = writer.resumed_samples
                for item in x:
                    parts = _split_batch(item)
                    n = _batch_len(parts)
                    if skip:
                        if n <= skip:
                            skip -= n
                            continue
                        parts = tuple(_slice(p, skip, n) for p in parts)
                        skip = 0
                    writer.write(*parts)
            assert writer.manifest is not None
            return writer.manifest
        # Validate everything before anything is touched on disk.
        kwargs["min_shards"] = 8 if min_shards is None else min_shards
        kwargs["expected_samples"] = 0  # replaced below, once the arrays are checked
        probe = cls(directory, **kwargs)
        batch = probe._validate(x, y, sample_weight)
        if not resume:  # sizes that cannot work (a resumed conversion keeps its journal's)
            probe._set_schema(batch)
        kwargs["expected_samples"] = batch.n
        with cls(directory, **kwargs) as writer:
            start = writer.resumed_samples
            if start > batch.n:
                raise ValueError(
                    f"The unfinished conversion in {directory} already holds {start} samples, "
                    f"more than the {batch.n} given: resume it with the same input."
                )
            if start < batch.n:
                writer._write_validated(batch, start)
        assert writer.manifest is not None
        return writer.manifest

    # ------------------------------------------------------------------ Keras callback

    def on_predict_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Writes the batch's predictions (as ``x``) when used as a predict callback."""
        outputs = (logs or {}).get("outputs")
        if outputs is None:
            return
        outputs = keras.tree.map_structure(
            lambda t: np.asarray(keras.ops.convert_to_numpy(t)), outputs
        )
        self.write(outputs)

    def on_predict_end(self, logs: dict | None = None) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _validate(self, x: Any, y: Any, sample_weight: Any) -> _Batch:
        if x is None:
            raise ValueError("Expected `x` to hold at least one array. Received: x=None")
        if sample_weight is not None and y is None:
            raise ValueError(
                "Expected `y` with `sample_weight`: Keras weighs each sample's loss against "
                "its target, so a data set with sample weights needs targets. "
                f"Received: y=None and sample_weight of type {type(sample_weight).__name__}"
            )
        structure: dict[str, str] = {}
        specs: list[FeatureSpec] = []
        arrays: list[Any] = []
        for role, value in (("x", x), ("y", y), ("sample_weight", sample_weight)):
            flat = _flatten(role, value, self.variable_length)
            if flat is None:
                continue
            kind, items = flat
            structure[role] = kind
            for name, arr in items:
                argument = role if kind == "array" else f"{role}[{name!r}]"
                spec = FeatureSpec.from_array(role, name, arr, argument=argument)
                specs.append(spec)
                arrays.append(arr)
        lengths = {s.key: int(a.shape[0]) for s, a in zip(specs, arrays)}
        if len(set(lengths.values())) > 1:
            raise ValueError(
                "Expected `x`, `y` and `sample_weight` to hold the same number of samples. "
                f"Received: {', '.join(f'{k}: {v}' for k, v in lengths.items())}"
            )
        n = next(iter(lengths.values()))
        if n == 0:
            raise ValueError("Expected at least one sample. Received: empty arrays (0 samples).")
        for s in specs:
            if s.sample_bytes == 0:
                raise ValueError(
                    f"Expected samples of `{s.key}` to hold at least one value. "
                    f"Received: per-sample shape {s.shape}"
                )
        order = sorted(range(len(specs)), key=lambda i: specs[i].key)
        specs = [specs[i] for i in order]
        arrays = [arrays[i] for i in order]
        if self._specs is not None:
            self._check_same_schema(structure, specs)
        return _Batch(structure, specs, arrays)

    def _check_same_schema(self, structure: dict[str, str], specs: list[FeatureSpec]) -> None:
        if structure != self._structure:
            raise ValueError(
                "Expected every batch to have the structure of the first one. "
                f"Expected: {self._structure}. Received: {structure}"
            )
        old = {s.key: s for s in self._specs or []}
        new = {s.key: s for s in specs}
        if set(old) != set(new):
            raise ValueError(
                "Expected every batch to hold the features of the first one. "
                f"Expected: {sorted(old)}. Received: {sorted(new)}"
            )
        for k, s in new.items():
            o = old[k]
            if (s.dtype, s.shape, s.kind) != (o.dtype, o.shape, o.kind):
                raise ValueError(
                    f"Expected `{k}` to keep dtype {o.dtype} and per-sample shape {o.shape} "
                    f"({o.kind}) across batches. Received: dtype {s.dtype}, shape {s.shape} "
                    f"({s.kind})"
                )

    def _open(self) -> None:
        if self._opened:
            return
        if self._closed:
            raise RuntimeError(f"This writer for {self.directory} is already closed.")
        _io.makedirs(self.directory)
        self._lock.acquire()
        try:
            self._inspect_directory()
        except BaseException:
            self._lock.release()
            raise
        self._opened = True
        if self.verbose:
            self._progbar = keras.utils.Progbar(
                self.expected_samples, verbose=self.verbose, unit_name="sample"
            )
            if self.resumed_samples:
                self._progbar.update(self.resumed_samples)

    def _inspect_directory(self) -> None:
        manifest_path = _io.join(self.directory, MANIFEST_NAME)
        progress_path = _io.join(self.directory, PROGRESS_NAME)
        has_manifest = _io.exists(manifest_path)
        has_progress = _io.exists(progress_path)
        if has_manifest and not self.overwrite:
            raise DatasetExistsError(
                f"{self.directory} already holds a keras-tfr data set ({MANIFEST_NAME} exists). "
                "Pass `overwrite=True` to replace it, or choose another directory."
            )
        if has_progress and not (self.resume or self.overwrite):
            raise IncompleteDatasetError(
                f"{self.directory} holds an unfinished conversion. Pass `resume=True` to "
                "continue it from its last complete shard, or `overwrite=True` to start over."
            )
        if self.overwrite:
            # Deleted at the first valid `write`, so bad input leaves the old data intact.
            self._old_files = [
                n for n in _io.listdir(self.directory) if _SHARD_RE.match(n) or _is_atomic_tmp(n)
            ] + [PROGRESS_NAME, MANIFEST_NAME]
            if has_manifest:
                try:  # shards of another writer may have other names: the manifest knows them
                    old = Manifest.load(self.directory, check_files=False)
                    self._old_files += [s.file for s in old.shards]
                except (ManifestError, OSError):
                    pass
            return
        for name in _io.listdir(self.directory):
            if (name.endswith(".tfrecord.tmp") and _SHARD_RE.match(name)) or _is_atomic_tmp(name):
                _io.remove(_io.join(self.directory, name))  # left by a killed writer
        if has_progress and self.resume:
            self._load_progress(progress_path)
        elif self.resume:
            log.info(
                "keras-tfr: nothing to resume in %s; starting a new conversion", self.directory
            )
        stray = [n for n in _io.listdir(self.directory) if _SHARD_RE.match(n)]
        known = {s.file for s in self._shards}
        stray = [n for n in stray if n not in known]
        if stray and has_progress and self.resume:
            # Beyond the journal (a writer killed between a rename and its journal entry,
            # or shards that failed their check): this conversion's own, rewritten now.
            for name in stray:
                _io.remove(_io.join(self.directory, name))
            stray = []
        if stray:
            raise IncompleteDatasetError(
                f"{self.directory} holds shard files that no manifest or journal lists "
                f"({', '.join(sorted(stray)[:5])}). Pass `overwrite=True` to replace them."
            )

    def _clear_old_once(self) -> None:
        if self._cleared_old or not self.overwrite:
            return
        self._cleared_old = True
        # The manifest goes first: from then on no reader takes the directory for a data set.
        for name in [MANIFEST_NAME, *self._old_files]:
            _io.remove(_io.join(self.directory, name))

    def _load_progress(self, path: str) -> None:
        import json

        try:
            journal = json.loads(_io.read_bytes(path).decode("utf-8"))
            if journal.get("format") != FORMAT_NAME or journal.get("format_version") != (
                FORMAT_VERSION
            ):
                raise ValueError("unknown journal format")
            probe = Manifest.from_json(
                {
                    "format": FORMAT_NAME,
                    "format_version": FORMAT_VERSION,
                    **journal["config"],
                    "shards": journal["shards"],
                },
                source=path,
            )
            records_per_shard = int(journal["records_per_shard"])
        except (ValueError, KeyError, TypeError) as e:
            raise IncompleteDatasetError(
                f"The journal {path} of the unfinished conversion is damaged ({e}); "
                "start over with `overwrite=True`."
            ) from e
        probe.directory = self.directory
        from keras_tfr.verifier import verify_shard

        kept: list[ShardInfo] = []
        for shard in probe.shards:
            problems = verify_shard(probe, shard)
            if problems:
                log.warning("keras-tfr: not resuming from %s: %s", shard.file, "; ".join(problems))
                break
            kept.append(shard)
        for shard in probe.shards[len(kept) :]:
            _io.remove(_io.join(self.directory, shard.file))
        self._structure = probe.structure
        self._specs = sorted(probe.features, key=lambda s: s.key)
        self._encoder = BlockEncoder(self._specs)
        self._spr = probe.samples_per_record
        self._record_bytes = probe.record_bytes
        self.compression = probe.compression
        self._records_per_shard = records_per_shard
        self._zero_copy = self._can_zero_copy()
        self._shards = kept
        self._samples_written = sum(s.samples for s in kept)
        self.resumed_samples = self._samples_written
        log.info(
            "keras-tfr: resuming %s after %d complete shards (%d samples)",
            self.directory,
            len(kept),
            self.resumed_samples,
        )

    def _set_schema(self, batch: _Batch) -> None:
        specs = list(batch.specs)
        encoder = BlockEncoder(specs)
        sample_bytes = sum(s.sample_bytes for s in specs)
        variable = any(s.kind != "fixed" for s in specs)
        if variable:  # sized from the first batch's mean sample
            mean = sum(map(_mean_sample_bytes, batch.specs, batch.arrays))
            sample_bytes = max(1, math.ceil(mean))

        def record_bytes(spr: int) -> int:
            if variable:
                return spr * sample_bytes + 32 * (1 + 2 * len(specs))
            return encoder.fixed_layout(spr)[2]

        def on_disk(spr: int) -> int:  # a record and its TFRecord framing
            return record_bytes(spr) + 16

        if self.samples_per_record_arg is not None:
            spr = self.samples_per_record_arg
        else:
            spr = max(1, self.record_size // sample_bytes)
            if on_disk(spr) > self.shard_size:
                # A shard holds whole records: records shrink until one fits.
                framing = on_disk(1) - sample_bytes
                spr = max(1, (self.shard_size - framing) // sample_bytes)
                while spr > 1 and on_disk(spr) > self.shard_size:
                    spr -= 1  # a few steps at most: only varint lengths grow with spr
        if on_disk(spr) > self.shard_size:
            if self.samples_per_record_arg is not None and spr > 1:
                raise ValueError(
                    f"Expected `shard_size` to hold at least one record of "
                    f"`samples_per_record={spr}` samples, which takes {on_disk(spr)} bytes on "
                    f"disk. Received: shard_size={self.shard_size} bytes. Raise `shard_size` "
                    "or lower `samples_per_record`."
                )
            raise ValueError(
                f"Expected `shard_size` to hold at least one sample: a record of one sample "
                f"takes {on_disk(1)} bytes on disk ({sample_bytes} bytes of data"
                f"{' on average' if variable else ''} and {on_disk(1) - sample_bytes} of "
                f"framing). Received: shard_size={self.shard_size} bytes."
            )
        if spr * sample_bytes > MAX_RECORD_BYTES:
            raise ValueError(
                f"A record of {spr} samples of {sample_bytes} bytes would pass the 2 GiB "
                "protobuf limit: lower `samples_per_record`."
            )
        self._structure = dict(batch.structure)
        self._specs = specs
        self._encoder = encoder
        self._spr = spr
        self._record_bytes = record_bytes(spr)
        self._zero_copy = self._can_zero_copy()
        per_shard = max(1, self.shard_size // (self._record_bytes + 16))
        if self.expected_samples:
            total_records = math.ceil(self.expected_samples / spr)
            # Rounded down: ceil would give 5 shards of 2 for 10 records and min_shards=8.
            per_shard = min(per_shard, max(1, total_records // self.min_shards))
        self._records_per_shard = per_shard

    def _can_zero_copy(self) -> bool:
        fixed = all(s.kind == "fixed" for s in self._specs or [])
        return self.compression is None and _crc.hardware() and fixed

    def _write_validated(self, batch: _Batch, start: int = 0) -> None:
        self._open()
        if self._specs is None:
            self._set_schema(batch)  # may refuse the sizes: before the old data set goes
        else:
            self._check_same_schema(batch.structure, batch.specs)
        self._clear_old_once()
        self._append(batch, start)

    def _append(self, batch: _Batch, start: int = 0) -> None:
        assert self._specs is not None
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
                assert self._sink is not None
                self._sink.finish_shard()

    def _append_fixed(self, batch: _Batch, start: int) -> None:
        spr = self._spr
        n = batch.n
        i = start
        if self._pending_count:
            take = min(spr - self._pending_count, n - i)
            for slot, (spec, arr) in enumerate(zip(batch.specs, batch.arrays)):
                self._pending[slot].append(to_le_bytes(arr[i : i + take], spec).copy())
            self._pending_count += take
            i += take
            if self._pending_count == spr:
                self._flush_pending()
        sample_bytes = sum(s.sample_bytes for s in batch.specs)
        chunk_blocks = max(1, self.chunk_size // max(1, sample_bytes * spr))
        while n - i >= spr:
            nblocks = min(chunk_blocks, (n - i) // spr)
            end = i + nblocks * spr
            views = []
            for arr in batch.arrays:
                _populate_pages(arr, i, end)
            for spec, arr in zip(batch.specs, batch.arrays):
                views.append((to_le_bytes(arr[i:end], spec).data.cast("B"), spec))
            for b in range(nblocks):
                payloads = []
                for mv, spec in views:
                    bb = spr * spec.sample_bytes
                    payloads.append(mv[b * bb : (b + 1) * bb])
                self._emit(spr, payloads)
            del views
            # After the sink wrote these rows (it may still be reading them).
            assert self._sink is not None
            self._sink.put(("release", batch.arrays, i, end))
            i = end
            self._samples_written += nblocks * spr
            if self._progbar is not None:
                self._progbar.update(self.samples_written)
        if i < n:
            if not self._pending:
                self._pending = [[] for _ in batch.specs]
            for slot, (spec, arr) in enumerate(zip(batch.specs, batch.arrays)):
                self._pending[slot].append(to_le_bytes(arr[i:n], spec).copy())
            self._pending_count += n - i
            if self._progbar is not None:
                self._progbar.update(self.samples_written)

    def _append_variable(self, batch: _Batch, start: int) -> None:
        """Block by block, through the pending lists: records differ in size."""
        n = batch.n
        i = start
        while i < n:
            if not self._pending:
                self._pending = [[] for _ in batch.specs]
            take = min(self._spr - self._pending_count, n - i)
            for slot, (spec, arr) in enumerate(zip(batch.specs, batch.arrays)):
                part = arr[i : i + take]
                self._pending[slot].append(
                    part if spec.kind != "fixed" else to_le_bytes(part, spec).copy()
                )
            self._pending_count += take
            i += take
            if self._pending_count == self._spr:
                self._flush_pending()
        if self._progbar is not None:
            self._progbar.update(self.samples_written)

    def _flush_pending(self) -> None:
        count = self._pending_count
        assert self._specs is not None
        payloads = [_join_payload(s, parts) for s, parts in zip(self._specs, self._pending)]
        self._pending = [[] for _ in self._specs or []]
        self._pending_count = 0
        self._emit(count, payloads)
        self._samples_written += count

    def _emit(self, count: int, payloads: list[Any]) -> None:
        assert self._encoder is not None
        if self._shard_writer is None:
            self._open_shard()
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
        self._shard_crc = _crc.crc32c([struct.pack("<I", record_crc)], self._shard_crc)
        assert self._sink is not None
        self._sink.put((record, record_crc))
        self._shard_records += 1
        self._shard_samples += count
        if self._shard_records >= self._records_per_shard:
            self._close_shard()

    def _open_shard(self) -> None:
        name = _SHARD_FILE.format(len(self._shards))
        self._shard_tmp = _io.join(self.directory, name + ".tmp")
        self._shard_writer = _open_record_file(self._shard_tmp, self.compression)
        self._shard_samples = self._shard_records = self._shard_crc = 0
        if self._sink is None:
            self._sink = _RecordSink(max(2, (64 << 20) // max(1, self._record_bytes)))
        self._sink.start_shard(self._shard_writer)

    def _close_shard(self) -> None:
        if self._shard_writer is None:
            return
        self._sink.finish_shard()
        self._shard_writer.close()
        self._shard_writer = None
        _start_writeback(self._shard_tmp)
        name = _SHARD_FILE.format(len(self._shards))
        final = _io.join(self.directory, name)
        self._shards.append(
            ShardInfo(
                file=name,
                samples=self._shard_samples,
                records=self._shard_records,
                bytes=_io.size(self._shard_tmp),
                checksum=f"crc32c:{self._shard_crc:08x}",
            )
        )
        # Journal first, then rename: a kill in between leaves a journal entry whose file
        # is missing (resume checks and rewrites it), never a shard no journal lists.
        self._write_progress()
        _io.rename(self._shard_tmp, final)

    def _sync_shards(self) -> None:
        """Makes every shard durable before the manifest names it.

        Local files: each shard is fsynced, then the directory (its renames); the manifest
        is then written with an fsync of its own (`Manifest.save`). All at the end rather
        than as each shard closes: an fsync waits for all the data written before it (ext4
        commits in order), so syncing shard by shard would stall the conversion. Write-back
        of each shard starts, without waiting, as it closes (`_start_writeback`), so the
        fsyncs here wait only for the rest (``benchmarks/write_fsync.py``). URLs
        (``gs://``, ``s3://``, ``hdfs://``): `tf.io.gfile` has no fsync; a shard is as
        durable as its file system makes a closed file (an object store's upload
        completes when the file is closed).
        """
        if _io.is_remote(self.directory):
            return
        flags = os.O_RDWR if os.name == "nt" else os.O_RDONLY  # Windows syncs writable fds
        for shard in self._shards:
            path = _io.join(self.directory, shard.file)
            fd = os.open(path, flags)
            try:
                os.fsync(fd)
            except OSError as e:
                raise OSError(
                    e.errno, f"Could not sync the shard {path} to disk: {e.strerror}"
                ) from e
            finally:
                os.close(fd)
        _io._fsync_dir(self.directory)

    def _write_progress(self) -> None:
        assert self._specs is not None
        journal = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "writer_version": __version__,
            "records_per_shard": self._records_per_shard,
            "config": {
                "structure": self._structure,
                "features": [s.to_json() for s in self._specs],
                "samples_per_record": self._spr,
                "record_bytes": self._record_bytes,
                "compression": self.compression,
            },
            "shards": [s.to_json() for s in self._shards],
        }
        _io.write_json_atomic(_io.join(self.directory, PROGRESS_NAME), journal, durable=False)


def _is_atomic_tmp(name: str) -> bool:
    """A temporary file of `_io.write_atomic` (manifest or journal) left by a killed writer."""
    return name.startswith((MANIFEST_NAME + ".tmp-", PROGRESS_NAME + ".tmp-"))


def _is_batch_iterable(x: Any) -> bool:
    if x is None or _is_array_like(x) or isinstance(x, (Mapping, list, tuple, str, bytes)):
        return False
    return isinstance(x, Iterable)


def _split_batch(item: Any) -> tuple:
    if isinstance(item, tuple):
        if not 1 <= len(item) <= 3:
            raise ValueError(
                "Expected each batch to be `x`, `(x,)`, `(x, y)` or `(x, y, sample_weight)`. "
                f"Received: a tuple of {len(item)} elements"
            )
        return item
    return (item,)


def _batch_len(parts: tuple) -> int:
    first = parts[0]
    while isinstance(first, (Mapping, list, tuple)):
        first = next(iter(first.values())) if isinstance(first, Mapping) else first[0]
    return int(np.shape(first)[0])


def _slice(part: Any, start: int, stop: int) -> Any:
    if part is None:
        return None
    if isinstance(part, Mapping):
        return {k: _slice(v, start, stop) for k, v in part.items()}
    if isinstance(part, (list, tuple)):
        return type(part)(_slice(v, start, stop) for v in part)
    return part[start:stop]


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


_SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(path: str) -> bool:
    """Starts writing a finished shard to disk without waiting (Linux `sync_file_range`),
    so that the fsync before the manifest finds less left to write. An advice: errors and
    other systems are ignored. Returns True when the write-back was started."""
    if _io.is_remote(path) or not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        fd = os.open(path, os.O_RDONLY)
        try:
            call = _libc().sync_file_range
            call.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
            return call(fd, 0, 0, _SYNC_FILE_RANGE_WRITE) == 0
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        return False


def _release_pages(arr: Any, start: int, stop: int) -> None:
    """Drops the converted rows of a read-only or shared memmap from this process' memory.

    Pages of a file mapping that were read stay mapped, and count in RSS, until unmapped:
    converting a memmap larger than RAM would look like it loads the whole file.
    ``MADV_DONTNEED`` on a read-only or shared mapping only drops the mapping's pages (the
    data stays in the file and the page cache); copy-on-write (mode ``"c"``) maps are left alone.
    """
    if not isinstance(arr, np.memmap) or getattr(arr, "mode", "c") not in ("r", "r+", "readonly"):
        return
    if not arr.flags.c_contiguous or arr.ndim == 0:
        return
    import mmap

    _madvise(arr, start, stop, mmap.MADV_DONTNEED, inward=True)


def _madvise(arr: Any, start: int, stop: int, advice: int, inward: bool) -> None:
    """`madvise` on rows ``[start, stop)`` of a C-contiguous array: on the whole pages
    inside them (``inward``) or on every page they touch. Errors are ignored (an advice)."""
    try:
        import ctypes
        import mmap

        row = arr.strides[0]
        base = arr.__array_interface__["data"][0]
        page = mmap.PAGESIZE
        lo = base + start * row
        hi = base + stop * row
        if inward:
            lo, hi = (lo + page - 1) // page * page, hi // page * page
        else:
            lo, hi = lo // page * page, (hi + page - 1) // page * page
        if hi <= lo:
            return
        _libc().madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), advice)
    except (OSError, AttributeError, ValueError):
        pass


_MADV_POPULATE_READ = 22  # Linux 5.14+: maps a range of pages in one call


def _populate_pages(arr: Any, start: int, stop: int) -> None:
    """Maps rows of a memmap with one `madvise` instead of a page fault per 4 KB page."""
    if not isinstance(arr, np.memmap) or not arr.flags.c_contiguous or arr.ndim == 0:
        return
    _madvise(arr, start, stop, _MADV_POPULATE_READ, inward=False)


class _RecordSink:
    """Writes records on a background thread.

    The write releases the GIL, so while this thread writes one record the caller's
    thread slices, serializes and checksums the next (hardware CRC-32C): on two cores
    conversion runs close to the disk's rate.
    The queue is bounded (about 64 MB of records), so memory stays bounded too; an error
    in the thread is raised in the caller at the next `put` or `finish_shard`.
    """

    def __init__(self, max_records: int):
        import queue
        import threading

        self._queue: queue.Queue = queue.Queue(maxsize=max_records)
        self._error: BaseException | None = None
        self._writer: Any = None
        self._thread = threading.Thread(target=self._run, name="keras-tfr-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import queue

        while True:
            # What else is queued goes out with it: one `writev` for several records.
            items = [self._queue.get()]
            while len(items) < 64 and _is_record(items[-1]):
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                records = [it for it in items if _is_record(it)]
                if records and self._error is None:
                    self._writer.write_many(records)
                for it in items:
                    if it is not None and not _is_record(it):
                        for arr in it[1]:
                            _release_pages(arr, it[2], it[3])
            except BaseException as e:  # surfaced in the caller's thread
                self._error = e
            finally:
                for _ in items:
                    self._queue.task_done()
            if items[-1] is None:
                return

    def _raise_pending(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def start_shard(self, writer: Any) -> None:
        self._queue.join()
        self._raise_pending()
        self._writer = writer

    def put(self, item: tuple) -> None:
        """Queues ``(record, its CRC-32C)`` for writing (the record as bytes or as a list
        of parts), or ``("release", arrays, start, stop)`` to drop memmap pages once the
        records before it are written."""
        self._raise_pending()
        self._queue.put(item)

    def finish_shard(self) -> None:
        """Waits until every queued record is written."""
        self._queue.join()
        self._raise_pending()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._error = None


def _is_record(item: Any) -> bool:
    return item is not None and not (isinstance(item[0], str) and item[0] == "release")


class _FramedFile:
    """Writes uncompressed TFRecord framing itself: TensorFlow's writer computes CRC32C in
    software (about 3 GB/s here); `google_crc32c` uses the CPU's CRC instructions (>10 GB/s).

    Frame: uint64 length, masked CRC32C of the length, data, masked CRC32C of the data
    (all little-endian), byte for byte what `tf.io.TFRecordWriter` writes.
    """

    def __init__(self, path: str):
        self._remote = _io.is_remote(path)
        if self._remote:
            import tensorflow as tf

            self._f = tf.io.gfile.GFile(path, "wb")
        else:
            self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def write(self, record: Any, crc: int | None = None) -> None:
        """Writes one record: ``bytes``, or a list of buffers (written without joining)."""
        self.write_many([(record, crc)])

    def write_many(self, records: list[tuple[Any, int | None]]) -> None:
        """Writes ``(record, its CRC-32C or None)`` pairs with as few `writev` calls as
        IOV_MAX allows."""
        parts: list[Any] = []
        total = 0
        for record, crc in records:
            body = record if isinstance(record, list) else [record]
            if crc is None:
                crc = _crc.crc32c(body)
            length = sum(memoryview(p).nbytes for p in body)
            header = struct.pack("<Q", length)
            header += _crc.masked_bytes(_crc.crc32c([header]))
            parts += [header, *body, _crc.masked_bytes(crc)]
            total += length + 16
            if len(parts) > 512:  # IOV_MAX is 1024 on Linux
                self._write_parts(parts, total)
                parts, total = [], 0
        if parts:
            self._write_parts(parts, total)

    def _write_parts(self, parts: list[Any], total: int) -> None:
        if self._remote:
            for part in parts:
                self._f.write(bytes(part))
            return
        assert self._fd is not None  # a local file is open until close()
        written = os.writev(self._fd, parts)
        if written != total:  # rare short write: finish it byte-exactly
            rest = b"".join(bytes(p) for p in parts)[written:]
            while rest:
                rest = rest[os.write(self._fd, rest) :]

    def close(self) -> None:
        if self._remote:
            self._f.close()
        elif self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _open_record_file(path: str, compression: str | None) -> Any:
    if compression is None:
        return _FramedFile(path)
    import tensorflow as tf

    writer = tf.io.TFRecordWriter(path, tf.io.TFRecordOptions(compression_type=compression))
    return _CompressedFile(writer)


class _CompressedFile:
    """GZIP/ZLIB shards: TensorFlow's writer frames and compresses."""

    def __init__(self, writer: Any):
        self._writer = writer

    def write(self, record: Any, crc: int | None = None) -> None:
        if isinstance(record, list):
            record = b"".join(bytes(p) for p in record)
        self._writer.write(record)

    def write_many(self, records: list[tuple[Any, int | None]]) -> None:
        for record, crc in records:
            self.write(record, crc)

    def close(self) -> None:
        self._writer.close()
