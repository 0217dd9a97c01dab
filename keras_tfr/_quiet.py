"""TensorFlow's start-up log lines that ``TF_CPP_MIN_LOG_LEVEL`` does not reach.

With TensorFlow 2.21, ``import tensorflow`` prints, whatever ``TF_CPP_MIN_LOG_LEVEL`` says::

    WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
    I0000 00:00:1796102325.200200    6787 port.cc:153] oneDNN custom operations are on. ...
    I0000 00:00:1796102325.200653    6787 cudart_stub.cc:31] Could not find cuda drivers ...

(twice: ``libtensorflow_framework.so.2`` and the profiler plugin each link their own copy
of Abseil), and on a machine without an NVIDIA GPU the first device query adds
``E0000 ... cuda_platform.cc:52] failed call to cuInit: ...``. They come from Abseil's C++
logging, which writes every message to stderr until ``absl::InitializeLog()`` is called
(TensorFlow never calls it), whatever the minimum level; the ``0000 00:00:<seconds>``
time stamp is Abseil's mark of such a line. No environment variable stops them
(``TF_CPP_MIN_LOG_LEVEL=3`` hides only the ``E`` line; ``GRPC_VERBOSITY``,
``GLOG_minloglevel`` and ``ABSL_MIN_LOG_LEVEL`` change nothing: checked with TF 2.21).

This module applies the user's own ``TF_CPP_MIN_LOG_LEVEL`` to exactly those lines, and
nothing else: a line is dropped only if it has Abseil's pre-initialization form and a
severity below that level, or is the banner above, or is the cuInit failure on a machine
with no NVIDIA device (where it only says that there is no GPU). Python warnings, Python
logging (``WARNING:tensorflow:...``, absl-py's lines carry a real date) and anything else
pass through. keras-tfr's examples, demo and ``keras-tfr`` command use it; a user's
program is left alone (``keras-tfr parallel`` and ``tune`` pass their children's output on
as it is).
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from typing import TextIO

__all__ = ["FilteredOutput", "import_tensorflow_quietly", "is_startup_noise", "quiet_stderr"]

# `keras_tfr.parallel.launch` puts "[i] " in front of each line of child i.
_PREFIX = re.compile(r"^\[\d+\] ")
_BANNER = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
# Abseil's line before InitializeLog(): severity, "0000 00:00:<unix seconds>", thread id,
# file:line], message.
_PRE_INIT = re.compile(
    r"^(?P<severity>[IWEF])0000 00:00:\d+\.\d+ +\d+ (?P<file>[\w.+-]+):\d+\] (?P<message>.*)$"
)
_SEVERITY = {"I": 0, "W": 1, "E": 2, "F": 3}


def _min_level() -> int:
    try:
        return int(os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0"))
    except ValueError:
        return 0


def _no_nvidia_device() -> bool:
    return not glob.glob("/dev/nvidia[0-9]*")


def is_startup_noise(line: str, min_level: int | None = None) -> bool:
    """Whether `line` is one of TensorFlow's start-up lines that `min_level` should hide.

    Args:
        line: one line of output, with or without its newline.
        min_level: TensorFlow's C++ log level (0 shows all, 1 hides INFO, 2 also WARNING,
            3 also ERROR); default ``TF_CPP_MIN_LOG_LEVEL`` from the environment.

    Returns:
        True only for Abseil's pre-initialization lines below `min_level`, its banner
        (when `min_level` is at least 1), and ``failed call to cuInit`` on a machine
        without ``/dev/nvidia<N>`` (when `min_level` is at least 1).

    Example:
        >>> is_startup_noise("I0000 00:00:1796102325.200200    6787 port.cc:153] oneDNN", 2)
        True
        >>> is_startup_noise("/tmp/x.py:3: UserWarning: mine", 3)
        False
    """
    level = _min_level() if min_level is None else min_level
    if level < 1:
        return False
    text = _PREFIX.sub("", line.rstrip("\r\n"), count=1)
    if text == _BANNER:
        return True
    match = _PRE_INIT.match(text)
    if match is None:
        return False
    if _SEVERITY[match["severity"]] < level:
        return True
    return (
        match["file"] == "cuda_platform.cc"
        and match["message"].startswith("failed call to cuInit")
        and _no_nvidia_device()
    )


class FilteredOutput:
    """A text stream that passes on every line except TensorFlow's start-up noise.

    For `keras_tfr.parallel.launch`'s ``output=``, which writes whole lines.

    Args:
        out: where the kept lines go.
        min_level: as in `is_startup_noise`.

    Example:
        >>> launch(command, 4, output=FilteredOutput(sys.stdout))
    """

    def __init__(self, out: TextIO, min_level: int | None = None):
        self._out = out
        self._min_level = min_level
        self._partial = ""

    def write(self, text: str) -> int:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            if not is_startup_noise(line, self._min_level):
                self._out.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self._out.flush()


@contextlib.contextmanager
def quiet_stderr(min_level: int | None = None) -> Iterator[None]:
    """Holds back this process's stderr (file descriptor 2) and replays it without noise.

    Everything written to stderr inside the block, by Python or by C++ code, goes to a
    temporary file and is written out when the block ends (also when it raises), less
    the lines `is_startup_noise` drops. Meant for short blocks with no interactive output,
    such as importing TensorFlow.

    Args:
        min_level: as in `is_startup_noise`.

    Example:
        >>> with quiet_stderr():
        ...     import tensorflow as tf
    """
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as held:
            os.dup2(held.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                held.seek(0)
                text = held.read().decode("utf-8", errors="replace")
                kept = [
                    line
                    for line in text.splitlines(keepends=True)
                    if not is_startup_noise(line, min_level)
                ]
                if kept:
                    sys.stderr.write("".join(kept))
                    sys.stderr.flush()
    finally:
        os.close(saved)


def import_tensorflow_quietly(min_level: int | None = None) -> None:
    """Imports TensorFlow and lists its devices with `quiet_stderr` around both.

    Listing the physical devices does not initialize them, so `limit_gpu_memory` and
    `tf.config.set_logical_device_configuration` still work afterwards.

    Args:
        min_level: as in `is_startup_noise`.

    Example:
        >>> import_tensorflow_quietly()  # before anything imports TensorFlow or Keras
    """
    with quiet_stderr(min_level):
        import tensorflow as tf

        tf.config.list_physical_devices("GPU")
