"""``keras-tfr parallel``: run N capped training processes at once (`keras_tfr.parallel`)."""

from __future__ import annotations

import argparse
import sys

from keras_tfr.parallel import _ENV_FRACTION, _ENV_MEGABYTES, launch

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``keras-tfr parallel`` (imports nothing heavy)."""
    parser.add_argument(
        "-n",
        "--num-processes",
        dest="n",  # `launch(n=...)`: its errors name `n`, shown as the flag
        type=int,
        required=True,
        metavar="N",
        help="how many processes to run at once",
    )
    cap = parser.add_mutually_exclusive_group()
    cap.add_argument(
        "--gpu-memory-mb",
        type=int,
        metavar="MB",
        help=f"each process's GPU memory cap in MiB (sets {_ENV_MEGABYTES} for each child)",
    )
    cap.add_argument(
        "--gpu-memory-fraction",
        type=float,
        metavar="F",
        help=f"each process's cap as a fraction of the GPU (sets {_ENV_FRACTION})",
    )
    parser.add_argument(
        "--fail-fast", action="store_true", help="stop the others as soon as one fails"
    )
    parser.add_argument(
        "--grace-period",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="after Ctrl-C or SIGTERM, wait this long before killing (default 10)",
    )
    parser.add_argument(
        "child_command",  # not `command`: the top-level parser keeps the subcommand there
        nargs=argparse.REMAINDER,
        metavar="COMMAND",
        help="the command after `--`; {i} becomes each process's index, {n} the count",
    )
    parser.epilog = (
        "example: keras-tfr parallel -n 4 --gpu-memory-mb 1024 -- python train.py --trial {i}"
    )


def run(args: argparse.Namespace) -> int:
    """Runs ``keras-tfr parallel``; returns the exit code (see `launch`)."""
    command = list(args.child_command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print(
            "keras-tfr parallel: error: expected a command after `--`, e.g. "
            "keras-tfr parallel -n 4 -- python train.py --trial {i}",
            file=sys.stderr,
        )
        return 2
    return launch(
        command,
        args.n,
        gpu_memory_mb=args.gpu_memory_mb,
        gpu_memory_fraction=args.gpu_memory_fraction,
        fail_fast=args.fail_fast,
        grace_period=args.grace_period,
    )
