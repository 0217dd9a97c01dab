"""`TFRecordHyperModel` and `rebatch`: the trial's batch size applied to keras-tfr sources.

`TFRecordHyperModel`, a ready `keras_tuner.HyperModel`: the user writes only
``build(hp)``. Its ``fit`` re-batches a `TFRecordSequenceSource` (train and
``validation_data``) with the trial's ``batch_size`` (and optionally the shuffle's memory
budget) through `TFRecordSequenceSource.replace`, which reuses the manifest in memory.
keras-tuner's documented way, ``model.fit(..., batch_size=hp.Choice(...))``, does nothing
for a `tf.data.Dataset`; this makes it work. `rebatch` is the same step as a function,
for a ``fit`` of your own. keras-tuner is imported when the class is first used.
"""

from __future__ import annotations

import logging
import operator
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["TFRecordHyperModel", "rebatch"]  # noqa: F822 (built on first use, __getattr__)


# --------------------------------------------------------------------------- re-batching


def _is_source(data: Any) -> bool:
    if "keras_tfr.source" not in sys.modules:
        return False  # nothing can be a source before the module was imported
    from keras_tfr.source import TFRecordSequenceSource

    return isinstance(data, TFRecordSequenceSource)


def _check_batch_size(value: Any, argument: str = "batch_size") -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise TypeError(
            f"Expected `{argument}` to be a positive int. Received: {value!r}"
        ) from None
    if value < 1:
        raise ValueError(f"Expected `{argument}` to be a positive int. Received: {value}")
    return value


def _is_dataset(data: Any) -> bool:
    """A `tf.data.Dataset` (or anything that iterates batches of its own, as
    ``keras.utils.PyDataset``), not arrays."""
    return hasattr(data, "element_spec") or hasattr(data, "num_batches")


def rebatch(
    data: Any,
    batch_size: int | None = None,
    *,
    shuffle_memory: int | str | None = None,
) -> Any:
    """A copy of a `TFRecordSequenceSource` with another batch size or shuffle budget.

    The copy is built from the manifest already in memory (no file is read). Anything
    that is not a source (arrays, a plain `tf.data.Dataset`, None) is returned as is.

    Args:
        data: a `TFRecordSequenceSource` or anything else ``model.fit`` takes.
        batch_size: the new batch size, or None to keep it.
        shuffle_memory: the new shuffle memory budget (``"64MB"`` or bytes), or None.

    Returns:
        The re-batched source, ``data`` itself when nothing changes or it is not a source.

    Example:
        >>> def fit(self, hp, model, x, *args, **kwargs):
        ...     x = rebatch(x, hp.Choice("batch_size", [32, 128]))
        ...     return model.fit(x, *args, **kwargs)
    """
    if batch_size is not None:
        batch_size = _check_batch_size(batch_size)
    if shuffle_memory is not None:
        from keras_tfr.manifest import parse_size

        parse_size(shuffle_memory, argument="shuffle_memory")
    if not _is_source(data):
        return data
    changes: dict[str, Any] = {}
    if batch_size is not None and batch_size != data.batch_size:
        changes["batch_size"] = batch_size
    if shuffle_memory is not None and shuffle_memory != data.config.shuffle_memory:
        changes["shuffle_memory"] = shuffle_memory
    return data.replace(**changes) if changes else data


def _own_copy(given: Any, rebatched: Any) -> Any:
    """A trial's own copy of a source: `rebatch` returns ``given`` itself when nothing
    changes, whose epochs the trials would then share and advance (a trial at the
    source's batch size read on from the last one's epochs, another from epoch 0)."""
    return given.replace() if rebatched is given else rebatched


# --------------------------------------------------------------------------- HyperModel

_HP_BATCH = "batch_size"
_HP_SHUFFLE = "shuffle_memory"


def _check_choices(value: Any, argument: str, check_one: Callable[[Any], Any]) -> Any:
    """None, a fixed value, a callable ``hp -> value`` or a non-empty list of choices."""
    if value is None or callable(value):
        return value
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"Expected `{argument}` to list at least one value. Received: []")
        for v in value:
            check_one(v)
        if len({type(v) for v in value}) > 1:
            raise TypeError(
                f"Expected the values of `{argument}` to have one type (keras-tuner's "
                f"`hp.Choice` needs it). Received: {value!r}"
            )
        return list(value)
    check_one(value)
    return value


