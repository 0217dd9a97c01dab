"""TFRecord files written by other tools: stream them, or convert them to keras-tfr blocks.

Most TFRecord data in the wild holds one `tf.train.Example` per sample, often in the
layout of TensorFlow's tutorial: the image as ``tf.io.serialize_tensor`` bytes in a
``bytes_list``, the label in a ``float_list`` or ``int64_list``. `from_tfrecords` streams
such files as fast as that layout allows: records are batched first, then parsed with one
batched ``parse_example``; a serialized tensor of known dtype and shape is cut out of its
bytes with one ``substr`` and one ``decode_raw`` (no per-sample ``parse_tensor``), and
``parse_tensor`` is mapped per sample only where the shape is unknown. Records are
counted once and the counts cached beside the files in ``.keras-tfr-counts.json`` (keyed
by file name, size and modification time), so the step count is known from then on.

The per-sample layout still pays tf.data's per-element cost for every sample;
`convert_tfrecords` (``keras-tfr convert-tfrecords SRC... DST``) rewrites the files as
keras-tfr blocks once, after which `TFRecordSequenceSource` reads them several times
faster (see ``benchmarks/tfrecords_convert.py``).
"""

from __future__ import annotations

import glob as _glob
import json
import logging
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from keras_tfr import _checks, _io
from keras_tfr._compat import tf as compat_tf
from keras_tfr._seeds import drawn_seed, only_op_seeds
from keras_tfr.manifest import DEFAULT_RECORD_SIZE, DEFAULT_SHARD_SIZE, Manifest, parse_size

if TYPE_CHECKING:  # only for annotations: TensorFlow loads when a function runs
    import tensorflow as tf

__all__ = [
    "COUNTS_NAME",
    "TensorFeature",
    "convert_tfrecords",
    "count_records",
    "from_tfrecords",
    "infer_features",
]

log = logging.getLogger("keras_tfr")

COUNTS_NAME = ".keras-tfr-counts.json"
_COUNTS_FORMAT = "keras-tfr-record-counts"
_READ_BUFFER = 1 << 20
_INFER_RECORDS = 64


@dataclass(frozen=True)
class TensorFeature:
    """A bytes feature holding ``tf.io.serialize_tensor`` of each sample (tutorial layout).

    Args:
        dtype: the serialized tensors' dtype (``tf.float32``, ``"uint8"``, ...).
        shape: their shape, when every sample has the same one: decoding then takes one
            ``substr`` and one ``decode_raw`` per batch. ``None`` maps ``tf.io.parse_tensor``
            over each sample (slower; shapes must still agree within a batch).

    Example:
        >>> features = {"image": TensorFeature(tf.float32, (28, 28)),
        ...             "label": tf.io.FixedLenFeature([], tf.float32)}
    """

    dtype: Any
    shape: tuple[int, ...] | None = None


# ----------------------------------------------------------------- decode / ragged options


def check_decode_options(
    ragged: str, decode: Mapping[str, Callable] | None, keys: Sequence[str]
) -> tuple[str, dict[str, Callable]]:
    """Validates ``ragged=`` and ``decode=`` against the feature keys."""
    if ragged not in ("pad", "ragged"):
        raise ValueError(f"Expected `ragged` to be 'pad' or 'ragged'. Received: {ragged!r}")
    if decode is None:
        return ragged, {}
    if not isinstance(decode, Mapping):
        raise TypeError(
            "Expected `decode` to be a dict mapping feature keys to functions, e.g. "
            f"{{'x': tf.io.decode_png}}. Received: {type(decode).__name__}"
        )
    for k, fn in decode.items():
        if k not in keys:
            raise ValueError(
                f"Expected the keys of `decode` to be feature keys of the data set "
                f"({sorted(keys)}). Received: {k!r}"
            )
        if not callable(fn):
            raise TypeError(f"Expected `decode[{k!r}]` to be callable. Received: {fn!r}")
    return ragged, dict(decode)


