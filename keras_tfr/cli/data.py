"""``keras-tfr convert | info | verify | bench``: data set subcommands of the command line.

Argument definitions import nothing heavy; ``info`` never imports TensorFlow (it reads
only the manifest), the others import it when they run.

Exit codes: 0 success; 1 the command ran and found a problem (``verify`` found a bad
shard); 2 bad usage or input (a missing file, an invalid manifest, a bad argument).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

__all__ = [
    "add_bench_arguments",
    "add_convert_arguments",
    "add_info_arguments",
    "add_size_arguments",
    "add_verify_arguments",
    "load_array",
    "progress",
    "run_bench",
    "run_convert",
    "run_info",
    "run_verify",
]

_H5_SUFFIXES = (".h5", ".hdf5", ".he5")


def progress(args: argparse.Namespace) -> int:
    """The progress bar's ``verbose``: 1 on a terminal, 0 with ``--quiet`` or when stdout
    is a pipe or a file (Keras' bar redraws its line with terminal codes, which a log
    would keep as they are; the summary line is printed either way)."""
    if getattr(args, "quiet", False):
        return 0
    isatty = getattr(sys.stdout, "isatty", None)
    return 1 if callable(isatty) and isatty() else 0


def _error(command: str, message: Any) -> int:
    print(f"keras-tfr {command}: error: {message}", file=sys.stderr)
    return 2


def add_size_arguments(parser: argparse.ArgumentParser) -> None:
    """``--shard-size`` / ``--record-size``, defaulting to the writer's own defaults."""
    from keras_tfr.manifest import DEFAULT_RECORD_SIZE, DEFAULT_SHARD_SIZE

    parser.add_argument("--shard-size", default=DEFAULT_SHARD_SIZE, help="bytes per shard")
    parser.add_argument("--record-size", default=DEFAULT_RECORD_SIZE, help="bytes per block")


# --------------------------------------------------------------------------- convert


