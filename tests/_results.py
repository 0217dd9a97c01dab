"""The ``RESULT {json}`` line a test's child process prints last, parsed."""

from __future__ import annotations

import json
import subprocess
from typing import Any

PREFIX = "RESULT "


def result_of(completed: subprocess.CompletedProcess) -> Any:
    """The JSON after ``RESULT `` in a child's stdout (the child must have exited 0)."""
    assert completed.returncode == 0, completed.stderr
    line = next(x for x in completed.stdout.splitlines() if x.startswith(PREFIX))
    return json.loads(line[len(PREFIX) :])
