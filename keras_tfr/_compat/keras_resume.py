"""Every private Keras API that keras-tfr uses, named and version-checked in one place.

Keras 3's ``fit`` has two gaps that exact mid-epoch resume (`keras_tfr.BackupAndRestore`)
must cross, and no public API crosses them:

1. A callback cannot reach the data ``fit`` reads, so it cannot tell the training
   source which epoch, and which step of it, to deliver next.
2. ``fit`` can start at an epoch (``model._initial_epoch``, itself private, is what
   Keras' own `keras.callbacks.BackupAndRestore` sets) but always starts it at step 0.
   Keras 2 had ``_initial_step`` for this; Keras 3 dropped it.

What keras-tfr uses instead (each entry of `PRIVATE_APIS`):

- ``Trainer._initial_epoch``: the epoch ``fit`` starts at, read once after
  ``on_train_begin`` (the same write Keras' own callback does).
- the local variables of the backend's ``fit`` (``self``, ``x``, ``validation_data``,
  ``epoch_iterator``, ``callbacks``), read from its stack frame while a callback's
  ``on_train_begin`` runs. Only read: nothing in that frame is changed.
- ``EpochIterator._enumerate_iterator`` and ``EpochIterator._num_batches``: for the one
  epoch that resumes at step ``k``, an attribute set on that one ``EpochIterator``
  object (not on the class) runs Keras' own loop over ``len(source) - k`` batches and
  numbers them ``k, k + 1, ...``; the attribute removes itself when that epoch's loop
  starts, so every later epoch runs Keras' code untouched.
- ``Trainer._symbolic_build(data_batch=...)``: the TensorFlow trainer creates the
  compiled metrics' variables only when it traces the first step; a resumed epoch
  restores their running totals before that, so it has Keras build them from the
  source's ``element_spec`` (what the JAX trainer does before every ``fit``).
- ``EpochIterator.steps_per_epoch``, ``EpochIterator.data_adapter`` and the adapter's
  ``get_tf_dataset()``: to check that each epoch's iterator is made from the source
  itself (no ``steps_per_epoch``, no ``class_weight`` map, no distribution wrapper).

The verified Keras range is `VERIFIED_RANGE`. Outside it `fit_context` says why, and
the callback behaves exactly like Keras' own (with a warning);
`check_private_api` lists what moved, and ``tests/test_compat.py`` fails loudly on it.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types
from typing import Any

# Inclusive lower bound, exclusive upper bound (major, minor).
VERIFIED_RANGE = ((3, 15), (3, 16))

PRIVATE_APIS = {
    "Trainer._initial_epoch": (
        "keras/src/trainers/trainer.py; read by the backend's fit() after on_train_begin"
    ),
    "fit() locals self, x, validation_data, epoch_iterator, callbacks": (
        "keras/src/backend/{tensorflow,jax,torch}/trainer.py: fit()"
    ),
    "EpochIterator._enumerate_iterator": "keras/src/trainers/epoch_iterator.py",
    "EpochIterator._num_batches": "keras/src/trainers/epoch_iterator.py",
    "EpochIterator.steps_per_epoch, .steps_per_execution, .data_adapter": (
        "keras/src/trainers/epoch_iterator.py"
    ),
    "Trainer._symbolic_build(data_batch=...)": (
        "keras/src/trainers/trainer.py; builds the compiled metrics before a resumed step"
    ),
    "TFDatasetAdapter.get_tf_dataset()": ("keras/src/trainers/data_adapters/tf_dataset_adapter.py"),
}

_FIT_LOCALS = ("self", "x", "validation_data", "epoch_iterator", "callbacks")


def keras_version() -> tuple[int, int, str]:
    import keras

    text = keras.version()
    parts = text.split(".")
    try:
        return int(parts[0]), int(parts[1]), text
    except (IndexError, ValueError):
        return 0, 0, text


def version_problem(version: tuple[int, int, str] | None = None) -> str | None:
    """None when the installed Keras is in `VERIFIED_RANGE`, else why not."""
    major, minor, text = version or keras_version()
    low, high = VERIFIED_RANGE
    if low <= (major, minor) < high:
        return None
    return (
        f"keras-tfr's mid-epoch resume was verified on Keras "
        f"{low[0]}.{low[1]}.x and relies on private Keras APIs; this is Keras {text}"
    )


@dataclasses.dataclass
class FitContext:
    """What a callback can see of the running ``fit`` (all read from its frame)."""

    model: Any
    x: Any
    validation_data: Any
    epoch_iterator: Any
    callback_list: Any

    @property
    def steps_per_epoch(self) -> int | None:
        """Batches per epoch as ``fit`` counts them (None when unknown)."""
        return self.epoch_iterator._num_batches

    @property
    def steps_per_execution(self) -> int:
        return int(getattr(self.epoch_iterator, "steps_per_execution", 1) or 1)

    def history(self) -> Any:
        """The `keras.callbacks.History` of this ``fit`` (None if there is none)."""
        from keras.callbacks import History

        for cb in getattr(self.callback_list, "callbacks", []):
            if isinstance(cb, History):
                return cb
        return None

    def iterates_source_directly(self) -> str | None:
        """None when each epoch's batches come from ``iter(x)``, else why not."""
        it = self.epoch_iterator
        if it.steps_per_epoch is not None:
            return (
                "`fit` was given `steps_per_epoch`, so Keras carries one iterator across "
                "epochs; leave `steps_per_epoch` unset to let the source define epochs"
            )
        adapter = getattr(it, "data_adapter", None)
        get = getattr(adapter, "get_tf_dataset", None)
        if get is None or get() is not self.x:
            return (
                "Keras wraps the source (`class_weight`, or a `keras.distribution`), so "
                "its iterators are not made from the source itself"
            )
        wrapped = getattr(it, "_distributed_dataset", self.x)
        if wrapped is not self.x:
            return "a `tf.distribute` strategy wraps the source"
        return None


