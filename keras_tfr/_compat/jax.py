"""The private JAX API keras-tfr uses, behind one accessor.

* ``jax._src.xla_bridge`` (``backends_are_initialized()``, or ``_backends`` in older
  JAX): whether JAX has created its backends, after which XLA no longer reads the
  memory variables that `keras_tfr.limit_gpu_memory` sets (`keras_tfr.gpu`).

Listed in `keras_tfr._compat.PRIVATE_APIS` and checked by ``tests/test_compat.py``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["backends_started"]


def backends_started() -> bool | None:
    """Whether JAX created its backends; None when the private API is not found."""
    try:
        from jax._src import xla_bridge
    except ImportError:
        return None
    started = getattr(xla_bridge, "backends_are_initialized", None)
    if started is not None:
        return bool(started())
    backends: Any = getattr(xla_bridge, "_backends", None)
    return bool(backends)
