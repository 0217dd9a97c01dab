"""Keras' shuffle warning, off for keras-tfr sources: the private Keras APIs it needs.

The names below are in `keras_tfr._compat.PRIVATE_APIS`, with the Keras versions they
were verified on (`KERAS_VERIFIED`). Outside that range nothing private is touched (the
filter is simply off), and ``tests/test_compat.py`` fails loudly, naming the API, when
the installed Keras is outside the range or the API has moved (`check_private_api`), so
that a Keras upgrade is re-verified here rather than discovered by users.

Private APIs used:

* ``keras.src.trainers.epoch_iterator.EpochIterator.__init__(self, x, y=None,
  sample_weight=None, batch_size=None, steps_per_epoch=None, shuffle=False, ...)``: every
  backend's trainer (``TFEpochIterator``, ``JAXEpochIterator``, ``TorchEpochIterator``
  call it through ``super().__init__``) builds one per ``fit``/``evaluate``/``predict``
  call, and it passes ``shuffle`` on to
* ``keras.src.trainers.data_adapters.get_data_adapter(x, ..., shuffle=...)``, which in
  Keras 3.15 warns ("`shuffle=True` was passed, but will be ignored since the data `x`
  was provided as a tf.data.Dataset", ``stacklevel=2``) whenever ``shuffle`` is true and
  ``x`` is a `tf.data.Dataset`. ``fit``'s default ``shuffle=True`` makes that happen on
  every ``fit`` with a `TFRecordSequenceSource`, although the source shuffles itself (its
  own ``shuffle=`` and ``seed=`` arguments); for a `tf.data.Dataset` the flag has no
  other effect in the verified versions.

The same wrapper logs a warning (once per source) when ``fit``, ``evaluate`` or
``predict`` is given a ``batch_size`` other than the source's (Keras ignores it for a data
set), and when ``predict`` reads a source that
shuffles: Keras' trainers (TensorFlow, JAX, torch) build ``predict``'s iterator without
``y=``, ``fit``'s and ``evaluate``'s with it, so an iterator made without ``y`` is
``predict``'s. Its predictions follow the source's shuffled order, where ``predict`` on
arrays keeps theirs; and with ``drop_remainder=True``, a partial last batch's samples
get none (a warning says how many are read). Only ``fit``'s training iterator is given
``class_weight=`` (its validation iterator and ``evaluate``'s are not): where ``fit``'s
``shuffle`` asks for another order than the source's own ``shuffle`` gives
(``shuffle=True``, the default, on a source made with ``shuffle=False``, or
``shuffle=False`` on one that shuffles), a warning says which order is read and how to
get the other.

An iterator made for a source, or for a data set made from sources (``source.map(f)``,
``.take``, ``.repeat()``, Keras' ``class_weight`` map; found through tf.data's
``DatasetV2._inputs``), is marked with them (``SOURCE_OF_ITERATOR``), for
`keras_tfr._compat.keras_build`.

The other data sets keras-tfr returns that shuffle themselves (`from_tfrecords`'s,
`distribute_source`'s, `keras_distribution_source`'s when it cuts the batches) carry a
mark (`mark_self_shuffling`), and get the same ``shuffle=False`` without the other
warnings.

``EpochIterator.__init__`` is wrapped rather than ``get_data_adapter`` so that, for any
other data, Keras' warning still points where it did (``stacklevel=2`` names the frame
that called ``get_data_adapter``: Keras' own ``__init__``, not a keras-tfr wrapper).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import logging
import sys
import threading
from typing import Any

__all__ = [
    "KERAS_VERIFIED",
    "check_private_api",
    "install_shuffle_warning_filter",
    "keras_version_verified",
    "mark_self_shuffling",
]

log = logging.getLogger("keras_tfr")

# [low, high): the Keras (major, minor) versions the private APIs above were verified on.
# Widen it only after `pytest tests/test_compat.py tests/test_quiet.py` passed on it.
KERAS_VERIFIED: tuple[tuple[int, int], tuple[int, int]] = ((3, 15), (3, 16))

# The private names, in one place (the test checks each of them).
EPOCH_ITERATOR_MODULE = "keras.src.trainers.epoch_iterator"
EPOCH_ITERATOR = "EpochIterator"
DATA_ADAPTERS_MODULE = "keras.src.trainers.data_adapters"
GET_DATA_ADAPTER = "get_data_adapter"
SHUFFLE_WARNING = "`shuffle=True` was passed, but will be ignored since the data `x` was provided"

_MARK = "_keras_tfr_shuffle_filter"
SOURCE_OF_ITERATOR = "_keras_tfr_sources"  # on an EpochIterator: the sources it reads
_SHUFFLES_ITSELF = "_keras_tfr_shuffles_itself"
_lock = threading.Lock()


def _version_tuple(version: str) -> tuple[int, int]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit()) or "0"
        parts.append(int(digits))
    while len(parts) < 2:
        parts.append(0)
    return parts[0], parts[1]


def keras_version_verified(version: str | None = None) -> bool:
    """Whether a Keras version (default: the installed one) is in `KERAS_VERIFIED`.

    Args:
        version: a Keras version string such as ``"3.15.1"``; ``None`` reads the
            installed ``keras.__version__``.

    Returns:
        True when ``KERAS_VERIFIED[0] <= (major, minor) < KERAS_VERIFIED[1]``.

    Example:
        >>> keras_version_verified("3.15.1")
        True
    """
    if version is None:
        import keras

        version = str(keras.__version__)
    low, high = KERAS_VERIFIED
    return low <= _version_tuple(version) < high


def _is_keras_tfr_source(x: Any) -> bool:
    # No import: if keras_tfr.source was never imported, `x` cannot be one of its sources.
    source = sys.modules.get("keras_tfr.source")
    return source is not None and isinstance(x, source.TFRecordSequenceSource)


def sources_within(x: Any, limit: int = 10_000) -> list[Any]:
    """The `TFRecordSequenceSource` objects ``x`` reads: ``x`` itself, or those inside a
    data set made from sources (``source.map(f)``, ``.take``, ``.repeat()``, ``zip``,
    Keras' own ``class_weight`` map), found through tf.data's input data sets (at most
    ``limit`` data sets are looked at)."""
    module = sys.modules.get("keras_tfr.source")
    if module is None:  # never imported: `x` holds none of its sources
        return []
    from keras_tfr._compat.tf import dataset_inputs

    found: list[Any] = []
    seen: set[int] = set()
    todo = [x]
    while todo and len(seen) < limit:
        d = todo.pop()
        if id(d) in seen:
            continue
        seen.add(id(d))
        if isinstance(d, module.TFRecordSequenceSource):
            found.append(d)
        else:
            todo.extend(dataset_inputs(d))
    return found


def _shuffles_itself(x: Any) -> bool:
    return bool(getattr(x, _SHUFFLES_ITSELF, False))


def mark_self_shuffling(dataset: Any) -> Any:
    """Marks a data set of keras-tfr's that shuffles itself by its own arguments (and is
    not a `TFRecordSequenceSource`) so that Keras' shuffle warning is off for it too;
    installs the filter. Returns ``dataset``.

    Example:
        >>> ds = mark_self_shuffling(tf.data.Dataset.range(4).shuffle(4))
    """
    try:
        setattr(dataset, _SHUFFLES_ITSELF, True)
    except AttributeError:  # an object that takes no attributes: Keras warns as before
        return dataset
    install_shuffle_warning_filter()
    return dataset


def install_shuffle_warning_filter() -> bool:
    """Stops Keras' "`shuffle=True` ... will be ignored" warning for keras-tfr sources only.

    ``fit`` defaults to ``shuffle=True``, and Keras 3.15 warns on every ``fit`` with a
    `tf.data.Dataset` that this flag is ignored. A `TFRecordSequenceSource` shuffles by its
    own ``shuffle=`` and ``seed=`` arguments, so for it the warning is wrong; for any other
    data set (a user's own `tf.data.Dataset` included, and a source after ``.map`` or
    ``.repeat``, which is no longer a source) Keras is called unchanged and still warns.

    It wraps the private ``keras.src.trainers.epoch_iterator.EpochIterator.__init__``
    (see the module docstring) so that, when ``x`` is a `TFRecordSequenceSource`, Keras
    gets ``shuffle=False``. Idempotent and thread-safe; a no-op (returns False) when the
    installed Keras is outside `KERAS_VERIFIED` or the API is not where it was.

    Returns:
        True when the filter is in place (now or from an earlier call).

    Example:
        >>> from keras_tfr._compat import keras_shuffle
        >>> keras_shuffle.install_shuffle_warning_filter()
        True
    """
    with _lock:
        try:
            verified = keras_version_verified()
        except ImportError:  # no Keras: nothing to quiet
            return False
        if not verified:
            log.debug("keras-tfr: Keras outside %s; Keras' shuffle warning left on", KERAS_VERIFIED)
            return False
        try:
            iterator_class = getattr(importlib.import_module(EPOCH_ITERATOR_MODULE), EPOCH_ITERATOR)
            original = iterator_class.__init__
            signature = inspect.signature(original)
        except (ImportError, AttributeError, TypeError, ValueError) as e:  # the API moved
            log.debug("keras-tfr: %s.%s not found (%s)", EPOCH_ITERATOR_MODULE, EPOCH_ITERATOR, e)
            return False
        if getattr(original, _MARK, False):
            return True
        if not {"self", "x", "shuffle"} <= set(signature.parameters):
            return False

        @functools.wraps(original)
        def __init__(*args: Any, **kwargs: Any) -> None:
            bound = signature.bind(*args, **kwargs)
            x = bound.arguments.get("x")
            if _is_keras_tfr_source(x):
                if "class_weight" in bound.arguments:  # only `fit`'s training iterator
                    _warn_fit_order(x, bound.arguments.get("shuffle", True))
                if bound.arguments.get("shuffle"):
                    # The source shuffles itself; for a tf.data.Dataset Keras' `shuffle`
                    # only warns.
                    bound.arguments["shuffle"] = False
                if "y" not in bound.arguments:  # `predict`: fit and evaluate pass y=
                    _warn_shuffled_predict(x)
                    _warn_dropped_predictions(x)
                _warn_ignored_batch_size(x, bound.arguments.get("batch_size"))
            elif bound.arguments.get("shuffle") and _shuffles_itself(x):
                bound.arguments["shuffle"] = False
            original(*bound.args, **bound.kwargs)
            # The sources this iterator reads (the source itself, or those inside a data
            # set made from sources), for `keras_build`'s hook.
            sources = sources_within(x)
            if sources:
                setattr(bound.arguments["self"], SOURCE_OF_ITERATOR, tuple(sources))

        setattr(__init__, _MARK, True)
        iterator_class.__init__ = __init__
        return True


def _warn_once(source: Any, flag: str, message: str, *args: Any) -> None:
    """Logs ``message`` for ``source`` unless it was logged for it already."""
    if getattr(source, flag, False):
        return
    setattr(source, flag, True)
    log.warning(message, *args)


def _warn_shuffled_predict(source: Any) -> None:
    """``model.predict(source)`` on a source that shuffles: its predictions come in that
    epoch's shuffled order, where ``predict`` on arrays keeps their order. Logged once per
    source."""
    if not source._cfg.shuffle:
        return
    _warn_once(
        source,
        "_predict_warned",
        "keras-tfr: predict reads %s with shuffle=True, so the predictions come in a "
        "shuffled order (a new one on each call), not in the order the samples were "
        "written. For predictions in written order, give predict a source made with "
        "shuffle=False (source.replace(shuffle=False)).",
        source._cfg.directory,
    )


def _warn_dropped_predictions(source: Any) -> None:
    """``model.predict(source)`` on a source made with ``drop_remainder=True`` whose last
    batch is partial: that batch is not read, so fewer predictions come back than the
    source holds samples (``predict`` on arrays keeps every row). Logged once per source."""
    cfg = source._cfg
    if not cfg.drop_remainder:
        return
    read = (source.steps - source._pad_batches) * cfg.batch_size
    if read >= source.num_samples:
        return
    _warn_once(
        source,
        "_dropped_predict_warned",
        "keras-tfr: predict reads %d of the %d samples of %s: it was made with "
        "drop_remainder=True, which leaves out the last, partial batch. For a prediction "
        "of every sample, give predict source.replace(drop_remainder=False).",
        read,
        source.num_samples,
        cfg.directory,
    )


def _warn_fit_order(source: Any, shuffle: Any) -> None:
    """``fit(source, shuffle=...)``: Keras neither shuffles nor unshuffles a data set, so
    the source's own ``shuffle`` decides the order. Said once per source where ``fit``'s
    asks for the other one: ``shuffle=True`` (fit's default) on a source that reads in
    written order, or ``shuffle=False`` on one that shuffles."""
    if bool(shuffle) and not source._cfg.shuffle:
        _warn_once(
            source,
            "_fit_order_warned",
            "keras-tfr: fit reads %s in written order, the same order every epoch: the "
            "source was made with shuffle=False, and fit's shuffle=True does not shuffle a "
            "data set. For a new order each epoch, give fit source.replace(shuffle=True); "
            "to train in written order, pass fit(..., shuffle=False), which also silences "
            "this warning.",
            source._cfg.directory,
        )
    elif not shuffle and source._cfg.shuffle:
        _warn_once(
            source,
            "_fit_order_warned",
            "keras-tfr: fit(shuffle=False) does not change the order of %s: the source "
            "shuffles its samples itself (it was made with shuffle=True), a new order each "
            "epoch, and fit's shuffle does not reach a data set. To train in written "
            "order, give fit source.replace(shuffle=False).",
            source._cfg.directory,
        )


def _warn_ignored_batch_size(source: Any, batch_size: Any) -> None:
    """``fit(source, batch_size=k)``: Keras ignores ``batch_size`` for a data set, so the
    source's own batches are read; said once per source when ``k`` differs from them."""
    if batch_size is None or batch_size == source._cfg.batch_size:
        return
    _warn_once(
        source,
        "_batch_size_warned",
        "keras-tfr: batch_size=%s is ignored for a data set: %s reads batches of %d (its "
        "own batch_size). For batches of %s, give Keras source.with_batch_size(%s).",
        batch_size,
        source._cfg.directory,
        source._cfg.batch_size,
        batch_size,
        batch_size,
    )


def check_private_api() -> list[str]:
    """What moved in the installed Keras, as readable lines (empty when all is in place).

    Checks that the Keras version is verified, that ``EpochIterator.__init__`` takes
    ``(self, x, ..., shuffle)`` and hands ``shuffle`` to ``get_data_adapter``, which
    takes ``x`` and ``shuffle``.
    """
    import keras

    problems = []
    if not keras_version_verified():
        low, high = KERAS_VERIFIED
        problems.append(
            f"Keras {keras.__version__} is outside the range keras_tfr/_compat/keras_shuffle.py "
            f"was verified on ({low} to {high}, exclusive): check each private API its "
            "docstring lists, then widen KERAS_VERIFIED."
        )
    try:
        iterator_class = getattr(importlib.import_module(EPOCH_ITERATOR_MODULE), EPOCH_ITERATOR)
        adapters = importlib.import_module(DATA_ADAPTERS_MODULE)
        get_data_adapter = getattr(adapters, GET_DATA_ADAPTER)
    except (ImportError, AttributeError) as e:
        return [*problems, f"{EPOCH_ITERATOR_MODULE}.{EPOCH_ITERATOR} or {GET_DATA_ADAPTER}: {e}"]
    init = iterator_class.__init__
    if getattr(init, _MARK, False):
        init = init.__wrapped__
    params = list(inspect.signature(init).parameters)
    if params[:2] != ["self", "x"] or "shuffle" not in params:
        problems.append(f"{EPOCH_ITERATOR_MODULE}.EpochIterator.__init__ changed: {params}")
    body = inspect.getsource(init)
    if f"{GET_DATA_ADAPTER}(" not in body or "shuffle=shuffle" not in body:
        problems.append(
            f"{EPOCH_ITERATOR_MODULE}.EpochIterator.__init__ no longer passes `shuffle` to "
            f"{GET_DATA_ADAPTER}"
        )
    if not {"x", "shuffle"} <= set(inspect.signature(get_data_adapter).parameters):
        problems.append(f"{DATA_ADAPTERS_MODULE}.{GET_DATA_ADAPTER} lost `x` or `shuffle`")
    problems += _check_fit_alone_passes_class_weight()
    return problems


def _check_fit_alone_passes_class_weight() -> list[str]:
    """`_warn_fit_order` tells ``fit``'s training iterator by its ``class_weight=``: the
    trainers installed must pass it in ``fit`` and not in ``evaluate`` or ``predict``."""
    problems = []
    for module, name, needs in [
        ("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer", "tensorflow"),
        ("keras.src.backend.jax.trainer", "JAXTrainer", "jax"),
        ("keras.src.backend.torch.trainer", "TorchTrainer", "torch"),
    ]:
        if importlib.util.find_spec(needs) is None:
            continue
        try:
            trainer = getattr(importlib.import_module(module), name)
            fit, evaluate, predict = (
                inspect.getsource(inspect.unwrap(getattr(trainer, f)))
                for f in ("fit", "evaluate", "predict")
            )
        except (ImportError, AttributeError, OSError, TypeError) as e:
            problems.append(f"{module}.{name}: {e}")
            continue
        if "class_weight=class_weight" not in fit or any(
            "class_weight" in body for body in (evaluate, predict)
        ):
            problems.append(
                f"{module}.{name}: only fit should pass class_weight= to its epoch "
                "iterator (keras_tfr._compat.keras_shuffle tells fit's iterator so)"
            )
    return problems
