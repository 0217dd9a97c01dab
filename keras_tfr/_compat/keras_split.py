"""``fit(source, validation_split=...)``: Keras' refusal, with the keras-tfr way to say it.

Keras splits only arrays and tensors: with a `tf.data.Dataset` it raises "Argument
`validation_split` is only supported for tensors or NumPy arrays". A user who moves from
``fit(x, y, validation_split=0.1)`` to a `TFRecordSequenceSource` (a data set) meets that
error; for a source it now also says how the source splits itself (``validation_split``,
``subset`` and ``seed`` on two sources, the second as ``validation_data``). Same type
(`ValueError`), raised at the same point, before any training; any other input gets
Keras' function unchanged.

Private API used (listed in `keras_tfr._compat.PRIVATE_APIS`, checked by
``tests/test_compat.py``):

* ``keras.src.trainers.data_adapters.array_slicing.train_validation_split(arrays,
  validation_split)``: every backend's trainer calls it as a module attribute
  (``array_slicing.train_validation_split``) in ``fit`` when ``validation_split`` is set
  and ``validation_data`` is not, so the module attribute is wrapped.

Outside `keras_shuffle.KERAS_VERIFIED` nothing is wrapped (Keras' own message stays).
"""

from __future__ import annotations

import functools
import importlib
import sys
import threading
from typing import Any

from keras_tfr._compat.keras_shuffle import keras_version_verified

__all__ = ["SLICING_MODULE", "install_split_hint", "split_hint"]

SLICING_MODULE = "keras.src.trainers.data_adapters.array_slicing"
_MARK = "_keras_tfr_split_hint"
_lock = threading.Lock()


def split_hint(source: Any, validation_split: Any) -> str:
    """What to write instead of ``fit(source, validation_split=...)``: the source's own
    split, made with `TFRecordSequenceSource.replace` so that every other option (seed,
    batch size, windows, ...) stays as the user gave it."""
    cfg = source._cfg
    head = (
        f"keras-tfr: fit(validation_split={validation_split!r}) cannot split a "
        f"TFRecordSequenceSource ({cfg.directory}): Keras splits arrays only. "
    )
    if cfg.validation_split is not None:
        other = "validation" if cfg.subset == "training" else "training"
        return head + (
            f"This source is already the {cfg.subset!r} subset of its own "
            f"validation_split={cfg.validation_split!r}; pass the {other!r} subset as "
            "validation_data:\n"
            f"    val = source.replace(subset={other!r}, shuffle=False)\n"
            "    model.fit(source, validation_data=val, ...)"
        )
    # A split needs a seed: `replace` passes on the source's (given or drawn).
    seed = "" if source._seed is not None else ", seed=0"
    return head + (
        "The source splits itself (`validation_split`, `subset`, `seed`): make two "
        "sources from it and pass the second as validation_data:\n"
        f"    train = source.replace(validation_split={validation_split!r}, "
        f"subset='training'{seed})\n"
        f"    val = source.replace(validation_split={validation_split!r}, "
        f"subset='validation', shuffle=False{seed})\n"
        "    model.fit(train, validation_data=val, ...)"
    )


def _source_in(arrays: Any) -> Any:
    source = sys.modules.get("keras_tfr.source")
    if source is None:
        return None
    items = arrays if isinstance(arrays, (tuple, list)) else (arrays,)
    return next((a for a in items if isinstance(a, source.TFRecordSequenceSource)), None)


def install_split_hint() -> bool:
    """Wraps Keras' ``train_validation_split`` so that a source gets `split_hint`.

    Idempotent and thread-safe; a no-op (returns False) outside the verified Keras
    versions or when the function is not where it was.

    Example:
        >>> from keras_tfr._compat import keras_split
        >>> keras_split.install_split_hint()
        True
    """
    with _lock:
        try:
            if not keras_version_verified():
                return False
            module = importlib.import_module(SLICING_MODULE)
            original = module.train_validation_split
        except (ImportError, AttributeError):
            return False
        if getattr(original, _MARK, False):
            return True

        @functools.wraps(original)
        def train_validation_split(arrays: Any, validation_split: Any) -> Any:
            source = _source_in(arrays)
            if source is not None:
                raise ValueError(split_hint(source, validation_split))
            return original(arrays, validation_split)

        setattr(train_validation_split, _MARK, True)
        setattr(module, "train_validation_split", train_validation_split)  # noqa: B010
        return True