def _map_samples(fn: Callable, values: Any, key: str) -> Any:
    """Applies `fn` to each sample of a batch (dense or ragged) with one `tf.map_fn`."""
    import tensorflow as tf

    if isinstance(values, tf.RaggedTensor):
        elem = tf.TensorSpec([None, *values.shape[2:]], values.dtype)
    else:
        elem = tf.TensorSpec(values.shape[1:], values.dtype)
    # A `tf.function`, so that AutoGraph converts the user's function (its Python `if`
    # on tensors, say) also where the caller's own is not converted (keras-tfr's
    # pipelines: `keras_tfr._compat.tf.one_device_functions`).
    per_sample = tf.function(fn)
    traced = per_sample.get_concrete_function(elem).structured_outputs
    if not isinstance(traced, tf.Tensor):
        raise TypeError(
            f"Expected `decode[{key!r}]` to return one tensor per sample. Received: {traced!r}"
        )
    signature = tf.TensorSpec(traced.shape, traced.dtype)
    return tf.map_fn(per_sample, values, fn_output_signature=signature)


def finish_features(decode: Mapping[str, Callable], ragged: str) -> Callable:
    """A per-batch function over ``{key: tensor}``: user decoders, then padding."""
    import tensorflow as tf

    def finish(batch: dict) -> dict:
        out = {}
        for key, value in batch.items():
            if key in decode:
                value = _map_samples(decode[key], value, key)
            if ragged == "pad" and isinstance(value, tf.RaggedTensor):
                value = value.to_tensor()
            out[key] = value
        return out

    return finish


# ------------------------------------------------------------------------- file listing


def expand_paths(paths_or_glob: Any, *, argument: str = "paths_or_glob") -> list[str]:
    """Expands a path, a glob pattern or a list of them into a sorted list of files."""
    if isinstance(paths_or_glob, (str, os.PathLike)):
        patterns = [os.fspath(paths_or_glob)]
    elif isinstance(paths_or_glob, Iterable):
        patterns = [os.fspath(p) for p in paths_or_glob]
    else:
        raise TypeError(
            f"Expected `{argument}` to be a path, a glob pattern or a list of them. "
            f"Received: {paths_or_glob!r}"
        )
    files: list[str] = []
    for p in patterns:
        # A file that exists is itself, though its name holds `[` or `*`.
        if any(c in p for c in "*?[") and not (_io.exists(p) and not _io.isdir(p)):
            if _io.is_remote(p):
                import tensorflow as tf

                matches = sorted(tf.io.gfile.glob(p))
            else:
                matches = sorted(_glob.glob(p))
            if not matches:
                raise FileNotFoundError(f"`{argument}`: the pattern {p!r} matches no file.")
            files.extend(matches)
        else:
            if not _io.exists(p):
                raise FileNotFoundError(f"`{argument}`: {p!r} does not exist.")
            if _io.isdir(p):
                raise IsADirectoryError(
                    f"`{argument}`: {p!r} is a directory; give files or a glob such as "
                    f"{os.path.join(p, '*.tfrecord')!r}."
                )
            files.append(p)
    if not files:
        raise ValueError(f"Expected `{argument}` to name at least one file. Received: none.")
    return files


# ------------------------------------------------------------------------- record counts


def _stat(path: str) -> tuple[int, int]:
    if _io.is_remote(path):
        import tensorflow as tf

        st = tf.io.gfile.stat(path)
        return int(st.length), int(st.mtime_nsec)
    st = os.stat(path)
    return int(st.st_size), int(st.st_mtime_ns)


def _read_cache(path: str) -> dict:
    try:
        obj = json.loads(_io.read_bytes(path).decode("utf-8"))
    except Exception:  # missing, unreadable or damaged: count again
        return {}
    if not isinstance(obj, dict) or obj.get("format") != _COUNTS_FORMAT:
        return {}
    files = obj.get("files")
    return files if isinstance(files, dict) else {}


