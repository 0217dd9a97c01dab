"""The ``keras-tfr`` command.

Each subcommand lives in the module that owns its concept and provides two functions:
``add_arguments(parser)`` (light: no TensorFlow import) and ``run(args) -> int`` (the exit
code). TensorFlow is imported only by the subcommand that needs it, so ``keras-tfr --help``
answers at once.

Exit codes: 0 success, 1 the command ran and found a problem (a bad shard, a failed
child process), 2 bad usage or input (argparse's own convention).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from types import ModuleType

from keras_tfr._version import __version__
from keras_tfr.errors import KerasTFRError

# name -> (module, one-line help). Order is the order of `--help`.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "convert": ("keras_tfr._cli_data", "convert .npy/.npz files, memmaps or HDF5 data sets"),
    "info": ("keras_tfr._cli_data", "show a data set's schema, counts, sizes and shards"),
    "verify": ("keras_tfr._cli_data", "read every record and check CRCs, counts, checksums"),
    "bench": ("keras_tfr._cli_data", "measure a data set's read throughput on this machine"),
    "convert-tfrecords": (
        "keras_tfr.tfrecords",
        "rewrite TFRecords of other tools (one Example per sample) as keras-tfr blocks",
    ),
    "parallel": ("keras_tfr.parallel", "run N capped training processes at once on one GPU"),
    "tune": ("keras_tfr.tuner", "run a keras-tuner search with a chief and N local workers"),
    "serve": ("keras_tfr.distribute", "start a tf.data service dispatcher and workers"),
}


def _load(module: str) -> ModuleType | None:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:
            return None
        raise


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keras-tfr",
        description="Train Keras models on data larger than RAM: convert arrays to sharded "
        "TFRecords, inspect and verify them, and run several capped trainings on one GPU.",
    )
    parser.add_argument("--version", action="version", version=f"keras-tfr {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = _load(module_name)
        if module is None or not hasattr(module, f"add_{name.replace('-', '_')}_arguments"):
            continue
        p = sub.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:])
        getattr(module, f"add_{name.replace('-', '_')}_arguments")(p)
        p.set_defaults(_module=module_name, _run=f"run_{name.replace('-', '_')}")
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    module = importlib.import_module(args._module)
    try:
        return int(getattr(module, args._run)(args) or 0)
    except KeyboardInterrupt:
        print("keras-tfr: interrupted", file=sys.stderr)
        return 130
    except (KerasTFRError, ValueError, TypeError, OSError) as e:
        # One place turns bad input into exit code 2 for every subcommand.
        print(f"keras-tfr {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
