"""Shared by the reader tests: the check that one epoch's batches follow the source's order."""

from __future__ import annotations

import numpy as np


def same(a, b) -> None:
    """Bit for bit (float NaNs and -0.0 included); ``a`` may be a tensor."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


def check_order(batches, order, *arrays) -> int:
    """Each ``(x, y, w)`` batch holds ``arrays`` at the next positions of ``order``;
    returns how many samples the batches held."""
    at = 0
    for batch in batches:
        rows = order[at : at + len(batch[1])]
        for got, want in zip(batch, arrays):
            same(got, want[rows])
        at += len(batch[1])
    return at