def count_records(
    paths: Sequence[str], *, compression: str | None = None, cache: bool = True
) -> list[int]:
    """Counts the records of each file, once: counts are cached beside the files.

    The cache, ``.keras-tfr-counts.json`` in each file's directory, maps a file name to
    its size, modification time and record count; a file whose size or time changed is
    counted again. A directory that cannot be written is simply not cached.

    Example:
        >>> count_records(["old/train-0.tfrecord", "old/train-1.tfrecord"])
        [5000, 5000]
    """
    import tensorflow as tf

    counts = []
    caches: dict[str, dict] = {}
    dirty: set[str] = set()
    for path in paths:
        directory, name = os.path.split(path) if not _io.is_remote(path) else path.rsplit("/", 1)
        cache_path = _io.join(directory or ".", COUNTS_NAME)
        if cache and cache_path not in caches:
            caches[cache_path] = _read_cache(cache_path)
        size, mtime = _stat(path)
        entry = caches.get(cache_path, {}).get(name)
        if (
            isinstance(entry, dict)
            and entry.get("size") == size
            and entry.get("mtime_ns") == mtime
            and entry.get("compression") == compression
            and isinstance(entry.get("records"), int)
        ):
            counts.append(entry["records"])
            continue
        ds = tf.data.TFRecordDataset(path, compression or "", buffer_size=_READ_BUFFER)
        try:
            n = int(ds.reduce(np.int64(0), lambda c, _: c + 1))
        except tf.errors.OpError as e:
            raise OSError(f"Could not read the TFRecord file {path}: {_said(e)}") from e
        counts.append(n)
        if cache:
            caches[cache_path][name] = {
                "size": size,
                "mtime_ns": mtime,
                "compression": compression,
                "records": n,
            }
            dirty.add(cache_path)
    for cache_path in dirty:
        try:
            _io.write_json_atomic(
                cache_path, {"format": _COUNTS_FORMAT, "files": caches[cache_path]}
            )
        except Exception as e:  # read-only directory: fine, count again next time
            log.info("keras-tfr: could not cache record counts in %s (%s)", cache_path, e)
    return counts


def _said(error: Any) -> str:
    """A TensorFlow error's message without the function, op and node names around it."""
    text = re.sub(r"^\{\{function_node [^}]*\}\}\s*", "", str(error.message))
    text = re.sub(
        r"^Error in user-defined function passed to \S+ transformation with iterator: \S+\s*",
        "",
        text,
    )
    text = re.sub(r"\s*\[\[\{\{node [^\n]*\]\]", "", text)
    return re.sub(r"\s*\[Op:[^\]]*\].*$", "", text, flags=re.S).strip()


# ---------------------------------------------------------------------- feature inference


def infer_features(
    paths: Sequence[str], *, compression: str | None = None, max_records: int = _INFER_RECORDS
) -> dict[str, Any]:
    """Guesses a parsing spec from the first records of the first file that holds any.

    A bytes feature that parses as a serialized tensor becomes a `TensorFeature`; lists
    of one length in every record seen become ``FixedLenFeature``, others
    ``VarLenFeature``. Pass ``features=`` explicitly where a guess from the first
    `max_records` records could be wrong.
    """
    import tensorflow as tf
    from tensorflow.core.framework import tensor_pb2

    seen: dict[str, list[tuple[str, int, Any]]] = {}
    n_records = 0
    for path in paths:  # the first file that holds records (sharded writers leave empty ones)
        ds = iter(tf.data.TFRecordDataset(path, compression or "").take(max_records))
        while True:
            try:
                raw = next(ds)
            except StopIteration:
                break
            except tf.errors.OpError as e:  # not TFRecords, or another compression
                raise OSError(f"Could not read the TFRecord file {path}: {_said(e)}") from e
            try:
                example = tf.train.Example.FromString(raw.numpy())
            except Exception as e:  # protobuf's DecodeError: not an Example
                raise ValueError(
                    f"Cannot infer `features`: record {n_records} of {path} is not a "
                    "`tf.train.Example`; pass `features=` for what it holds."
                ) from e
            n_records += 1
            _seen_features(example, seen, tensor_pb2)
        if n_records:
            break
    if not n_records:
        which = (
            f"{paths[0]} holds no record"
            if len(paths) == 1
            else f"none of the {len(paths)} files holds a record"
        )
        raise ValueError(f"Cannot infer `features`: {which}.")
    features: dict[str, Any] = {}
    for key, entries in sorted(seen.items()):
        kinds = {k for k, _, _ in entries if k}
        if len(kinds) != 1:
            raise ValueError(
                f"Cannot infer `features`: feature {key!r} has the kinds {sorted(kinds)} in "
                "different records; pass `features=` explicitly."
            )
        kind = kinds.pop()
        dtype = {"bytes_list": tf.string, "float_list": tf.float32, "int64_list": tf.int64}[kind]
        lengths = {n for _, n, _ in entries}
        tensors = [t for _, _, t in entries]
        if kind == "bytes_list" and len(entries) == n_records and all(tensors):
            dtypes = {t[0] for t in tensors}
            shapes = {t[1] for t in tensors}
            if len(dtypes) == 1:
                features[key] = TensorFeature(
                    dtypes.pop(), shapes.pop() if len(shapes) == 1 else None
                )
                continue
        if len(entries) == n_records and len(lengths) == 1:
            n = lengths.pop()
            features[key] = tf.io.FixedLenFeature([] if n == 1 else [n], dtype)
        else:
            features[key] = tf.io.VarLenFeature(dtype)
    return features


