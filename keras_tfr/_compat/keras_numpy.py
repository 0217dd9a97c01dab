"""Keras' JAX and torch backends: NumPy batches from a source without tf.data in between.

Under the JAX and torch backends, Keras reads a `tf.data.Dataset` through
``keras.src.trainers.data_adapters.tf_dataset_adapter.TFDatasetAdapter``: its
``get_jax_iterator``, ``get_numpy_iterator`` and ``get_torch_dataloader`` iterate the
dataset eagerly (``for batch in self._dataset``) and convert every tensor to NumPy. For a
`TFRecordSequenceSource` in sample mode, `TFRecordSequenceSource.as_numpy_iterator`
gives the same batches (same order, epochs, checks and damage handling) straight from the
memory-mapped reader, without TensorFlow's eager iteration (about 0.2 ms per batch) or the
conversion. The three methods are wrapped so that, when ``self._dataset`` is such a
source, they read from it; for any other data set Keras' own method runs unchanged.

Private APIs used (listed in `keras_tfr._compat.PRIVATE_APIS`, checked by
``tests/test_compat.py``):

* ``TFDatasetAdapter.get_jax_iterator(self)``, ``get_numpy_iterator(self)`` and
  ``get_torch_dataloader(self)``: generators (the last returns a
  ``torch.utils.data.DataLoader``) that Keras' `EpochIterator` calls for each new epoch
  iterator;
* ``TFDatasetAdapter._dataset``: the data set the adapter was made for;
* ``keras.src.trainers.data_adapters.data_adapter_utils.get_torch_dataloader(iterable)``:
  wraps an iterable of NumPy batches into the ``DataLoader`` Keras' torch trainer expects.

Outside `keras_shuffle.KERAS_VERIFIED` nothing is wrapped (Keras' path is slower, not
wrong).
"""

from __future__ import annotations

import functools
import importlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

from keras_tfr._compat.keras_shuffle import keras_version_verified

__all__ = ["ADAPTER_MODULE", "install_numpy_batches", "numpy_batches_of"]

ADAPTER_MODULE = "keras.src.trainers.data_adapters.tf_dataset_adapter"
UTILS_MODULE = "keras.src.trainers.data_adapters.data_adapter_utils"
_MARK = "_keras_tfr_numpy_batches"
_lock = threading.Lock()


def numpy_batches_of(dataset: Any) -> Any | None:
    """The source's direct NumPy path, or None when ``dataset`` has none (not a
    `TFRecordSequenceSource`, block mode, or a ``decode=`` function)."""
    source = sys.modules.get("keras_tfr.source")
    if source is None or not isinstance(dataset, source.TFRecordSequenceSource):
        return None
    return dataset if dataset._numpy_direct() else None


class _Epochs:
    """An iterable whose every iteration is a new epoch of the source's NumPy batches."""

    def __init__(self, source: Any):
        self._source = source

    def __iter__(self) -> Iterator[Any]:
        return self._source.as_numpy_iterator()


def install_numpy_batches() -> bool:
    """Routes Keras' JAX/torch reading of a sample-mode source to `as_numpy_iterator`.

    Idempotent and thread-safe. Returns False (and changes nothing) when the installed
    Keras is outside the verified versions or the private API moved.

    Example:
        >>> from keras_tfr._compat import keras_numpy
        >>> keras_numpy.install_numpy_batches()
        True
    """
    with _lock:
        try:
            adapters = importlib.import_module(ADAPTER_MODULE)
            utils = importlib.import_module(UTILS_MODULE)
            cls = adapters.TFDatasetAdapter
            originals = {
                name: getattr(cls, name)
                for name in ("get_jax_iterator", "get_numpy_iterator", "get_torch_dataloader")
            }
            make_loader = utils.get_torch_dataloader
        except (ImportError, AttributeError):
            return False
        if getattr(originals["get_jax_iterator"], _MARK, False):
            return True
        if not keras_version_verified():
            return False

        def wrap_iterator(original: Any) -> Any:
            @functools.wraps(original)
            def method(self: Any) -> Any:
                source = numpy_batches_of(getattr(self, "_dataset", None))
                if source is None:
                    return original(self)
                # Lazy, as Keras' own generators are: no epoch is taken before the
                # first batch is pulled.
                return source.as_numpy_iterator()

            setattr(method, _MARK, True)
            return method

        @functools.wraps(originals["get_torch_dataloader"])
        def get_torch_dataloader(self: Any) -> Any:
            source = numpy_batches_of(getattr(self, "_dataset", None))
            if source is None:
                return originals["get_torch_dataloader"](self)
            return make_loader(_Epochs(source))

        setattr(get_torch_dataloader, _MARK, True)
        cls.get_jax_iterator = wrap_iterator(originals["get_jax_iterator"])
        cls.get_numpy_iterator = wrap_iterator(originals["get_numpy_iterator"])
        cls.get_torch_dataloader = get_torch_dataloader
        return True
