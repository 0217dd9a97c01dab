"""`SourceOptions`: every argument of `TFRecordSequenceSource`, checked once.

A frozen dataclass: built and validated in one place, copied with `dataclasses.replace`
(what `TFRecordSequenceSource.replace` does), never mirrored in attributes that could
drift apart.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

from keras_tfr import _checks, _io
from keras_tfr.manifest import parse_size
from keras_tfr.read import split as _distribute

DEFAULT_SHUFFLE_MEMORY = "64MB"
ACCESS_MODES = ("auto", "samples", "blocks")
VERIFY_MODES = ("first_read", "every_epoch")


@dataclasses.dataclass(frozen=True)
class SourceOptions:
    """The arguments of `TFRecordSequenceSource` (see its docstring for each one).

    Example:
        >>> opts = SourceOptions("data/train", batch_size=64)
        >>> dataclasses.replace(opts, batch_size=128).batch_size
        128
    """

    directory: str
    batch_size: int = 32
    shuffle: bool = True
    seed: int | None = None
    drop_remainder: bool = False
    validation_split: float | None = None
    subset: str | None = None
    access: str = "auto"
    verify: str = "first_read"
    shuffle_memory: int | str = DEFAULT_SHUFFLE_MEMORY
    shuffle_window: int | str | None = "auto"
    on_corrupt: str = "raise"
    max_corrupt_records: int = 100
    num_parallel_reads: int | None = None
    deterministic: bool | None = None
    check_files: bool = True
    ragged: str = "pad"
    decode: Mapping[str, Callable] | None = None
    num_workers: int | None = None
    worker_index: int | None = None
    service: str | None = None
    service_mode: str = "distributed_epoch"
    service_job_name: str | None = None

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        if not isinstance(self.directory, (str, os.PathLike)):
            raise TypeError(
                "Expected `directory` to be a path or URL. Received: "
                + _checks.brief(self.directory)
            )
        directory = os.fspath(self.directory)
        if "://" not in directory:
            # A relative path names the same data set after an `os.chdir` (its shards
            # were checked where it was when the source was made); `~` is the home.
            directory = os.path.abspath(_io.expand_user(directory))
        put("directory", directory)
        put("batch_size", _checks.positive_int("batch_size", self.batch_size))
        put("shuffle", _checks.boolean("shuffle", self.shuffle))
        put("seed", _checks.optional_seed("seed", self.seed))
        put("drop_remainder", _checks.boolean("drop_remainder", self.drop_remainder))
        if self.validation_split is not None:
            put("validation_split", _checks.fraction("validation_split", self.validation_split))
            if self.subset not in ("training", "validation"):
                raise ValueError(
                    "Expected `subset` to be 'training' or 'validation' when "
                    f"`validation_split` is set. Received: subset={self.subset!r}"
                )
            if self.seed is None:
                raise ValueError(
                    "Expected a `seed` with `validation_split`: both subsets must use the "
                    "same seed to be disjoint. Received: seed=None"
                )
        elif self.subset is not None:
            raise ValueError(
                f"`subset={self.subset!r}` needs `validation_split`. "
                "Received: validation_split=None"
            )
        _checks.choice("access", self.access, ACCESS_MODES)
        _checks.choice("verify", self.verify, VERIFY_MODES)
        parse_size(self.shuffle_memory, argument="shuffle_memory")
        if self.shuffle_window is not None and self.shuffle_window != "auto":
            parse_size(self.shuffle_window, argument="shuffle_window")
        _checks.choice("on_corrupt", self.on_corrupt, ("raise", "skip"))
        put(
            "max_corrupt_records",
            _checks.non_negative_int("max_corrupt_records", self.max_corrupt_records),
        )
        put(
            "num_parallel_reads",
            _checks.optional_positive_int("num_parallel_reads", self.num_parallel_reads),
        )
        put("deterministic", _checks.optional_boolean("deterministic", self.deterministic))
        put("check_files", _checks.boolean("check_files", self.check_files))
        _distribute.check_worker_args(self.num_workers, self.worker_index)
        _distribute.check_service_args(self.service, self.service_mode, self.service_job_name)
        if self.service is not None and self.on_corrupt == "skip":
            raise ValueError(
                "`on_corrupt='skip'` runs Python code in the pipeline, which the tf.data "
                f"service cannot ship to its workers. Received: service={self.service!r} "
                "with on_corrupt='skip'; use on_corrupt='raise'."
            )
        if self.service is not None and self.access == "samples":
            raise ValueError(
                "Expected access='auto' or 'blocks' with the tf.data service: its workers "
                "read whole records. Received: access='samples'"
            )

    @property
    def shuffle_bytes(self) -> int:
        return parse_size(self.shuffle_memory, argument="shuffle_memory")

    @property
    def is_remote(self) -> bool:
        return "://" in self.directory

    def as_kwargs(self) -> dict[str, Any]:
        """The options as `TFRecordSequenceSource` keyword arguments (no ``directory``)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out.pop("directory")
        return out
