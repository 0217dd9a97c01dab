"""Child processes for ``keras-tfr parallel`` and ``keras-tfr tune``: one supervisor.

Both launchers start processes the same way and stop them the same way:

* each child runs in its own process group (``start_new_session``), so that a signal
  reaches the whole tree it starts (a training script's data workers included);
* its stdout and stderr, merged, are read line by line by a thread and handed to a sink:
  `PrefixedText` (``[3] `` before each line, to a text stream shared under a lock) or
  `LogFile` (each line to a log file, and optionally ``[tuner0] `` + line to stdout);
* `stop_all` sends a signal (SIGTERM, or the user's SIGINT) to every running child's
  group, waits a grace period, then SIGKILLs the groups that are left;
* a `Guard` (a small process of its own) does the same if the launcher itself ends
  without stopping them: killed with SIGKILL, or by a SIGTERM it does not handle. The
  children are in groups of their own, so nothing else would stop them.

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

__all__ = ["Child", "Guard", "LogFile", "PrefixedText", "signal_group", "stop_all"]

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


# The guard's program (run with ``python -c``; it imports nothing of ours). Its stdin is a
# pipe from the launcher: "+ PGID" when a child starts, "- PGID" once the launcher has seen
# it end. End of input with groups left means the launcher is gone without stopping them.
_GUARD_PROGRAM = r"""
import os, signal, sys, time
grace, name = float(sys.argv[1]), sys.argv[2]
groups = []
for line in sys.stdin:
    op, _, pgid = line.partition(" ")
    if op == "+":
        groups.append(int(pgid))
    elif op == "-" and int(pgid) in groups:
        groups.remove(int(pgid))
def send(group, sig):
    try:
        os.killpg(group, sig)
        return True
    except OSError:
        return False
groups = [g for g in groups if send(g, 0)]
if groups:
    sys.stderr.write(
        f"{name}: the launcher ended without stopping its {len(groups)} process(es); "
        f"stopping them (SIGTERM, then SIGKILL after {grace:g} s)\n")
    for g in groups:
        send(g, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(send(g, 0) for g in groups):
        time.sleep(0.05)
    for g in groups:
        send(g, signal.SIGKILL)
"""


class Guard:
    """Stops a launcher's children if the launcher ends without doing it itself.

    A process of its own (in its own session: a Ctrl-C at the terminal does not reach it)
    reads which process groups are running from a pipe. When the pipe closes with groups
    left (the launcher was killed with SIGKILL, or ended by a SIGTERM or an error it did
    not handle), it sends SIGTERM to each group, then SIGKILL after ``grace_period``
    seconds: what the launcher would have done. POSIX only; elsewhere it does nothing.
    """

    def __init__(self, grace_period: float, name: str):
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        if not hasattr(os, "killpg"):  # pragma: no cover - Windows
            return
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _GUARD_PROGRAM, repr(float(grace_period)), name],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _say(self, line: str) -> None:
        with self._lock:
            if self._proc is None or self._proc.stdin is None or self._proc.stdin.closed:
                return
            try:
                self._proc.stdin.write(line.encode())
                self._proc.stdin.flush()
            except OSError:  # the guard is gone: nothing to tell
                pass

    def watch(self, pid: int) -> None:
        """A child now runs in process group ``pid``."""
        self._say(f"+ {pid}\n")

    def release(self, pid: int) -> None:
        """The child in group ``pid`` has ended and its launcher has seen it."""
        self._say(f"- {pid}\n")

    def close(self) -> None:
        """The launcher is done: the guard ends (stopping any group still watched)."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        assert proc.stdin is not None
        try:
            proc.stdin.close()
        except OSError:
            pass
        proc.wait()


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
        guard: Guard | None = None,
    ):
        self.name = name
        self.sink = sink
        self._guard = guard
        self.proc = subprocess.Popen(
            list(argv),
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: signals reach its whole tree
        )
        if guard is not None:
            guard.watch(self.proc.pid)
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
        return self._ended(self.proc.poll())

    def wait(self, timeout: float | None = None) -> int:
        code = self.proc.wait(timeout)
        self._ended(code)
        return code

    def _ended(self, code: int | None) -> int | None:
        if code is not None and self._guard is not None:
            self._guard.release(self.proc.pid)
            self._guard = None
        return code

    def signal(self, sig: int) -> None:
        signal_group(self.proc, sig)

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