def load_array(spec: str) -> Any:
    """Opens one array lazily (memory-mapped or as an h5py data set) from a SPEC.

    ``file.npy``; ``file.npz:key`` (``.npz`` members are read into memory: NumPy cannot
    memory-map inside a zip; store large arrays as ``.npy``); ``file.h5:group/dataset``;
    ``file.bin:DTYPE:D1,D2`` for a raw memmap of samples of shape ``(D1, D2)``
    (``file.bin:DTYPE`` for scalars; DTYPE one of the dtypes keras-tfr stores).

    Raises:
        ValueError, OSError: the SPEC is malformed or the file cannot be opened or read;
            the message starts with the SPEC (``'x.npy': ...``).
    """
    import numpy as np

    path, rest = _split_spec(spec)
    lower = path.lower()
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path!r} does not exist" + (f" (from {spec!r})" if path != spec else "")
        )
    if lower.endswith(".npy"):
        if rest:
            raise ValueError(f"{spec!r}: a .npy file takes no ':KEY'")
        with _reading(spec), open(path, "rb") as f:
            magic = f.read(len(_NPY_MAGIC))
        if magic != _NPY_MAGIC:
            # np.load would take it for a pickle ("contains pickled (object) data") or,
            # from a zip, return an archive rather than an array.
            raise ValueError(
                f"{spec!r}: {path} is not a .npy file "
                + ("(it is empty)" if not magic else "(it does not start with NumPy's header)")
            )
        with _reading(spec):
            return np.load(path, mmap_mode="r")
    if lower.endswith(".npz"):
        with _reading(spec):
            archive = np.load(path)
        if not hasattr(archive, "files"):
            raise ValueError(f"{spec!r}: {path} holds one array, not a .npz archive of arrays")
        if not rest:
            if len(archive.files) != 1:
                raise ValueError(f"{spec!r}: name one of the arrays {archive.files} as {path}:KEY")
            rest = archive.files[0]
        if rest not in archive.files:
            raise ValueError(f"{spec!r}: {path} has no array {rest!r} (it has {archive.files})")
        with _reading(spec):
            return archive[rest]
    if lower.endswith(_H5_SUFFIXES):
        try:
            import h5py
        except ImportError as e:
            raise ValueError(f"{spec!r}: reading HDF5 needs h5py (pip install h5py)") from e
        if not rest:
            raise ValueError(f"{spec!r}: name the data set as {path}:DATASET")
        with _reading(spec):
            f = h5py.File(path, "r")
            found = rest in f and isinstance(f[rest], h5py.Dataset)
        if not found:
            raise ValueError(f"{spec!r}: {path} has no data set {rest!r}")
        return f[rest]
    dt, sample_shape = _raw_layout(spec, path, rest)
    with _reading(spec):
        size = os.path.getsize(path)
    # Python ints: a product of large dimensions does not wrap around as int64 would.
    sample_bytes = dt.itemsize * math.prod(sample_shape)
    layout = f"dtype {dt}, shape {sample_shape}"
    if size == 0:
        raise ValueError(f"{spec!r}: {path} is empty: no samples ({layout})")
    if size < sample_bytes:
        raise ValueError(
            f"{spec!r}: {path} holds {size} bytes, less than one sample of {sample_bytes} "
            f"bytes ({layout})"
        )
    if size % sample_bytes:
        raise ValueError(
            f"{spec!r}: {path} holds {size} bytes, not a whole number of samples of "
            f"{sample_bytes} bytes ({layout})"
        )
    with _reading(spec):
        return np.memmap(path, dtype=dt, mode="r", shape=(size // sample_bytes, *sample_shape))


_NPY_MAGIC = b"\x93NUMPY"


def _raw_layout(spec: str, path: str, rest: str) -> tuple[Any, tuple[int, ...]]:
    """A raw SPEC's ``DTYPE[:D1,D2]``: the NumPy dtype, one keras-tfr stores, and the
    per-sample shape. Checked before any memmap is made: a memmap of an object dtype
    reads the file's bytes as pointers (and crashes the process)."""
    import numpy as np

    from keras_tfr.schema import SUPPORTED_DTYPES

    dtype, _, shape = rest.partition(":")
    if not dtype:
        raise ValueError(
            f"{spec!r}: a raw file needs its dtype and per-sample shape, as "
            f"{path}:float32:28,28 (or {path}:int64 for scalars)"
        )
    try:
        dt = np.dtype(dtype)
        sample_shape = tuple(int(d) for d in shape.split(",")) if shape else ()
    except (TypeError, ValueError, SyntaxError) as e:  # np.dtype("f4,(2"): SyntaxError
        raise ValueError(f"{spec!r}: bad dtype or shape ({e})") from e
    if dt.name not in SUPPORTED_DTYPES:
        raise ValueError(
            f"{spec!r}: Expected a raw file's dtype to be one of {sorted(SUPPORTED_DTYPES)}. "
            f"Received: {dtype!r} (NumPy dtype {dt})"
        )
    if any(d < 1 for d in sample_shape):
        raise ValueError(
            f"{spec!r}: bad shape {shape!r}: every dimension must be a positive int, as in "
            f"{path}:{dtype}:28,28"
        )
    return dt, sample_shape


@contextlib.contextmanager
def _reading(spec: str) -> Iterator[None]:
    """Names ``spec`` in the errors of the libraries that open and read its file
    (NumPy's "EOF: reading array header", h5py's "file signature not found", a
    `zipfile.BadZipFile`, ...), as a `ValueError` (an `OSError` stays one). Running out
    of memory is not bad input: a `MemoryError` goes on as it is."""
    try:
        yield
    except MemoryError:
        raise
    except Exception as e:
        message = f"{spec!r}: {str(e) or type(e).__name__}"
        raise (OSError if isinstance(e, OSError) else ValueError)(message) from e


def _split_spec(spec: str) -> tuple[str, str]:
    """``(path, rest)`` of a SPEC: the longest part before a ``:`` (or the whole SPEC)
    that names an existing file, so that a file name may hold ``:``; else the part
    before the first ``:``."""
    cuts = [i for i, c in enumerate(spec) if c == ":"]
    for cut in [len(spec), *reversed(cuts)]:
        if os.path.isfile(spec[:cut]):
            return spec[:cut], spec[cut + 1 :]
    path, _, rest = spec.partition(":")
    return path, rest


def _load(flag: str, given: str, spec: str) -> Any:
    """`load_array` of ``spec``, given to ``flag`` as ``given`` (``NAME=SPEC`` or the
    SPEC): its errors name both, so that the bad one of several files is told."""
    try:
        return load_array(spec)
    except (ValueError, TypeError, OSError) as e:
        message = str(e).removeprefix(f"{spec!r}: ")
        raise ValueError(f"cannot read {flag} spec {given!r}: {message}") from e


def _role_value(specs: list[str] | None, flag: str) -> Any:
    """One SPEC -> an array; several ``NAME=SPEC`` -> a dict. A SPEC whose file name holds
    ``=`` is a SPEC, not ``NAME=SPEC``. ``flag`` (``--x``, ``--y``) is named in errors."""
    if not specs:
        return None
    if len(specs) == 1 and (
        "=" not in specs[0].split(":")[0] or os.path.isfile(_split_spec(specs[0])[0])
    ):
        return _load(flag, specs[0], specs[0])
    out = {}
    for s in specs:
        name, sep, spec = s.partition("=")
        if not sep:
            raise ValueError(f"with several arrays for one role, name each: NAME=SPEC (got {s!r})")
        if name in out:
            raise ValueError(f"the name {name!r} is given twice (NAME=SPEC names one array each)")
        out[name] = _load(flag, s, spec)
    return out


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Convert arrays on disk to a keras-tfr data set, chunk by chunk with flat memory. "
        "SPEC is file.npy (memory-mapped), file.npz:KEY, file.h5:DATASET (h5py), or a raw "
        "memmap file.bin:DTYPE:D1,D2 (per-sample shape). Give several NAME=SPEC for named "
        "inputs or outputs."
    )
    parser.epilog = "example: keras-tfr convert data/train --x x.npy --y labels.h5:y"
    parser.add_argument("directory", help="directory of the new data set")
    parser.add_argument("--x", action="append", required=True, metavar="SPEC", help="inputs")
    parser.add_argument("--y", action="append", metavar="SPEC", help="targets")
    parser.add_argument("--sample-weight", metavar="SPEC", help="per-sample weights")
    add_size_arguments(parser)
    parser.add_argument(
        "--compression",
        type=str.upper,
        choices=["GZIP", "ZLIB"],
        help="shard compression (any case)",
    )
    parser.add_argument("--min-shards", type=int, default=8, help="write at least N shards")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing data set")
    parser.add_argument("--resume", action="store_true", help="continue an unfinished conversion")
    parser.add_argument(
        "--shuffle-seed",
        type=int,
        metavar="N",
        help="write the samples in the order of a permutation seeded by N (mixes "
        "class-sorted arrays for block mode; reads the input at random)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run_convert(args: argparse.Namespace) -> int:
    if args.overwrite and args.resume:
        return _error("convert", "--overwrite and --resume contradict each other: pass one of them")
    x = _role_value(args.x, "--x")
    y = _role_value(args.y, "--y")
    sw = args.sample_weight
    sw = _load("--sample-weight", sw, sw) if sw else None
    from keras_tfr.write.arrays_to_records import ArraysToRecords

    manifest = ArraysToRecords.from_arrays(
        x,
        y,
        args.directory,
        sample_weight=sw,
        compression=args.compression,
        min_shards=args.min_shards,
        overwrite=args.overwrite,
        resume=args.resume,
        verbose=progress(args),
        shard_size=args.shard_size,
        record_size=args.record_size,
        shuffle_seed=args.shuffle_seed,
    )
    print(
        f"wrote {manifest.total_samples} samples in {len(manifest.shards)} shards "
        f"({_fmt_bytes(manifest.total_bytes)}) to {args.directory}"
    )
    return 0


# ------------------------------------------------------------------------------ info


def _fmt_bytes(n: float) -> str:
    from keras_tfr.manifest import format_bytes

    return format_bytes(n)


def add_info_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Show a data set's schema (features, roles, dtypes, shapes), counts, sizes and a "
        "table of its shards. Reads only the manifest (and file sizes): quick on any size."
    )
    parser.add_argument("directory", help="the data set's directory")
    parser.add_argument("--json", action="store_true", help="print the manifest as JSON")
    parser.add_argument(
        "--max-shards", type=int, default=50, help="shards listed in the table (0: all)"
    )


def _layout(m: Any) -> str:
    """The record layout in words: plain, or the lattice and what its padding costs."""
    if m.lattice is None:
        return "plain"
    from keras_tfr.schema import BlockEncoder

    plain = BlockEncoder(m.features).fixed_layout(m.samples_per_record)[2]
    padding = (m.record_bytes - plain) / max(1, plain)
    rows = ", ".join(f"{k} {v} B" for k, v in sorted(m.lattice.rows.items()))
    return f"lattice (period {m.lattice.period} B; rows: {rows}; padding {padding:.1%})"


def run_info(args: argparse.Namespace) -> int:
    from keras_tfr.manifest import Manifest

    if args.max_shards < 0:
        raise ValueError(f"Expected `--max-shards` >= 0 (0: all). Received: {args.max_shards}")
    m = Manifest.load(args.directory, check_files=False)
    states = [_shard_state(m, shard) for shard in m.shards]
    problems = sum(state != "ok" for state in states)
    if args.json:
        print(json.dumps(m.to_json(), indent=2))
        return _shard_problems(problems)
    out = [
        f"data set    {args.directory}",
        f"format      keras-tfr v{m.to_json()['format_version']}, written by keras-tfr "
        f"{m.writer_version} {m.created}",
        f"samples     {m.total_samples}",
        f"records     {m.total_records} ({m.samples_per_record} samples per record)",
        f"layout      {_layout(m)}",
        "order       "
        + (
            "as given"
            if m.shuffle_seed is None
            else f"shuffled when written (shuffle_seed={m.shuffle_seed})"
        ),
        f"shards      {len(m.shards)}",
        f"size        {_fmt_bytes(m.total_bytes)} on disk"
        + (f", {m.compression} compressed" if m.compression else ""),
        "features:",
    ]
    width = max(len(f.key) for f in m.features)
    for f in m.features:
        shape = f"({', '.join(map(str, f.shape))}{',' if len(f.shape) == 1 else ''})"
        kind = getattr(f, "kind", "fixed")
        if kind == "ragged":
            shape = "(None" + "".join(f", {d}" for d in f.shape) + ")"
        desc = "bytes (one string per sample)" if kind == "bytes" else f"{f.dtype:8} {shape}"
        out.append(f"  {f.key:{width}}  {f.role:13}  {desc}")
    if m.user_metadata:
        out.append(f"metadata    {json.dumps(m.user_metadata)}")
    out.append("shards:")
    out.append(f"  {'file':28} {'samples':>10} {'records':>9} {'bytes':>12}  checksum       state")
    limit = args.max_shards or len(m.shards)
    for shard, state in list(zip(m.shards, states))[:limit]:
        out.append(
            f"  {shard.file:28} {shard.samples:>10} {shard.records:>9} {shard.bytes:>12}  "
            f"{shard.checksum}  {state}"
        )
    if len(m.shards) > limit:
        out.append(f"  ... and {len(m.shards) - args.max_shards} more (--max-shards 0 lists all)")
    print("\n".join(out))
    return _shard_problems(problems)


def _shard_state(m: Any, shard: Any) -> str:
    """ "ok", "MISSING" or "SIZE <bytes>" (local shards; a URL's are not looked at)."""
    if "://" in m.directory:
        return "ok"
    try:
        actual = os.path.getsize(m.shard_path(shard))
    except OSError:
        return "MISSING"
    return "ok" if actual == shard.bytes else f"SIZE {actual}"


def _shard_problems(problems: int) -> int:
    """`info`'s exit code: 1 (and a line on stderr) when shards are missing or resized."""
    if not problems:
        return 0
    print(
        f"{problems} shard(s) missing or of the wrong size: run `keras-tfr verify`",
        file=sys.stderr,
    )
    return 1


# ---------------------------------------------------------------------------- verify


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Read every record of a data set and check it: file sizes, TFRecord CRCs, the "
        "Example layout, record and sample counts, and each shard's checksum. Exits 1 "
        "naming every bad shard, 0 when all are sound."
    )
    parser.add_argument("directory", help="the data set's directory")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run_verify(args: argparse.Namespace) -> int:
    from keras_tfr.verifier import verify

    report = verify(args.directory, verbose=progress(args))
    print(report.summary())
    return 0 if report.ok else 1


