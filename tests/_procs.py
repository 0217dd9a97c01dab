"""Launchers' children in tests: start a launcher, wait for its children's pid files,
tell whether they still run."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path


def running(pid: int) -> bool:
    """Running (a zombie counts as ended: an orphan may wait unreaped for PID 1)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:  # no /proc (or it ended meanwhile)
        return True


def still_running(pids: list[int], seconds: float) -> list[int]:
    """The pids still running after waiting up to ``seconds`` for all to end."""
    deadline = time.monotonic() + seconds
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if running(p)]


def start_and_wait(
    cmd: list[str], directory: Path, n: int, seconds: float = 60, stdout: int | None = None
) -> tuple[subprocess.Popen, dict[str, int]]:
    """Starts ``cmd`` and waits until ``n`` children wrote ``pid-NAME`` files (whole:
    written beside, then renamed) in ``directory``: the launcher and ``{NAME: pid}``."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE if stdout is None else stdout, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + seconds
    while len(list(directory.glob("pid-*"))) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the children did not start"
        time.sleep(0.05)
    return proc, {p.name[4:]: int(p.read_text()) for p in directory.glob("pid-*")}
