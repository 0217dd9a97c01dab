"""The ``keras-tfr`` command: `main` and the table of its subcommands.

`SUBCOMMANDS` lists every subcommand with its one-line help and its two functions:
``add_arguments(parser)`` (light: no TensorFlow import) and ``run(args) -> int`` (the exit
code). Each lives in a module of this package, one per subcommand or group:
`keras_tfr.cli.data` (``convert``, ``info``, ``verify``, ``bench``),
`keras_tfr.cli.tfrecords`, `keras_tfr.cli.parallel`, `keras_tfr.cli.tune` and
`keras_tfr.cli.serve`. TensorFlow is imported only by the subcommand that runs and needs
it, so ``keras-tfr --help`` answers at once.

Exit codes: 0 success, 1 the command ran and found a problem (a bad shard, a failed
child process), 2 bad usage or input (argparse's own convention).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from keras_tfr._version import __version__
from keras_tfr.cli import data, parallel, serve, tfrecords, tune
from keras_tfr.errors import KerasTFRError

__all__ = ["SUBCOMMANDS", "Subcommand", "build_parser", "main"]


@dataclasses.dataclass(frozen=True)
class Subcommand:
    """One ``keras-tfr`` subcommand: its help line, its arguments and what it runs."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    # Whether `run` imports TensorFlow (Keras' progress bar does): `main` imports it first
    # with TensorFlow's start-up lines filtered (`keras_tfr._quiet`), as the examples do.
    tensorflow: bool = True


