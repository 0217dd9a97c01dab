"""Reads every record of a data set and checks it against the manifest.

`verify` checks, per shard: the file exists with the recorded size; every record passes
its TFRecord CRCs; every record is a well-formed Example of the manifest's schema with the
recorded sample count; the records and samples add up; and the checksum over the
records' CRC-32Cs equals the manifest's. It reports every bad shard by name, with
the byte offset of the first bad record where there is one.
"""

from __future__ import annotations

import logging
import re
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import google_crc32c

from keras_tfr import _io
from keras_tfr.manifest import Manifest, ShardInfo
from keras_tfr.schema import COUNT_KEY, variable_lengths

__all__ = ["VerifyReport", "verify", "verify_shard"]


@dataclass
class VerifyReport:
    """The outcome of `verify`: `ok`, and per bad shard its problems."""

    directory: str
    shards_checked: int = 0
    records_checked: int = 0
    samples_checked: int = 0
    problems: dict[str, list[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        if self.ok:
            return (
                f"OK: {self.directory}: {self.shards_checked} shards, {self.records_checked} "
                f"records, {self.samples_checked} samples verified"
            )
        lines = [f"FAILED: {self.directory}: {len(self.problems)} bad shard(s)"]
        for name, probs in self.problems.items():
            lines.extend(f"  {name}: {p}" for p in probs)
        return "\n".join(lines)


def _iter_records(path: str, compression: str | None) -> Iterator[tuple[int | None, bytes]]:
    """Yields (offset, record bytes); offset is None for compressed files."""
    import tensorflow as tf

    if compression is None:
        try:
            from keras_tfr._compat import tf as compat_tf

            reader = compat_tf.random_record_reader(path)
        except Exception:  # private API moved: fall back to the plain iterator
            reader = None
        if reader is not None:
            offset = 0
            try:
                while True:
                    try:
                        record, next_offset = reader.read(offset)
                    except IndexError:  # clean end of file
                        return
                    except Exception as e:
                        if type(e).__name__ == "OutOfRangeError" or "end of file" in str(e).lower():
                            return
                        raise _RecordError(offset, e) from e
                    yield offset, record
                    offset = next_offset
            finally:
                reader.close()
            return
    options = tf.io.TFRecordOptions(compression_type=compression or "")
    # Not tf.data: this reader starts no TensorFlow runtime (a JAX or torch program's
    # GPU stays TensorFlow's to hide). Its call logs that it is deprecated, which says
    # nothing to a user of `verify`.
    tf_log = logging.getLogger("tensorflow")
    level = tf_log.level
    tf_log.setLevel(logging.ERROR)
    try:
        it = tf.compat.v1.io.tf_record_iterator(path, options)
    except Exception as e:  # the file could not be opened: this shard's problem
        raise _RecordError(None, e) from e
    finally:
        tf_log.setLevel(level)
    while True:
        try:
            record = next(it)
        except StopIteration:
            return
        except Exception as e:
            raise _RecordError(None, e) from e
        yield None, record


def _check_compressed_stream(path: str, compression: str) -> str | None:
    """Checks a GZIP / ZLIB file's own framing (its trailer CRC and length), which
    TensorFlow's reader does not: damage there is harmless to the records but is damage."""
    d = zlib.decompressobj(31 if compression == "GZIP" else 15)
    try:
        with _io.open_read(path) as f:
            while not d.eof:
                chunk = f.read(1 << 20)
                if not chunk:
                    return f"compressed stream ends early ({compression} trailer missing)"
                while chunk and not d.eof:
                    d.decompress(chunk, 1 << 20)  # bounded output; the data itself is not kept
                    chunk = d.unconsumed_tail
            if d.unused_data or f.read(1):
                return f"bytes after the end of the {compression} stream"
    except zlib.error as e:
        return f"{compression} stream is damaged ({e})"
    return None


class _RecordError(Exception):
    def __init__(self, offset: int | None, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.offset = offset
        self.cause = cause


def verify_shard(manifest: Manifest, shard: ShardInfo) -> list[str]:
    """Returns the problems of one shard (empty when it is sound)."""
    from keras_tfr._proto import ProtoError, parse_example_bytes

    path = manifest.shard_path(shard)
    try:
        actual = _io.size(path)
    except Exception:
        return ["missing"]
    try:  # a shard there but not readable (its permissions): named, and the others checked
        with _io.open_read(path):
            pass
    except OSError as e:
        return [f"the file cannot be opened ({e.strerror or e})"]
    problems = []
    if actual != shard.bytes:
        problems.append(f"{actual} bytes, the manifest records {shard.bytes}")
    crc = 0
    records = samples = 0
    keys = {f.key: f for f in manifest.features}
    spr = manifest.samples_per_record
    last_shard = shard.file == manifest.shards[-1].file
    size_problems = len(problems)
    record_index = 0
    end_offset: int | None = 0  # where the records read so far end (uncompressed only)
    try:
        for offset, record in _iter_records(path, manifest.compression):
            where = f"record {record_index}" + (
                f" at byte offset {offset}" if offset is not None else ""
            )
            crc = google_crc32c.extend(crc, struct.pack("<I", google_crc32c.value(record)))
            end_offset = None if offset is None else offset + len(record) + 16
            try:
                fields = parse_example_bytes(record)
            except ProtoError as e:
                problems.append(f"{where}: not a valid Example ({e})")
                break
            count = fields.get(COUNT_KEY)
            if not isinstance(count, int) or not 1 <= count <= spr:
                problems.append(f"{where}: bad sample count {count!r}")
                break
            if count != spr and not (last_shard and record_index == shard.records - 1):
                problems.append(
                    f"{where}: holds {count} samples, not {spr} (only the data set's last "
                    "record may hold fewer)"
                )
                break
            for key, spec in keys.items():
                raw = fields.get(key)
                if spec.kind != "fixed":
                    try:
                        variable_lengths(spec, raw, fields.get(spec.lengths_key), count)
                    except ValueError as e:
                        problems.append(f"{where}: {e}")
                        break
                    continue
                if not isinstance(raw, memoryview) or len(raw) != count * spec.sample_bytes:
                    problems.append(f"{where}: feature `{key}` is missing or has the wrong size")
                    break
            if len(problems) > size_problems:
                break  # the first bad record is named; the rest of the shard is not trusted
            records += 1
            samples += count
            record_index += 1
    except _RecordError as e:
        where = f"record {record_index}" + (
            f" at byte offset {e.offset}" if e.offset is not None else ""
        )
        problems.append(f"{where}: {_cause(e.cause)}")
        return problems
    if len(problems) > size_problems:
        return problems
    if manifest.compression is not None:
        stream_problem = _check_compressed_stream(path, manifest.compression)
        if stream_problem:
            problems.append(stream_problem)
    if end_offset is not None and manifest.compression is None and end_offset < actual:
        # Fewer than a record header's 12 bytes left: the reader calls that end of file.
        problems.append(
            f"record {record_index} at byte offset {end_offset}: truncated "
            f"({actual - end_offset} bytes that are not a whole record)"
        )
    if records != shard.records or samples != shard.samples:
        problems.append(
            f"holds {records} records / {samples} samples, the manifest records "
            f"{shard.records} / {shard.samples}"
        )
    if f"crc32c:{crc:08x}" != shard.checksum:
        problems.append(f"checksum crc32c:{crc:08x} differs from the manifest's {shard.checksum}")
    return problems


_TRUNCATED = re.compile(r"^truncated record at (\d+)(?:' failed with\s*(.*))?$", re.DOTALL)


def _cause(cause: BaseException) -> str:
    """A reader's error as a problem: TensorFlow's "truncated record at N' failed with
    M" (its own quoting, M often empty) as the truncation it is."""
    text = str(getattr(cause, "message", None) or cause).strip()
    found = _TRUNCATED.match(text)
    if found:
        detail = (found.group(2) or "").strip()
        return "the file ends inside this record (truncated" + (f": {detail})" if detail else ")")
    return f"corrupt ({type(cause).__name__}: {text[:200]})"


def verify(directory: str, *, verbose: int = 0) -> VerifyReport:
    """Reads every record of the data set in `directory` and checks it.

    Args:
        directory: the data set's directory.
        verbose: 1 shows a progress bar over shards.

    Returns:
        A `VerifyReport`; ``report.ok`` is False when any shard is bad, and
        ``report.problems`` maps each bad shard's file name to its problems.

    Raises:
        ManifestError: the manifest itself is missing or invalid.

    Example:
        >>> report = verify("data/train")
        >>> print(report.summary())
    """
    manifest = Manifest.load(directory, check_files=False)
    report = VerifyReport(directory=str(directory))
    bar = None
    if verbose:
        import keras

        bar = keras.utils.Progbar(len(manifest.shards), unit_name="shard")
    for i, shard in enumerate(manifest.shards):
        probs = verify_shard(manifest, shard)
        report.shards_checked += 1
        if probs:
            report.problems[shard.file] = probs
        else:
            report.records_checked += shard.records
            report.samples_checked += shard.samples
        if bar is not None:
            bar.update(i + 1)
    return report
