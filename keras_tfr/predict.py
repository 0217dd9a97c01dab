"""`predict_to_records`: a model's predictions over a source, streamed into a data set.

Keras' ``model.predict`` gathers every batch's outputs in memory before it returns, so
predictions larger than RAM cannot pass through it (even with `ArraysToRecords` attached
as a callback, the outputs are still gathered). `predict_to_records` runs the model batch
by batch (``model.predict_on_batch``) and hands each batch to `ArraysToRecords` at once:
memory stays that of one batch, whatever the number of samples.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from keras_tfr.manifest import DEFAULT_RECORD_SIZE, DEFAULT_SHARD_SIZE, Manifest

__all__ = ["predict_to_records"]


def _numpy(structure: Any) -> Any:
    import keras

    return keras.tree.map_structure(lambda t: np.asarray(keras.ops.convert_to_numpy(t)), structure)


def predict_to_records(
    model: Any,
    source: Any,
    directory: str | os.PathLike,
    *,
    keep_inputs: bool = False,
    keep_targets: bool = False,
    steps: int | None = None,
    verbose: int = 1,
    overwrite: bool = False,
    shard_size: int | str = DEFAULT_SHARD_SIZE,
    record_size: int | str = DEFAULT_RECORD_SIZE,
    samples_per_record: int | None = None,
    compression: str | None = None,
    metadata: dict[str, Any] | None = None,
) -> Manifest:
    """Runs `model` over `source` and writes the predictions as a keras-tfr data set.

    Layout of the written data set:

    ==========================  ====================================================
    arguments                   written as
    ==========================  ====================================================
    (default)                   ``x`` = predictions
    ``keep_inputs=True``        ``x`` = the source's inputs, ``y`` = predictions (a
                                teacher's outputs as targets: distillation)
    ``keep_targets=True``       ``x`` = predictions, ``y`` = the source's targets
    both                        ``x`` = inputs, ``y`` = ``{"predictions": ...,
                                "targets": ...}`` (a dict of two outputs)
    ==========================  ====================================================

    Args:
        model: a Keras model (any backend).
        source: a `TFRecordSequenceSource`, a `tf.data.Dataset` or any iterable of
            batches ``x``, ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)``. Read once, in
            its order: pass ``shuffle=False`` to keep predictions aligned with the data.
        directory: where the predictions go.
        keep_inputs: also write each batch's inputs (see the table).
        keep_targets: also write each batch's targets (see the table).
        steps: stop after this many batches (default: the whole source).
        verbose: 1 shows a progress bar.
        overwrite, shard_size, record_size, samples_per_record, compression, metadata:
            as for `ArraysToRecords`.

    Returns:
        The written data set's `Manifest`.

    Example:
        >>> src = TFRecordSequenceSource("data/train", batch_size=512, shuffle=False)
        >>> predict_to_records(teacher, src, "data/teacher", keep_inputs=True)
        >>> student.fit(TFRecordSequenceSource("data/teacher", batch_size=256), epochs=5)
    """
    import keras

    from keras_tfr.write.arrays_to_records import ArraysToRecords
    from keras_tfr.write.options import WriteOptions

    if not hasattr(model, "predict_on_batch"):
        raise TypeError(f"Expected `model` to be a Keras model. Received: {type(model).__name__}")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"Expected `steps` to be a positive int or None. Received: {steps!r}")
    cfg = getattr(source, "_cfg", None)  # a TFRecordSequenceSource's options
    if cfg is not None and cfg.shuffle:
        import logging

        logging.getLogger("keras_tfr").warning(
            "keras-tfr: predict_to_records reads a shuffled source; the predictions follow "
            "its shuffled order (pass shuffle=False to keep the written order)."
        )
    expected = None
    if steps is None and hasattr(source, "num_samples"):
        expected = int(source.num_samples)
    options = WriteOptions(
        overwrite=overwrite,
        shard_size=shard_size,
        record_size=record_size,
        samples_per_record=samples_per_record,
        compression=compression,
        expected_samples=expected,
        verbose=verbose,
        metadata=metadata,
    )
    writer = ArraysToRecords._from_options(directory, options)
    tensorflow_backend = keras.backend.backend() == "tensorflow"
    with writer:
        for step, batch in enumerate(source):
            if steps is not None and step >= steps:
                break
            if not isinstance(batch, tuple):
                batch = (batch,)
            x, y, _ = keras.utils.unpack_x_y_sample_weight(batch)
            if not tensorflow_backend:
                x = _numpy(x)  # JAX's and torch's `predict_on_batch` take no tf.Tensor
            predictions = _numpy(model.predict_on_batch(x))
            if keep_targets and y is None:
                raise ValueError(
                    "Expected `source` to yield `(x, y)` batches with `keep_targets=True`. "
                    "Received: batches without targets."
                )
            if keep_inputs and keep_targets:
                writer.write(_numpy(x), {"predictions": predictions, "targets": _numpy(y)})
            elif keep_inputs:
                writer.write(_numpy(x), predictions)
            elif keep_targets:
                writer.write(predictions, _numpy(y))
            else:
                writer.write(predictions)
    return writer.close()  # closed by `with`: hands back its manifest
