"""Batches as NumPy arrays straight from the memory-mapped reader, without tf.data.

`TFRecordSequenceSource.as_numpy_iterator` uses this in sample mode. A Python loop that
wants NumPy (a custom training loop, the JAX and torch Keras backends) would otherwise
pull each batch out of tf.data as a tensor and convert it back: about 130 µs of CPU per
batch on top of the gather, a third of what the whole gather of a 256 x 3 KB batch costs.
Here each batch is an array per feature, copied once from the page cache by the
reader threads (a sorted fancy index of a memory-mapped array copies as much), with the
same order, the same checks (every record's CRC and layout
before any of its samples is handed out) and the same epochs as the tf.data pipeline.
On a lattice (the writer's default) every array starts on a 64-byte boundary: where a
batch's bytes are a multiple of 64, the batches of one unit (about 8 MB) are views of one
aligned buffer gathered by one `np.take` per feature, else each batch has its own.
JAX on the CPU then takes each batch without a copy (an unaligned array is copied by
`jax.device_put`), and `TensorBatches` hands the same batches out as
`tf.Tensor`s made through DLPack, no second copy: what a Python loop over a sample-mode
source gets.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from keras_tfr.read.mapped import Epoch, MappedPlan, _libc
from keras_tfr.schema import FeatureSpec


class NumpyBatches:
    """One epoch (one iterator) of NumPy batches from a `MappedPlan`.

    The epoch is taken from ``next_epoch()`` when the first batch is pulled, as the
    tf.data iterator does, so an iterator made and dropped unread reads nothing and
    takes no epoch. The reader threads stop when the epoch ends, when `close` is called
    or when the iterator is collected.
    """

    def __init__(
        self,
        plan: MappedPlan,
        next_epoch: Callable[[], tuple[int, int]],
        structure: Callable[[dict[str, np.ndarray]], Any],
        pad_batches: int,
        convert_error: Callable[[BaseException], BaseException | None],
    ):
        self._plan = plan
        # On a lattice every array starts on a 64-byte boundary (still one copy): what
        # TensorFlow needs of a buffer it adopts through DLPack, and what JAX needs to
        # take a NumPy array on the CPU without copying it (`jax.device_put`, once per
        # batch in Keras' JAX `fit`).
        self._aligned = plan.lattice_rows is not None
        self._next_epoch = next_epoch
        self._structure = structure
        self._pad = int(pad_batches)
        self._convert_error = convert_error
        self._leaf = self._leaf_fn()
        self._epoch: Epoch | None = None
        self._closer: Any = None
        self._batches: Iterator[Any] = iter(())
        self._ended = False
        # One batch at a time, as tf.data's iterator hands them out: threads that share this
        # iterator each took an epoch of their own and replaced each other's (its readers
        # then stopped: batches lost, repeated, or `CancelledError`).
        self._lock = threading.Lock()

    def __iter__(self) -> NumpyBatches:
        return self

    def __next__(self) -> Any:
        with self._lock:
            return self._next()

    def _next(self) -> Any:
        if self._ended:
            raise StopIteration
        if self._epoch is None:
            _reuse_freed_batches()
            number, start = self._next_epoch()
            # The reader threads make each unit's batches whole (structure, tensors); this
            # thread only hands them out. (Nothing in the epoch refers back to this
            # iterator, so that collecting the iterator stops the readers.)
            finish = _batch_maker(self._plan.specs, self._structure, self._leaf)
            self._epoch = Epoch(
                self._plan, number, start, batches=True, aligned=self._aligned, finish=finish
            )
            self._closer = weakref.finalize(self, self._epoch.close)
        while True:
            batch = next(self._batches, None)
            if batch is not None:
                return batch
            try:
                unit = self._epoch.next_unit()
            except StopIteration:
                self._finish()
                if self._pad:
                    self._pad, pads = 0, self._pad
                    self._batches = iter([self._empty()] * pads)
                    self._ended = False
                    continue
                raise
            except ValueError as e:
                converted = self._convert_error(e)
                self.close()
                if converted is None:
                    raise
                raise converted from e
            self._batches = iter(unit)

    def _leaf_fn(self) -> Callable[[np.ndarray], Any]:
        """What each feature's array of a batch is handed out as (called in the reader
        threads; it must not refer to this iterator)."""
        return _same

    def _empty(self) -> Any:
        """A padding batch: no rows, each feature in its dtype and shape."""
        make = _batch_maker(self._plan.specs, self._structure, self._leaf)
        return make([[np.empty((0, sb), np.uint8) for sb in self._plan.sample_bytes]])[0]

    def _finish(self) -> None:
        self._ended = True
        if self._closer is not None:
            self._closer()

    def close(self) -> None:
        """Stops the reader threads; the iterator then ends."""
        self._finish()
        self._batches = iter(())
        self._pad = 0


class TensorBatches(NumpyBatches):
    """One epoch (one iterator) of batches as `tf.Tensor`s, straight from the
    memory-mapped reader: the batches `NumpyBatches` makes (on a lattice, each array on
    a 64-byte boundary, copied once from the page cache), each handed to
    TensorFlow through DLPack, which makes a tensor over its memory without a copy
    (about 3 µs, against 80-130 µs for `tf.convert_to_tensor`, which copies). What a
    Python loop over a sample-mode source gets in place of tf.data's eager iterator
    (`TFRecordSequenceSource.__iter__`).
    """

    def _leaf_fn(self) -> Callable[[np.ndarray], Any]:
        import tensorflow as tf

        from_dlpack, convert = tf.experimental.dlpack.from_dlpack, tf.convert_to_tensor

        def leaf(a: np.ndarray) -> Any:
            # Every array here is a view of one from `aligned_empty` (64-byte aligned, as
            # TensorFlow's kernels need; DLPack would hand over any address). Empty
            # (padding) batches and dtypes DLPack lacks are copied.
            if a.size:
                try:
                    return from_dlpack(a.__dlpack__())
                except (BufferError, TypeError, ValueError):  # pragma: no cover - dtypes
                    pass
            return convert(a)

        return leaf


def _same(a: np.ndarray) -> np.ndarray:
    return a


def _batch_maker(
    specs: list[FeatureSpec],
    structure: Callable[[dict[str, Any]], Any],
    leaf: Callable[[np.ndarray], Any],
) -> Callable[[list[list[np.ndarray]]], list[Any]]:
    """A unit's batches (per batch, per feature a ``[rows, sample_bytes]`` uint8 array)
    -> the batches handed out: each feature in its dtype and shape, made a leaf, in the
    source's structure."""
    keyed = [(s.key, _dtype(s), s.shape) for s in specs]

    def make(unit: list[list[np.ndarray]]) -> list[Any]:
        return [
            structure(
                {k: leaf(u.view(dt).reshape(-1, *shape)) for (k, dt, shape), u in zip(keyed, b)}
            )
            for b in unit
        ]

    return make