def fit_context(model: Any) -> tuple[FitContext | None, str | None]:
    """Finds the ``fit`` call running ``model`` from inside one of its callbacks.

    Returns:
        ``(context, problem)``. ``context`` is None when no ``fit`` frame with the
        expected locals is on the stack. ``problem`` says why the private APIs must not
        be used (Keras outside `VERIFIED_RANGE`, or no ``fit`` found); the context may
        then still be read (which data ``fit`` got) but not acted on.
    """
    try:
        from keras.src.trainers.epoch_iterator import EpochIterator
    except ImportError:
        return None, "keras.src.trainers.epoch_iterator.EpochIterator is gone"

    context = None
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and context is None:
        if frame.f_code.co_name == "fit":
            local = frame.f_locals
            if local.get("self") is model and all(n in local for n in _FIT_LOCALS):
                iterator = local["epoch_iterator"]
                if isinstance(iterator, EpochIterator):
                    context = FitContext(
                        model=model,
                        x=local["x"],
                        validation_data=local["validation_data"],
                        epoch_iterator=iterator,
                        callback_list=local["callbacks"],
                    )
        frame = frame.f_back
    if context is None:
        return None, (
            "no running `model.fit` with the locals keras-tfr expects was found on the "
            "stack (Keras' `fit` changed)"
        )
    return context, version_problem()


def set_initial_epoch(model: Any, epoch: int | None) -> None:
    """The epoch the running ``fit`` starts at (read after ``on_train_begin``)."""
    model._initial_epoch = epoch


def build_metrics(model: Any, element_spec: Any) -> None:
    """Creates the compiled metrics' variables before the first training step.

    The TensorFlow trainer creates them when it traces the first step (JAX's ``fit``
    before ``on_train_begin``); a resumed epoch must set their running totals before
    that step. Keras' own ``Trainer._symbolic_build`` does it from the batch's spec.
    """
    import keras
    import tensorflow as tf

    def symbolic(spec: Any) -> Any:
        return keras.KerasTensor(tuple(spec.shape.as_list()), dtype=spec.dtype.name)

    model._symbolic_build(data_batch=tf.nest.map_structure(symbolic, element_spec))


