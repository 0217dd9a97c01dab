"""Child processes for ``keras-tfr parallel`` and ``keras-tfr tune``: one supervisor.

Both launchers start processes the same way and stop them the same way:

* each child runs in its own process group (``start_new_session``), so that a signal
  reaches the whole tree it starts (a training script's data workers included);
* its stdout and stderr, merged, are read line by line by a thread and handed to a sink:
  `PrefixedText` (``[3] `` before each line, to a text stream shared under a lock) or
  `LogFile` (each line to a log file, and optionally ``[tuner0] `` + line to stdout);
* `stop_all` sends a signal (SIGTERM, or the user's SIGINT) to every running child's
  group, waits a grace period, then SIGKILLs the groups that are left.

Example:
    >>> child = Child("0", ["python", "-c", "print('hi')"], dict(os.environ),
    ...               sink=PrefixedText(sys.stdout, "[0] "))
    >>> child.wait()
    0
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TextIO

__all__ = ["Child", "LogFile", "PrefixedText", "signal_group", "stop_all"]

POLL_SECONDS = 0.05
SIGKILL = getattr(signal, "SIGKILL", signal.SIGTERM)


class Sink(Protocol):
    def write(self, line: bytes) -> None: ...

    def close(self) -> None: ...


class PrefixedText:
    """Writes each line, decoded and prefixed, to a text stream (one line at a time)."""

    def __init__(self, out: TextIO, prefix: str, lock: threading.Lock | None = None):
        self._out = out
        self._prefix = prefix
        self._lock = lock or threading.Lock()

    def write(self, line: bytes) -> None:
        text = line.decode("utf-8", errors="replace")
        if not text.endswith("\n"):
            text += "\n"
        with self._lock:
            self._out.write(self._prefix + text)
            self._out.flush()

    def close(self) -> None:
        pass


class LogFile:
    """Copies each line to a log file and, with ``echo``, prefixed to our stdout."""

    def __init__(self, path: str, prefix: str, echo: bool):
        self.path = path
        self._prefix = prefix.encode()
        self._echo = echo
        self._log = open(path, "wb")  # noqa: SIM115 (closed by `close`, from the reader)

    def write(self, line: bytes) -> None:
        self._log.write(line)
        self._log.flush()
        if self._echo:
            out = getattr(sys.stdout, "buffer", None)
            if out is not None:
                out.write(self._prefix + line)
                out.flush()
            else:
                sys.stdout.write((self._prefix + line).decode(errors="replace"))

    def close(self) -> None:
        self._log.close()

    def tail(self, lines: int = 5) -> str:
        """The last ``lines`` lines of the log ("" when it cannot be read)."""
        try:
            with open(self.path, "rb") as f:
                text = f.read()[-4000:].decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Sends `sig` to the child's whole process group (its own children included)."""
    try:
        if hasattr(os, "killpg"):
            os.killpg(proc.pid, sig)
        else:  # pragma: no cover - Windows
            proc.send_signal(sig)
    except (ProcessLookupError, PermissionError):
        pass


class Child:
    """One child process in its own group, its output read by a thread into ``sink``."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: dict[str, str],
        *,
        sink: Sink,
        cwd: str | None = None,
    ):
        self.name = name
        self.sink = sink
        self.proc = subprocess.Popen(
            list(argv),
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: signals reach its whole tree
        )
        self._reader = threading.Thread(
            target=self._pump, name=f"keras-tfr-child-{name}", daemon=True
        )
        self._reader.start()

    def _pump(self) -> None:
        stream = self.proc.stdout
        assert stream is not None
        try:
            for line in iter(stream.readline, b""):
                self.sink.write(line)
        finally:
            stream.close()
            self.sink.close()

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    def signal(self, sig: int) -> None:
        signal_group(self.proc, sig)

    def stop(self, grace_period: float) -> None:
        """SIGTERM to its group, SIGKILL after ``grace_period`` seconds."""
        stop_all([self], signal.SIGTERM, grace_period)

    def join_output(self, timeout: float | None) -> bool:
        """Waits for its output to be read to the end; False when it is not yet."""
        self._reader.join(timeout)
        return not self._reader.is_alive()


def stop_all(
    children: Sequence[Child],
    sig: int,
    grace_period: float,
    *,
    force: Callable[[], bool] = lambda: False,
    on_kill: Callable[[Child], Any] | None = None,
) -> None:
    """`sig` to every running child, SIGKILL to those left after the grace period.

    Args:
        children: the children to stop.
        sig: the first signal (SIGTERM, or the SIGINT the launcher received).
        grace_period: seconds to wait for them to end before SIGKILL.
        force: polled while waiting; True kills at once (a second Ctrl-C).
        on_kill: called for each child about to be killed (to warn).
    """
    for child in children:
        if child.poll() is None:
            child.signal(sig)
    deadline = time.monotonic() + grace_period
    while any(c.poll() is None for c in children):
        if force() or time.monotonic() >= deadline:
            break
        time.sleep(POLL_SECONDS)
    for child in children:
        if child.poll() is None:
            if on_kill is not None:
                on_kill(child)
            child.signal(SIGKILL)
            child.wait()
