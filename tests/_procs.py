"""Whether a process still runs, for tests that check a launcher's children all ended."""

from __future__ import annotations

import os
import time


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