# ----------------------------------------------------------------------------- bench


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Measure how fast this machine reads a data set: examples/s and MB/s over --epochs "
        "epochs of TFRecordSequenceSource. A warm-up iterator reads one batch, not timed "
        "(it starts the pipeline: threads, first reads, tracing); then every epoch is "
        "timed whole, from its first batch (where a shuffle buffer fills, as in training), "
        "and the samples reported are theirs. Run it twice to see the page cache's effect."
    )
    parser.add_argument("directory", help="the data set's directory")
    parser.add_argument("--batch-size", type=int, default=256, help="samples per batch")
    parser.add_argument("--epochs", type=int, default=1, help="epochs to time")
    parser.add_argument(
        "--no-shuffle", action="store_true", help="read in written order (default: shuffled)"
    )
    parser.add_argument("--shuffle-memory", default="64MB", help="shuffle buffer in bytes")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def _batch_len(batch: Any) -> int:
    first = batch[0] if isinstance(batch, tuple) else batch
    while isinstance(first, (dict, tuple, list)):
        first = next(iter(first.values())) if isinstance(first, dict) else first[0]
    return int(first.shape[0])


def run_bench(args: argparse.Namespace) -> int:
    if args.batch_size < 1 or args.epochs < 1:
        return _error("bench", "--batch-size and --epochs must be positive")
    from keras_tfr.errors import CorruptRecordError, ShardError

    try:
        return _bench(args)
    except (ShardError, CorruptRecordError) as e:
        # The command ran and found damage, as `info` and `verify` report it: status 1.
        message = str(e).removeprefix("keras-tfr: ")
        print(f"keras-tfr bench: damaged data set: {message}", file=sys.stderr)
        return 1


