"""`WriteOptions`: the writer's options, their defaults and their checks in one place.

`ArraysToRecords`, `ArraysToRecords.from_arrays`, `predict_to_records` and
`convert_tfrecords` spell the options out in their signatures (so users see them), and
hand them to this frozen dataclass, which validates them once: the same mistake gets the
same exception and message from every entry point. Copies are made with
`dataclasses.replace`, which validates again.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from typing import Any

from keras_tfr import _checks, _io
from keras_tfr.manifest import (
    COMPRESSIONS,
    DEFAULT_CHUNK_SIZE,
    DEFAULT_RECORD_SIZE,
    DEFAULT_SHARD_SIZE,
    parse_size,
)
from keras_tfr.schema import MAX_RECORD_BYTES


def check_directory(directory: Any) -> str:
    """A data set's directory (a path or URL) as a string; a local path's ``~`` expanded
    (a directory named ``~`` in the working directory is never what was meant)."""
    if not isinstance(directory, (str, os.PathLike)) or not str(directory):
        raise TypeError(
            f"Expected `directory` to be a path or URL string. Received: {_checks.brief(directory)}"
        )
    path = _io.expand_user(os.fspath(directory))
    if _io.is_remote(path):
        return path
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(
            f"Expected `directory` to be a directory (created if missing). Received: "
            f"{path!r}, which is a file."
        )
    return path


@dataclasses.dataclass(frozen=True)
class WriteOptions:
    """How a data set is written; see `ArraysToRecords` for each option.

    The sizes are kept as given (``"64MB"`` or an int) and parsed into `shard_bytes`,
    `record_bytes` and `chunk_bytes`; `compression` is upper-cased (``""`` is None),
    `verbose` an int, `metadata` a dict and `variable_length` a frozenset.

    Example:
        >>> options = WriteOptions(shard_size="64MB", compression="gzip")
        >>> options.shard_bytes, options.compression
        (64000000, 'GZIP')
    """

    shard_size: int | str = DEFAULT_SHARD_SIZE
    record_size: int | str = DEFAULT_RECORD_SIZE
    samples_per_record: int | None = None
    compression: str | None = None
    overwrite: bool = False
    resume: bool = False
    expected_samples: int | None = None
    min_shards: int = 1
    chunk_size: int | str = DEFAULT_CHUNK_SIZE
    verbose: int = 1
    metadata: dict[str, Any] | None = None
    variable_length: Iterable[str] = ()
    lattice: bool = True
    shuffle_seed: int | None = None
    shard_bytes: int = dataclasses.field(init=False)
    record_bytes: int = dataclasses.field(init=False)
    chunk_bytes: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:  # frozen: set once, here
            object.__setattr__(self, name, value)

        put("shard_bytes", parse_size(self.shard_size, argument="shard_size"))
        put("record_bytes", parse_size(self.record_size, argument="record_size"))
        put("chunk_bytes", parse_size(self.chunk_size, argument="chunk_size"))
        if self.record_bytes > MAX_RECORD_BYTES:
            raise ValueError(
                "Expected `record_size` to be below 2 GiB (the protobuf limit). "
                f"Received: {self.record_size!r}"
            )
        put(
            "samples_per_record",
            _checks.optional_positive_int("samples_per_record", self.samples_per_record),
        )
        compression = self.compression
        if isinstance(compression, str):
            compression = compression.upper() or None
        put("compression", _checks.choice("compression", compression, COMPRESSIONS))
        put("overwrite", _checks.boolean("overwrite", self.overwrite))
        put("resume", _checks.boolean("resume", self.resume))
        put("lattice", _checks.boolean("lattice", self.lattice))
        put("shuffle_seed", _checks.optional_seed("shuffle_seed", self.shuffle_seed, True))
        if self.overwrite and self.resume:
            raise ValueError(
                "`overwrite=True` and `resume=True` contradict each other: pass one of them."
            )
        self._check_counts(put)
        put("verbose", int(_checks.choice("verbose", self.verbose, (0, 1, 2))))
        put("metadata", _checked_metadata(self.metadata))
        variable = self.variable_length
        put("variable_length", frozenset((variable,) if isinstance(variable, str) else variable))

    def _check_counts(self, put: Any) -> None:
        if self.expected_samples is not None:
            put(
                "expected_samples",
                _checks.non_negative_int("expected_samples", self.expected_samples),
            )
        put("min_shards", _checks.positive_int("min_shards", self.min_shards))
        if self.min_shards > 1 and self.expected_samples is None:
            raise ValueError(
                f"Expected `expected_samples` with `min_shards={self.min_shards}`: shards are "
                "cut as data arrives, so the writer can split into at least `min_shards` only "
                "when it knows the total in advance. Received: expected_samples=None"
            )


def _checked_metadata(metadata: Any) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise TypeError(f"Expected `metadata` to be a dict or None. Received: {metadata!r}")
    try:  # checked now, not when the manifest is written after all the data
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(
            "Expected `metadata` to be a JSON-serializable dict (str keys; str, "
            f"number, bool, None, list or dict values). Received: {metadata!r:.200} ({e})"
        ) from e
    return dict(metadata)