def _seen_features(example: Any, seen: dict[str, list[tuple[str, int, Any]]], pb2: Any) -> None:
    """Adds what one `tf.train.Example` holds to ``seen``: per key, (kind, length, tensor)."""
    for key, feature in example.features.feature.items():
        kind = feature.WhichOneof("kind")
        values = getattr(feature, kind).value if kind else []
        tensor = None
        if kind == "bytes_list" and len(values) == 1:
            tensor = _as_serialized_tensor(values[0], pb2)
        seen.setdefault(key, []).append((kind, len(values), tensor))


def _has_values(proto: Any) -> bool:
    """Whether a TensorProto holds values in its typed fields (not `tensor_content`)."""
    return any(field.name.endswith("_val") and value for field, value in proto.ListFields())


def _as_serialized_tensor(value: bytes, tensor_pb2: Any) -> tuple[str, tuple[int, ...]] | None:
    try:
        proto = tensor_pb2.TensorProto.FromString(value)
    except Exception:
        return None
    import tensorflow as tf

    try:
        dtype = tf.as_dtype(proto.dtype)
    except Exception:
        return None
    if not proto.dtype or dtype == tf.string or not dtype.is_numpy_compatible:
        return None
    shape = tuple(int(d.size) for d in proto.tensor_shape.dim)
    nbytes = math.prod(shape) * dtype.size
    content_ok = len(proto.tensor_content) == nbytes and (nbytes > 0 or not _has_values(proto))
    if content_ok and proto.SerializeToString() == value:
        return dtype.name, shape
    return None


# -------------------------------------------------------------------------- the pipeline


def _parse_plan(features: Mapping[str, Any]) -> tuple[dict, dict]:
    """Returns (parse spec for `parse_example`, {key: TensorFeature})."""
    import tensorflow as tf

    if not isinstance(features, Mapping) or not features:
        raise TypeError(
            "Expected `features` to be a non-empty dict mapping feature names to "
            "tf.io.FixedLenFeature, tf.io.VarLenFeature, tf.io.RaggedFeature or "
            f"TensorFeature. Received: {features!r:.200}"
        )
    spec: dict[str, Any] = {}
    tensors: dict[str, TensorFeature] = {}
    for key, f in features.items():
        if isinstance(f, TensorFeature):
            dtype = tf.as_dtype(f.dtype)
            if dtype == tf.string and f.shape is not None:
                raise ValueError(
                    f"Feature {key!r}: a serialized tensor of strings is read with "
                    f"`TensorFeature(tf.string)` (shape=None): its bytes have no fixed size "
                    f"to decode by. Received: shape={tuple(f.shape)}"
                )
            tensors[key] = TensorFeature(dtype, None if f.shape is None else tuple(f.shape))
            spec[key] = tf.io.FixedLenFeature([], tf.string)
        elif isinstance(f, tf.io.VarLenFeature):
            spec[key] = tf.io.RaggedFeature(f.dtype, row_splits_dtype=tf.int64)
        elif isinstance(f, (tf.io.FixedLenFeature, tf.io.RaggedFeature)):
            spec[key] = f
        else:
            raise TypeError(
                f"Expected `features[{key!r}]` to be a tf.io.FixedLenFeature, VarLenFeature, "
                f"RaggedFeature or keras_tfr.tfrecords.TensorFeature. Received: {f!r}"
            )
    return spec, tensors


