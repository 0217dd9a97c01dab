"""The manifest: what a data set holds, written last and atomically.

A directory is a complete keras-tfr data set exactly when it holds ``manifest.json``.
The writer creates it after every shard is closed, under a temporary name that is then
renamed into place, so a reader never sees a half-written manifest or a manifest of a
conversion that did not finish.

``manifest.json``, field by field
---------------------------------
=====================  ================================================================
field                  meaning
=====================  ================================================================
``format``             always ``"keras-tfr"``
``format_version``     integer; readers refuse versions they do not know (now ``1``)
``writer_version``     version of keras-tfr that wrote the data set
``created``            UTC time the data set was completed, ISO 8601
``structure``          per role present (``x``, ``y``, ``sample_weight``): ``"array"``,
                       ``"dict"`` or ``"list"``: how the source rebuilds what Keras sees
``features``           list of ``{role, name, key, dtype, shape}``; ``key`` is the
                       Example feature holding the bytes (see `keras_tfr.schema`);
                       variable-length features add ``kind`` (``"ragged"`` or
                       ``"bytes"``); fixed ones carry no ``kind`` field
``samples_per_record`` samples in each record (block); only the last record of the data
                       set may hold fewer
``record_bytes``       size of a full record's serialized Example, in bytes (with a
                       non-fixed feature: an estimate of the average record's size)
``lattice``            optional ``{period, rows}``: the records are padded so that every
                       sample sits on a lattice (`keras_tfr.schema.Lattice`); absent in
                       older data sets, and where it would cost more than 1/16 of a
                       record. Readers that ignore it still read
                       the records (the pads are extra Example keys)
``compression``        ``null``, ``"GZIP"`` or ``"ZLIB"`` (TFRecord compression)
``total_samples``      samples in the data set
``total_records``      records in the data set
``total_bytes``        bytes of all shard files together
``shards``             list, in sample order, of ``{file, samples, records, bytes,
                       checksum}``: ``file`` is a plain file name inside the directory,
                       ``bytes`` the file's size, ``checksum`` ``"crc32c:<8 hex digits>"``,
                       the CRC-32C (Castagnoli) of the sequence of the records' own
                       CRC-32Cs (each over one serialized Example, 4 bytes little-endian,
                       in order): one pass over the data yields both, and it changes when
                       any record changes, moves or goes missing
``user_metadata``      optional JSON object given by the writer's caller
``shuffle_seed``       optional int: the samples were written in the order of the seeded
                       permutation `keras_tfr.read.order.Permutation` of ``total_samples``
                       with key ``(shuffle_seed, 3)`` (``from_arrays(..., shuffle_seed=)``);
                       absent: in the order given
``key_order``          optional, per role whose ``structure`` is ``"dict"``: its names
                       in the order the writer's first batch gave them, which a source's
                       dicts keep (as a dict of arrays does in ``fit``); absent (older
                       data sets): sorted by name. ``features`` stay in key order
=====================  ================================================================

A manifest may come from an untrusted place: it is parsed as JSON only, shard names must
be plain file names (no ``/``, no ``..``), and every count, size and shape is checked
against limits and against each other before anything is allocated.
"""

from __future__ import annotations

import datetime
import json
import numbers
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from keras_tfr import _io
from keras_tfr._version import __version__
from keras_tfr.errors import IncompleteDatasetError, ManifestError, ShardError
from keras_tfr.schema import (
    FEATURE_KINDS,
    MAX_RANK,
    MAX_RECORD_BYTES,
    MAX_SAMPLE_BYTES,
    ROLES,
    SUPPORTED_DTYPES,
    FeatureSpec,
    Lattice,
)

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "MANIFEST_NAME", "Manifest", "ShardInfo"]

FORMAT_NAME = "keras-tfr"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
PROGRESS_NAME = ".keras-tfr-progress.json"
COMPRESSIONS = (None, "GZIP", "ZLIB")