# The order is the order of `--help`.
SUBCOMMANDS: dict[str, Subcommand] = {
    "convert": Subcommand(
        "convert .npy/.npz files, memmaps or HDF5 data sets",
        data.add_convert_arguments,
        data.run_convert,
    ),
    "info": Subcommand(
        "show a data set's schema, counts, sizes and shards",
        data.add_info_arguments,
        data.run_info,
        tensorflow=False,
    ),
    "verify": Subcommand(
        "read every record and check CRCs, counts, checksums",
        data.add_verify_arguments,
        data.run_verify,
    ),
    "bench": Subcommand(
        "measure a data set's read throughput on this machine",
        data.add_bench_arguments,
        data.run_bench,
    ),
    "convert-tfrecords": Subcommand(
        "rewrite TFRecords of other tools (one Example per sample) as keras-tfr blocks",
        tfrecords.add_arguments,
        tfrecords.run,
    ),
    "parallel": Subcommand(
        "run N capped training processes at once on one GPU",
        parallel.add_arguments,
        parallel.run,
        tensorflow=False,  # the children are the user's programs, their output untouched
    ),
    "tune": Subcommand(
        "run a keras-tuner search with a chief and N local workers",
        tune.add_arguments,
        tune.run,
        tensorflow=False,  # likewise
    ),
    "serve": Subcommand(
        "start a tf.data service dispatcher and workers",
        serve.add_arguments,
        serve.run,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keras-tfr",
        description="Train Keras models on data larger than RAM: convert arrays to sharded "
        "TFRecords, inspect and verify them, and run several capped trainings on one GPU.",
    )
    parser.add_argument("--version", action="version", version=f"keras-tfr {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in SUBCOMMANDS.items():
        description = command.help[0].upper() + command.help[1:]
        p = sub.add_parser(name, help=command.help, description=description)
        command.add_arguments(p)
        p.set_defaults(_run=command.run, _tensorflow=command.tensorflow, _flags=_flags_of(p))
    return parser


def _flags_of(parser: argparse.ArgumentParser) -> dict[str, str]:
    """The subcommand's options by the Python argument they feed: `` `dest` `` ->
    `` `--flag` `` (its long form), and ``Received: dest=`` -> ``Received: --flag``, for
    `with_flags`."""
    flags = {}
    for action in parser._actions:
        names = [o for o in action.option_strings if o.startswith("--")] or action.option_strings
        if names and action.dest not in ("help", argparse.SUPPRESS):
            flags[f"`{action.dest}`"] = f"`{names[0]}`"
            flags[f"Received: {action.dest}="] = f"Received: {names[0]} "
    return flags


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(_own_summary)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    # The data commands stop on SIGTERM (a preempted job, `kill`) as on Ctrl-C: a
    # conversion keeps its complete shards and their journal, and leaves no lock or
    # partial shard; `tune` stops its processes. `serve` and `parallel` handle their
    # signals themselves.
    term = _on_sigterm() if args.command in _STOPPED_BY_SIGTERM else None
    try:
        if args._tensorflow and "tensorflow" not in sys.modules:
            from keras_tfr import _quiet

            _quiet.import_tensorflow_quietly()  # seconds: a Ctrl-C often lands here
        return int(args._run(args) or 0)
    except KeyboardInterrupt as e:
        said = "terminated (SIGTERM)" if isinstance(e, _Terminated) else "interrupted"
        print(f"keras-tfr: {said}{_resume_hint(args)}", file=sys.stderr)
        return 143 if isinstance(e, _Terminated) else 130
    except BrokenPipeError:
        # The reader of stdout went away (`keras-tfr info DIR | head`): as other
        # command-line tools, end quietly, with 141 (128 + SIGPIPE) as a shell reports it.
        # Later writes to stdout (at exit) go nowhere instead of failing again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except (KerasTFRError, ValueError, TypeError, OSError) as e:
        # One place turns bad input into exit code 2 for every subcommand.
        print(f"keras-tfr {args.command}: error: {with_flags(e, args._flags)}", file=sys.stderr)
        return 2
    finally:
        if term is not None:
            signal.signal(signal.SIGTERM, term)


def _resume_hint(args: argparse.Namespace) -> str:
    """What to do after an interrupted `convert` that kept complete shards."""
    from keras_tfr.manifest import MANIFEST_NAME, PROGRESS_NAME

    if args.command != "convert":
        return ""
    directory = str(args.directory)
    try:
        kept = os.path.exists(os.path.join(directory, PROGRESS_NAME))
        done = os.path.exists(os.path.join(directory, MANIFEST_NAME))
    except (OSError, ValueError):
        return ""
    if done or not kept:
        return ""
    return f"; the complete shards in {directory} are kept: run the same command with --resume"


_STOPPED_BY_SIGTERM = ("convert", "convert-tfrecords", "verify", "bench", "info", "tune")


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where a Ctrl-C would be, so that work stops as cleanly."""


def _on_sigterm() -> Any:
    """Raises `_Terminated` on SIGTERM from now on; returns the handler it replaced (to
    put back), or None off the main thread, where no handler can be set."""

    def terminated(signum: int, frame: Any) -> None:
        raise _Terminated

    try:
        previous = signal.signal(signal.SIGTERM, terminated)
    except ValueError:
        return None
    return signal.SIG_DFL if previous is None else previous


def _own_summary(record: logging.LogRecord) -> bool:
    """Drops the writer's "wrote N samples" log line: the commands that write print their
    own summary of it (with the size) on stdout."""
    return not str(record.msg).startswith("keras-tfr: wrote ")


# The library's errors name its Python arguments; a user of the command has these flags.
_FLAGS = {
    "`ArraysToRecords(..., resume=True)`": "`keras-tfr convert ... --resume` (or "
    "`ArraysToRecords(..., resume=True)` for a conversion written in Python)",
    "`overwrite=True`": "`--overwrite`",
    "`resume=True`": "`--resume`",
    "`shuffle_seed`": "`--shuffle-seed`",
    "shuffle_seed=None": "no --shuffle-seed",
    "shuffle_seed=": "--shuffle-seed ",
    "`shard_size`": "`--shard-size`",
    "`record_size`": "`--record-size`",
    "`min_shards`": "`--min-shards`",
    "`compression`": "`--compression`",
    "Expected `y` with `sample_weight`": "Expected `--y` with `--sample-weight`",
    "Received: y=None and sample_weight": "Received: no --y and --sample-weight",
    "`paths_or_glob`: ": "SRC ",
    "is not in `features`": "has no --feature",
    "add it to `features`.": "add a --feature for it (given --feature, no feature is inferred).",
    "Pass `features=` (or --feature)": "Pass --feature",
    "with the given `features`": "with the given --feature",
}


def with_flags(error: BaseException, flags: dict[str, str] | None = None) -> str:
    """``error``'s message with the library's arguments replaced by the commands' flags:
    `_FLAGS`, then the subcommand's own options (``flags``, from `_flags_of`)."""
    message = str(error)
    for argument, flag in _FLAGS.items():
        message = message.replace(argument, flag)
    for argument, flag in (flags or {}).items():
        message = message.replace(argument, flag)
    return message