def _check_shuffle_memory(value: Any) -> Any:
    from keras_tfr.manifest import parse_size

    parse_size(value, argument="shuffle_memory")
    return value


def _resolve(hp: Any, name: str, spec: Any) -> Any:
    if spec is None:
        return hp.values.get(name) if hasattr(hp, "values") else None
    if callable(spec):
        return spec(hp)
    if isinstance(spec, list):
        return hp.Choice(name, spec)
    return spec


class _HyperModelMixin:
    """The part of `TFRecordHyperModel` that does not need keras-tuner at import time."""

    def _init_tfr(self, build: Callable | None, batch_size: Any, shuffle_memory: Any) -> None:
        if build is not None and not callable(build):
            raise TypeError(
                f"Expected `build` to be a callable `build(hp) -> keras.Model`. Received: {build!r}"
            )
        self._build_fn = build
        self.batch_size = _check_choices(batch_size, "batch_size", _check_batch_size)
        self.shuffle_memory = _check_choices(
            shuffle_memory, "shuffle_memory", _check_shuffle_memory
        )

    def _warn_overridden(self, hp: Any, batch_size: Any) -> None:
        """``batch_size`` given to ``fit`` (``tuner.search(..., batch_size=k)``) where the
        trial holds another ``"batch_size"`` hyperparameter: it trains with ``k`` while
        the tuner records the other. Logged once per hypermodel."""
        recorded = hp.values.get(_HP_BATCH) if hasattr(hp, "values") else None
        if recorded is None or recorded == batch_size or getattr(self, "_override_warned", 0):
            return
        self._override_warned = True
        logging.getLogger("keras_tfr").warning(
            "keras-tfr: batch_size=%s given to fit (tuner.search(..., batch_size=...)) "
            "overrides the trial's batch_size hyperparameter (%s): the trials train with "
            "%s, while the tuner records and reports %s. Leave batch_size out of "
            "search() to tune it.",
            batch_size,
            recorded,
            batch_size,
            recorded,
        )

    def build(self, hp: Any) -> Any:
        """Builds the model for ``hp``: override it, or pass ``build`` to the constructor."""
        if self._build_fn is None:
            raise NotImplementedError(
                "TFRecordHyperModel needs a model: override `build(self, hp)` or pass "
                "`build=` to the constructor."
            )
        return self._build_fn(hp)

    def declare_hyperparameters(self, hp: Any) -> None:
        # Declared before the first build, so every tuner (GridSearch included) sees
        # them in its search space from the first trial on.
        for name, spec in ((_HP_BATCH, self.batch_size), (_HP_SHUFFLE, self.shuffle_memory)):
            if isinstance(spec, list):
                hp.Choice(name, spec)
            elif callable(spec):
                spec(hp)

    def fit(
        self,
        hp: Any,
        model: Any,
        x: Any = None,
        *args: Any,
        validation_data: Any = None,
        batch_size: int | None = None,
        validation_batch_size: int | None = None,
        **kwargs: Any,
    ) -> Any:
        """Trains ``model`` on ``x`` re-batched with the trial's values.

        The batch size is, in this order: ``batch_size`` given here (e.g. by a subclass's
        ``super().fit(..., batch_size=hp.Choice(...))``), the constructor's
        ``batch_size``, a ``"batch_size"`` hyperparameter declared in ``build``, or the
        source's own. ``validation_data`` that is a source gets ``validation_batch_size``
        or else the same batch size, as ``model.fit`` does for arrays. Arrays and other
        data are passed to ``model.fit`` with ``batch_size`` unchanged.

        Returns:
            The `History` of ``model.fit``.
        """
        # The previous trial's model and pipelines are garbage by now (keras-tuner clears
        # the Keras session before each build): hand their memory back to the system.
        _release_memory()
        if batch_size is None:
            batch_size = _resolve(hp, _HP_BATCH, self.batch_size)
        else:
            self._warn_overridden(hp, batch_size)
        shuffle_memory = _resolve(hp, _HP_SHUFFLE, self.shuffle_memory)
        if _is_source(x):
            x = _own_copy(x, rebatch(x, batch_size, shuffle_memory=shuffle_memory))
        elif batch_size is not None:
            kwargs["batch_size"] = _check_batch_size(batch_size)
            if _is_dataset(x) and not getattr(self, "_batch_warned", False):
                self._batch_warned = True
                logging.getLogger("keras_tfr").warning(
                    "keras-tfr: TFRecordHyperModel got a %s, not a TFRecordSequenceSource: "
                    "a data set brings its own batches and Keras ignores batch_size=%s, so "
                    "the trials' batch_size has no effect on training. Give it a "
                    "TFRecordSequenceSource (or arrays).",
                    type(x).__name__,
                    batch_size,
                )
        if _is_source(validation_data):
            validation_data = _own_copy(
                validation_data, rebatch(validation_data, validation_batch_size or batch_size)
            )
        elif validation_batch_size is not None:
            kwargs["validation_batch_size"] = validation_batch_size
        history = model.fit(x, *args, validation_data=validation_data, **kwargs)
        # Drop this trial's pipelines now rather than with the next trial's model; the
        # tuner itself clears the Keras session before each build.
        del x, validation_data
        return history


