"""Keras' JAX and torch trainers build an unbuilt model from one batch of its data: for
a source, that batch must not use up an epoch.

``fit`` and ``evaluate`` under the JAX and torch backends call
``Trainer._symbolic_build(iterator=epoch_iterator)`` before the first epoch when the
model, its metrics or its loss are not built yet: it reads one batch from a fresh
iterator of the data, then ``epoch_iterator.reset()``. For a `TFRecordSequenceSource`,
every iterator that starts reading is the next epoch, so that batch used up epoch 0:
``fit``'s epoch ``e`` read ``sample_order(e + 1)`` (under TensorFlow, which builds inside
its first step, ``sample_order(e)``), and a `keras_tfr.BackupAndRestore`, which sets each
epoch itself, changed the order. The same held for a data set made from a source
(``source.map(f)``, ``.take``, ``.repeat()``, Keras' ``class_weight`` map). The wrapper
holds the epoch of every source the iterator reads while the build reads
(`TFRecordSequenceSource`'s clock, ``held``): its iterator reads the next epoch's first
batch without using that epoch up.

Private APIs used (listed in `keras_tfr._compat.PRIVATE_APIS`, checked by
``tests/test_compat.py``):

* ``keras.src.trainers.trainer.Trainer._symbolic_build(self, iterator=None,
  data_batch=None)``, inherited by every backend's trainer;
* the mark `keras_shuffle` puts on an ``EpochIterator`` made for a source, or for a data
  set made from sources (``SOURCE_OF_ITERATOR``, set by its wrapper of
  ``EpochIterator.__init__``, which finds them through ``DatasetV2._inputs``).

Outside `keras_shuffle.KERAS_VERIFIED` nothing is wrapped (the order is then off by one
epoch under JAX and torch, as before).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import threading
from typing import Any

from keras_tfr._compat.keras_shuffle import SOURCE_OF_ITERATOR, keras_version_verified

__all__ = ["SYMBOLIC_BUILD", "TRAINER", "TRAINER_MODULE", "install_build_hook"]

log = logging.getLogger("keras_tfr")

TRAINER_MODULE = "keras.src.trainers.trainer"
TRAINER = "Trainer"
SYMBOLIC_BUILD = "_symbolic_build"
_MARK = "_keras_tfr_build_hook"
_lock = threading.Lock()


def install_build_hook() -> bool:
    """Wraps ``Trainer._symbolic_build`` so that the batch it reads from a source's
    iterator does not use up an epoch. Idempotent; False (nothing wrapped) outside the
    verified Keras versions or when the API moved.

    Example:
        >>> from keras_tfr._compat import keras_build
        >>> keras_build.install_build_hook()
        True
    """
    with _lock:
        try:
            if not keras_version_verified():
                return False
            trainer = getattr(importlib.import_module(TRAINER_MODULE), TRAINER)
            original = getattr(trainer, SYMBOLIC_BUILD)
            signature = inspect.signature(original)
        except (ImportError, AttributeError, TypeError, ValueError) as e:
            log.debug("keras-tfr: %s.%s not found (%s)", TRAINER_MODULE, SYMBOLIC_BUILD, e)
            return False
        if getattr(original, _MARK, False):
            return True
        if not {"self", "iterator", "data_batch"} <= set(signature.parameters):
            return False

        @functools.wraps(original)
        def _symbolic_build(*args: Any, **kwargs: Any) -> Any:
            iterator = signature.bind(*args, **kwargs).arguments.get("iterator")
            sources = getattr(iterator, SOURCE_OF_ITERATOR, ())
            with contextlib.ExitStack() as stack:
                for source in sources:
                    stack.enter_context(source._clock.held())
                return original(*args, **kwargs)

        setattr(_symbolic_build, _MARK, True)
        setattr(trainer, SYMBOLIC_BUILD, _symbolic_build)
        return True