def _dtype(spec: FeatureSpec) -> np.dtype:
    return np.dtype(np.bool_) if spec.dtype == "bool" else spec.np_dtype


_HEAP_BLOCK = (32 << 20) - (8 << 10)  # just under glibc's largest dynamic mmap threshold
_heap_lock = threading.Lock()
_heap_done: list[bool] = []


def _reuse_freed_batches() -> None:
    """Once per process, on glibc: mallocs and frees one block of 32 MB less 8 KB.

    Every batch is a new array (hundreds of KB to a few MB). glibc serves an allocation
    that large with a fresh memory map, or trims the freed heap back to the kernel, until
    it has seen a block of that size freed: then it raises its dynamic mmap threshold to
    that size and its trim threshold to twice it. Until then each batch costs a page
    fault per 4 KB (measured: half the time of reading 0.5 GB, 57,000 faults per epoch
    against 200). Freeing one large block first is what any process that has loaded and
    dropped a large array has already done; after it the process keeps up to 64 MB of
    freed memory for reuse instead of returning it at once. Nothing changes where the
    thresholds were fixed (``mallopt``, ``MALLOC_MMAP_THRESHOLD_``) or without glibc.
    """
    with _heap_lock:
        if _heap_done:
            return
        _heap_done.append(True)
        libc = _libc()
        if not sys.platform.startswith("linux") or not hasattr(libc, "gnu_get_libc_version"):
            return  # not glibc
        block = libc.malloc(_HEAP_BLOCK)
        if block:
            libc.free(block)