# The writer's size defaults, here (a light module) so that every entry point that passes
# them on (CLI, converters, predictions) states them once.
DEFAULT_SHARD_SIZE = "128MB"
DEFAULT_RECORD_SIZE = "1MB"
DEFAULT_CHUNK_SIZE = "16MB"

MAX_MANIFEST_BYTES = 256 << 20
MAX_FEATURES = 4096
MAX_SHARDS = 10_000_000
MAX_SAMPLES = 1 << 48
_SHARD_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")
_FEATURE_NAME = re.compile(r"^[^/\x00]{0,255}$")


@dataclass(frozen=True)
class ShardInfo:
    """One shard file as recorded in the manifest."""

    file: str
    samples: int
    records: int
    bytes: int
    checksum: str

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "samples": self.samples,
            "records": self.records,
            "bytes": self.bytes,
            "checksum": self.checksum,
        }


@dataclass
class Manifest:
    """A parsed, validated manifest. Build with `Manifest.load(directory)`.

    Example:
        >>> manifest = Manifest.load("data/train")
        >>> manifest.total_samples, len(manifest.shards), manifest.total_bytes
        >>> [(f.key, f.role, f.dtype, f.shape) for f in manifest.features]
    """

    structure: dict[str, str]
    features: list[FeatureSpec]
    samples_per_record: int
    record_bytes: int
    compression: str | None
    shards: list[ShardInfo]
    writer_version: str = __version__
    created: str = ""
    user_metadata: dict[str, Any] = field(default_factory=dict)
    directory: str = ""
    lattice: Lattice | None = None
    shuffle_seed: int | None = None
    key_order: dict[str, list[str]] = field(default_factory=dict)

    @property
    def total_samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def total_records(self) -> int:
        return sum(s.records for s in self.shards)

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    @property
    def sample_bytes(self) -> int:
        return sum(f.sample_bytes for f in self.features)

    def input_indices(self, written: Any = None) -> Any:
        """The input index of written samples (all of them by default): where each came
        from in the arrays given to ``from_arrays``. The identity unless the data set was
        written with ``shuffle_seed``. Returns an ``int64`` NumPy array.

        Example:
            >>> m = Manifest.load("data/train")  # written with shuffle_seed=0
            >>> original_row_of_first_written = m.input_indices([0])[0]
        """
        import numpy as np

        if written is None:
            written = np.arange(self.total_samples, dtype=np.int64)
        positions = np.asarray(written, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= self.total_samples):
            raise IndexError(
                f"Expected written sample indices in [0, {self.total_samples}). "
                f"Received: {int(positions.min())} to {int(positions.max())}"
            )
        if self.shuffle_seed is None:
            return positions.copy()
        from keras_tfr.read.order import write_order

        return write_order(self.total_samples, self.shuffle_seed)(positions)

    def features_of(self, role: str) -> list[FeatureSpec]:
        return [f for f in self.features if f.role == role]

    def names_in_order(self, role: str) -> list[str]:
        """The names of a dict role's features in the order the writer was given them
        (``key_order``; sorted where the manifest has none)."""
        names = self.key_order.get(role)
        return list(names) if names else sorted(f.name for f in self.features_of(role))

    def shard_path(self, shard: ShardInfo) -> str:
        return _io.join(self.directory, shard.file)

    def to_json(self) -> dict[str, Any]:
        out = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "writer_version": self.writer_version,
            "created": self.created,
            "structure": dict(self.structure),
            "features": [f.to_json() for f in self.features],
            "samples_per_record": self.samples_per_record,
            "record_bytes": self.record_bytes,
            **({"lattice": self.lattice.to_json()} if self.lattice is not None else {}),
            "compression": self.compression,
            "total_samples": self.total_samples,
            "total_records": self.total_records,
            "total_bytes": self.total_bytes,
            "shards": [s.to_json() for s in self.shards],
        }
        if self.user_metadata:
            out["user_metadata"] = self.user_metadata
        if self.shuffle_seed is not None:
            out["shuffle_seed"] = self.shuffle_seed
        if self.key_order:
            out["key_order"] = {role: list(names) for role, names in self.key_order.items()}
        return out

    def save(self, directory: str) -> None:
        """Writes ``manifest.json`` atomically and durably: a temporary name, fsync, rename,
        then an fsync of the directory (local files)."""
        if not self.created:
            self.created = datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"
            )
        _io.write_json_atomic(_io.join(directory, MANIFEST_NAME), self.to_json())
        self.directory = str(directory)

    @classmethod
    def load(cls, directory: str, *, check_files: bool = True) -> Manifest:
        """Reads and validates ``DIRECTORY/manifest.json``.

        Args:
            directory: the data set's directory (local path or any `tf.io.gfile` URL).
            check_files: also check that every shard exists with its recorded size.

        Raises:
            IncompleteDatasetError: no manifest, but shards of an unfinished conversion.
            ManifestError: no manifest, or it is malformed, unsafe or of an unknown version.
            ShardError: a shard is missing or has the wrong size (names the shard).
        """
        directory = _io.expand_user(str(directory))
        path = _io.join(directory, MANIFEST_NAME)
        if not _io.exists(path):
            if _io.isdir(directory) and _io.exists(_io.join(directory, PROGRESS_NAME)):
                writer = _io.live_writer(directory)
                if writer is not None:
                    raise IncompleteDatasetError(
                        f"{directory} is being written: a conversion ({writer}) holds its "
                        f"lock and has not written its {MANIFEST_NAME} yet. Read it once that "
                        "conversion finishes (if that process is gone, resume the conversion "
                        "with `ArraysToRecords(..., resume=True)`)."
                    )
                raise IncompleteDatasetError(
                    f"{directory} holds an incomplete data set: a conversion into it did not "
                    f"finish, so it has no {MANIFEST_NAME}. Resume it with "
                    "`ArraysToRecords(..., resume=True)` or start over with `overwrite=True`."
                )
            if not _io.isdir(directory):
                what = "is a file" if _io.exists(directory) else "does not exist"
                raise ManifestError(
                    f"Expected `directory` to be a keras-tfr data set directory. "
                    f"Received: {directory!r}, which {what}."
                )
            raise ManifestError(
                f"Expected `directory` to be a keras-tfr data set directory with a "
                f"{MANIFEST_NAME}. Received: {directory!r}, which has none."
            )
        size = _io.size(path)  # checked before reading: the file may be hostile
        if size > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{path} is {size} bytes, over the {MAX_MANIFEST_BYTES} limit")
        raw = _io.read_bytes(path)
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{path} is {len(raw)} bytes, over the {MAX_MANIFEST_BYTES} limit")
        manifest = cls.from_json_bytes(raw, source=path)
        manifest.directory = directory
        if check_files:
            manifest.check_files()
        return manifest

    def check_files(self) -> None:
        """Checks that every shard exists with the size the manifest records."""
        problems = []
        for shard in self.shards:
            p = self.shard_path(shard)
            try:
                actual = _io.size(p)
            except (OSError, FileNotFoundError):
                problems.append(f"{shard.file}: missing")
                continue
            except Exception as e:  # tf.errors.NotFoundError on remote file systems
                if type(e).__name__ == "NotFoundError":
                    problems.append(f"{shard.file}: missing")
                    continue
                raise
            if actual != shard.bytes:
                problems.append(f"{shard.file}: {actual} bytes, the manifest records {shard.bytes}")
        if problems:
            raise ShardError(
                f"The data set in {self.directory} does not match its manifest: "
                + "; ".join(problems[:20])
                + (f"; and {len(problems) - 20} more" if len(problems) > 20 else "")
            )

    @classmethod
    def from_json_bytes(cls, raw: bytes, *, source: str = "manifest") -> Manifest:
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise ManifestError(f"{source}: expected bytes, got {type(raw).__name__}")
        try:
            obj = json.loads(bytes(raw).decode("utf-8"))
        except (ValueError, RecursionError) as e:
            # ValueError covers bad UTF-8, bad JSON and integers of over 4300 digits;
            # RecursionError, arrays nested thousands deep.
            raise ManifestError(f"{source} is not valid JSON: {str(e)[:200]}") from e
        return cls.from_json(obj, source=source)

    @classmethod
    def from_json(cls, obj: Any, *, source: str = "manifest") -> Manifest:
        """Validates a decoded manifest; raises `ManifestError` naming the field."""

        def fail(msg: str) -> ManifestError:
            return ManifestError(f"{source}: {msg}")

        def get(d: dict, key: str, types: Any, where: str = "") -> Any:
            if key not in d:
                raise fail(f"missing field `{where}{key}`")
            v = d[key]
            if types is int and (isinstance(v, bool) or not isinstance(v, int)):
                raise fail(f"field `{where}{key}` must be an integer, got {v!r:.80}")
            if types is not int and not isinstance(v, types):
                raise fail(f"field `{where}{key}` has the wrong type: {v!r:.80}")
            return v

        if not isinstance(obj, dict):
            raise fail("expected a JSON object")
        if obj.get("format") != FORMAT_NAME:
            raise fail(f"`format` is {obj.get('format')!r:.80}, expected {FORMAT_NAME!r}")
        version = get(obj, "format_version", int)
        if version != FORMAT_VERSION:
            raise fail(
                f"format_version {version} is not supported by keras-tfr {__version__} "
                f"(it reads version {FORMAT_VERSION}); upgrade keras-tfr"
            )
        structure = get(obj, "structure", dict)
        if not structure or any(
            r not in ROLES or s not in ("array", "dict", "list") for r, s in structure.items()
        ):
            raise fail(f"`structure` must map roles {ROLES} to 'array', 'dict' or 'list'")
        if "x" not in structure:
            raise fail("`structure` has no `x` role")
        raw_features = get(obj, "features", list)
        if not raw_features or len(raw_features) > MAX_FEATURES:
            raise fail(f"`features` must hold 1 to {MAX_FEATURES} entries")
        features = []
        keys = set()
        for i, f in enumerate(raw_features):
            where = f"features[{i}]."
            if not isinstance(f, dict):
                raise fail(f"`features[{i}]` must be an object")
            role = get(f, "role", str, where)
            name = get(f, "name", str, where)
            dtype = get(f, "dtype", str, where)
            shape = get(f, "shape", list, where)
            if role not in structure:
                raise fail(f"`{where}role` {role!r:.40} is not in `structure`")
            if not _FEATURE_NAME.match(name):
                raise fail(f"`{where}name` {name!r:.40} is not a valid feature name")
            if (structure[role] == "array") != (name == ""):
                raise fail(f"`{where}name` does not fit the role's structure")
            if dtype not in SUPPORTED_DTYPES:
                raise fail(f"`{where}dtype` {dtype!r:.40} is not supported")
            if len(shape) > MAX_RANK or any(
                isinstance(d, bool) or not isinstance(d, int) or d < 0 or d > 1 << 31 for d in shape
            ):
                raise fail(f"`{where}shape` {shape!r:.80} is not a valid shape")
            kind = f.get("kind", "fixed")  # absent for fixed features (format version 1)
            if kind not in FEATURE_KINDS:
                raise fail(f"`{where}kind` {kind!r:.40} is not one of {FEATURE_KINDS}")
            if kind == "bytes" and (dtype != "uint8" or shape):
                raise fail(f"`{where}` a 'bytes' feature must have dtype uint8 and shape []")
            spec = FeatureSpec(role=role, name=name, dtype=dtype, shape=tuple(shape), kind=kind)
            if spec.sample_bytes > MAX_SAMPLE_BYTES:
                raise fail(f"`{where}` samples of {spec.sample_bytes} bytes exceed the limit")
            if "key" in f and f["key"] != spec.key:
                raise fail(f"`{where}key` is {f['key']!r:.40}, expected {spec.key!r}")
            if spec.key in keys:
                raise fail(f"feature key {spec.key!r} appears twice")
            keys.add(spec.key)
            features.append(spec)
        for role in structure:
            if not any(f.role == role for f in features):
                raise fail(f"role {role!r} has no features")
        spr = get(obj, "samples_per_record", int)
        if spr < 1 or spr > MAX_SAMPLES:
            raise fail(f"`samples_per_record` {spr} is out of range")
        sample_bytes = sum(f.sample_bytes for f in features)
        if spr * sample_bytes > MAX_RECORD_BYTES:
            raise fail(f"records of {spr} samples x {sample_bytes} bytes exceed the 2 GiB limit")
        record_bytes = get(obj, "record_bytes", int)
        if record_bytes < 0 or record_bytes > MAX_RECORD_BYTES:
            raise fail("`record_bytes` is out of range")
        lattice = None
        if obj.get("lattice") is not None:
            try:
                lattice = Lattice.from_json(obj["lattice"])
            except ValueError as e:
                raise fail(str(e)) from None
            if not lattice.fits(features):
                raise fail("`lattice` does not match the features")
        compression = obj.get("compression")
        if compression not in COMPRESSIONS:
            raise fail(f"`compression` {compression!r:.40} is not one of {COMPRESSIONS}")
        raw_shards = get(obj, "shards", list)
        fixed_sample_bytes = sum(
            f.sample_bytes for f in features if getattr(f, "kind", "fixed") == "fixed"
        )
        if len(raw_shards) > MAX_SHARDS:
            raise fail("too many shards")
        shards = []
        names = set()
        for i, s in enumerate(raw_shards):
            where = f"shards[{i}]."
            if not isinstance(s, dict):
                raise fail(f"`shards[{i}]` must be an object")
            name = get(s, "file", str, where)
            if not _SHARD_NAME.match(name) or name in (".", "..") or name == MANIFEST_NAME:
                raise fail(
                    f"`{where}file` {name!r:.80} must be a plain file name inside the data set "
                    "directory (no '/', no '..', no absolute path)"
                )
            if name in names:
                raise fail(f"shard file {name!r} appears twice")
            names.add(name)
            samples = get(s, "samples", int, where)
            records = get(s, "records", int, where)
            nbytes = get(s, "bytes", int, where)
            checksum = get(s, "checksum", str, where)
            if not (0 <= samples <= MAX_SAMPLES and 0 <= nbytes < 1 << 50):
                raise fail(f"`{where}` counts are out of range")
            if records != -(-samples // spr):
                raise fail(
                    f"`{where}records` is {records}; {samples} samples in records of {spr} "
                    f"need {-(-samples // spr)}"
                )
            # The file must be able to hold what the shard claims (16 bytes of framing per
            # record plus the fixed features' payloads; deflate packs at most 1032:1), so
            # counts that drive allocations are bounded by the real file size.
            least = records * 16 + samples * fixed_sample_bytes
            if (nbytes if compression is None else nbytes * 1032 + 1024) < least:
                raise fail(
                    f"`{where}bytes` {nbytes} cannot hold {records} records of {samples} "
                    f"samples ({least} bytes at least)"
                )
            if i < len(raw_shards) - 1 and samples % spr:
                raise fail(f"`{where}samples` {samples} is not a multiple of {spr}")
            if not re.match(r"^crc32c:[0-9a-f]{8}$", checksum):
                raise fail(f"`{where}checksum` {checksum!r:.40} is not 'crc32c:<8 hex digits>'")
            shards.append(ShardInfo(name, samples, records, nbytes, checksum))
        manifest = cls(
            structure=dict(structure),
            features=features,
            samples_per_record=spr,
            record_bytes=record_bytes,
            compression=compression,
            shards=shards,
            writer_version=str(obj.get("writer_version", "")),
            created=str(obj.get("created", "")),
            user_metadata=obj.get("user_metadata") or {},
            lattice=lattice,
            shuffle_seed=obj.get("shuffle_seed"),
            key_order=_key_order(obj.get("key_order"), structure, features, fail),
        )
        seed = manifest.shuffle_seed
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 63
        ):
            raise fail(
                f"`shuffle_seed` must be a non-negative integer below 2**63, got {seed!r:.40}"
            )
        for total, value in (
            ("total_samples", manifest.total_samples),
            ("total_records", manifest.total_records),
            ("total_bytes", manifest.total_bytes),
        ):
            if total in obj and obj[total] != value:
                raise fail(f"`{total}` is {obj[total]!r:.40} but the shards add up to {value}")
        if not isinstance(manifest.user_metadata, dict):
            raise fail("`user_metadata` must be an object")
        return manifest


