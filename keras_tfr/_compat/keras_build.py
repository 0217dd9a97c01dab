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

``predict`` under the JAX backend builds an unbuilt model itself, the same way (one
batch from its epoch iterator, then ``epoch_iterator.reset()``): the wrapper of
``JAXTrainer.predict`` holds the sources' epochs from the call until that iterator's first
``reset`` (the wrapper of ``EpochIterator.reset``), so that the predictions are the
epoch TensorFlow's ``predict`` reads, and the next iterator reads the epoch after it.

* ``keras.src.backend.jax.trainer.JAXTrainer.predict`` (its build: ``layer.built`` of
  ``self._flatten_layers()``, then ``epoch_iterator.reset()``);
* ``keras.src.trainers.epoch_iterator.EpochIterator.reset``.

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

from keras_tfr._compat.keras_shuffle import (
    SOURCE_OF_ITERATOR,
    keras_version_verified,
    sources_within,
)

__all__ = [
    "JAX_TRAINER",
    "JAX_TRAINER_MODULE",
    "SYMBOLIC_BUILD",
    "TRAINER",
    "TRAINER_MODULE",
    "check_private_api",
    "install_build_hook",
]

log = logging.getLogger("keras_tfr")

TRAINER_MODULE = "keras.src.trainers.trainer"
TRAINER = "Trainer"
SYMBOLIC_BUILD = "_symbolic_build"
JAX_TRAINER_MODULE = "keras.src.backend.jax.trainer"
JAX_TRAINER = "JAXTrainer"
_MARK = "_keras_tfr_build_hook"
_lock = threading.Lock()
# Per thread: the epochs a JAX `predict` holds until its iterator's first `reset`.
_predict_holds = threading.local()


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
        _install_jax_predict_hook()
        return True


def _install_jax_predict_hook() -> None:
    """Under the JAX backend: wraps ``JAXTrainer.predict`` and ``EpochIterator.reset`` (see
    the module's docstring). Called with ``_lock`` held."""
    import keras

    if keras.backend.backend() != "jax":  # the JAX trainer is only used then
        return
    try:
        from keras_tfr._compat.keras_shuffle import EPOCH_ITERATOR, EPOCH_ITERATOR_MODULE

        jax_trainer = getattr(importlib.import_module(JAX_TRAINER_MODULE), JAX_TRAINER)
        predict = jax_trainer.predict
        iterator_class = getattr(importlib.import_module(EPOCH_ITERATOR_MODULE), EPOCH_ITERATOR)
        reset = iterator_class.reset
    except (ImportError, AttributeError) as e:
        log.debug("keras-tfr: %s.%s.predict not found (%s)", JAX_TRAINER_MODULE, JAX_TRAINER, e)
        return
    if getattr(predict, _MARK, False) or check_private_api():
        return

    @functools.wraps(predict)
    def _predict(self: Any, x: Any = None, *args: Any, **kwargs: Any) -> Any:
        sources = sources_within(x) if x is not None else []
        if not sources or all(layer.built for layer in self._flatten_layers()):
            return predict(self, x, *args, **kwargs)
        with contextlib.ExitStack() as stack:
            for source in sources:
                stack.enter_context(source._clock.held())
            _predict_holds.stack = stack  # until the build's `reset`
            try:
                return predict(self, x, *args, **kwargs)
            finally:
                _predict_holds.stack = None

    @functools.wraps(reset)
    def _reset(self: Any) -> Any:
        stack = getattr(_predict_holds, "stack", None)
        if stack is not None:  # the build's batch is read: the predictions use an epoch
            _predict_holds.stack = None
            stack.close()
        return reset(self)

    for function in (_predict, _reset):
        setattr(function, _MARK, True)
    jax_trainer.predict = _predict
    iterator_class.reset = _reset


def check_private_api() -> list[str]:
    """What moved in the JAX trainer's ``predict`` (empty when all is in place; nothing
    to check where JAX is not installed)."""
    try:
        jax_trainer = getattr(importlib.import_module(JAX_TRAINER_MODULE), JAX_TRAINER)
    except ImportError:
        return []
    except AttributeError as e:
        return [f"{JAX_TRAINER_MODULE}.{JAX_TRAINER}: {e}"]
    predict = inspect.unwrap(jax_trainer.predict)
    body = inspect.getsource(predict)
    needed = ("layer.built for layer in self._flatten_layers()", "epoch_iterator.reset()")
    missing = [n for n in needed if n not in body]
    if missing or "x" not in inspect.signature(predict).parameters:
        return [
            f"{JAX_TRAINER_MODULE}.{JAX_TRAINER}.predict no longer builds a model as "
            f"keras_tfr._compat.keras_build expects (missing: {missing})"
        ]
    return []
