"""``keras-tfr convert-tfrecords``: TFRecords of other tools rewritten as keras-tfr blocks.

Argument definitions import nothing heavy; TensorFlow loads when the command runs.
"""

from __future__ import annotations

import argparse
from typing import Any

from keras_tfr.cli.data import add_size_arguments, progress

__all__ = ["add_arguments", "run"]


def _parse_feature_arg(text: str) -> tuple[str, Any]:
    """``NAME=SPEC``: ``float32``, ``int64:3``, ``float32:var``, ``bytes``,
    ``tensor:float32:28,28`` or ``tensor:uint8`` (any shape)."""
    import tensorflow as tf

    from keras_tfr.tfrecords import TensorFeature

    name, sep, spec = text.partition("=")
    if not sep or not name:
        raise ValueError(f"Expected --feature NAME=SPEC. Received: {text!r}")
    parts = spec.split(":")
    try:
        if parts[0] == "tensor":
            shape = None
            if len(parts) > 2 and parts[2]:
                shape = tuple(int(d) for d in parts[2].split(","))
            return name, TensorFeature(tf.as_dtype(parts[1]), shape)
        if parts[0] == "bytes":
            return name, tf.io.FixedLenFeature([], tf.string)
        dtype = tf.as_dtype(parts[0])
        if len(parts) > 1 and parts[1] == "var":
            return name, tf.io.VarLenFeature(dtype)
        dims = [int(d) for d in parts[1].split(",")] if len(parts) > 1 and parts[1] else []
        return name, tf.io.FixedLenFeature(dims, dtype)
    except (TypeError, ValueError, IndexError) as e:
        raise ValueError(
            f"--feature {text!r}: SPEC must be float32|int64[:D1,D2|:var], bytes or "
            f"tensor:DTYPE[:D1,D2] ({e})"
        ) from e


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``keras-tfr convert-tfrecords`` (no TensorFlow import here)."""
    parser.description = (
        "Rewrite TFRecord files of one tf.train.Example per sample (e.g. the tutorial layout: "
        "tf.io.serialize_tensor bytes and a float label) as a keras-tfr data set of blocks, "
        "which reads several times faster. Features are inferred from the first records "
        "unless given with --feature."
    )
    parser.add_argument("paths", nargs="+", metavar="SRC", help="TFRecord files or glob patterns")
    parser.add_argument("directory", metavar="DST", help="directory of the new data set")
    parser.add_argument(
        "--feature",
        action="append",
        default=[],
        metavar="NAME=SPEC",
        help="feature spec: float32, int64:3, float32:var, bytes, tensor:float32:28,28 "
        "(repeat per feature; default: inferred)",
    )
    parser.add_argument("--x", action="append", metavar="NAME", help="input feature(s)")
    parser.add_argument("--y", action="append", metavar="NAME", help="target feature(s)")
    parser.add_argument("--sample-weight", metavar="NAME", help="per-sample weight feature")
    parser.add_argument(
        "--compression",
        type=str.upper,
        choices=["GZIP", "ZLIB"],
        help="compression of the source files (any case)",
    )
    parser.add_argument(
        "--output-compression",
        type=str.upper,
        choices=["GZIP", "ZLIB"],
        help="compression of the new shards (any case)",
    )
    add_size_arguments(parser)
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _one_or_list(values: list[str] | None) -> Any:
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def run(args: argparse.Namespace) -> int:
    """``keras-tfr convert-tfrecords``: 0 on success; bad input exits 2 through `cli.main`."""
    from keras_tfr.tfrecords import convert_tfrecords

    features = dict(_parse_feature_arg(t) for t in args.feature) or None
    manifest = convert_tfrecords(
        args.paths,
        args.directory,
        features,
        x=_one_or_list(args.x),
        y=_one_or_list(args.y),
        sample_weight=args.sample_weight,
        compression=args.compression,
        output_compression=args.output_compression,
        overwrite=args.overwrite,
        verbose=progress(args),
        shard_size=args.shard_size,
        record_size=args.record_size,
    )
    print(
        f"wrote {manifest.total_samples} samples in {len(manifest.shards)} shards to "
        f"{args.directory}"
    )
    return 0
