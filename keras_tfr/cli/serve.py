"""``keras-tfr serve``: start a tf.data service dispatcher and workers on this machine.

Argument definitions import nothing heavy; TensorFlow loads when the command runs.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import NoReturn

__all__ = ["add_arguments", "run"]

# How long Ctrl-C waits for the servers to stop before the process ends without them.
_STOP_SECONDS = 10.0
# How long `--dispatcher` waits for its dispatcher before the command says it is waiting.
_WAIT_NOTICE_SECONDS = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``keras-tfr serve`` (light: no TensorFlow import)."""
    parser.add_argument(
        "--workers", type=int, default=2, help="tf.data service workers to start (default 2)"
    )
    parser.add_argument(
        "--port", type=int, default=5050, help="dispatcher port (default 5050; 0: a free one)"
    )
    parser.add_argument(
        "--worker-ports",
        type=int,
        nargs="+",
        default=None,
        metavar="PORT",
        help="one port per worker (default: free ports)",
    )
    parser.add_argument(
        "--host",
        default="localhost",
        help="host name this machine is reached by, given to trainers (default localhost)",
    )
    parser.add_argument(
        "--dispatcher",
        default=None,
        metavar="HOST:PORT",
        help="start only workers, joining the dispatcher at this address",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop after this many seconds (default: run until Ctrl-C)",
    )


def _stop(stop: Callable[[], object], seconds: float) -> bool:
    """Runs ``stop`` (the servers'); False if it is still running after ``seconds``."""
    stopper = threading.Thread(target=stop, name="keras_tfr_serve_stop", daemon=True)
    stopper.start()
    stopper.join(seconds)
    return not stopper.is_alive()


def _wait_for_dispatcher(address: str, deadline: float | None) -> int:
    """Waits until the dispatcher at ``address`` takes a TCP connection (0), or the
    deadline passes or Ctrl-C comes (1, said on stderr); 2 for an address without a
    port. TensorFlow's workers wait for their dispatcher inside one call that neither
    Ctrl-C nor ``--duration`` can stop, so they start only once it answers."""
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if not host or not port.isdigit():
        print(
            f"keras-tfr serve: error: --dispatcher must be HOST:PORT, got {address!r}",
            file=sys.stderr,
        )
        return 2
    notice: float | None = time.monotonic() + _WAIT_NOTICE_SECONDS
    try:
        while True:
            try:
                socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
                return 0
            except OSError:
                pass
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                break
            if notice is not None and now >= notice:
                notice = None
                print(f"waiting for the dispatcher at {address}...", file=sys.stderr, flush=True)
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    print(
        f"keras-tfr serve: error: the dispatcher at {address} did not answer; no worker "
        "was started",
        file=sys.stderr,
    )
    return 1


def _take_stop_signals() -> None:
    """Lets Ctrl-C and SIGTERM reach this process even where its parent ignored or blocked
    them: both are inherited across ``exec`` (a shell's background job ignores SIGINT; a
    parent can hold it blocked), and then ``serve`` would never stop on Ctrl-C."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # SIGTERM stops it as Ctrl-C does, from the start (also while `--dispatcher` waits).
    signal.signal(signal.SIGTERM, _on_term)


def _on_term(signum: int, frame: FrameType | None) -> NoReturn:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    """Starts the servers, prints the address to pass as ``service=``, waits for Ctrl-C
    (or SIGTERM, or ``--duration``), stops the servers and ends the process.

    The process ends through ``os._exit`` once the servers have stopped, or after
    `_STOP_SECONDS` if they have not: TensorFlow's servers can hold their own shutdown,
    and the interpreter's exit, while a client still talks to them.
    """
    if args.workers < 0:
        print(
            f"keras-tfr serve: error: --workers must be >= 0, got {args.workers}", file=sys.stderr
        )
        return 2
    if args.duration is not None and not args.duration > 0:
        print(
            f"keras-tfr serve: error: --duration must be > 0 seconds, got {args.duration}",
            file=sys.stderr,
        )
        return 2
    if args.dispatcher is not None and args.workers == 0:
        print("keras-tfr serve: error: --dispatcher needs --workers >= 1", file=sys.stderr)
        return 2
    _take_stop_signals()  # before TensorFlow starts its threads, which inherit the mask
    deadline = None if args.duration is None else time.monotonic() + args.duration
    if args.dispatcher is not None:
        rc = _wait_for_dispatcher(args.dispatcher, deadline)
        if rc:
            return rc
    from keras_tfr.distribute import start_service

    cluster = start_service(
        args.workers,
        port=args.port,
        worker_ports=args.worker_ports,
        host=args.host,
        dispatcher=args.dispatcher,
    )
    if cluster.target is not None:
        print(f"dispatcher: {cluster.target}", flush=True)
    for address in cluster.worker_addresses:
        print(f"worker: {address}", flush=True)
    if cluster.target is not None:
        print(f'read with: TFRecordSequenceSource(..., service="{cluster.target}")', flush=True)

    try:
        # Inside the `try`: a Ctrl-C right after this line still stops the servers.
        print("serving; press Ctrl-C to stop", flush=True)
        while deadline is None or time.monotonic() < deadline:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends it at once
        stopped = _stop(cluster.stop, _STOP_SECONDS)
    if not stopped:
        print(
            f"keras-tfr serve: the servers were still stopping after {_STOP_SECONDS:g} s "
            "(a client still connected?); ending the process without waiting for them",
            file=sys.stderr,
            flush=True,
        )
    print("stopped", flush=True)
    sys.stderr.flush()
    os._exit(0)
