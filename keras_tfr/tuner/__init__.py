"""keras-tuner on keras-tfr sources: batch size as a hyperparameter, trials in parallel.

Two parts, one module each:

* `keras_tfr.tuner.hypermodel`: `TFRecordHyperModel`, a ready `keras_tuner.HyperModel`
  whose ``fit`` re-batches a `TFRecordSequenceSource` with the trial's ``batch_size`` (and
  optionally the shuffle's memory budget); `rebatch`, the same step as a function.
* `keras_tfr.tuner.launch`: `tune` (and ``keras-tfr tune``), keras-tuner's own
  distributed mode on one machine: the user's unchanged script runs as a chief (the
  oracle) and N workers, each worker's GPU memory capped; `is_chief` / `is_worker` tell
  a script which one it is.

Importing this package imports neither keras-tuner nor TensorFlow.

Example:
    >>> import keras, keras_tuner
    >>> from keras_tfr import TFRecordSequenceSource
    >>> from keras_tfr.tuner import TFRecordHyperModel
    >>> def build(hp):
    ...     model = keras.Sequential([keras.layers.Dense(hp.Int("units", 8, 64)),
    ...                               keras.layers.Dense(1)])
    ...     model.compile("adam", "mse")
    ...     return model
    >>> train = TFRecordSequenceSource("data/train", shuffle=True, seed=0)
    >>> val = TFRecordSequenceSource("data/val", shuffle=False)
    >>> tuner = keras_tuner.RandomSearch(
    ...     TFRecordHyperModel(build, batch_size=[64, 256, 1024]),
    ...     objective="val_loss", max_trials=10)
    >>> tuner.search(train, validation_data=val, epochs=5)
"""

from __future__ import annotations

from typing import Any

from keras_tfr.tuner import hypermodel as _hypermodel
from keras_tfr.tuner.hypermodel import rebatch
from keras_tfr.tuner.launch import TuneResult, is_chief, is_worker, tune

__all__ = [
    "TFRecordHyperModel",
    "TuneResult",
    "is_chief",
    "is_worker",
    "rebatch",
    "tune",
]


def __getattr__(name: str) -> Any:
    if name == "TFRecordHyperModel":
        cls = _hypermodel._hypermodel_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
