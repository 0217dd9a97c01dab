"""Batches as NumPy arrays straight from the memory-mapped reader, without tf.data.

`TFRecordSequenceSource.as_numpy_iterator` uses this in sample mode. A Python loop that
wants NumPy (a custom training loop, the JAX and torch Keras backends) would otherwise
pull each batch out of tf.data as a tensor and convert it back: about 130 µs of CPU per
batch on top of the gather, a third of what the whole gather of a 256 x 3 KB batch costs.
Here a batch is a view of the unit the reader threads gathered (copied from
the page cache), with the same order, the same checks (every record's CRC and layout
before any of its samples is handed out) and the same epochs as the tf.data pipeline.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from keras_tfr.read.mapped import Epoch, MappedPlan
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
        self._next_epoch = next_epoch
        self._structure = structure
        self._pad = int(pad_batches)
        self._convert_error = convert_error
        self._epoch: Epoch | None = None
        self._closer: Any = None
        self._batches: Iterator[Any] = iter(())
        self._ended = False

    def __iter__(self) -> NumpyBatches:
        return self

    def __next__(self) -> Any:
        if self._ended:
            raise StopIteration
        if self._epoch is None:
            number, start = self._next_epoch()
            self._epoch = Epoch(self._plan, number, start)
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
            self._batches = self._cut(unit)

    def _cut(self, unit: list[np.ndarray]) -> Iterator[Any]:
        specs = self._plan.specs
        b = self._plan.batch_size
        rows = len(unit[0])
        for a in range(0, rows, b):
            yield self._structure({s.key: _decode(u[a : a + b], s) for s, u in zip(specs, unit)})

    def _empty(self) -> Any:
        return self._structure(
            {s.key: np.empty((0, *s.shape), dtype=_dtype(s)) for s in self._plan.specs}
        )

    def _finish(self) -> None:
        self._ended = True
        if self._closer is not None:
            self._closer()

    def close(self) -> None:
        """Stops the reader threads; the iterator then ends."""
        self._finish()
        self._batches = iter(())
        self._pad = 0


def _dtype(spec: FeatureSpec) -> np.dtype:
    return np.dtype(np.bool_) if spec.dtype == "bool" else spec.np_dtype


def _decode(rows: np.ndarray, spec: FeatureSpec) -> np.ndarray:
    """``[n, sample_bytes]`` uint8 -> ``[n, *shape]`` in the feature's dtype, a view.

    `np.asarray` drops the reader's buffer subclass but keeps it as the view's base, so
    the buffer goes back to the reader only once the caller holds no batch from it.
    """
    return np.asarray(rows).view(_dtype(spec)).reshape(-1, *spec.shape)
