"""The private keras-tuner APIs that ``keras-tfr tune`` patches in its child processes.

keras-tuner's distributed mode (keras-tuner 1.4, read from its source) needs two changes
to run well on one machine; neither has a public hook:

* ``keras_tuner.src.engine.base_tuner.BaseTuner.__init__(..., overwrite=...)``:
  ``overwrite=True`` makes every process delete the project directory when its tuner is
  built, so a late worker could delete trials of the others. The patch keeps
  ``overwrite`` for the chief only, and reports each built tuner (its project directory
  and objective) to the launcher.
* ``keras_tuner.src.distribute.oracle_chief.time``: the chief checks every 20 s whether
  the search is over; the patch shortens its sleeps to `CHIEF_POLL_S`.

keras-tuner is not imported up front: the user's script may choose the Keras backend
(``KERAS_BACKEND``) before it imports Keras. The patches run right after keras-tuner's
own import of these modules (`install_child_patches`). Listed in
`keras_tfr._compat.PRIVATE_APIS` and checked by ``tests/test_compat.py``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import logging
import sys
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["BASE_TUNER_MODULE", "CHIEF_POLL_S", "ORACLE_CHIEF_MODULE", "install_child_patches"]

log = logging.getLogger("keras_tfr")

BASE_TUNER_MODULE = "keras_tuner.src.engine.base_tuner"
ORACLE_CHIEF_MODULE = "keras_tuner.src.distribute.oracle_chief"
CHIEF_POLL_S = 0.5


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs a function on a module right after it is imported (by the user's script)."""

    def __init__(self, patches: dict[str, Callable[[Any], None]]):
        self._patches = patches

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = self._patches.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        loader: Any = spec.loader  # its exec_module is replaced on this one instance
        original_exec = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original_exec(module)
            try:
                patch(module)
            except Exception as e:  # keep the search running on another keras-tuner
                log.warning("keras-tfr tune: could not hook keras-tuner (%s): %s", name, e)

        loader.exec_module = exec_module
        return spec


def patch_base_tuner(
    module: Any, is_worker: Callable[[], bool], on_built: Callable[[Any], None]
) -> None:
    """Wraps ``module.BaseTuner.__init__``: no ``overwrite`` on workers, then ``on_built``."""
    cls = module.BaseTuner
    original_init = cls.__init__
    signature = inspect.signature(original_init)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if is_worker():
            # Only the chief may start the project afresh: a worker built later would
            # delete the trials the others are running.
            bound = signature.bind_partial(self, *args, **kwargs)
            if bound.arguments.get("overwrite"):
                bound.arguments["overwrite"] = False
                args, kwargs = bound.args[1:], bound.kwargs
        original_init(self, *args, **kwargs)
        on_built(self)

    __init__.__wrapped__ = original_init  # type: ignore[attr-defined]
    cls.__init__ = __init__


class _ShortSleep:
    """`time` for keras-tuner's chief loop, whose 20 s waits delay the end of a search."""

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        time.sleep(min(seconds, CHIEF_POLL_S))


def patch_oracle_chief(module: Any) -> None:
    """Shortens the sleeps of keras-tuner's chief loop to `CHIEF_POLL_S`."""
    if getattr(module, "time", None) is time:
        module.time = _ShortSleep()


def install_child_patches(is_worker: Callable[[], bool], on_built: Callable[[Any], None]) -> None:
    """Patches keras-tuner's two modules when (and if) this process imports them."""
    sys.meta_path.insert(
        0,
        _PatchAfterImport(
            {
                BASE_TUNER_MODULE: lambda m: patch_base_tuner(m, is_worker, on_built),
                ORACLE_CHIEF_MODULE: patch_oracle_chief,
            }
        ),
    )
