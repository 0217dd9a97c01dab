"""Cap a process's GPU memory, so several models can train on one GPU.

With streamed data a model needs far less GPU memory than the whole device, so one GPU
can train several models at once, each in its own process with a cap. Each framework
allows that only in its own way, and TensorFlow and JAX only before they start:

- TensorFlow: one logical device with ``memory_limit`` per physical GPU
  (``tf.config.set_logical_device_configuration``). It works only before TensorFlow
  initializes the GPU, cannot be undone, and memory TensorFlow took is never returned
  to the driver before the process ends.
- JAX: ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (and ``XLA_PYTHON_CLIENT_PREALLOCATE=false``
  for growth), read once, when JAX starts its GPU backend (the first JAX operation).
- torch: ``torch.cuda.set_per_process_memory_fraction``, which can change at any time
  and is restored when the ``with`` block ends.

The environment variables ``KERAS_TFR_GPU_MEMORY_MB`` and ``KERAS_TFR_GPU_MEMORY_FRACTION``
cap a process without code changes (this is what ``keras-tfr parallel --gpu-memory-mb``
sets for each child). ``import keras_tfr`` checks them and sets XLA's variables at once
(they need no import); the rest depends on the Keras backend, and importing TensorFlow
imports Keras, which fixes its backend for the process. So unless Keras or TensorFlow is
imported already, the cap waits for the program to import Keras or TensorFlow (or torch,
when the backend is torch) and applies right after that import, for the backend the
program chose, before any of them can start on the GPU (`_WhenImported`).

The CUDA context and the cuDNN/cuBLAS handles take memory on top of every limit here
(roughly 0.3-1 GB per process, depending on the GPU and the libraries), so leave that
much per process when you split a GPU.

Under the JAX and torch backends the data still flows through tf.data, so TensorFlow runs
in the same process, and TensorFlow reserves most of a GPU's memory as soon as it starts
on it. `keep_tensorflow_off_gpus` hides the GPUs from TensorFlow there (the remedy the
JAX docs give for tf.data next to JAX: ``tf.config.set_visible_devices([], "GPU")``);
keras-tfr calls it before it runs TensorFlow, and `limit_gpu_memory` calls it too, so
TensorFlow's share of a GPU is zero and the cap is the backend's alone. The environment
variable ``KERAS_TFR_TF_GPU=1`` lets TensorFlow keep its GPUs. With the TensorFlow backend
nothing is hidden: TensorFlow trains the model there.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.abc
import json
import logging
import math
import os
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

from keras_tfr.errors import KerasTFRError

__all__ = [
    "ENV_FRACTION",
    "ENV_MEGABYTES",
    "ENV_TF_GPU",
    "GpuMemoryError",
    "GpuMemoryLimit",
    "TensorFlowGpuWarning",
    "keep_tensorflow_off_gpus",
    "limit_gpu_memory",
]

ENV_MEGABYTES = "KERAS_TFR_GPU_MEMORY_MB"
ENV_FRACTION = "KERAS_TFR_GPU_MEMORY_FRACTION"
ENV_TF_GPU = "KERAS_TFR_TF_GPU"

_MIB = 1 << 20
_F = TypeVar("_F", bound=Callable[..., Any])

logger = logging.getLogger("keras_tfr.gpu")

_FIX = (
    "Call `limit_gpu_memory(...)` at the top of the program, before any model, tensor or "
    "data set (a TFRecordSequenceSource included) is created, or set the environment "
    f"variable {ENV_MEGABYTES} (or {ENV_FRACTION}) before the program starts and "
    "`import keras_tfr` before anything else; it applies the cap before the framework "
    "starts."
)


class GpuMemoryError(KerasTFRError, RuntimeError):
    """The framework already started on the GPU with another memory setting."""


class GpuMemoryLimit:
    """The memory cap of this process on its GPUs; made by `limit_gpu_memory`.

    Attributes:
        backend: the Keras backend the cap was applied to (``"tensorflow"``, ``"jax"``,
            ``"torch"``): ``keras.config.backend()`` when Keras is imported, else the
            backend Keras will choose (``KERAS_BACKEND``, else ``keras.json``).
        megabytes: the cap per GPU in MiB as given (``None`` with `fraction` or `growth`).
        fraction: the cap as a fraction of each GPU's total, as given.
        limit_mb: the cap in MiB as applied (from `megabytes` or `fraction`; the smallest
            over the GPUs); ``None`` with ``growth=True`` or when `fraction` could not
            be applied for lack of a GPU.
        growth: whether memory is taken on demand instead of reserved up front.
        devices: names of the capped GPUs (``["GPU:0"]``); empty when there is no GPU.
        total_mb: each capped GPU's total memory in MiB where the driver reported it.
        tensorflow_gpus: what `keep_tensorflow_off_gpus` did for this process
            (``"hidden"`` under JAX or torch: TensorFlow's share of the GPUs is zero;
            ``"tensorflow-backend"`` with the TensorFlow backend).
    """

    def __init__(
        self,
        megabytes: int | None,
        fraction: float | None,
        growth: bool,
        devices: Sequence[int] | None,
    ):
        self.megabytes = megabytes
        self.fraction = fraction
        self.growth = growth
        self.limit_mb: int | None = megabytes
        self._indices = None if devices is None else list(devices)
        self.backend = _keras_backend()
        self.devices: list[str] = []
        self.total_mb: list[int | None] = []
        self._impl: Any  # _TensorFlow, _Jax or _Torch: classes of static methods
        self._impl = {"tensorflow": _TensorFlow, "jax": _Jax, "torch": _Torch}.get(self.backend)
        if self._impl is None:
            raise ValueError(
                "limit_gpu_memory supports the Keras backends 'tensorflow', 'jax' and "
                f"'torch'. Received backend: {self.backend!r}"
            )
        self._state: Any = None
        self._recorded_peak: float | None = None
        # Under JAX or torch, TensorFlow (the data pipeline) must take no GPU memory, or
        # the cap below is not the process's budget; with TensorFlow this changes nothing.
        self.tensorflow_gpus = keep_tensorflow_off_gpus()
        self._apply()

    # -- applying and reporting ---------------------------------------------------------

    def _apply(self) -> None:
        self._state = self._impl.apply(self)
        self._recorded_peak = None
        if not self.devices:
            logger.info(
                "limit_gpu_memory: no GPU visible to %s; running without a GPU memory limit.",
                _BACKEND_NAMES[self.backend],
            )

    def _peaks(self) -> list[float]:
        if not self.devices:
            return []
        return self._impl.peaks_mb(self)

    @property
    def peak_mb(self) -> float | None:
        """The highest GPU memory use in MiB of any capped GPU (``None`` without a GPU).

        Inside the ``with`` block (or after a plain call) this is the peak so far; after
        the block it is the peak the block reached (the statistics are reset on exit).
        """
        if self._recorded_peak is not None or not self.devices:
            return self._recorded_peak
        peaks = self._peaks()
        return max(peaks) if peaks else None

    def report(self) -> str:
        """A one-line summary: backend, devices, limit, peak and device total."""
        tensorflow = (
            "" if self.backend == "tensorflow" else f"; TensorFlow GPUs: {self.tensorflow_gpus}"
        )
        if not self.devices:
            return f"limit_gpu_memory: no GPU ({self.backend}); no limit{tensorflow}"
        limit = "growth" if self.limit_mb is None else f"{self.limit_mb} MiB"
        peak = self.peak_mb
        total = ", ".join("?" if t is None else str(t) for t in self.total_mb)
        return (
            f"limit_gpu_memory: {self.backend} on {', '.join(self.devices)}: limit {limit}, "
            f"peak {'?' if peak is None else f'{peak:.0f} MiB'}, device total {total} MiB"
            f"{tensorflow}"
        )

    # -- context manager and decorator ---------------------------------------------------

    def __enter__(self) -> GpuMemoryLimit:
        if self._state is None:  # re-entered after __exit__ (torch restored its fraction)
            self._apply()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if not self.devices:
            return  # nothing was applied, nothing to report or restore
        peaks = self._peaks()
        self._recorded_peak = max(peaks) if peaks else None
        logger.info("%s", self.report())
        self._impl.reset_and_restore(self)
        self._state = None

    def __call__(self, fn: _F) -> _F:
        """Decorator: the cap applies from decoration; each call reports its peak."""
        if not callable(fn):
            raise TypeError(
                f"Expected `limit_gpu_memory(...)` to decorate a function. Received: {fn!r}"
            )

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    def __repr__(self) -> str:
        if self.growth:
            what = "growth=True"
        elif self.fraction is not None:
            what = f"fraction={self.fraction}"
        else:
            what = f"megabytes={self.megabytes}"
        return f"GpuMemoryLimit({what}, backend={self.backend!r}, devices={self.devices})"


def limit_gpu_memory(
    megabytes: int | None = None,
    *,
    fraction: float | None = None,
    growth: bool = False,
    devices: Sequence[int] | None = None,
) -> GpuMemoryLimit:
    """Caps this process's GPU memory, so several processes can share one GPU.

    Give exactly one of `megabytes`, `fraction` or `growth=True`; with none of them the
    environment variable ``KERAS_TFR_GPU_MEMORY_MB`` (or ``KERAS_TFR_GPU_MEMORY_FRACTION``)
    decides. The cap applies at once, so a plain call at the top of the program works;
    the result is also a context manager (reports the peak on exit) and a decorator.
    A call replaces a cap from the environment variable that is still waiting for
    Keras or TensorFlow to be imported.

    Backends: ``keras.config.backend()`` once Keras is imported, else the backend Keras
    will choose (``KERAS_BACKEND``, else the ``"backend"`` of ``keras.json``, else
    TensorFlow), read without importing Keras. Applying the cap imports TensorFlow
    (under JAX and torch to hide its GPUs, see below), and importing TensorFlow imports
    Keras, which fixes Keras' backend: choose the backend before calling this.

    - TensorFlow: each chosen GPU becomes one logical device with ``memory_limit``. This
      must happen before TensorFlow initializes the GPU (before any model, tensor or
      data set); if it already did with another setting, `GpuMemoryError` says so.
      **It cannot be undone**: leaving the ``with`` block does not lift the cap, and
      TensorFlow never returns memory it took to the driver before the process ends.
      A later call with `megabytes` or `fraction` replaces the limit until TensorFlow
      initializes the GPU; ``growth=True`` on a GPU that has a limit already raises
      `GpuMemoryError` (TensorFlow refuses memory growth on a GPU with a logical device
      configuration, even before it starts). On exit the peak
      (``tf.config.experimental.get_memory_info``) is logged and the statistics are
      reset.
    - JAX: sets ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (``megabytes`` becomes a fraction of
      the largest GPU) or ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` for growth, before
      JAX's first operation; `GpuMemoryError` if JAX already started with other values.
      A later call removes the variables an earlier call (or the environment variable)
      set, so ``growth=True`` leaves no fraction behind; variables set outside keras-tfr
      stay. The cap applies to every GPU JAX sees (select GPUs with
      ``CUDA_VISIBLE_DEVICES``), so `devices` is a ValueError when JAX has a GPU.
    - torch: ``torch.cuda.set_per_process_memory_fraction`` on each chosen GPU, restored
      to its previous value when the ``with`` block ends. torch always takes memory on
      demand, so ``growth=True`` only sets the fraction to 1.0 (no cap), which lifts an
      earlier cap until the block ends.
    - JAX and torch: TensorFlow, which runs the data pipeline, gets no GPU at all
      (`keep_tensorflow_off_gpus`; it imports TensorFlow when installed): TensorFlow's
      share is zero, so the cap is the backend's whole budget. ``KERAS_TFR_TF_GPU=1``
      keeps TensorFlow's GPUs (then TensorFlow's memory comes on top of the cap).

    With no GPU it does nothing (`devices` is not checked either) and logs one line, so
    the same script runs on a laptop; then `GpuMemoryLimit.devices` is empty and
    `GpuMemoryLimit.peak_mb` is ``None``.

    The CUDA context and the cuDNN/cuBLAS handles take memory beyond the cap (roughly
    0.3-1 GB per process): a GPU of T MiB fits about ``T / (cap + 1024)`` processes.

    Args:
        megabytes: the cap per GPU in MiB (2**20 bytes, as TensorFlow's
            ``memory_limit``), a positive int.
        fraction: the cap as a fraction of each GPU's total memory, in (0, 1].
        growth: take memory on demand with no cap (TensorFlow's memory growth).
            With TensorFlow it applies to every visible GPU whatever `devices` says
            (TensorFlow requires one growth setting for all visible GPUs).
        devices: indices of the GPUs to cap (``[0, 2]``); all visible GPUs by default.
            TensorFlow and torch only; with JAX select GPUs with ``CUDA_VISIBLE_DEVICES``.

    Returns:
        A `GpuMemoryLimit`, with ``devices``, ``limit_mb``, ``peak_mb`` and ``report()``.

    Raises:
        TypeError: an argument of the wrong type (``megabytes="1024"``, ``growth=1``).
        ValueError: the arguments or the environment variable are invalid.
        GpuMemoryError: the framework already started on the GPU with another setting.

    Example:

    ```python
    from keras_tfr import limit_gpu_memory

    with limit_gpu_memory(1024) as gpu:  # at the top of the program
        model = make_model()
        model.fit(source, epochs=5)
    print(gpu.peak_mb, gpu.devices)
    ```
    """
    megabytes, fraction, growth = _check_arguments(megabytes, fraction, growth, devices)
    _WhenImported.cancel()  # this call is the cap now, not the environment's waiting one
    return GpuMemoryLimit(megabytes, fraction, growth, devices)


def _check_arguments(
    megabytes: Any, fraction: Any, growth: Any, devices: Any
) -> tuple[int | None, float | None, bool]:
    if callable(megabytes):
        raise TypeError(
            "`limit_gpu_memory` needs its arguments when used as a decorator: write "
            f"`@limit_gpu_memory(1024)`, not `@limit_gpu_memory`. Received: {megabytes!r}"
        )
    if not isinstance(growth, bool):
        raise TypeError(f"Expected `growth` to be True or False. Received: {growth!r}")
    given = [
        name
        for name, value in (("megabytes", megabytes), ("fraction", fraction), ("growth", growth))
        if value is not None and value is not False
    ]
    if len(given) > 1:
        raise ValueError(
            "Expected only one of `megabytes`, `fraction` or `growth=True`. "
            f"Received: {', '.join(given)}"
        )
    if devices is not None:
        if isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence):
            raise TypeError(
                f"Expected `devices` to be a list of GPU indices like [0, 1]. Received: {devices!r}"
            )
        for d in devices:
            if isinstance(d, bool) or not isinstance(d, int) or d < 0:
                raise ValueError(
                    "Expected `devices` to hold GPU indices (ints >= 0). "
                    f"Received: {list(devices)!r}"
                )
        if len(set(devices)) != len(devices) or not devices:
            raise ValueError(
                "Expected `devices` to be a non-empty list of distinct GPU indices. "
                f"Received: {list(devices)!r}"
            )
    if not given:
        env = _from_environment()
        if env is None:
            raise ValueError(
                "Expected one of `megabytes`, `fraction` or `growth=True` (or the "
                f"environment variable {ENV_MEGABYTES} or {ENV_FRACTION}). Received none."
            )
        megabytes, fraction = env
    if megabytes is not None:
        megabytes = _check_megabytes(megabytes, argument="megabytes")
    if fraction is not None:
        fraction = _check_fraction(fraction, argument="fraction")
    return megabytes, fraction, growth


def _check_megabytes(value: Any, *, argument: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"Expected `{argument}` to be a positive int of MiB (e.g. 1024). Received: {value!r}"
        )
    if not math.isfinite(value) or value < 1 or value != int(value):
        raise ValueError(
            f"Expected `{argument}` to be a positive whole number of MiB (e.g. 1024). "
            f"Received: {value!r}"
        )
    return int(value)


def _check_fraction(value: Any, *, argument: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"Expected `{argument}` to be a float in (0, 1]. Received: {value!r}")
    if not (0.0 < float(value) <= 1.0):
        raise ValueError(f"Expected `{argument}` to be in (0, 1]. Received: {value!r}")
    return float(value)


def _from_environment() -> tuple[int | None, float | None] | None:
    """Reads ``KERAS_TFR_GPU_MEMORY_MB`` / ``_FRACTION``; ``None`` when neither is set."""
    mb = os.environ.get(ENV_MEGABYTES, "").strip()
    fr = os.environ.get(ENV_FRACTION, "").strip()
    if mb and fr:
        raise ValueError(
            f"Expected only one of the environment variables {ENV_MEGABYTES} and "
            f"{ENV_FRACTION}. Received: {ENV_MEGABYTES}={mb!r}, {ENV_FRACTION}={fr!r}"
        )
    if mb:
        try:
            value = int(mb)
        except ValueError:
            raise ValueError(
                f"Expected the environment variable {ENV_MEGABYTES} to be a whole number "
                f"of MiB (e.g. 1024). Received: {mb!r}"
            ) from None
        return _check_megabytes(value, argument=ENV_MEGABYTES), None
    if fr:
        try:
            value_f = float(fr)
        except ValueError:
            raise ValueError(
                f"Expected the environment variable {ENV_FRACTION} to be a number in (0, 1]. "
                f"Received: {fr!r}"
            ) from None
        return None, _check_fraction(value_f, argument=ENV_FRACTION)
    return None


def _limit_from_environment() -> GpuMemoryLimit | None:
    """The environment's cap; called by ``import keras_tfr`` when one is set.

    Checks the variables (ValueError at import) and sets XLA's variables whatever the
    backend (no import needed, and a program that picks JAX later is capped too). The
    rest needs the Keras backend, and importing TensorFlow imports Keras, which fixes
    that backend: so it applies now only when Keras or TensorFlow is imported already
    (or torch, and the backend is torch); otherwise right after the program imports one
    of them (`_WhenImported`). Returns the cap when it applied now, else ``None``.
    """
    env = _from_environment()
    if env is None:
        return None
    megabytes, fraction = env
    if not _jax_started():  # once started, XLA read its variables: JAX's apply decides
        totals = _jax_gpu_totals()
        if totals is not None:
            _set_jax_variables(_jax_environment(megabytes, fraction, False, totals))
    if _backend_is_settled():
        return _apply_environment_limit(megabytes, fraction)
    _WhenImported.install(megabytes, fraction)
    return None


def _backend_is_settled() -> bool:
    """Whether the environment's cap can apply now without fixing Keras' backend early:
    Keras or TensorFlow (which imports Keras) is imported, or torch is and the backend
    is torch (torch's cap needs torch only)."""
    return (
        _backend_is_fixed()
        or "tensorflow" in sys.modules
        or ("torch" in sys.modules and _keras_backend() == "torch")
    )


def _apply_environment_limit(megabytes: int | None, fraction: float | None) -> GpuMemoryLimit:
    global _ENVIRONMENT_LIMIT
    _ENVIRONMENT_LIMIT = GpuMemoryLimit(megabytes, fraction, False, None)
    return _ENVIRONMENT_LIMIT


# The cap applied from the environment, if any (None while it waits, `_WhenImported`).
_ENVIRONMENT_LIMIT: GpuMemoryLimit | None = None


class _WhenImported(importlib.abc.MetaPathFinder):
    """Applies the environment's cap right after the program imports Keras or TensorFlow.

    A `sys.meta_path` finder that wraps the loader of ``keras``, ``tensorflow`` and
    ``torch`` (the pattern of ``wrapt``'s post-import hooks: the module keeps its own
    loader). When the outermost of these imports has finished, Keras' backend is the one
    the program chose (TensorFlow imports Keras itself), and no framework has started
    on a GPU yet (that takes an operation): the cap applies then, once. After ``torch``
    alone it applies only when the backend is torch (torch's cap needs torch; the other
    backends wait for Keras or TensorFlow). A `limit_gpu_memory` call cancels it. An
    error while applying it (e.g. ``megabytes`` above a GPU's total) is raised by that
    import statement, as it was by ``import keras_tfr`` before the cap could wait.
    """

    TRIGGERS = ("keras", "tensorflow", "torch")
    _finder: _WhenImported | None = None
    _cap: tuple[int | None, float | None] | None = None
    _depth = 0
    _lock = threading.Lock()

    @classmethod
    def install(cls, megabytes: int | None, fraction: float | None) -> None:
        with cls._lock:
            cls._cap = (megabytes, fraction)
            if cls._finder is None:
                cls._finder = cls()
                sys.meta_path.insert(0, cls._finder)

    @classmethod
    def cancel(cls) -> tuple[int | None, float | None] | None:
        """Removes the finder; returns the cap that was waiting, if any."""
        with cls._lock:
            cap, cls._cap = cls._cap, None
            finder, cls._finder = cls._finder, None
            if finder is not None and finder in sys.meta_path:
                sys.meta_path.remove(finder)
            return cap

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self.TRIGGERS or _WhenImported._cap is None:
            return None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _ThenApply(spec.loader, fullname)
                return spec
        return None

    @classmethod
    def imported(cls, name: str) -> None:
        """Called when the import of `name` (one of TRIGGERS) has finished."""
        with cls._lock:
            cls._depth -= 1
            if cls._depth or cls._cap is None:
                return  # inside another of them (TensorFlow imports Keras): wait for it
        if name == "torch" and _keras_backend() != "torch":
            return
        cap = cls.cancel()
        if cap is not None:
            _apply_environment_limit(*cap)


class _ThenApply:
    """A loader that runs `loader` and then tells `_WhenImported` (wrapt's pattern)."""

    def __init__(self, loader: Any, name: str):
        self.loader = loader
        self.name = name

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ...: the loader's
        return getattr(self.loader, name)

    def create_module(self, spec: Any) -> Any:
        create = getattr(self.loader, "create_module", None)
        return None if create is None else create(spec)

    def exec_module(self, module: Any) -> None:
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self.loader
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self.loader
        with _WhenImported._lock:
            _WhenImported._depth += 1
        try:
            self.loader.exec_module(module)
        except BaseException:
            with _WhenImported._lock:
                _WhenImported._depth -= 1
            raise
        _WhenImported.imported(self.name)


# -- backends ----------------------------------------------------------------------------

_BACKEND_NAMES = {"tensorflow": "TensorFlow", "jax": "JAX", "torch": "torch"}


def _keras_backend() -> str:
    """``keras.config.backend()`` once Keras is imported, else the backend Keras will
    choose when it is (`_keras_backend_from_settings`). Never imports Keras: that would
    fix the backend before the program could choose one."""
    backend = getattr(getattr(sys.modules.get("keras"), "config", None), "backend", None)
    if callable(backend):
        return str(backend())
    return _keras_backend_from_settings()


def _backend_is_fixed() -> bool:
    """Whether Keras is imported, so that its backend can no longer change."""
    config = getattr(sys.modules.get("keras"), "config", None)
    return callable(getattr(config, "backend", None))


def _keras_backend_from_settings() -> str:
    """The backend Keras 3 chooses at import, read as ``keras/src/backend/config.py`` does.

    ``KERAS_BACKEND`` when set and not empty; else the ``"backend"`` of ``keras.json`` in
    ``$KERAS_HOME`` (when set), else in ``~/.keras`` (``/tmp/.keras`` when the home
    folder is not writable); else ``"tensorflow"``. An unreadable or invalid
    ``keras.json`` counts as empty (Keras ignores invalid JSON too).
    """
    if "KERAS_HOME" in os.environ:
        keras_dir = os.environ["KERAS_HOME"]
    else:
        base = os.path.expanduser("~")
        if not os.access(base, os.W_OK):
            base = "/tmp"
        keras_dir = os.path.join(base, ".keras")
    backend: Any = "tensorflow"
    try:
        with open(os.path.expanduser(os.path.join(keras_dir, "keras.json"))) as f:
            config = json.load(f)
    except (OSError, ValueError):
        config = {}
    if isinstance(config, dict):
        backend = config.get("backend", backend)
    if os.environ.get("KERAS_BACKEND"):
        backend = os.environ["KERAS_BACKEND"]
    return str(backend)


# -- TensorFlow off the GPUs under the other backends -------------------------------------

# What `keep_tensorflow_off_gpus` did, decided once per process (None: not yet).
_TF_GPUS: str | None = None
_TF_GPUS_LOCK = threading.Lock()


class TensorFlowGpuWarning(UserWarning):
    """TensorFlow started on the GPUs before keras-tfr could hide them (JAX/torch backend)."""


def keep_tensorflow_off_gpus() -> str:
    """Hides the GPUs from TensorFlow when Keras runs on JAX or torch.

    keras-tfr reads data with tf.data, so TensorFlow runs in the training process under
    every Keras backend. When TensorFlow starts on a GPU it reserves most of that GPU's
    memory, and the JAX or torch model beside it then runs out. Under a backend other
    than TensorFlow this calls ``tf.config.set_visible_devices([], "GPU")``, the usual
    remedy for tf.data next to JAX, before TensorFlow starts: the pipeline runs on the
    CPU (where tf.data runs anyway) and TensorFlow takes no GPU memory. With the
    TensorFlow backend it changes nothing: TensorFlow trains the model there.

    keras-tfr calls it where it starts TensorFlow's runtime (creating a
    `TFRecordSequenceSource`, reading TFRecord files with ``from_tfrecords`` or
    ``convert_tfrecords``) and in `limit_gpu_memory`; writing, ``verify`` and the tf.data
    service servers do not start that runtime. Call it yourself at the top of a program
    that runs TensorFlow operations of its own before that. The environment variable
    ``KERAS_TFR_TF_GPU=1`` (read at the first call) lets TensorFlow keep its GPUs under
    JAX and torch.

    It decides once per process: later calls return the first answer at once. If
    TensorFlow already started with its GPUs, it cannot hide them any more; the first
    call then warns once (`TensorFlowGpuWarning`) and says how to fix the call order.

    Returns:
        What it did, one of:

        - ``"hidden"``: TensorFlow's GPUs are hidden now.
        - ``"already-hidden"``: TensorFlow saw GPUs, but none was visible to it any more
          (e.g. the program called ``set_visible_devices`` itself).
        - ``"no-gpu"``: TensorFlow sees no GPU; nothing to hide.
        - ``"no-tensorflow"``: TensorFlow is not installed.
        - ``"tensorflow-backend"``: the Keras backend is TensorFlow; nothing changed.
        - ``"opted-out"``: ``KERAS_TFR_TF_GPU=1``; nothing changed.
        - ``"too-late"``: TensorFlow had already started with its GPUs (warned).

    Raises:
        ValueError: ``KERAS_TFR_TF_GPU`` is none of ``1``/``true``/``yes`` and
            ``0``/``false``/``no`` (any case), nor empty.

    Example:

    ```python
    import os
    os.environ["KERAS_BACKEND"] = "jax"

    from keras_tfr.gpu import keep_tensorflow_off_gpus

    keep_tensorflow_off_gpus()  # "hidden" on a GPU machine, before any TensorFlow op
    import tensorflow as tf
    ```
    """
    global _TF_GPUS
    decided = _TF_GPUS
    if decided is not None:  # the common case: one global read, no import
        return decided
    backend = _keras_backend()
    if backend != "tensorflow" and not _tensorflow_gpu_opt_out():
        # Import TensorFlow outside the lock: the import may apply the environment's cap
        # (`_WhenImported`), which calls this function.
        try:
            import tensorflow  # noqa: F401
        except ImportError:
            pass
    with _TF_GPUS_LOCK:
        if _TF_GPUS is None:
            result, message = _decide_tensorflow_gpus(backend)
            if message is not None:
                warnings.warn(message, TensorFlowGpuWarning, stacklevel=2)
            _TF_GPUS = result
        return _TF_GPUS


def _tensorflow_gpu_opt_out() -> bool:
    """``KERAS_TFR_TF_GPU``: true lets TensorFlow keep its GPUs under JAX and torch."""
    text = os.environ.get(ENV_TF_GPU, "").strip().lower()
    if text in ("", "0", "false", "no"):
        return False
    if text in ("1", "true", "yes"):
        return True
    raise ValueError(
        f"Expected the environment variable {ENV_TF_GPU} to be 1 (TensorFlow keeps its "
        f"GPUs) or 0 (the default: hidden under JAX and torch). "
        f"Received: {os.environ[ENV_TF_GPU]!r}"
    )


def _decide_tensorflow_gpus(backend: str) -> tuple[str, str | None]:
    """``(what was done, a warning to give or None)`` for this Keras backend."""
    if backend == "tensorflow":
        return "tensorflow-backend", None  # never touch the training framework's devices
    if _tensorflow_gpu_opt_out():
        return "opted-out", None
    try:
        import tensorflow as tf
    except ImportError:
        return "no-tensorflow", None
    return _hide_tensorflow_gpus(tf.config, backend)


def _hide_tensorflow_gpus(config: Any, backend: str) -> tuple[str, str | None]:
    """Hides the GPUs through `config` (``tf.config``); pure apart from `config`.

    ``list_physical_devices`` and ``get_visible_devices`` do not start TensorFlow's
    runtime; ``set_visible_devices`` refuses a change once it started.
    """
    gpus = config.list_physical_devices("GPU")
    if not gpus:
        return "no-gpu", None
    visible = config.get_visible_devices("GPU")
    if not visible:
        return "already-hidden", None
    try:
        config.set_visible_devices([], "GPU")
    except RuntimeError as e:
        names = [getattr(d, "name", str(d)) for d in visible]
        return "too-late", (
            f"keras-tfr could not hide the GPUs from TensorFlow: TensorFlow already started "
            f"on {names} in this process ({e}), so it holds GPU memory that the Keras "
            f"{_BACKEND_NAMES.get(backend, backend)} backend now lacks (TensorFlow reserves "
            "most of a GPU's memory when it starts on it). Fix the call order: create the "
            "TFRecordSequenceSource, or call `limit_gpu_memory(...)` or "
            "`keras_tfr.gpu.keep_tensorflow_off_gpus()`, before any TensorFlow tensor, "
            "operation or tf.data pipeline of your own; or call "
            "`tf.config.set_visible_devices([], 'GPU')` right after `import tensorflow`. "
            f"Set {ENV_TF_GPU}=1 if TensorFlow is meant to use the GPUs; that also silences "
            "this warning."
        )
    logger.info(
        "keras-tfr: hid %d GPU(s) from TensorFlow: Keras trains on %s, and the tf.data "
        "pipeline runs on the CPU (%s=1 keeps them).",
        len(visible),
        _BACKEND_NAMES.get(backend, backend),
        ENV_TF_GPU,
    )
    return "hidden", None


def _cuda_device_totals_mb() -> list[int] | None:
    """Each CUDA device's total memory in MiB, from the driver, without a CUDA context.

    Uses ``cuInit`` and ``cuDeviceTotalMem`` of libcuda (respects ``CUDA_VISIBLE_DEVICES``,
    creates no context, takes no device memory). ``None`` where there is no driver.
    """
    names = ["nvcuda.dll"] if sys.platform == "win32" else ["libcuda.so.1", "libcuda.so"]
    lib = None
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if lib is None or lib.cuInit(0) != 0:
        return None
    count = ctypes.c_int(0)
    if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return None
    totals = []
    for ordinal in range(count.value):
        dev = ctypes.c_int(0)
        size = ctypes.c_size_t(0)
        if lib.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
            return None
        if lib.cuDeviceTotalMem_v2(ctypes.byref(size), dev) != 0:
            return None
        totals.append(size.value // _MIB)
    return totals


def _choose(indices: list[int] | None, available: int, what: str) -> list[int]:
    if indices is None:
        return list(range(available))
    bad = [i for i in indices if i >= available]
    if bad:
        raise ValueError(
            f"Expected `devices` to index the {available} GPU(s) visible to {what}. "
            f"Received: {indices!r}"
        )
    return indices


def _limit_for_total(limit: GpuMemoryLimit, total_mb: int | None, name: str) -> int:
    """MiB for one GPU: `megabytes`, or `fraction` of the GPU's total."""
    if limit.megabytes is not None:
        if total_mb is not None and limit.megabytes > total_mb:
            raise ValueError(
                f"Expected `megabytes` to be at most {name}'s total memory of {total_mb} MiB. "
                f"Received: {limit.megabytes}"
            )
        return limit.megabytes
    if total_mb is None:
        raise GpuMemoryError(
            f"`fraction` needs {name}'s total memory, which the CUDA driver (libcuda) did not "
            "report. Pass `megabytes` instead."
        )
    return max(1, int(cast(float, limit.fraction) * total_mb))  # megabytes or fraction is set


class _TensorFlow:
    @staticmethod
    def apply(limit: GpuMemoryLimit) -> Any:
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")  # does not initialize the runtime
        if not gpus:
            return "no-gpu"
        chosen = _choose(limit._indices, len(gpus), "TensorFlow")
        visible = tf.config.get_visible_devices("GPU")
        totals = _cuda_device_totals_mb()  # for `fraction` and the report
        names, per_device_total = [], []
        if limit.growth:
            # TensorFlow requires the same growth setting on every visible GPU, so this
            # ignores `devices` (documented); `limit.devices` names the chosen ones.
            for gpu in visible:
                _tf_set(tf, gpu, growth=True)
        for i in chosen:
            gpu = gpus[i]
            total = totals[i] if totals is not None and i < len(totals) else None
            if not limit.growth:
                mb = _limit_for_total(limit, total, f"GPU:{i}")
                limit.limit_mb = mb if limit.limit_mb is None else min(mb, limit.limit_mb)
                _tf_set(tf, gpu, logical=[tf.config.LogicalDeviceConfiguration(memory_limit=mb)])
            if gpu in visible:  # the logical name: one logical device per visible GPU
                names.append(f"GPU:{visible.index(gpu)}")
                per_device_total.append(total)
        limit.devices = names
        limit.total_mb = per_device_total
        return "applied"

    @staticmethod
    def peaks_mb(limit: GpuMemoryLimit) -> list[float]:
        import tensorflow as tf

        return [tf.config.experimental.get_memory_info(d)["peak"] / _MIB for d in limit.devices]

    @staticmethod
    def reset_and_restore(limit: GpuMemoryLimit) -> None:
        import tensorflow as tf

        for d in limit.devices:
            tf.config.experimental.reset_memory_stats(d)


def _tf_set(tf: Any, device: Any, *, logical: list | None = None, growth: bool = False) -> None:
    """One TensorFlow device setting, with TensorFlow's refusals translated.

    TensorFlow refuses a change once its runtime started ("Virtual devices cannot be
    modified after being initialized") and accepts a repeat of the current setting.
    """
    try:
        if logical is not None:
            tf.config.set_logical_device_configuration(device, logical)
        else:
            tf.config.experimental.set_memory_growth(device, growth)
    except RuntimeError as e:
        current = tf.config.get_logical_device_configuration(device)
        if current:
            limits = [c.memory_limit for c in current]
            had = f"{len(current)} logical device(s) with memory_limit={limits}"
        elif device.device_type == "GPU" and tf.config.experimental.get_memory_growth(device):
            had = "memory growth"
        else:
            had = "no memory limit (all of its memory)"
        raise GpuMemoryError(
            f"limit_gpu_memory must run before TensorFlow initializes the GPU, but "
            f"TensorFlow already initialized {device.name} with {had}, and it cannot change "
            f"or undo a device's memory setting after that ({e}). {_FIX}"
        ) from e
    except ValueError as e:
        if "virtual devices configured" not in str(e):
            raise
        current = tf.config.get_logical_device_configuration(device) or []
        raise GpuMemoryError(
            f"`growth=True` cannot apply to {device.name}: it already has a memory limit "
            f"({[c.memory_limit for c in current]} MiB), from an earlier limit_gpu_memory "
            f"call or the environment variable {ENV_MEGABYTES}/{ENV_FRACTION}. Use one "
            "setting per process."
        ) from e


_JAX_VARIABLES = (
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "XLA_PYTHON_CLIENT_ALLOCATOR",
)


def _jax_environment(
    megabytes: int | None, fraction: float | None, growth: bool, totals_mb: list[int] | None
) -> dict[str, str]:
    """The XLA variables that give JAX this cap (pure: the caller sets them).

    XLA turns ``XLA_PYTHON_CLIENT_MEM_FRACTION`` into its allocator's byte limit on every
    GPU (preallocated unless ``XLA_PYTHON_CLIENT_PREALLOCATE=false``); `megabytes` becomes
    the fraction of the largest GPU, so no GPU gets more than `megabytes`.
    """
    if growth:
        return {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    if fraction is None:
        if not totals_mb:
            raise GpuMemoryError(
                "With the JAX backend `megabytes` becomes XLA_PYTHON_CLIENT_MEM_FRACTION, "
                "which needs the GPUs' total memory, and the CUDA driver (libcuda) did not "
                "report it. Pass `fraction` instead."
            )
        largest = max(totals_mb)
        megabytes = cast(int, megabytes)  # one of megabytes and fraction is set
        if megabytes > largest:
            raise ValueError(
                f"Expected `megabytes` to be at most the GPU's total memory of {largest} MiB. "
                f"Received: {megabytes}"
            )
        fraction = megabytes / largest
    # Round down so that the cap never exceeds what was asked.
    text = f"{math.floor(fraction * 1e6) / 1e6:.6f}".rstrip("0").rstrip(".")
    return {"XLA_PYTHON_CLIENT_MEM_FRACTION": text}


def _jax_started() -> bool:
    """Whether JAX already created its backends (then XLA's variables are read)."""
    if "jax" not in sys.modules:
        return False
    from keras_tfr._compat import jax as compat_jax

    return bool(compat_jax.backends_started())


def _check_jax_not_started(wanted: dict[str, str], stale: Sequence[str] = ()) -> None:
    """Raises when JAX started already, unless the environment holds `wanted` already
    and nothing in `stale` is to be removed."""
    if not _jax_started() or (not stale and all(os.environ.get(k) == v for k, v in wanted.items())):
        return  # e.g. `import keras_tfr` set the same cap before JAX started
    had = {k: os.environ[k] for k in _JAX_VARIABLES if k in os.environ}
    raise GpuMemoryError(
        "limit_gpu_memory must run before JAX's first operation, but JAX already started "
        f"its backends (with {had or 'its default preallocation'}), and XLA reads "
        f"{', '.join(sorted({*wanted, *stale}))} only when it starts. " + _FIX
    )


# The XLA variables keras-tfr set last, with their values: the next cap replaces them.
_JAX_SET: dict[str, str] = {}


def _set_jax_variables(wanted: dict[str, str]) -> None:
    """Sets `wanted` and removes what keras-tfr set before and `wanted` lacks (so that
    ``growth=True`` after a cap leaves no fraction); variables set elsewhere stay."""
    stale = [k for k, v in _JAX_SET.items() if k not in wanted and os.environ.get(k) == v]
    _check_jax_not_started(wanted, stale)
    for k in stale:
        del os.environ[k]
    os.environ.update(wanted)
    _JAX_SET.clear()
    _JAX_SET.update(wanted)


def _jax_gpu_totals() -> list[int] | None:
    """Each GPU's total in MiB as JAX would use them; None when JAX gets no GPU."""
    platforms = os.environ.get("JAX_PLATFORMS", "").lower()
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return None
    return _cuda_device_totals_mb() or None


class _Jax:
    @staticmethod
    def apply(limit: GpuMemoryLimit) -> Any:
        totals = _jax_gpu_totals()
        if totals is None:
            return "no-gpu"  # nothing to cap, so `devices` does not matter either
        if limit._indices is not None:
            raise ValueError(
                "With the JAX backend the cap applies to every GPU JAX sees; select GPUs "
                "with CUDA_VISIBLE_DEVICES before the program starts. "
                f"Received: devices={limit._indices}"
            )
        wanted = _jax_environment(limit.megabytes, limit.fraction, limit.growth, totals)
        _set_jax_variables(wanted)
        fraction = float(wanted.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "nan"))
        limit.limit_mb = None if limit.growth else int(fraction * min(totals))
        limit.devices = [f"GPU:{i}" for i in range(len(totals))]
        limit.total_mb = list(totals)
        return "applied"

    @staticmethod
    def _gpus() -> list[Any]:
        import jax

        return [d for d in jax.local_devices() if d.platform == "gpu"]

    @staticmethod
    def peaks_mb(limit: GpuMemoryLimit) -> list[float]:
        return [(d.memory_stats() or {}).get("peak_bytes_in_use", 0) / _MIB for d in _Jax._gpus()]

    @staticmethod
    def reset_and_restore(limit: GpuMemoryLimit) -> None:
        """JAX has no public call to reset its peak statistic, nor to change its cap."""


class _Torch:
    @staticmethod
    def apply(limit: GpuMemoryLimit) -> Any:
        import torch

        if not torch.cuda.is_available():
            return "no-gpu"
        chosen = _choose(limit._indices, torch.cuda.device_count(), "torch")
        previous = {}
        totals: list[int | None] = []
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        for i in chosen:
            total = torch.cuda.get_device_properties(i).total_memory // _MIB
            totals.append(total)
            previous[i] = getter(i) if getter is not None else 1.0
            if limit.growth:
                # torch's caching allocator always takes memory on demand: growth only
                # lifts a cap set before (the environment's, an earlier call's).
                torch.cuda.set_per_process_memory_fraction(1.0, i)
                continue
            mb = _limit_for_total(limit, total, f"GPU:{i}")
            torch.cuda.set_per_process_memory_fraction(min(1.0, mb / total), i)
            limit.limit_mb = mb if limit.limit_mb is None else min(mb, limit.limit_mb)
        limit.devices = [f"GPU:{i}" for i in chosen]
        limit.total_mb = totals
        return previous

    @staticmethod
    def peaks_mb(limit: GpuMemoryLimit) -> list[float]:
        import torch

        return [torch.cuda.max_memory_reserved(int(d[4:])) / _MIB for d in limit.devices]

    @staticmethod
    def reset_and_restore(limit: GpuMemoryLimit) -> None:
        import torch

        for d in limit.devices:
            torch.cuda.reset_peak_memory_stats(int(d[4:]))
        for i, fraction in (limit._state or {}).items():
            torch.cuda.set_per_process_memory_fraction(fraction, i)
