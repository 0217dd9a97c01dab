"""Run N training processes at once, each with a GPU memory cap: ``keras-tfr parallel``.

Several models fit on one GPU when each process is capped (see `keras_tfr.gpu`). This
launcher starts the N processes, gives each its cap through the environment variable
``KERAS_TFR_GPU_MEMORY_MB`` (or ``KERAS_TFR_GPU_MEMORY_FRACTION``), which keras-tfr
applies in the child (once the child imports both ``keras_tfr`` and Keras, before the
framework starts on the GPU), streams each one's output
with a prefix (``[3] ``), stops the others on Ctrl-C or SIGTERM, and fails if any fails.

```
keras-tfr parallel -n 4 --gpu-memory-mb 1024 -- python train.py --trial {i}
```

``{i}`` in the command becomes the process's index (0 to N-1) and ``{n}`` the count; the
children also find them in ``KERAS_TFR_PARALLEL_INDEX`` and ``KERAS_TFR_PARALLEL_COUNT``.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from keras_tfr._supervise import Child, Guard, PrefixedText, stop_all

__all__ = ["launch"]

logger = logging.getLogger("keras_tfr.parallel")

ENV_INDEX = "KERAS_TFR_PARALLEL_INDEX"
ENV_COUNT = "KERAS_TFR_PARALLEL_COUNT"
_ENV_MEGABYTES = "KERAS_TFR_GPU_MEMORY_MB"  # = keras_tfr.gpu.ENV_MEGABYTES (no TF import here)
_ENV_FRACTION = "KERAS_TFR_GPU_MEMORY_FRACTION"

_POLL_SECONDS = 0.05  # how often the launcher checks its children


def launch(
    command: Sequence[str],
    n: int,
    *,
    gpu_memory_mb: int | None = None,
    gpu_memory_fraction: float | None = None,
    env: Mapping[str, str] | None = None,
    fail_fast: bool = False,
    grace_period: float = 10.0,
    output: TextIO | None = None,
) -> int:
    """Runs `n` copies of `command` at once, each capped, and waits for all of them.

    Each child runs in its own process group with ``{i}`` and ``{n}`` in `command`
    replaced by its index and the count, and with ``KERAS_TFR_GPU_MEMORY_MB`` (or
    ``KERAS_TFR_GPU_MEMORY_FRACTION``) in its environment, which the child applies by
    importing ``keras_tfr`` (or by calling ``limit_gpu_memory()``). Every line a child
    prints, on stdout or stderr, is written to `output` as it comes, prefixed with
    ``[i] ``.

    On Ctrl-C (SIGINT) or SIGTERM the children get the same signal, then SIGKILL after
    `grace_period` seconds (at once on a second Ctrl-C). Signals are caught only when
    called from the main thread.

    Args:
        command: the program and its arguments, e.g. ``["python", "train.py", "--trial",
            "{i}"]``.
        n: how many processes to run at once, at least 1.
        gpu_memory_mb: each process's cap per GPU in MiB.
        gpu_memory_fraction: each process's cap as a fraction of each GPU, in (0, 1].
        env: extra environment variables for every child.
        fail_fast: stop the others (SIGTERM) as soon as one fails.
        grace_period: seconds between the stop signal and SIGKILL.
        output: where the prefixed lines go; ``sys.stdout`` by default.

    Returns:
        The exit code: 0 when every process succeeded, 1 when any failed, 130 after
        Ctrl-C and 143 after SIGTERM.

    Example:

    ```python
    from keras_tfr.parallel import launch

    code = launch(["python", "train.py", "--trial", "{i}"], 4, gpu_memory_mb=1024)
    ```
    """
    argv, child_envs = _prepare(command, n, gpu_memory_mb, gpu_memory_fraction, env)
    grace_period = _check_grace(grace_period)
    out = sys.stdout if output is None else output
    launcher = _Launcher(argv, child_envs, out, fail_fast, grace_period)
    return launcher.run()


def _prepare(
    command: Sequence[str],
    n: Any,
    gpu_memory_mb: Any,
    gpu_memory_fraction: Any,
    env: Mapping[str, str] | None,
) -> tuple[list[list[str]], list[dict[str, str]]]:
    if isinstance(command, (str, bytes)) or not isinstance(command, Sequence) or not command:
        raise ValueError(
            "Expected `command` to be a non-empty list of program and arguments, like "
            f"['python', 'train.py', '--trial', '{{i}}']. Received: {command!r}"
        )
    if not all(isinstance(a, str) for a in command):
        raise TypeError(f"Expected `command` to hold strings. Received: {list(command)!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"Expected `n` to be an int >= 1. Received: {n!r}")
    if gpu_memory_mb is not None and gpu_memory_fraction is not None:
        raise ValueError(
            "Expected only one of `gpu_memory_mb` and `gpu_memory_fraction`. "
            f"Received: {gpu_memory_mb!r} and {gpu_memory_fraction!r}"
        )
    base = dict(os.environ)
    base.update(env or {})
    base["PYTHONUNBUFFERED"] = "1"  # so Python children's lines arrive as they are printed
    base[ENV_COUNT] = str(n)
    if gpu_memory_mb is not None:
        if isinstance(gpu_memory_mb, bool) or not isinstance(gpu_memory_mb, int):
            raise TypeError(f"Expected `gpu_memory_mb` to be an int. Received: {gpu_memory_mb!r}")
        if gpu_memory_mb < 1:
            raise ValueError(f"Expected `gpu_memory_mb` to be >= 1. Received: {gpu_memory_mb}")
        _set_gpu_memory_env(base, megabytes=gpu_memory_mb)
    elif gpu_memory_fraction is not None:
        if isinstance(gpu_memory_fraction, bool) or not isinstance(
            gpu_memory_fraction, float | int
        ):
            raise TypeError(
                f"Expected `gpu_memory_fraction` to be a float. Received: {gpu_memory_fraction!r}"
            )
        if not 0 < gpu_memory_fraction <= 1:
            raise ValueError(
                f"Expected `gpu_memory_fraction` to be in (0, 1]. Received: {gpu_memory_fraction}"
            )
        _set_gpu_memory_env(base, fraction=gpu_memory_fraction)
    argv, envs = [], []
    for i in range(n):
        argv.append([a.replace("{i}", str(i)).replace("{n}", str(n)) for a in command])
        child_env = dict(base)
        child_env[ENV_INDEX] = str(i)
        envs.append(child_env)
    return argv, envs


def _set_gpu_memory_env(
    env: dict[str, str], *, megabytes: int | None = None, fraction: float | None = None
) -> None:
    """Puts one GPU memory cap in `env` and removes the other variable, in place.

    ``import keras_tfr`` refuses an environment holding both ``KERAS_TFR_GPU_MEMORY_MB``
    and ``KERAS_TFR_GPU_MEMORY_FRACTION`` (a ValueError), so a cap set by a launcher
    (``keras-tfr parallel``, ``keras-tfr tune``) must replace one the user's shell
    exports. With neither argument both variables are removed: no cap. The values are
    written as given; callers check them.
    """
    env.pop(_ENV_MEGABYTES, None)
    env.pop(_ENV_FRACTION, None)
    if megabytes is not None:
        env[_ENV_MEGABYTES] = str(megabytes)
    elif fraction is not None:
        env[_ENV_FRACTION] = repr(float(fraction))


def _check_grace(grace_period: Any) -> float:
    if isinstance(grace_period, bool) or not isinstance(grace_period, int | float):
        raise TypeError(f"Expected `grace_period` to be seconds. Received: {grace_period!r}")
    if grace_period < 0:
        raise ValueError(f"Expected `grace_period` to be >= 0. Received: {grace_period}")
    return float(grace_period)


class _Launcher:
    def __init__(
        self,
        argv: list[list[str]],
        envs: list[dict[str, str]],
        out: TextIO,
        fail_fast: bool,
        grace_period: float,
    ):
        self.argv = argv
        self.envs = envs
        self.out = out
        self.fail_fast = fail_fast
        self.grace_period = grace_period
        self.children: list[Child] = []
        self.lock = threading.Lock()  # one line at a time on `out`
        self.stop_signal: int | None = None  # set by the signal handler
        self.force = False
        self.guard: Guard | None = None  # stops the children if this process is killed

    # -- signals ------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.stop_signal is not None:
            self.force = True  # a second Ctrl-C: kill now
        else:
            self.stop_signal = signum

    def _install_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous: dict[int, Any] = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, self._on_signal)
        return previous

    # -- the run ------------------------------------------------------------------------

    def _start(self) -> None:
        for i, (argv, env) in enumerate(zip(self.argv, self.envs)):
            sink = PrefixedText(self.out, f"[{i}] ", self.lock)
            self.children.append(Child(str(i), argv, env, sink=sink, guard=self.guard))

    def _stop(self, sig: int) -> None:
        """`sig` to every running child, SIGKILL to those left after the grace period."""
        stop_all(
            self.children,
            sig,
            self.grace_period,
            force=lambda: self.force,
            on_kill=lambda child: logger.warning(
                "keras-tfr parallel: [%s] did not stop; killing it", child.name
            ),
        )

    def run(self) -> int:
        previous = self._install_handlers()
        stopped_by: int | None = None
        self.guard = Guard(self.grace_period, "keras-tfr parallel")
        try:
            try:
                self._start()
            except BaseException:  # e.g. the program of child k was not found
                self._stop(signal.SIGTERM)
                for child in self.children:
                    child.wait()
                raise
            logger.info(
                "keras-tfr parallel: started %d process(es): %s",
                len(self.children),
                shlex.join(self.argv[0]),
            )
            while any(c.poll() is None for c in self.children):
                if self.stop_signal is not None:
                    stopped_by = self.stop_signal
                    name = signal.Signals(stopped_by).name
                    logger.warning("keras-tfr parallel: %s received; stopping all processes", name)
                    self._stop(stopped_by)
                    break
                if self.fail_fast and any(c.poll() not in (None, 0) for c in self.children):
                    logger.warning("keras-tfr parallel: a process failed; stopping the others")
                    self._stop(signal.SIGTERM)
                    break
                time.sleep(_POLL_SECONDS)
            for child in self.children:
                child.wait()
            self._join_readers()
        finally:
            self.guard.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return self._summarize(stopped_by)

    def _join_readers(self) -> None:
        # A grandchild that outlives its parent can hold the pipe open: end its group.
        deadline = time.monotonic() + 2.0
        done = [c.join_output(max(0.0, deadline - time.monotonic())) for c in self.children]
        if not all(done):
            for child in self.children:
                child.signal(signal.SIGKILL)
            for child in self.children:
                child.join_output(2.0)

    def _summarize(self, stopped_by: int | None) -> int:
        failed = 0
        for i, child in enumerate(self.children):
            code = child.wait()  # it has ended: its exit status
            if code == 0:
                continue
            failed += 1
            if code < 0:
                how = f"was stopped by {signal.Signals(-code).name}"
            else:
                how = f"exited with code {code}"
            logger.warning("keras-tfr parallel: [%d] %s", i, how)
        if stopped_by is not None:
            return 128 + int(stopped_by)
        if failed:
            logger.warning(
                "keras-tfr parallel: %d of %d process(es) failed", failed, len(self.children)
            )
            return 1
        logger.info("keras-tfr parallel: all %d process(es) succeeded", len(self.children))
        return 0
