"""Shared by the tests of `keras-tfr serve` and the tf.data service: a server process, up
to its "serving" line, and free ports."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (all held open while they are chosen)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@contextlib.contextmanager
def serving(cmd):
    """Starts ``cmd`` (a `keras-tfr serve`, or a script that runs one), yields the process
    and its stdout lines up to "serving"; kills it if it still runs at the end."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines: list[str] = []
        while not lines or not lines[-1].startswith("serving"):
            line = proc.stdout.readline()
            assert line, f"serve exited early: {proc.stderr.read()[-2000:]}"
            lines.append(line.strip())
        yield proc, lines
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)