def _decode_tensor(strings: Any, key: str, feature: TensorFeature) -> Any:
    """``[n]`` serialized tensors -> ``[n, *shape]``; substr + decode_raw for a known shape."""
    import tensorflow as tf

    dtype = feature.dtype
    if feature.shape is None:
        return tf.map_fn(
            lambda s: tf.io.parse_tensor(s, dtype),
            strings,
            fn_output_signature=tf.TensorSpec(None, dtype),
        )
    shape = feature.shape
    nbytes = math.prod(shape) * dtype.size
    with tf.init_scope():  # eager, also while the pipeline's function is traced
        example = tf.io.serialize_tensor(tf.zeros(shape, dtype)).numpy()
    header = example[: len(example) - nbytes]
    ok = tf.reduce_all(tf.strings.length(strings) == len(example)) & tf.reduce_all(
        tf.strings.substr(strings, 0, len(header)) == header
    )
    check = tf.debugging.Assert(
        ok,
        [
            f"keras-tfr: feature `{key}` holds a serialized tensor that is not {dtype.name} "
            f"of shape {shape}: pass the writer's dtype and shape to TensorFeature, or "
            "shape=None"
        ],
    )
    if nbytes == 0:  # a tensor with no element: its header was checked, no bytes to read
        with tf.control_dependencies([check]):
            return tf.zeros(tf.concat([tf.shape(strings, tf.int64), shape], 0), dtype)
    with tf.control_dependencies([check]):
        payload = tf.strings.substr(strings, len(header), nbytes)
    u8 = tf.io.decode_raw(payload, tf.uint8, fixed_length=nbytes)
    if dtype.size == 1:
        x = tf.reshape(u8, [-1, *shape])
        return tf.cast(x, tf.bool) if dtype == tf.bool else tf.bitcast(x, dtype)
    return tf.bitcast(tf.reshape(u8, [-1, *shape, dtype.size]), dtype)


def _keys_of(value: Any, argument: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, Sequence) and all(isinstance(v, str) for v in value):
        return list(value)
    raise TypeError(
        f"Expected `{argument}` to be a feature name or a list of names. Received: {value!r}"
    )


def _roles(
    keys: Sequence[str], x: Any, y: Any, sample_weight: Any, inferred: bool = False
) -> dict[str, Any]:
    """role -> a feature name (one tensor) or a list of names (a dict of tensors).
    ``inferred``: ``keys`` were read from the files, not given as ``features``."""
    y_keys = _keys_of(y, "y")
    sw_keys = _keys_of(sample_weight, "sample_weight")
    if len(sw_keys) > 1:
        raise ValueError(f"Expected one `sample_weight` feature. Received: {sw_keys}")
    if x is None:
        x_keys = [k for k in keys if k not in y_keys and k not in sw_keys]
        x = x_keys[0] if len(x_keys) == 1 else x_keys
    x_keys = _keys_of(x, "x")
    used = x_keys + y_keys + sw_keys
    for k in used:
        if k not in keys:
            role = "x" if k in x_keys else "y" if k in y_keys else "sample_weight"
            if inferred:
                raise ValueError(
                    f"Expected `{role}` to name a feature of the files. Received: {k!r}; "
                    f"their records hold {sorted(keys)}."
                )
            raise ValueError(
                f"Feature {k!r} is not in `features` ({sorted(keys)}): add it to `features`."
            )
    if len(set(used)) != len(used) or not x_keys:
        raise ValueError(
            "Expected `x`, `y` and `sample_weight` to name distinct features, `x` at least "
            f"one. Received: x={x!r}, y={y!r}, sample_weight={sample_weight!r}"
        )
    roles: dict[str, Any] = {"x": x}
    if y is not None:
        roles["y"] = y
    if sample_weight is not None:
        roles["sample_weight"] = sw_keys[0]
    return roles


def _next_seed(seed: int) -> int:
    """The seed after `seed`, wrapping within int64 (the records' shuffle is seeded apart
    from the files' shuffle, which takes `seed` itself)."""
    return (seed + 1 + _checks.SEED_BOUND) % (2 * _checks.SEED_BOUND) - _checks.SEED_BOUND


