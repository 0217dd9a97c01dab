"""keras-tfr: train Keras models on data larger than RAM.

Arrays, memmaps, h5py data sets and iterables of batches become sharded TFRecord files
(`ArraysToRecords`), which stream back into ``fit``, ``evaluate``, ``predict`` and
keras-tuner's ``search`` (`TFRecordSequenceSource`); `limit_gpu_memory` caps each
process's GPU memory so several models can train on one GPU.

Heavy modules (TensorFlow, Keras) load on first use of a name, not at import, so
``keras-tfr --help`` and reading a manifest stay quick.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from keras_tfr._version import __version__

__all__ = [
    "ArraysToRecords",
    "BackupAndRestore",
    "CorruptRecordError",
    "DatasetExistsError",
    "DatasetLockedError",
    "IncompleteDatasetError",
    "KerasTFRError",
    "Manifest",
    "ManifestError",
    "ShardError",
    "TFRecordSequenceSource",
    "TensorFeature",
    "__version__",
    "convert_tfrecords",
    "distribute_source",
    "keras_distribution_source",
    "limit_gpu_memory",
    "predict_to_records",
    "verify",
]

_LAZY = {
    "ArraysToRecords": "keras_tfr.write.arrays_to_records",
    "BackupAndRestore": "keras_tfr.backup",
    "TFRecordSequenceSource": "keras_tfr.source",
    "limit_gpu_memory": "keras_tfr.gpu",
    "verify": "keras_tfr.verifier",
    "predict_to_records": "keras_tfr.predict",
    "TensorFeature": "keras_tfr.tfrecords",
    "convert_tfrecords": "keras_tfr.tfrecords",
    "distribute_source": "keras_tfr.distribute",
    "keras_distribution_source": "keras_tfr.distribute",
    "Manifest": "keras_tfr.manifest",
    "CorruptRecordError": "keras_tfr.errors",
    "DatasetExistsError": "keras_tfr.errors",
    "DatasetLockedError": "keras_tfr.errors",
    "IncompleteDatasetError": "keras_tfr.errors",
    "KerasTFRError": "keras_tfr.errors",
    "ManifestError": "keras_tfr.errors",
    "ShardError": "keras_tfr.errors",
}

if TYPE_CHECKING:  # pragma: no cover
    from keras_tfr.backup import BackupAndRestore
    from keras_tfr.distribute import distribute_source, keras_distribution_source
    from keras_tfr.errors import (
        CorruptRecordError,
        DatasetExistsError,
        DatasetLockedError,
        IncompleteDatasetError,
        KerasTFRError,
        ManifestError,
        ShardError,
    )
    from keras_tfr.gpu import limit_gpu_memory
    from keras_tfr.manifest import Manifest
    from keras_tfr.predict import predict_to_records
    from keras_tfr.source import TFRecordSequenceSource
    from keras_tfr.tfrecords import TensorFeature, convert_tfrecords
    from keras_tfr.verifier import verify
    from keras_tfr.write.arrays_to_records import ArraysToRecords


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'keras_tfr' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


def _apply_gpu_limit_from_environment() -> None:
    # Opt-in, for launchers such as `keras-tfr parallel`: a cap set in the environment
    # applies at import, before TensorFlow, JAX or torch start on the GPU. Without one of
    # these variables, importing keras_tfr imports nothing heavy and changes nothing.
    import os

    if any(
        os.environ.get(name, "").strip()
        for name in ("KERAS_TFR_GPU_MEMORY_MB", "KERAS_TFR_GPU_MEMORY_FRACTION")
    ):
        from keras_tfr.gpu import _limit_from_environment

        _limit_from_environment()


_apply_gpu_limit_from_environment()
del _apply_gpu_limit_from_environment
