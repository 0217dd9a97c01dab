"""Seeds of keras-tfr pipelines: `seed=` alone decides their order.

One home for the rule that `TFRecordSequenceSource` and `from_tfrecords` share: the
global seed that `keras.utils.set_random_seed` sets (through `tf.random.set_seed`) does
not change which order a given `seed=` yields.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["drawn_seed", "only_op_seeds"]


def drawn_seed() -> int:
    """The seed of a pipeline given ``seed=None``: drawn from NumPy's global random state.

    So its order differs from process to process, yet `keras.utils.set_random_seed(n)`
    (or `np.random.seed(n)`) at a program's start makes it reproducible, as it makes
    Keras' shuffle of NumPy inputs. (The draw advances that global state, as Keras'
    shuffle advances its own.)
    """
    import numpy as np

    return int(np.random.randint(0, 2**62, dtype=np.int64))


@contextlib.contextmanager
def only_op_seeds() -> Iterator[None]:
    """Hides TensorFlow's global seed while a pipeline is built (eagerly).

    TensorFlow combines an op's seed with the global seed (`tf.random.set_seed`, which
    `keras.utils.set_random_seed` calls), so the same `seed=` would shuffle differently
    in a program that set one. The global seed is hidden, not reset: `tf.random.set_seed`
    would restart the user's own random sequence.

    Example:
        >>> with only_op_seeds():
        ...     ds = tf.data.Dataset.range(10).shuffle(10, seed=0)
    """
    import tensorflow as tf

    from keras_tfr._compat import tf as compat_tf  # the global seed has no public home

    saved = compat_tf.get_global_seed()
    if saved is None or not tf.executing_eagerly():
        yield
        return
    compat_tf.set_global_seed(None)
    try:
        yield
    finally:
        compat_tf.set_global_seed(saved)
