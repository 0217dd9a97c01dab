"""Keras 3 under `tf.distribute.MultiWorkerMirroredStrategy`: the one home of the workaround.

Keras 3's TensorFlow trainer cannot ``fit`` or ``evaluate`` under
MultiWorkerMirroredStrategy with *any* dataset (seen with Keras 3.15.1 and TensorFlow
2.21; reported as keras-team/keras#20585 and tensorflow/tensorflow#72388). Two bugs:

1. ``TensorFlowTrainer._maybe_symbolic_build`` takes the first batch of the distributed
   iterator and calls ``strategy.reduce("MEAN", batch, axis=None)`` on the whole
   ``(x, y)`` structure; the collective strategy's ``reduce`` takes one value, not a
   structure: ``ValueError: Attempt to convert a value (PerReplica:{...}) with an
   unsupported type``.
2. ``reduce_per_replica`` reduces every log across workers with
   ``strategy.reduce("MEAN", v, axis=0)``; the logs are scalars: ``ValueError: Invalid
   reduction dimension 0 for input with 0 dimensions``.

The fix wraps both functions and changes only the multi-worker case (Keras' own test for
it, ``_collective_all_reduce_multi_worker``); everything else goes to Keras' code as is:

1. the model is built from the first batch's local values
   (`tf.distribute.Strategy.experimental_local_results`): the symbolic build needs their
   shapes, not a mean over workers;
2. scalar logs are averaged over the workers with ``axis=None``; logs of rank 1 or more
   keep Keras' own ``axis=0`` reduction.

`keras_tfr.distribute.distribute_source` installs the fix when it is given a
MultiWorkerMirroredStrategy and the installed Keras needs it (`multi_worker_fix_needed`),
so user code holds only public ``tf.distribute`` and Keras calls. When a Keras release
fixes the bugs, ``tests/test_distribute.py`` (which reproduces them with the fix off)
fails: set `FIXED_IN` to that release and the fix turns itself off there.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
from collections.abc import Callable
from typing import Any

log = logging.getLogger("keras_tfr")

#: The private Keras APIs this module uses, and the parameters it relies on.
PRIVATE_APIS = {
    "keras.src.backend.tensorflow.trainer.TensorFlowTrainer._maybe_symbolic_build": (
        "self",
        "iterator",
        "data_batch",
    ),
    "keras.src.backend.tensorflow.trainer.reduce_per_replica": (
        "values",
        "strategy",
        "reduction",
    ),
    "keras.src.backend.tensorflow.trainer._collective_all_reduce_multi_worker": ("strategy",),
}

#: The first Keras release with the bugs (Keras 3's new trainer).
AFFECTED_SINCE = (3, 0, 0)
#: The first Keras release that fixes both bugs; None while no release does.
FIXED_IN: tuple[int, ...] | None = None

_originals: dict[str, Any] = {}


class KerasCompatError(RuntimeError):
    """A private Keras API that keras-tfr relies on moved or changed its signature."""


def keras_version(version: str | None = None) -> tuple[int, ...]:
    """``keras.__version__`` (or ``version``) as a tuple of ints: ``"3.15.1"`` -> (3, 15, 1)."""
    if version is None:
        import keras

        version = keras.__version__
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        raise ValueError(f"Expected a Keras version such as '3.15.1'. Received: {version!r}")
    return tuple(int(part or 0) for part in match.groups())


def multi_worker_fix_needed(version: str | None = None) -> bool:
    """Whether this Keras (or ``version``) has the two MultiWorkerMirroredStrategy bugs."""
    v = keras_version(version)
    return v >= AFFECTED_SINCE and (FIXED_IN is None or v < FIXED_IN)


def multi_worker_fix_applies(strategy: Any) -> bool:
    """Whether ``strategy`` is a MultiWorkerMirroredStrategy that this Keras mishandles."""
    import tensorflow as tf

    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return False
    import keras

    return keras.backend.backend() == "tensorflow" and multi_worker_fix_needed()


def _resolve() -> tuple[Any, Any]:
    """Keras' TensorFlow trainer module and class, with the private APIs checked."""
    try:
        from keras.src.backend.tensorflow import trainer as module
    except ImportError as error:  # pragma: no cover - depends on the Keras install
        raise KerasCompatError(
            f"keras-tfr expected the private module `keras.src.backend.tensorflow.trainer` "
            f"in Keras {keras_version()}: {error}"
        ) from error
    for path, expected in PRIVATE_APIS.items():
        owner: Any = module
        for part in path.removeprefix("keras.src.backend.tensorflow.trainer.").split("."):
            owner = getattr(owner, part, None)
        if owner is None:
            raise KerasCompatError(f"keras-tfr expected `{path}` in Keras {keras_version()}.")
        found = tuple(inspect.signature(inspect.unwrap(owner)).parameters)
        if found != expected:
            raise KerasCompatError(
                f"keras-tfr expected `{path}` to take {expected}. Received: {found} "
                f"(Keras {keras_version()})."
            )
    return module, module.TensorFlowTrainer