def _key_order(
    raw: Any,
    structure: dict[str, str],
    features: list[FeatureSpec],
    fail: Callable[[str], ManifestError],
) -> dict[str, list[str]]:
    """The manifest's ``key_order``, checked: for dict roles only, each a permutation of
    the role's feature names."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise fail(f"`key_order` must be an object, got {raw!r:.80}")
    out = {}
    for role, names in raw.items():
        if structure.get(role) != "dict":
            raise fail(f"`key_order` names {role!r:.40}, which is not a dict role in `structure`")
        given = sorted(f.name for f in features if f.role == role)
        if (
            not isinstance(names, list)
            or sorted(map(str, names)) != given
            or any(not isinstance(n, str) for n in names)
        ):
            listed = ", ".join(given[:5]) + (", ..." if len(given) > 5 else "")
            raise fail(
                f"`key_order.{role}` must list the names of {role!r}'s features once each "
                f"({listed}), got {names!r:.80}"
            )
        out[role] = list(names)
    return out


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)


def written_again(directory: str, shards: Sequence[tuple[str, int, str | None]]) -> str | None:
    """What became of the data set in ``directory`` since a source read the manifest
    whose shards are ``shards`` (``(file, bytes, checksum)`` each, a checksum None when
    unknown), as a clause after "the data set": it was written again (``overwrite=True``),
    or its manifest or its whole directory is gone (deleted, or moved away). None while
    its manifest.json lists those shards, and when that file exists but cannot be read
    (nothing to tell).

    Example:
        >>> written_again(m.directory, [(s.file, s.bytes, s.checksum) for s in m.shards])
        'was written again after this source was made (its manifest.json lists other shards)'
    """
    path = _io.join(directory, MANIFEST_NAME)
    try:
        now = Manifest.from_json_bytes(_io.read_bytes(path), source=path)
    except FileNotFoundError:
        try:
            there = _io.exists(directory)
        except Exception:
            there = True  # nothing to tell: say what is known
        if not there:
            return "was moved or deleted after this source was made (its directory is gone)"
        return (
            f"was deleted or written again after this source was made (its {MANIFEST_NAME} is gone)"
        )
    except Exception:
        return None
    other = f"was written again after this source was made (its {MANIFEST_NAME} lists other shards)"
    if len(now.shards) != len(shards):
        return other
    for s, (file, size, checksum) in zip(now.shards, shards):
        if s.file != file or s.bytes != size or checksum not in (None, s.checksum):
            return other
    return None


def parse_size(value: Any, *, argument: str) -> int:
    """Parses ``"128MB"``, ``"64KiB"``, ``"1.5GB"`` or an int of bytes."""
    if isinstance(value, bool):
        raise TypeError(f"Expected `{argument}` to be a size in bytes. Received: {value!r}")
    if isinstance(value, numbers.Integral):  # NumPy's integers too
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE.match(value)
        if not m:
            raise ValueError(
                f"Expected `{argument}` to be a size like '128MB', '64KiB' or an int of "
                f"bytes. Received: {value!r}"
            )
        unit = (m.group(2) or "B").upper()
        base = 1024 if "I" in unit else 1000
        power = {"": 0, "B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit.rstrip("B").rstrip("I")]
        n = int(float(m.group(1)) * base**power)
    else:
        raise TypeError(
            f"Expected `{argument}` to be a size like '128MB' or an int of bytes. "
            f"Received: {value!r} of type {type(value).__name__}"
        )
    if n <= 0:
        raise ValueError(f"Expected `{argument}` to be a positive size. Received: {value!r}")
    return n
