"""Scaling out: many workers (`tf.distribute`), the tf.data service, the `serve` command.

Three engines of TensorFlow's own, no new machinery:

* **Many workers, one model** (`tf.distribute.MultiWorkerMirroredStrategy`). Every worker
  process builds the same `TFRecordSequenceSource` with ``num_workers`` and
  ``worker_index``: each then reads a disjoint, balanced share of the records (contiguous
  runs of whole shards; at most one shard is split between two neighbours), and every
  worker gets the same step count, so the collectives of one step never wait for a worker
  that already finished its epoch. `distribute_source` does this through
  `tf.distribute.Strategy.distribute_datasets_from_function`, with the global batch the
  user asked for split evenly across replicas. Given a MultiWorkerMirroredStrategy, it
  also installs the workaround Keras 3's TensorFlow trainer needs there
  (`keras_tfr._compat.keras_dist`).
* **Many processes, one model, Keras' own way** (``keras.distribution`` on the JAX
  backend): `keras_distribution_source` builds the same kind of share for each process,
  with the per-process batch and the same batch size on every process at every step.
* **The tf.data service** (`tf.data.experimental.service`): ``service="grpc://host:port"``
  on the source sends reading and decoding to a dispatcher and its workers;
  `start_service` and ``keras-tfr serve`` start such a cluster.
* **Storage beyond the local disk**: every file access of keras-tfr goes through
  `keras_tfr._io`, which hands paths with a URL scheme to `tf.io.gfile`.

Why not TensorFlow's automatic file sharding alone: when Keras distributes a plain
`tf.data.Dataset`, tf.data's auto-sharding hands out shards round-robin; when the shards
do not split evenly over the workers, one worker has more batches than the step count
Keras took from the whole data set, and the rest of its data is silently left unread that
epoch. An explicit, balanced share per worker with one agreed step count has no such case.

This module imports TensorFlow only inside functions, so importing it is quick.
"""

from __future__ import annotations

import gc
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from keras_tfr._compat import keras_dist, keras_shuffle

if TYPE_CHECKING:  # only for annotations: TensorFlow loads when a function runs
    import tensorflow as tf

    from keras_tfr.source import TFRecordSequenceSource

__all__ = ["ServiceCluster", "distribute_source", "keras_distribution_source", "start_service"]


def distribute_source(
    strategy: tf.distribute.Strategy, directory: str, batch_size: int, **source_kwargs: Any
) -> tf.distribute.DistributedDataset:
    """A source split across the replicas of ``strategy``, for ``model.fit``.

    Calls ``strategy.distribute_datasets_from_function``: each input pipeline (one per
    worker, or one per replica when a worker holds several) builds a
    `TFRecordSequenceSource` over its own balanced share of the records, with the per-replica
    batch ``batch_size / num_replicas_in_sync``. Every pipeline has the same step count, so
    the global batch of one step is ``batch_size`` and together the replicas see every
    sample once per epoch.

    Args:
        strategy: a `tf.distribute.Strategy` (e.g. `MultiWorkerMirroredStrategy`,
            `MirroredStrategy`).
        directory: the data set's directory (local or a `tf.io.gfile` URL).
        batch_size: the global batch size; must divide by ``num_replicas_in_sync``.
        **source_kwargs: other `TFRecordSequenceSource` arguments (``shuffle``, ``seed``,
            ``validation_split``, ``subset``, ...), the same on every worker.

    Under `tf.distribute.MultiWorkerMirroredStrategy` with a Keras that needs it, this
    also wraps two functions of Keras' TensorFlow trainer for the process
    (`keras_tfr._compat.keras_dist`), so that ``fit`` and ``evaluate`` work with the model
    built in ``strategy.scope()`` and no other change.

    Returns:
        A `tf.distribute.DistributedDataset` that ``model.fit`` takes as it is.

    Example:
        >>> strategy = tf.distribute.MultiWorkerMirroredStrategy()
        >>> with strategy.scope():
        ...     model = make_model()
        >>> train = distribute_source(strategy, "data/train", 256, shuffle=True, seed=0)
        >>> model.fit(train, epochs=5)
    """
    import tensorflow as tf

    from keras_tfr.manifest import Manifest
    from keras_tfr.source import TFRecordSequenceSource

    _check_helper_args("distribute_source", batch_size, source_kwargs)
    if keras_dist.multi_worker_fix_applies(strategy):
        # Keras' TensorFlow trainer cannot `fit` under MultiWorkerMirroredStrategy without
        # it (keras_tfr/_compat/keras_dist.py names the bugs); off once Keras is fixed.
        keras_dist.install_multi_worker_fix()
    replicas = strategy.num_replicas_in_sync
    if batch_size < replicas or batch_size % replicas:
        raise ValueError(
            f"Expected the global `batch_size` to be a multiple of the {replicas} replicas "
            f"in sync, so that every replica gets the same batch. Received: {batch_size}"
        )
    # Loaded once for every pipeline of this worker; the shard check (one stat per shard)
    # only when the source would do it.
    manifest = Manifest.load(str(directory), check_files=source_kwargs.get("check_files", True))
    workers = _num_workers(strategy)
    per_replica_pipelines = replicas > workers
    mode = (
        tf.distribute.InputReplicationMode.PER_REPLICA
        if per_replica_pipelines
        else tf.distribute.InputReplicationMode.PER_WORKER
    )

    def dataset_fn(ctx: tf.distribute.InputContext) -> TFRecordSequenceSource:
        if per_replica_pipelines:
            # One pipeline per replica; pipeline ids are numbered across all workers.
            num, index = replicas, _global_replica_id(strategy, ctx)
        else:
            num, index = ctx.num_input_pipelines, ctx.input_pipeline_id
        return TFRecordSequenceSource(
            directory,
            batch_size=batch_size // replicas,
            num_workers=num,
            worker_index=index,
            manifest=manifest,
            **source_kwargs,
        )

    distributed = strategy.distribute_datasets_from_function(
        dataset_fn, options=tf.distribute.InputOptions(experimental_replication_mode=mode)
    )
    if source_kwargs.get("shuffle", True):
        keras_shuffle.mark_self_shuffling(distributed)  # Keras' shuffle warning is wrong for it
    return distributed


