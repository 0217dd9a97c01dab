"""Private Keras API the reader relies on, named and version-checked in one place.

* ``keras.src.trainers.epoch_iterator.EpochIterator.catch_stop_iteration`` (Keras 3):
  the context manager every backend's `fit`, `evaluate` and `predict` run their steps in.
  Damage found by a keras-tfr reader surfaces there as a TensorFlow error (its type
  depends on the reader and on where the damage was found); wrapping that context
  manager turns such errors, and only those, into `keras_tfr.CorruptRecordError`, so a
  user catches one documented type around `fit` as around plain iteration.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

VERIFIED_KERAS = ((3, 0), (3, 16))  # [first, last) major.minor seen to work
_lock = threading.Lock()
_installed = False


def keras_version() -> tuple[int, int]:
    import keras

    major, minor = (int(p) for p in keras.__version__.split(".")[:2])
    return major, minor


def epoch_iterator_class() -> Any:
    """Keras' private `EpochIterator` (raises ImportError when it moved)."""
    from keras.src.trainers.epoch_iterator import EpochIterator

    if not hasattr(EpochIterator, "catch_stop_iteration"):
        raise ImportError("keras.src.trainers.epoch_iterator.EpochIterator.catch_stop_iteration")
    return EpochIterator


def install_corrupt_record_errors(
    convert: Callable[[BaseException], BaseException | None],
) -> bool:
    """Makes Keras' epoch loops raise `CorruptRecordError` for keras-tfr's damage errors.

    Args:
        convert: the `CorruptRecordError` an error stands for, or None
            (`keras_tfr.source.corrupt_record_error`; passed in so that this module
            does not import the source).

    Idempotent. Returns False (and changes nothing) outside the verified Keras versions or
    when the private API moved: errors then keep TensorFlow's types inside `fit`.
    """
    global _installed
    with _lock:
        if _installed:
            return True
        lo, hi = VERIFIED_KERAS
        if not lo <= keras_version() < hi:
            return False
        try:
            cls = epoch_iterator_class()
        except ImportError:
            return False
        original = cls.catch_stop_iteration

        @functools.wraps(original)
        @contextlib.contextmanager
        def catch_stop_iteration(self: Any) -> Iterator[None]:
            try:
                with original(self):
                    yield
            except Exception as e:
                converted = convert(e)
                if converted is None or converted is e:
                    raise
                raise converted from e

        cls.catch_stop_iteration = catch_stop_iteration
        _installed = True
        return True
