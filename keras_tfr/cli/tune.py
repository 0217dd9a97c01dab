"""``keras-tfr tune``: a keras-tuner search with a chief and N local workers.

Argument definitions import nothing heavy; keras-tuner and TensorFlow load in the
processes the command starts.
"""

from __future__ import annotations

import argparse
import json
import logging

__all__ = ["add_arguments", "run"]

log = logging.getLogger("keras_tfr")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("script", help="a keras-tuner script (builds a tuner, calls search)")
    parser.add_argument(
        "script_args", nargs=argparse.REMAINDER, help="arguments passed on to the script"
    )
    parser.add_argument(
        "--workers", type=int, default=2, help="worker processes, i.e. trials at once (2)"
    )
    parser.add_argument(
        "--gpu-memory-mb",
        type=int,
        default=None,
        help="cap each worker's GPU memory (MB; the CUDA context comes on top)",
    )
    parser.add_argument(
        "--gpus", default=None, help="comma-separated GPU ids handed to the workers in turn"
    )
    parser.add_argument(
        "--port",
        type=int,
        default=None,
        help="the oracle's port on 127.0.0.1 (default: one the chief binds and reports)",
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="stop everything after this many seconds"
    )
    parser.add_argument(
        "--log-dir", default=None, help="where each process's log goes (a temporary directory)"
    )
    parser.add_argument(
        "--results", default=None, metavar="PATH", help="also write the results as JSON here"
    )
    parser.add_argument("--quiet", action="store_true", help="do not echo the processes' output")


def run(args: argparse.Namespace) -> int:
    from keras_tfr.tuner import tune

    # Bad arguments raise ValueError/TypeError/FileNotFoundError: `keras_tfr.cli.main`
    # prints them with the flags' names and exits 2.
    result = tune(
        args.script,
        args.script_args,
        workers=args.workers,
        gpu_memory_mb=args.gpu_memory_mb,
        gpus=None if args.gpus is None else args.gpus.split(","),
        port=args.port,
        timeout=args.timeout,
        log_dir=args.log_dir,
        verbose=not args.quiet,
    )
    counts: dict[str, int] = {}
    for t in result.trials:
        counts[t["status"]] = counts.get(t["status"], 0) + 1
    log.info(
        "keras-tfr tune: %d trial(s): %s; project %s",
        len(result.trials),
        ", ".join(f"{n} {s.lower()}" for s, n in sorted(counts.items())) or "none",
        result.project_dir,
    )
    if result.best_hyperparameters is not None:
        log.info(
            "keras-tfr tune: best %s = %.6g with %s",
            result.objective or "score",
            result.best_score,
            json.dumps(result.best_hyperparameters, sort_keys=True),
        )
    for error in result.errors:
        log.error("keras-tfr tune: %s", error)
    if not result.ok:
        log.error("keras-tfr tune: failed; logs in %s", result.log_dir)
    if args.results:
        with open(args.results, "w", encoding="utf-8") as f:
            json.dump(result.to_json(), f, indent=2, sort_keys=True)
    return result.returncode