def _num_workers(strategy: tf.distribute.Strategy) -> int:
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return 1
    spec = resolver.cluster_spec().as_dict()
    return max(1, len(spec.get("worker", [])) + len(spec.get("chief", [])))


def _global_replica_id(strategy: tf.distribute.Strategy, ctx: tf.distribute.InputContext) -> int:
    # In PER_REPLICA mode TensorFlow numbers the pipelines of this worker from 0 and sets
    # num_input_pipelines to the local replica count; shift by the worker's position.
    local = ctx.num_input_pipelines
    resolver = getattr(strategy, "cluster_resolver", None)
    task = 0
    if resolver is not None and resolver.cluster_spec().as_dict():
        spec = resolver.cluster_spec().as_dict()
        order = [("chief", i) for i in range(len(spec.get("chief", [])))] + [
            ("worker", i) for i in range(len(spec.get("worker", [])))
        ]
        task = order.index((resolver.task_type, resolver.task_id))
    return task * local + ctx.input_pipeline_id


def _check_helper_args(helper: str, batch_size: Any, source_kwargs: dict) -> None:
    for name in ("num_workers", "worker_index", "batch_size", "manifest"):
        if name in source_kwargs:
            raise TypeError(f"`{helper}` sets `{name}` itself; do not pass it.")
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)):
        raise TypeError(f"Expected `batch_size` to be a positive int. Received: {batch_size!r}")
    if batch_size < 1:
        raise ValueError(f"Expected `batch_size` to be a positive int. Received: {batch_size}")


# ----------------------------------------------------------------- keras.distribution


