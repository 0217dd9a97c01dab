"""`ArraysToRecords`: the writer as Keras users meet it, and a `keras.callbacks.Callback`.

A thin adapter over `keras_tfr.write.writer.RecordWriter` (which does not import Keras):
the options as explicit keyword arguments, a `keras.utils.Progbar`, and the predict
callbacks. The only module of the writer that imports Keras.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import keras
import numpy as np

from keras_tfr.manifest import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_RECORD_SIZE,
    DEFAULT_SHARD_SIZE,
    Manifest,
)
from keras_tfr.write.options import WriteOptions
from keras_tfr.write.writer import RecordWriter, write_arrays

__all__ = ["ArraysToRecords"]


class ArraysToRecords(RecordWriter, keras.callbacks.Callback):
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
        verbose: 1 shows a `keras.utils.Progbar`, 0 is silent (attached to `predict`,
            `predict(..., verbose=0)` silences it too).
        metadata: a JSON-serializable dict stored in the manifest as ``user_metadata``.
        variable_length: feature keys (``"x"``, ``"y"``, ``"x/tokens"``, ...) whose samples
            vary in length: give them as lists of arrays (varying first axis) or of byte
            strings (e.g. encoded PNGs). A 1-D object array of such values is detected
            without being declared. Records then differ in size.
        lattice: pad uncompressed records of fixed-size features with zeros so that
            every sample sits on a lattice (`keras_tfr.schema.Lattice`; the padding is
            at most 1/16 of a record, under 1 % for most shapes): in sample mode,
            TensorFlow then gathers batches straight from the mapped shards, without a
            Python call per batch. ``False`` writes the plain layout. Ignored (plain
            layout) for compressed or variable-length data, and where no lattice fits.

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
        lattice: bool = True,
    ):
        options = WriteOptions(
            shard_size=shard_size,
            record_size=record_size,
            samples_per_record=samples_per_record,
            compression=compression,
            overwrite=overwrite,
            resume=resume,
            expected_samples=expected_samples,
            min_shards=min_shards,
            chunk_size=chunk_size,
            verbose=verbose,
            metadata=metadata,
            variable_length=variable_length,
            lattice=lattice,
        )
        self._start(directory, options)

    def _start(self, directory: Any, options: WriteOptions) -> None:
        keras.callbacks.Callback.__init__(self)
        RecordWriter.__init__(self, directory, options)

    @classmethod
    def _from_options(cls, directory: Any, options: WriteOptions) -> ArraysToRecords:
        """A writer from options already validated (`predict_to_records`, ...)."""
        writer = cls.__new__(cls)
        writer._start(directory, options)
        return writer

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
        lattice: bool = True,
        shuffle_seed: int | None = None,
    ) -> Manifest:
        """Converts arrays (or an iterable of batches) in one call.

        Args:
            x: an array-like, a dict or list of them, or an iterable of batches where each
                batch is ``x``, ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)`` (a
                generator, or a list of such tuples: a list of arrays is one array per
                input, as Keras reads a list).
            y: targets (arrays only; an iterable carries its own targets).
            directory: where the data set goes. ``from_arrays(x, "dir")`` also works.
            sample_weight: per-sample weights (arrays only).
            min_shards: write at least this many shards (when there are that many
                records); default 8 for arrays. An iterable of batches does not tell how
                many samples it holds, so it is written in shards of `shard_size` and
                refuses a `min_shards` above 1 (use `ArraysToRecords` with
                ``expected_samples=``).
            shuffle_seed: write the samples in the order of a permutation seeded by this
                int (from 0 to 2**63 - 1; arrays only), so that every record holds samples
                from across the input. Sample mode reads by sample and gains nothing
                from it; block mode (remote storage, compressed shards, variable-length
                features), which splits and shuffles whole records, then mixes
                class-sorted input as sample mode does. The input is read at random, a
                chunk at a time, each chunk in increasing index order (for a memmap or an
                h5py data set on a spinning disk, slow). The manifest records the seed; a
                resumed conversion must be given the same. ``None`` (default): the order
                given.
            Other arguments: as for `ArraysToRecords`.

        Returns:
            The written data set's `Manifest`.

        Example:
            >>> x = np.load("x.npy", mmap_mode="r"); y = np.load("y.npy", mmap_mode="r")
            >>> ArraysToRecords.from_arrays(x, y, "data/train")
        """
        if isinstance(x, (str, bytes, os.PathLike)):
            # `ArraysToRecords(directory)` takes the path first, `from_arrays` last: taken
            # as given, the path was `x` and the targets `directory`, and the error named
            # `directory` with the repr of every label.
            raise TypeError(
                "Expected the arrays first: ArraysToRecords.from_arrays(x, y, directory), "
                "the directory last (ArraysToRecords(directory) takes it first). Received "
                f"a path as `x`: {os.fsdecode(x)!r}"
            )
        if directory is None and isinstance(y, (str, os.PathLike)):
            directory, y = y, None
        if directory is None:
            raise TypeError("Expected `directory` (the data set's path). Received: None")
        options = WriteOptions(
            shard_size=shard_size,
            record_size=record_size,
            samples_per_record=samples_per_record,
            compression=compression,
            overwrite=overwrite,
            resume=resume,
            chunk_size=chunk_size,
            verbose=verbose,
            metadata=metadata,
            variable_length=variable_length,
            lattice=lattice,
            shuffle_seed=shuffle_seed,
        )
        return write_arrays(cls._from_options, directory, x, y, sample_weight, options, min_shards)

    def _make_progress(self, total: int | None) -> Any:
        verbose = 0 if getattr(self, "_predict_quiet", False) else self.options.verbose
        return keras.utils.Progbar(total, verbose=verbose, unit_name="sample")

    # ------------------------------------------------------------------ Keras callback

    def on_predict_begin(self, logs: dict | None = None) -> None:
        """``predict(..., verbose=0)`` silences this writer's progress bar too."""
        self._predict_quiet = (self.params or {}).get("verbose") == 0

    def on_predict_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Writes the batch's predictions (as ``x``) when used as a predict callback."""
        outputs = _predictions(self.model, logs or {})
        if outputs is None:
            return
        outputs = keras.tree.map_structure(
            lambda t: np.asarray(keras.ops.convert_to_numpy(t)), outputs
        )
        self.write(outputs)

    def on_predict_end(self, logs: dict | None = None) -> None:
        self.close()


def _predictions(model: Any, logs: dict) -> Any:
    """The batch's predictions in ``logs``. Keras hands ``{"outputs": predictions}`` to
    its callbacks through ``pythonify_logs``, which merges a dict into the logs: a model
    with dict outputs gives ``{name: prediction, ...}`` (an ``"outputs"`` key only where
    an output has that name). A subclassed model whose one dict output is named
    ``"outputs"`` cannot be told from a model of one output: its predictions are written
    as one array."""
    try:
        names = model.output if isinstance(model.output, dict) else None
    except Exception:  # a subclassed model: no symbolic output
        names = None
    if names is not None and all(k in logs for k in names):
        return {k: logs[k] for k in names}
    if set(logs) == {"outputs"}:
        return logs["outputs"]
    return dict(logs) or None  # a subclassed model's dict outputs