def _bench(args: argparse.Namespace) -> int:
    from keras_tfr.source import TFRecordSequenceSource

    src = TFRecordSequenceSource(
        args.directory,
        batch_size=args.batch_size,
        shuffle=not args.no_shuffle,
        seed=0,
        shuffle_memory=args.shuffle_memory,
    )
    m = src.manifest
    # The warm-up: an iterator of its own reads one batch before the clock starts (the
    # pipeline traced, its threads started) and is dropped. Every timed epoch is then
    # read whole, from its first batch: filling a shuffle buffer or the prefetch, which
    # every epoch pays, is timed too (timing an epoch from its second batch overstated
    # the rate of a data set that fits in that buffer many times over).
    warm = iter(src)
    warmup_samples = _batch_len(next(warm))
    del warm
    src.set_epoch(0)  # the timed epochs are epochs 0, 1, ...: the warm-up used none
    samples = 0
    start = time.perf_counter()
    for _epoch in range(args.epochs):
        for batch in src:
            samples += _batch_len(batch)
    seconds = time.perf_counter() - start
    mean_bytes = m.total_bytes / max(1, m.total_samples)
    result = {
        "directory": args.directory,
        "samples": samples,
        "seconds": round(seconds, 4),
        "examples_per_s": round(samples / seconds, 1) if seconds else None,
        "mb_per_s": round(samples * mean_bytes / seconds / 1e6, 2) if seconds else None,
        "batch_size": args.batch_size,
        "shuffle": not args.no_shuffle,
        "warmup_samples": warmup_samples,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{samples} samples in {seconds:.2f} s: {result['examples_per_s']:,.0f} examples/s, "
            f"{result['mb_per_s']:,.1f} MB/s (batch {args.batch_size}, "
            f"{'shuffled' if result['shuffle'] else 'in order'}"
            + f"; after a warm-up batch of {warmup_samples} samples)"
        )
    return 0
