"""Typed exceptions raised by keras-tfr.

Every error names the argument, file or record it is about, says what was expected and
shows what was received, in the voice of Keras' own data adapters.
"""

from __future__ import annotations

__all__ = [
    "CorruptRecordError",
    "DatasetExistsError",
    "DatasetLockedError",
    "IncompleteDatasetError",
    "KerasTFRError",
    "ManifestError",
    "ShardError",
]


class KerasTFRError(Exception):
    """Base class of every keras-tfr error.

    Example:
        >>> try:
        ...     TFRecordSequenceSource("data/nowhere", batch_size=32)
        ... except KerasTFRError as e:  # any keras-tfr error
        ...     print(type(e).__name__)
        ManifestError
    """


class ManifestError(KerasTFRError, ValueError):
    """`manifest.json` is missing, malformed, from an unknown format version or unsafe.

    Example:
        >>> Manifest.load("data/nowhere")
        Traceback (most recent call last):
        ManifestError: Expected `directory` to be a keras-tfr data set directory. ...
    """


class ShardError(KerasTFRError, OSError):
    """A shard named in the manifest is missing or has the wrong size.

    (A shard of the right size with other bytes is found by its records' checks or by
    `verify`'s checksums: see `CorruptRecordError`.)

    Example:
        >>> os.remove("data/train/shard-00001.tfrecord")
        >>> TFRecordSequenceSource("data/train", batch_size=32)
        Traceback (most recent call last):
        ShardError: ... shard-00001.tfrecord ...
    """


class CorruptRecordError(KerasTFRError, OSError):
    """A record failed its CRC or layout check, or its file is cut short or gone.

    The one type to catch around `fit`, `evaluate`, `predict` and plain iteration of a
    `TFRecordSequenceSource`, whichever reader found the damage (TensorFlow reports it
    as one of its own error types; keras-tfr turns it into this one, the TensorFlow
    error kept as ``__cause__``). ``file`` and ``offset`` name where, when known;
    ``message`` is the text, as on TensorFlow's errors.

    Example:
        >>> try:
        ...     model.fit(train, epochs=3)
        ... except CorruptRecordError as e:
        ...     print("damaged:", e.file, e.offset)
    """

    def __init__(self, message: str, *, file: str | None = None, offset: int | None = None):
        super().__init__(message)
        self.message = message
        self.file = file
        self.offset = offset

    def __str__(self) -> str:
        return self.message


class IncompleteDatasetError(ManifestError):
    """The directory holds shards of a conversion that did not finish (no manifest).

    Example:
        >>> TFRecordSequenceSource("data/killed_mid_way", batch_size=32)
        Traceback (most recent call last):
        IncompleteDatasetError: ... Resume it with `ArraysToRecords(..., resume=True)` ...
    """


class DatasetExistsError(KerasTFRError, FileExistsError):
    """The target directory already holds a data set and `overwrite=True` was not given.

    Example:
        >>> ArraysToRecords.from_arrays(x, y, "data/train")  # a second time
        Traceback (most recent call last):
        DatasetExistsError: ... overwrite=True ...
    """


class DatasetLockedError(KerasTFRError, RuntimeError):
    """Another writer holds the directory's lock file.

    Example:
        >>> with ArraysToRecords("data/train") as first, ArraysToRecords("data/train") as second:
        ...     second.write(x, y)
        Traceback (most recent call last):
        DatasetLockedError: Another writer ...
    """