PARTS = ("build", "reduce")


def install_multi_worker_fix(parts: tuple[str, ...] = PARTS) -> bool:
    """Wraps Keras' two functions (once per process); False when it cannot.

    Args:
        parts: which bugs to work around, ``"build"`` (1.) and/or ``"reduce"`` (2.);
            both unless a test reproduces one bug alone.

    Logs a warning instead of raising when the private API moved: ``fit`` then fails
    with Keras' own error, as it would without keras-tfr.
    """
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"Expected `parts` from {PARTS}. Received: {parts!r}")
    try:
        module, trainer = _resolve()
    except KerasCompatError as error:
        log.warning("%s Not applying the MultiWorkerMirroredStrategy workaround.", error)
        return False
    is_multi_worker = module._collective_all_reduce_multi_worker
    if "build" in parts and "build" not in _originals:
        _originals["build"] = trainer._maybe_symbolic_build
        trainer._maybe_symbolic_build = _fixed_build(_originals["build"], is_multi_worker)
    if "reduce" in parts and "reduce" not in _originals:
        _originals["reduce"] = module.reduce_per_replica
        module.reduce_per_replica = _fixed_reduce(_originals["reduce"], is_multi_worker)
    log.info(
        "keras-tfr: Keras %s needs a workaround under MultiWorkerMirroredStrategy "
        "(keras-team/keras#20585); applied: %s.",
        ".".join(map(str, keras_version())),
        ", ".join(sorted(_originals)),
    )
    return True


def uninstall_multi_worker_fix() -> None:
    """Restores Keras' own functions (for tests)."""
    if not _originals:
        return
    module, trainer = _resolve()
    if "build" in _originals:
        trainer._maybe_symbolic_build = _originals.pop("build")
    if "reduce" in _originals:
        module.reduce_per_replica = _originals.pop("reduce")


def _fixed_build(
    original: Callable[..., Any], is_multi_worker: Callable[[Any], bool]
) -> Callable[..., Any]:
    @functools.wraps(original)
    def _maybe_symbolic_build(self: Any, iterator: Any = None, data_batch: Any = None) -> Any:
        strategy = self._distribute_strategy
        if iterator is not None and strategy is not None and is_multi_worker(strategy):
            data_batch, iterator = _first_local_batch(iterator, strategy), None
        return original(self, iterator=iterator, data_batch=data_batch)

    _maybe_symbolic_build.keras_tfr_fix = True  # type: ignore[attr-defined]
    return _maybe_symbolic_build


def _first_local_batch(iterator: Any, strategy: Any) -> Any:
    import tensorflow as tf

    def local(value: Any) -> Any:
        if isinstance(value, tf.distribute.DistributedValues):
            return strategy.experimental_local_results(value)[0]
        return value

    # As Keras' own code does: the epoch iterator yields (first step, last step, iterator).
    for _, _, batches in iterator:
        return tf.nest.map_structure(local, next(batches))
    return None


def _fixed_reduce(
    original: Callable[..., Any], is_multi_worker: Callable[[Any], bool]
) -> Callable[..., Any]:
    @functools.wraps(original)
    def reduce_per_replica(values: Any, strategy: Any, reduction: str) -> Any:
        if reduction not in ("auto", "mean") or not is_multi_worker(strategy):
            return original(values, strategy, reduction)
        import tensorflow as tf

        def one(value: Any) -> Any:
            first = strategy.experimental_local_results(value)[0]
            if getattr(first, "shape", None) is not None and first.shape.rank == 0:
                return strategy.reduce("MEAN", value, axis=None)
            return original(value, strategy, reduction)

        return tf.nest.map_structure(one, values)

    reduce_per_replica.keras_tfr_fix = True  # type: ignore[attr-defined]
    return reduce_per_replica