def start_epoch_at_step(epoch_iterator: Any, step: int) -> None:
    """Makes the next epoch of ``epoch_iterator`` run steps ``step .. n - 1`` only.

    The source must deliver exactly the batches of those steps (``n - step`` of them).
    Keras' own loop runs them: ``_num_batches`` is lowered for that epoch, the steps it
    yields are renumbered from ``step`` (so callbacks and the progress bar see the real
    step numbers), and ``_num_batches`` comes back when the loop ends.
    """
    total = epoch_iterator._num_batches
    if not isinstance(total, int) or not 0 < step < total:
        raise ValueError(
            f"Expected `step` to be in [1, {total}) for a resumed epoch. Received: step={step}"
        )
    own = type(epoch_iterator)._enumerate_iterator

    def resumed(self: Any = epoch_iterator) -> Any:
        # One epoch only: the next `iter(epoch_iterator)` uses the class's method again.
        self.__dict__.pop("_enumerate_iterator", None)
        self._num_batches = total - step
        try:
            for begin, end, data in own(self):
                yield begin + step, end + step, data
        finally:
            self._num_batches = total

    epoch_iterator._enumerate_iterator = resumed


def check_private_api() -> list[str]:
    """What moved in the installed Keras, as readable lines (empty when all is in place).

    Checks the code, without running ``fit``: the attributes exist, and each backend's
    ``fit`` has the locals and reads ``_initial_epoch`` after ``on_train_begin`` and
    calls ``on_epoch_begin`` before iterating ``epoch_iterator``.
    """
    from keras.src.trainers import trainer as trainer_module
    from keras.src.trainers.data_adapters import tf_dataset_adapter
    from keras.src.trainers.epoch_iterator import EpochIterator

    problems = []
    version = version_problem()
    if version is not None:
        problems.append(version)
    build = getattr(trainer_module.Trainer, "_symbolic_build", None)
    if build is None or "data_batch" not in inspect.signature(build).parameters:
        problems.append("Trainer._symbolic_build(data_batch=...) is gone")
    init_src = inspect.getsource(trainer_module.Trainer.__init__)
    if "self._initial_epoch = None" not in init_src:
        problems.append("Trainer.__init__ no longer sets `self._initial_epoch`")
    enumerate_fn = getattr(EpochIterator, "_enumerate_iterator", None)
    if enumerate_fn is None or not inspect.isgeneratorfunction(enumerate_fn):
        problems.append("EpochIterator._enumerate_iterator is gone or not a generator")
    else:
        src = inspect.getsource(enumerate_fn)
        for needle in (
            "self.steps_per_epoch or self._num_batches",
            "self._current_iterator = iter(self._get_iterator())",
            "range(0, steps_per_epoch, self.steps_per_execution)",
        ):
            if needle not in src:
                problems.append(f"EpochIterator._enumerate_iterator lost `{needle}`")
    iter_src = inspect.getsource(EpochIterator.__iter__)
    if "self._enumerate_iterator()" not in iter_src:
        problems.append("EpochIterator.__iter__ no longer calls self._enumerate_iterator()")
    if "def get_tf_dataset" not in inspect.getsource(tf_dataset_adapter.TFDatasetAdapter):
        problems.append("TFDatasetAdapter.get_tf_dataset is gone")
    for backend in ("tensorflow", "jax", "torch"):
        problems += _check_backend_fit(backend)
    return problems


def _check_backend_fit(backend: str) -> list[str]:
    # Read from the file rather than imported: importing a backend's trainer imports
    # that backend (JAX, torch), which takes seconds or is not installed.
    import ast
    import os

    from keras.src import backend as backend_package

    path = os.path.join(os.path.dirname(backend_package.__file__), backend, "trainer.py")
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except OSError:
        return [f"{path} is gone"]
    fits = [
        node
        for cls in ast.parse(source).body
        if isinstance(cls, ast.ClassDef)
        for node in cls.body
        if isinstance(node, ast.FunctionDef) and node.name == "fit"
    ]
    if len(fits) != 1:
        return [f"{backend}: expected one Trainer.fit() in {path}, found {len(fits)}"]
    fit = fits[0]
    names = {a.arg for a in fit.args.args + fit.args.kwonlyargs}
    names |= {
        n.id for n in ast.walk(fit) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }
    problems = []
    missing = [n for n in _FIT_LOCALS if n not in names]
    if missing:
        problems.append(f"{backend} fit() lost the locals {missing}")
    text = ast.get_source_segment(source, fit) or ""
    order = [
        "callbacks.on_train_begin()",
        "self._initial_epoch or initial_epoch",
        "callbacks.on_epoch_begin(epoch)",
        "in epoch_iterator:",
    ]
    places = [text.find(s) for s in order]
    if -1 in places or places != sorted(places):
        problems.append(f"{backend} fit() no longer runs, in order: " + " ; ".join(order))
    return problems