def _release_memory() -> None:
    """Collects garbage and returns freed heap pages to the system (glibc only).

    Without ``malloc_trim`` the memory of a finished trial's pipelines (shuffle buffers,
    decoded pools, freed by tf.data's threads in their own malloc arenas) stays in the
    process, counted in its RSS, until glibc happens to reuse it.
    """
    import gc

    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass


_HYPERMODEL_CLASS: type | None = None


def _hypermodel_class() -> type:
    """Builds `TFRecordHyperModel` on first use, so importing this module stays light."""
    global _HYPERMODEL_CLASS
    if _HYPERMODEL_CLASS is not None:
        return _HYPERMODEL_CLASS
    import keras_tuner

    class TFRecordHyperModel(_HyperModelMixin, keras_tuner.HyperModel):
        """A `keras_tuner.HyperModel` that tunes the batch size of keras-tfr sources.

        Write only ``build(hp)`` (subclass, or pass the function). ``fit`` re-batches a
        `TFRecordSequenceSource` given to ``tuner.search`` (and its ``validation_data``)
        with the trial's batch size and shuffle memory budget; the copies reuse the
        manifest in memory and are dropped after the trial. With arrays it passes the
        batch size to ``model.fit`` instead.

        Args:
            build: ``build(hp) -> keras.Model``, when not subclassing.
            batch_size: a list of choices (the hyperparameter ``"batch_size"``, declared
                before the first trial so every tuner sees it), a fixed int, a function
                ``hp -> int`` (e.g. ``lambda hp: hp.Int("batch_size", 32, 512,
                sampling="log")``) or None (a ``"batch_size"`` declared in ``build``, or
                the source's own).
            shuffle_memory: the same for the shuffle's memory budget (``"64MB"`` or
                bytes; the hyperparameter ``"shuffle_memory"``).
            name: the hypermodel's name.
            tunable: as for `keras_tuner.HyperModel`.

        Example:
            >>> class MyHyperModel(TFRecordHyperModel):
            ...     def build(self, hp):
            ...         model = keras.Sequential([keras.layers.Dense(hp.Int("units", 8, 64)),
            ...                                   keras.layers.Dense(1)])
            ...         model.compile("adam", "mse")
            ...         return model
            >>> tuner = keras_tuner.Hyperband(MyHyperModel(batch_size=[32, 128, 512]),
            ...                               objective="val_loss", max_epochs=8)
            >>> tuner.search(train_source, validation_data=val_source)
        """

        def __init__(
            self,
            build: Callable | None = None,
            *,
            batch_size: int | Sequence[int] | Callable | None = None,
            shuffle_memory: int | str | Sequence[int | str] | Callable | None = None,
            name: str | None = None,
            tunable: bool = True,
        ):
            self._init_tfr(build, batch_size, shuffle_memory)
            keras_tuner.HyperModel.__init__(self, name=name, tunable=tunable)

    TFRecordHyperModel.__module__ = "keras_tfr.tuner"  # its public home
    TFRecordHyperModel.__qualname__ = "TFRecordHyperModel"
    _HYPERMODEL_CLASS = TFRecordHyperModel
    return TFRecordHyperModel


def __getattr__(name: str) -> Any:
    if name == "TFRecordHyperModel":
        cls = _hypermodel_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
