"""Ctrl-C and SIGTERM held back from the main thread while it waits on a queue.

Python raises a signal handler's exception (`KeyboardInterrupt`, or the command line's
SIGTERM) in the main thread wherever that thread is, including inside
`threading.Condition.wait` while it takes back the lock it waited with. There the
exception leaves the lock released by the wrong thread: a `queue.Queue` shared with
another thread then loses a wake-up or fails with "release unlocked lock". The writer's
thread waited forever for the item that ends it, and `keras-tfr convert` hung on SIGTERM
instead of ending with 143 (2 runs in about 85 on a loaded 2-core machine).

Inside `deferred()`, these signals stay pending for the main thread; another thread may
take them, and the main thread raises the exception as soon as the wait has returned, with
the queue whole. The wait is the writer's queue: at most a few records' writing.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

_HELD = frozenset({signal.SIGINT, signal.SIGTERM})
_CAN_HOLD = hasattr(signal, "pthread_sigmask")  # POSIX; on Windows a lock's wait is not
# interrupted by Ctrl-C


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Holds SIGINT and SIGTERM back while the block runs, when called on the main thread
    (the one where Python runs signal handlers); elsewhere, nothing to do.

    Example:
        >>> import queue
        >>> q = queue.Queue(maxsize=1)
        >>> with deferred():
        ...     q.put(1)
    """
    if not _CAN_HOLD or threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    try:
        yield
    finally:
        # A signal that came meanwhile is delivered now; its handler runs after this.
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
