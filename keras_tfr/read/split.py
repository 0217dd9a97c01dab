"""One worker's share of a data set: the split of records among training workers.

`TFRecordSequenceSource` with ``num_workers`` / ``worker_index`` reads a contiguous run of
the selected records (`worker_share`), and all workers agree on one step count; a worker
with fewer batches ends its epoch with empty ones (`pad_with_empty_batches`). With
``service=`` the reading runs on a tf.data service cluster instead (`via_service`).
`keras_tfr.distribute` builds on these for ``tf.distribute`` and ``keras.distribution``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # only for annotations: TensorFlow loads when a function runs
    import tensorflow as tf

__all__ = [
    "SERVICE_MODES",
    "check_service_args",
    "check_worker_args",
    "pad_with_empty_batches",
    "via_service",
    "worker_share",
]

SERVICE_MODES = ("distributed_epoch", "parallel_epochs")


# ----------------------------------------------------------------- per-worker share


def check_worker_args(num_workers: Any, worker_index: Any) -> tuple[int, int] | None:
    """Validates ``num_workers`` / ``worker_index``; None when neither is given."""
    if num_workers is None and worker_index is None:
        return None
    if num_workers is None or worker_index is None:
        raise ValueError(
            "Expected both `num_workers` and `worker_index`, or neither. Received: "
            f"num_workers={num_workers!r}, worker_index={worker_index!r}"
        )
    for name, value in (("num_workers", num_workers), ("worker_index", worker_index)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"Expected `{name}` to be an int. Received: {value!r}")
    if num_workers < 1:
        raise ValueError(f"Expected `num_workers` to be a positive int. Received: {num_workers}")
    if not 0 <= worker_index < num_workers:
        raise ValueError(
            f"Expected `worker_index` in [0, {num_workers}) for num_workers={num_workers}. "
            f"Received: {worker_index}"
        )
    return int(num_workers), int(worker_index)


def worker_share(
    keep: np.ndarray | None,
    record_samples: np.ndarray,
    num_workers: int,
    worker_index: int,
    batch_size: int,
    drop_remainder: bool,
) -> tuple[np.ndarray, int, int, int]:
    """One worker's share of the records and the step count all workers agree on.

    The selected records are cut into ``num_workers`` contiguous runs whose record counts
    differ by at most one (`numpy.array_split`), so each worker opens about
    ``1/num_workers`` of the shard files. The step count is the largest of the workers'
    own counts (the smallest with ``drop_remainder``); a worker with fewer batches ends
    its epoch with empty batches, which Keras' losses reduce with ``divide_no_nan``.

    Returns:
        ``(keep_mask, samples, steps, pad_batches)`` for this worker.
    """
    total = len(record_samples)
    selected = np.flatnonzero(keep) if keep is not None else np.arange(total)
    if len(selected) < num_workers:
        raise ValueError(
            f"`num_workers={num_workers}` needs at least {num_workers} records in the "
            f"selected data; it holds {len(selected)}. Write the data set with a smaller "
            "`samples_per_record` (and at least 10 shards per expected worker)."
        )
    runs = np.array_split(selected, num_workers)
    samples = [int(record_samples[r].sum()) for r in runs]
    if drop_remainder:
        own = [n // batch_size for n in samples]
        steps = min(own)
        if steps == 0:
            raise ValueError(
                f"`batch_size={batch_size}` with `drop_remainder=True` leaves no batch for "
                f"a worker: the smallest worker share holds {min(samples)} samples."
            )
    else:
        own = [math.ceil(n / batch_size) for n in samples]
        steps = max(own)
    mask = np.zeros(total, dtype=bool)
    mask[runs[worker_index]] = True
    pad = max(0, steps - own[worker_index])
    return mask, samples[worker_index], steps, pad


def pad_with_empty_batches(batches: tf.data.Dataset, count: int) -> tf.data.Dataset:
    """Appends ``count`` batches of zero samples with the element spec of ``batches``."""
    import tensorflow as tf

    def empty(spec: tf.TensorSpec) -> tf.Tensor:
        return tf.zeros([0, *spec.shape[1:]], spec.dtype)

    filler = tf.data.Dataset.from_tensors(tf.nest.map_structure(empty, batches.element_spec))
    return batches.concatenate(filler.repeat(count))


def check_service_args(service: Any, mode: Any, job_name: Any) -> None:
    """Validates the tf.data service arguments of `TFRecordSequenceSource`."""
    if service is None:
        return
    if not isinstance(service, str) or "://" not in service:
        raise ValueError(
            "Expected `service` to be a dispatcher address such as 'grpc://host:5050'. "
            f"Received: {service!r}"
        )
    if mode not in SERVICE_MODES:
        raise ValueError(
            f"Expected `service_mode` to be one of {SERVICE_MODES}. Received: {mode!r}"
        )
    if job_name is not None and (not isinstance(job_name, str) or not job_name):
        raise ValueError(
            f"Expected `service_job_name` to be a non-empty str or None. Received: {job_name!r}"
        )


def via_service(
    dataset: tf.data.Dataset, service: str, mode: str, job_name: str | None
) -> tf.data.Dataset:
    """Runs ``dataset`` (reading and decoding) on a tf.data service cluster.

    In ``"distributed_epoch"`` mode the dispatcher hands each shard file to one worker, so
    every record arrives once per epoch; in ``"parallel_epochs"`` mode each worker sends a
    whole epoch of its own. A shared ``job_name`` lets several trainers read one job.
    """
    import tensorflow as tf

    if mode == "distributed_epoch":
        policy = tf.data.experimental.service.ShardingPolicy.DYNAMIC
    else:
        policy = tf.data.experimental.service.ShardingPolicy.OFF
    return dataset.apply(
        tf.data.experimental.service.distribute(
            processing_mode=policy, service=service, job_name=job_name
        )
    )
