"""Shared by the reader tests: the check that one epoch's batches follow the source's order,
and TFRecord files of other tools (one `tf.train.Example` per sample)."""

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


def write_examples(path: str, x, y) -> dict:
    """Writes one `tf.train.Example` per sample to ``path``: ``x`` flattened as a float
    list, ``y`` as an int64; returns the features that parse them back."""
    import tensorflow as tf

    with tf.io.TFRecordWriter(path) as w:
        for a, b in zip(x, y):
            feature = {
                "x": tf.train.Feature(float_list=tf.train.FloatList(value=np.ravel(a))),
                "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[b])),
            }
            w.write(
                tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()
            )
    return {
        "x": tf.io.FixedLenFeature([int(np.prod(np.shape(x)[1:]))], tf.float32),
        "y": tf.io.FixedLenFeature([], tf.int64),
    }