def keras_distribution_source(
    directory: str, batch_size: int, *, distribution: Any = None, **source_kwargs: Any
) -> tf.data.Dataset:
    """This process's share of a data set, for ``keras.distribution`` over many processes.

    Keras 3's own multi-process input path (``DataParallel(auto_shard_dataset=True)``, the
    default) rebatches the dataset it is given to the per-process batch and keeps every
    N-th batch (`tf.data.Dataset.shard`): every process reads the whole data set and
    throws away all but 1/N of it. So create the distribution with
    ``auto_shard_dataset=False`` (Keras' own switch for "the dataset is already sharded
    across hosts") and give ``fit`` this source instead. In each process it is a
    `TFRecordSequenceSource` over a disjoint, balanced share of the samples
    (``num_workers`` = the data shards, ``worker_index`` = this process's shard), with the
    per-process batch ``batch_size / data shards``, so that:

    * each process reads only its own share, and together they see every sample once
      per epoch (but see the last point);
    * every process runs the same number of steps, and the global batch of a step is
      ``batch_size`` (the last step of an epoch may be smaller, the same on every process);
    * every process hands Keras a batch of the same size at every step: JAX builds each
      global batch from the processes' local ones (`jax.make_array_from_process_local_data`)
      and, when their sizes differ, computes a wrong step without an error. When the
      shares differ in size, each process therefore stops after the smallest share
      (rounded down to a multiple of its local devices): the few samples left over are
      not seen that epoch (with ``shuffle=True``, different ones each epoch).

    The shares' sizes are gathered across processes once, when the source is built
    (`jax.experimental.multihost_utils.process_allgather`), so build it on every process.
    Pass the validation data the same way (``subset="validation"``).

    Args:
        directory: the data set's directory (local or a `tf.io.gfile` URL).
        batch_size: the global batch size; must divide by the number of model replicas.
        distribution: a `keras.distribution.Distribution`; default: the one set with
            `keras.distribution.set_distribution`. With none, a plain
            `TFRecordSequenceSource` over all the data is returned.
        **source_kwargs: other `TFRecordSequenceSource` arguments (``shuffle``, ``seed``,
            ``validation_split``, ``subset``, ...), the same on every process.

    Returns:
        A `tf.data.Dataset` of this process's batches, with a known step count.

    Example:
        >>> keras.distribution.initialize()  # KERAS_DISTRIBUTION_* environment variables
        >>> keras.distribution.set_distribution(
        ...     keras.distribution.DataParallel(auto_shard_dataset=False))
        >>> model = make_model()
        >>> train = keras_distribution_source("gs://bucket/train", 256, shuffle=True, seed=0)
        >>> model.fit(train, epochs=5)
    """
    from keras_tfr.manifest import Manifest
    from keras_tfr.source import TFRecordSequenceSource

    _check_helper_args("keras_distribution_source", batch_size, source_kwargs)
    if distribution is None:
        import keras

        distribution = keras.distribution.distribution()
    if distribution is None:
        return TFRecordSequenceSource(directory, batch_size=batch_size, **source_kwargs)
    processes = int(distribution.num_processes)
    replicas = int(distribution.num_model_replicas)
    if processes > 1 and distribution.auto_shard_dataset:
        raise ValueError(
            "Expected a distribution created with `auto_shard_dataset=False`, e.g. "
            "`keras.distribution.DataParallel(auto_shard_dataset=False)`: this source already "
            "holds only this process's share, and Keras' auto-sharding would rebatch and "
            f"shard it again. Received: {distribution!r} with auto_shard_dataset=True"
        )
    if batch_size % replicas:
        raise ValueError(
            f"Expected the global `batch_size` to be a multiple of the {replicas} model "
            f"replicas, so that every replica gets the same batch. Received: {batch_size}"
        )
    # Keras' own rule (`Distribution.data_shard_id`): one data shard per process while
    # every process holds whole replicas; processes of one replica share a shard.
    shards = min(processes, replicas)
    local_replicas = max(1, replicas // processes)
    per_process = batch_size // shards
    if shards > 1:
        share = TFRecordSequenceSource(
            directory,
            batch_size=per_process,
            num_workers=shards,
            worker_index=int(distribution.data_shard_id),
            manifest=Manifest.load(
                str(directory), check_files=source_kwargs.get("check_files", True)
            ),
            **source_kwargs,
        )
    else:
        share = TFRecordSequenceSource(directory, batch_size=per_process, **source_kwargs)
    counts = _gather_counts(share.num_samples, processes)
    samples = min(counts) - min(counts) % local_replicas
    drop_remainder = bool(source_kwargs.get("drop_remainder", False))
    steps = samples // per_process if drop_remainder else math.ceil(samples / per_process)
    if steps == 0:
        raise ValueError(
            f"`batch_size={batch_size}` leaves no batch for a process: the smallest share "
            f"holds {min(counts)} samples, the per-process batch is {per_process}."
        )
    if samples == share.num_samples and steps == len(share):
        return share
    cut = first_samples(share, samples, per_process, steps)
    if share._cfg.shuffle:
        keras_shuffle.mark_self_shuffling(cut)  # Keras' shuffle warning is wrong for it
    return cut


def first_samples(
    batches: tf.data.Dataset, samples: int, batch_size: int, steps: int
) -> tf.data.Dataset:
    """The first ``steps`` batches of ``batches``, holding its first ``samples`` samples.

    ``batches`` yields full batches of ``batch_size`` (then a partial one, or empty
    ones): only the last batch kept is cut, so this costs one slice per epoch.
    """
    import tensorflow as tf

    batches = batches.take(steps)
    last = samples - (steps - 1) * batch_size
    if last < batch_size:

        def cut(step: tf.Tensor, batch: Any) -> Any:
            rows = tf.where(step == steps - 1, last, batch_size)
            return tf.nest.map_structure(lambda t: t[:rows], batch)

        batches = batches.enumerate().map(cut)
    return batches.apply(tf.data.experimental.assert_cardinality(steps))


def _gather_counts(count: int, processes: int) -> list[int]:
    """Every process's ``count``, in process order (a collective: call it everywhere)."""
    if processes == 1:
        return [int(count)]
    from jax.experimental import multihost_utils

    # JAX computes in 32 bits by default: send a count of up to 2**62 as two halves.
    halves = np.array([count >> 31, count & (2**31 - 1)], dtype=np.int32)
    gathered = np.asarray(multihost_utils.process_allgather(halves)).reshape(-1, 2)
    return [(int(hi) << 31) | int(lo) for hi, lo in gathered]


# ----------------------------------------------------------------- tf.data service


class ServiceCluster:
    """A tf.data service dispatcher and its workers in this process.

    Attributes:
        target: the address to pass as ``service=`` (``"grpc://host:port"``), or None when
            only workers of another dispatcher were started.
        worker_addresses: ``host:port`` of each worker.
    """

    def __init__(
        self,
        dispatcher: tf.data.experimental.service.DispatchServer | None,
        workers: list[tf.data.experimental.service.WorkerServer],
        target: str | None,
        addresses: list[str],
    ) -> None:
        self.dispatcher = dispatcher
        self.workers = workers
        self.target = target
        self.worker_addresses = addresses

    def stop(self) -> None:
        """Stops the workers, then the dispatcher.

        First collects this process's garbage: a data set read from the service and then
        dropped inside a reference cycle keeps its iterator, whose calls to the servers
        each server's stop waits for (30-90 s after the service tests of this project's
        suite; under a second once they were collected)."""
        gc.collect()
        for server in [*self.workers, self.dispatcher]:
            if server is not None and hasattr(server, "_stop"):
                server._stop()
        self.workers = []
        self.dispatcher = None

    def __enter__(self) -> ServiceCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<ServiceCluster dispatcher={self.target} workers={self.worker_addresses}>"


def _check_port(argument: str, port: Any) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(
            f"Expected `{argument}` to be a TCP port (1-65535, or 0 for a free one). "
            f"Received: {port!r}"
        )


def _port_free(port: int) -> None:
    """Raises `OSError` (errno EADDRINUSE) when another process listens on ``port``:
    TensorFlow's gRPC servers bind with ``SO_REUSEPORT``, so a second server on a port in
    use would start without a word and share the port with the first, trainers reaching
    one or the other at random."""
    if port == 0:
        return
    import errno
    import socket

    for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 here
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise OSError(
                        errno.EADDRINUSE,
                        f"Port {port} is already in use (another dispatcher or worker, or "
                        "another program, listens on it): choose another port, or 0 for a "
                        "free one",
                    ) from e
                # EADDRNOTAVAIL (an IPv6 stack without the address) and others: not ours


def start_service(
    num_workers: int = 2,
    *,
    port: int = 0,
    worker_ports: list[int] | None = None,
    host: str = "localhost",
    dispatcher: str | None = None,
    protocol: str = "grpc",
) -> ServiceCluster:
    """Starts a tf.data service dispatcher and ``num_workers`` workers in this process.

    Args:
        num_workers: workers to start (0: only the dispatcher).
        port: the dispatcher's port; 0 picks a free one.
        worker_ports: one port per worker; default: free ones.
        host: the host name workers give the dispatcher as their address (what trainers
            on other machines use to reach them).
        dispatcher: ``"host:port"`` (or ``"grpc://host:port"``) of a dispatcher that runs
            elsewhere: then only workers are started here, and they join it.
        protocol: the transport, ``"grpc"``.

    Returns:
        A `ServiceCluster`; pass its ``target`` as ``service=`` to `TFRecordSequenceSource`.

    Example:
        >>> with start_service(num_workers=2) as cluster:
        ...     train = TFRecordSequenceSource("data/train", 256, service=cluster.target)
        ...     model.fit(train, epochs=2)
    """
    import tensorflow as tf

    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(
            f"Expected `num_workers` to be a non-negative int. Received: {num_workers!r}"
        )
    if worker_ports is not None and len(worker_ports) != num_workers:
        raise ValueError(
            f"Expected one port per worker in `worker_ports` ({num_workers}). "
            f"Received: {worker_ports!r}"
        )
    _check_port("port", port)
    for p in worker_ports or ():
        _check_port("worker_ports", p)
    for p in ([port] if dispatcher is None else []) + list(worker_ports or []):
        _port_free(p)
    service = tf.data.experimental.service
    server = None
    if dispatcher is None:
        server = service.DispatchServer(service.DispatcherConfig(port=port, protocol=protocol))
        address = server.target.split("://", 1)[1]
        target = f"{protocol}://{host}:{address.rsplit(':', 1)[1]}"
    else:
        address = dispatcher.split("://", 1)[-1]
        target = None
    workers, addresses = [], []
    for i in range(num_workers):
        worker_port = 0 if worker_ports is None else int(worker_ports[i])
        worker = service.WorkerServer(
            service.WorkerConfig(
                dispatcher_address=address,
                port=worker_port,
                worker_address=f"{host}:%port%",
                protocol=protocol,
            )
        )
        workers.append(worker)
        addresses.append(f"{host}:{worker._address.rsplit(':', 1)[1]}")
    return ServiceCluster(server, workers, target, addresses)