def from_tfrecords(
    paths_or_glob: Any,
    features: Mapping[str, Any] | None = None,
    batch_size: int = 32,
    *,
    x: str | Sequence[str] | None = None,
    y: str | Sequence[str] | None = None,
    sample_weight: str | None = None,
    shuffle: bool = True,
    seed: int | None = None,
    shuffle_memory: int | str = "64MB",
    drop_remainder: bool = False,
    compression: str | None = None,
    ragged: str = "pad",
    decode: Mapping[str, Callable] | None = None,
    num_parallel_reads: int | None = None,
    cache_counts: bool = True,
    _raw_roles: bool = False,
) -> tf.data.Dataset:
    """Streams TFRecord files of one `tf.train.Example` per sample into Keras.

    Args:
        paths_or_glob: a file, a glob pattern (``"old/train-*.tfrecord"``) or a list.
        features: feature name -> ``tf.io.FixedLenFeature``, ``tf.io.VarLenFeature``,
            ``tf.io.RaggedFeature`` or `TensorFeature` (``serialize_tensor`` bytes).
            ``None`` infers them from the first records (see `infer_features`).
        batch_size: samples per batch.
        x: the input feature (a tensor), or a list of names (a dict of tensors, for
            named inputs). Default: every feature not in `y` or `sample_weight`.
        y: the target feature, or a list of names; None yields inputs only.
        sample_weight: the name of a per-sample weight feature.
        shuffle: shuffle file order and records (buffer of `shuffle_memory` bytes), anew
            each epoch. Default True, as for `TFRecordSequenceSource`; pass False to read
            the files in the given order.
        seed: makes the shuffle reproducible: the same `seed` gives the same order whether
            or not `keras.utils.set_random_seed` was called. Any int from -2**63 to
            2**63 - 1. ``None``: a seed drawn from NumPy's global random state when the
            data set is made, so that `keras.utils.set_random_seed` makes the order
            reproducible, as it makes Keras' shuffle of NumPy arrays.
        shuffle_memory: the shuffle buffer's size in bytes (``"64MB"``).
        drop_remainder: drop the last, partial batch.
        compression: ``None``, ``"GZIP"`` or ``"ZLIB"``: the files' compression.
        ragged: variable-length features as ``"pad"`` (zero-padded per batch) or
            ``"ragged"`` (`tf.RaggedTensor`).
        decode: ``{name: fn}``, a TensorFlow function applied to each sample of a
            feature, e.g. ``{"image": tf.io.decode_png}`` for encoded images.
        num_parallel_reads: files read at once (default up to 8).
        cache_counts: cache record counts beside the files (``.keras-tfr-counts.json``).

    Returns:
        A `tf.data.Dataset` of batches ``x``, ``(x, y)`` or ``(x, y, sample_weight)``
        whose cardinality (``len(ds)``) is the number of steps per epoch.

    Example:
        >>> features = {"image": TensorFeature(tf.float32, (28, 28)),
        ...             "label": tf.io.FixedLenFeature([], tf.float32)}
        >>> train = from_tfrecords("old/*.tfrecord", features, 256, y="label", seed=0)
        >>> model.fit(train, epochs=5)
    """
    import tensorflow as tf

    from keras_tfr.gpu import keep_tensorflow_off_gpus

    keep_tensorflow_off_gpus()  # before TensorFlow starts: no GPU for it under JAX/torch
    if (
        isinstance(batch_size, bool)
        or not isinstance(batch_size, (int, np.integer))
        or (batch_size < 1)
    ):
        raise ValueError(f"Expected `batch_size` to be a positive int. Received: {batch_size!r}")
    if not isinstance(shuffle, (bool, np.bool_)):
        raise TypeError(f"Expected `shuffle` to be a bool. Received: {shuffle!r}")
    seed = _checks.optional_seed("seed", seed)
    if isinstance(compression, str):
        compression = compression.upper() or None
    if compression not in (None, "GZIP", "ZLIB"):
        raise ValueError(
            f"Expected `compression` to be None, 'GZIP' or 'ZLIB'. Received: {compression!r}"
        )
    shuffle_bytes = parse_size(shuffle_memory, argument="shuffle_memory")
    paths = expand_paths(paths_or_glob)
    inferred = features is None
    if features is None:
        features = infer_features(paths, compression=compression)
        log.info("keras-tfr: inferred features %s", features)
    parse_spec, tensors = _parse_plan(features)
    keys = list(features)
    roles = _roles(keys, x, y, sample_weight, inferred=inferred)
    ragged, decode = check_decode_options(ragged, decode, keys)

    counts = count_records(paths, compression=compression, cache=cache_counts)
    total = int(sum(counts))
    steps = total // batch_size if drop_remainder else math.ceil(total / batch_size)
    if steps == 0:
        raise ValueError(
            f"{len(paths)} file(s) hold {total} records: no batch of {batch_size} "
            f"(drop_remainder={drop_remainder})."
        )
    if shuffle and seed is None:
        seed = drawn_seed()  # `keras.utils.set_random_seed` decides it
    kept = [(p, c) for p, c in zip(paths, counts) if c]
    files = tf.data.Dataset.from_tensor_slices([p for p, _ in kept])
    if shuffle:
        with only_op_seeds():  # the seeds are fixed here, as the op is built
            files = files.shuffle(len(kept), seed=seed, reshuffle_each_iteration=True)
    cycle = max(1, min(num_parallel_reads or min(8, max(2, os.cpu_count() or 2)), len(kept)))
    # Functions prepared without Grappler for each new iterator, traced without AutoGraph
    # (`keras_tfr._compat.tf.one_device_functions`), as a source's are.
    with compat_tf.one_device_functions():
        records = files.interleave(
            lambda p: tf.data.TFRecordDataset(p, compression or "", buffer_size=_READ_BUFFER),
            cycle_length=cycle,
            # Not shuffled: whole files one after another, in the given order.
            block_length=1 if shuffle else max(c for _, c in kept),
            num_parallel_calls=tf.data.AUTOTUNE,
            deterministic=True,  # the seed alone decides the order
        )
    if shuffle:
        mean_record = max(1, sum(_stat(p)[0] for p, _ in kept) // max(1, total))
        buffer = max(1, min(total, shuffle_bytes // mean_record))
        with only_op_seeds():
            records = records.shuffle(buffer, seed=None if seed is None else _next_seed(seed))
    finish = finish_features(decode, ragged)

    def parse(serialized: tf.Tensor) -> Any:
        parsed = tf.io.parse_example(serialized, parse_spec)
        for key, feature in tensors.items():
            parsed[key] = _decode_tensor(parsed[key], key, feature)
        parsed = finish(parsed)
        if _raw_roles:
            return parsed
        values = []
        for role in ("x", "y", "sample_weight"):
            if role in roles:
                spec = roles[role]
                values.append(
                    parsed[spec] if isinstance(spec, str) else {k: parsed[k] for k in spec}
                )
        return values[0] if len(values) == 1 else tuple(values)

    batches = records.batch(batch_size, drop_remainder=drop_remainder)
    with compat_tf.one_device_functions():
        batches = batches.map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    batches = batches.prefetch(tf.data.AUTOTUNE)
    batches = batches.apply(tf.data.experimental.assert_cardinality(steps))
    batches = batches.with_options(compat_tf.no_inject_prefetch(tf.data.Options()))
    if _raw_roles:
        batches._keras_tfr_roles = roles
        batches._keras_tfr_total = total
    elif shuffle:
        from keras_tfr._compat import keras_shuffle

        keras_shuffle.mark_self_shuffling(batches)  # Keras' shuffle warning is wrong for it
    return batches


# --------------------------------------------------------------------------- conversion


def _to_writer_value(value: Any) -> tuple[Any, bool]:
    """A batch's tensor as the writer takes it; True when it is variable-length."""
    import tensorflow as tf

    if isinstance(value, tf.RaggedTensor):
        if value.ragged_rank != 1:
            raise ValueError("convert_tfrecords supports one ragged dimension per feature.")
        flat = value.values.numpy()
        splits = value.row_splits.numpy()
        return [flat[a:b] for a, b in zip(splits[:-1], splits[1:])], True  # noqa: RUF007
    arr = value.numpy()
    if arr.dtype == object:
        if arr.ndim != 1:
            raise ValueError(
                "convert_tfrecords stores a bytes feature with one value per sample; "
                f"received a string tensor of shape {arr.shape}."
            )
        return list(arr), True
    return arr, False


def convert_tfrecords(
    sources: Any,
    directory: str | os.PathLike,
    features: Mapping[str, Any] | None = None,
    *,
    x: str | Sequence[str] | None = None,
    y: str | Sequence[str] | None = None,
    sample_weight: str | None = None,
    compression: str | None = None,
    read_batch_size: int = 1024,
    overwrite: bool = False,
    shard_size: int | str = DEFAULT_SHARD_SIZE,
    record_size: int | str = DEFAULT_RECORD_SIZE,
    samples_per_record: int | None = None,
    output_compression: str | None = None,
    min_shards: int = 8,
    verbose: int = 1,
    cache_counts: bool = True,
) -> Manifest:
    """Rewrites TFRecord files of one Example per sample as a keras-tfr data set.

    Serialized tensors are stored decoded (raw blocks), variable-length lists as ragged
    features and other bytes (e.g. encoded images) as ``bytes`` features, to be decoded
    when read (``TFRecordSequenceSource(..., decode={"x": tf.io.decode_png})``). Memory
    stays bounded by `read_batch_size` samples; sample order is kept.

    Args:
        sources: files, a glob pattern, or a list of them.
        directory: the new data set's directory.
        features, x, y, sample_weight, compression: as for `from_tfrecords`
            (``features=None`` infers them).
        read_batch_size: samples read and written at a time.
        overwrite, shard_size, record_size, samples_per_record, min_shards, verbose: as
            for `ArraysToRecords`; `output_compression` is its ``compression``.

    Returns:
        The written data set's `Manifest`.

    Example:
        >>> convert_tfrecords("old/*.tfrecord", "data/train", y="label")
        >>> train = TFRecordSequenceSource("data/train", batch_size=256)
    """
    from keras_tfr.write.arrays_to_records import ArraysToRecords
    from keras_tfr.write.options import WriteOptions

    ds = from_tfrecords(
        sources,
        features,
        read_batch_size,
        x=x,
        y=y,
        sample_weight=sample_weight,
        shuffle=False,  # the new data set keeps the files' order
        compression=compression,
        ragged="ragged",
        cache_counts=cache_counts,
        _raw_roles=True,
    )
    roles = ds._keras_tfr_roles
    total = ds._keras_tfr_total
    variable: list[str] = []

    def role_key(role: str, name: str) -> str:
        return role if isinstance(roles[role], str) else f"{role}/{name}"

    options = WriteOptions(
        shard_size=shard_size,
        record_size=record_size,
        samples_per_record=samples_per_record,
        compression=output_compression,
        overwrite=overwrite,
        expected_samples=total,
        min_shards=min_shards,
        verbose=verbose,
        metadata={"converted_from": "tfrecords"},
    )
    writer = ArraysToRecords._from_options(directory, options)
    import tensorflow as tf

    with writer:
        for batch in _checked(ds, tf):
            parts: list[Any] = []
            for role in ("x", "y", "sample_weight"):
                if role not in roles:
                    parts.append(None)
                    continue
                spec = roles[role]
                names = [spec] if isinstance(spec, str) else list(spec)
                values = {}
                for name in names:
                    values[name], is_var = _to_writer_value(batch[name])
                    if is_var and role_key(role, name) not in variable:
                        variable.append(role_key(role, name))
                parts.append(values[spec] if isinstance(spec, str) else values)
            writer.variable_length = frozenset(variable)
            writer.write(*parts)
    return writer.close()  # closed by `with`: hands back its manifest


def _checked(ds: Any, tf: Any) -> Iterator[Any]:
    """Iterates `ds`, turning TensorFlow's parse errors into a ValueError that says why."""
    it = iter(ds)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return
        except tf.errors.OpError as e:
            raise ValueError(
                f"Could not parse the source records with the given `features` ({_said(e)}). "
                "Pass `features=` (or --feature) matching how the files were written."
            ) from e
        yield batch
