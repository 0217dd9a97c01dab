"""Where records go: shard files, their framing, rotation and durability.

`ShardFiles` opens ``shard-NNNNN.tfrecord.tmp``, writes records to it on a background
thread (`_RecordSink`), and when the shard is full closes it, starts its write-back,
records it in the journal and renames it; `ShardFiles.sync` makes every shard durable
before the manifest names it. Uncompressed shards are framed here (`_FramedFile`, with
the frame layout of `keras_tfr.format.framing`); compressed ones by TensorFlow.
"""

from __future__ import annotations

import contextlib
import os
import struct
import sys
from typing import Any, NoReturn

from keras_tfr import _crc, _io
from keras_tfr.format import framing
from keras_tfr.manifest import ShardInfo
from keras_tfr.write.inputs import libc, release_pages
from keras_tfr.write.journal import SHARD_FILE, write_journal
from keras_tfr.write.plan import Layout

_SYNC_FILE_RANGE_WRITE = 2
_IOV_MAX = 1024  # buffers one `writev` takes, on Linux


def start_writeback(path: str) -> bool:
    """Starts writing a finished shard to disk without waiting (Linux `sync_file_range`),
    so that the fsync before the manifest finds less left to write. An advice: errors and
    other systems are ignored. Returns True when the write-back was started."""
    if _io.is_remote(path) or not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        fd = os.open(path, os.O_RDONLY)
        try:
            call = libc().sync_file_range
            call.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
            return call(fd, 0, 0, _SYNC_FILE_RANGE_WRITE) == 0
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        return False


class _RecordSink:
    """Writes records on a background thread.

    The write releases the GIL, so while this thread writes one record the caller's
    thread slices, serializes and checksums the next (hardware CRC-32C): on two cores
    conversion runs close to the disk's rate.
    At most ``max_records`` records (about 64 MB) wait for the thread, so memory stays
    bounded too; an error in the thread is raised in the caller at the next `put` or
    `finish_shard`.

    The caller waits only in C: for room, on `queue.SimpleQueue.get` of a token; for the
    queued records to be written, on a lock the thread releases. An interrupt (Ctrl-C, or
    the command line's SIGTERM) raised while the caller waits leaves both whole. With
    `queue.Queue`, whose waits are Python `Condition`s over a plain lock, an interrupt
    raised as a wait took its lock back left the lock released by the wrong thread: a
    wake-up was lost, and `keras-tfr convert` hung on SIGTERM (2 runs in about 85 under
    load), or the thread died with "release unlocked lock".
    """

    def __init__(self, max_records: int):
        import queue
        import threading

        self._items: queue.SimpleQueue = queue.SimpleQueue()  # for the thread, in order
        self._room: queue.SimpleQueue = queue.SimpleQueue()  # a token per record it may hold
        for _ in range(max_records):
            self._room.put(None)
        self._error: BaseException | None = None
        self._writer: Any = None
        self._thread = threading.Thread(target=self._run, name="keras-tfr-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import queue

        while True:
            # What else is queued goes out with it: one `writev` for several records.
            items = [self._items.get()]
            while len(items) < 64 and _is_record(items[-1]):
                try:
                    items.append(self._items.get_nowait())
                except queue.Empty:
                    break
            try:
                records = [it for it in items if _is_record(it)]
                if records and self._error is None:
                    self._writer.write_many(records)
                for it in items:
                    if _tag(it) == "release":
                        for arr in it[1]:
                            release_pages(arr, it[2], it[3])
            except BaseException as e:  # surfaced in the caller's thread
                self._error = e
            finally:
                for it in items:
                    if _is_record(it):
                        self._room.put(None)
                    elif _tag(it) == "written":
                        it[1].release()  # everything queued before it is written
            if items[-1] is None:
                return

    def _raise_pending(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _wait_written(self) -> None:
        """Returns once every item queued so far is through the thread."""
        import threading

        done = threading.Lock()
        done.acquire()
        self._items.put(("written", done))
        done.acquire()  # released by the thread when it reaches the marker

    def start_shard(self, writer: Any) -> None:
        self._wait_written()
        self._raise_pending()
        self._writer = writer

    def put(self, item: tuple) -> None:
        """Queues ``(record, its CRC-32C)`` for writing (the record as bytes or as a list
        of parts), waiting for room, or ``("release", arrays, start, stop)`` to drop
        memmap pages once the records before it are written."""
        self._raise_pending()
        if _is_record(item):
            self._room.get()
        self._items.put(item)

    def finish_shard(self) -> None:
        """Waits until every queued record is written."""
        self._wait_written()
        self._raise_pending()

    def stop(self) -> None:
        self._items.put(None)
        self._thread.join()
        self._error = None


def _tag(item: Any) -> str | None:
    """A marker's tag (``"release"``, ``"written"``); None for a record or the end."""
    return item[0] if item is not None and isinstance(item[0], str) else None


def _is_record(item: Any) -> bool:
    """A record to write, ``(bytes or a list of parts, CRC)``: not the end (None) nor a
    marker."""
    return item is not None and _tag(item) is None


class _FramedFile:
    """Writes uncompressed TFRecord framing itself: TensorFlow's writer computes CRC32C in
    software (about 3 GB/s here); `google_crc32c` uses the CPU's CRC instructions (>10 GB/s).

    The frame (`keras_tfr.format.framing`) is byte for byte what `tf.io.TFRecordWriter`
    writes.

    A local file is written in whole 2 MB pieces, each at a multiple of 2 MB (the bytes
    past the last such boundary wait, copied, for the next write or `close`): a write
    that covers a whole aligned 2 MB lets the kernel keep it in the page cache as one
    huge page (on file systems with large folios, such as ext4 and XFS on Linux 6.x),
    which the reader maps whole (`keras_tfr.read.mapped`). Written record by record
    (about 1 MB each, at any offset), the same data was cached in smaller pieces.
    """

    def __init__(self, path: str):
        self._remote = _io.is_remote(path)
        if self._remote:
            import tensorflow as tf

            with _io.os_errors():
                self._f = tf.io.gfile.GFile(path, "wb")
        else:
            self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self._pos = 0  # bytes handed to the kernel
            self._tail = bytearray()  # bytes past the last 2 MB boundary, not yet written

    def write(self, record: Any, crc: int | None = None) -> None:
        """Writes one record: ``bytes``, or a list of buffers (written without joining)."""
        self.write_many([(record, crc)])

    def write_many(self, records: list[tuple[Any, int | None]]) -> None:
        """Writes ``(record, its CRC-32C or None)`` pairs with as few `writev` calls as
        IOV_MAX allows."""
        parts: list[Any] = []
        total = 0
        for record, crc in records:
            body = record if isinstance(record, list) else [record]
            if crc is None:
                crc = _crc.crc32c(body)
            length = sum(memoryview(p).nbytes for p in body)
            parts += [framing.header(length), *body, framing.masked_bytes(crc)]
            total += framing.frame_size(length)
            if len(parts) > 512:  # IOV_MAX is 1024 on Linux
                self._write_parts(parts, total)
                parts, total = [], 0
        if parts:
            self._write_parts(parts, total)

    def _write_parts(self, parts: list[Any], total: int) -> None:
        if self._remote:
            with _io.os_errors():
                for part in parts:
                    self._f.write(bytes(part))
            return
        # ``_pos`` is a multiple of 2 MB and the tail shorter: either these parts reach the
        # next boundary, and the tail goes out whole with them, or they join the tail
        # (each byte is copied into a tail once at most, however small the records).
        cut = (self._pos + len(self._tail) + total) // _io.HUGE_PAGE * _io.HUGE_PAGE - self._pos
        if not cut:
            for part in parts:
                self._tail += memoryview(part).cast("B")
            return
        head: list[Any] = [memoryview(self._tail)] if self._tail else []
        cut -= len(self._tail)
        tail = bytearray()
        for i, part in enumerate(parts):
            view = memoryview(part).cast("B")
            if len(view) > cut:  # the part that crosses the boundary, and those after it
                head.append(view[:cut])
                tail += view[cut:]
                for rest in parts[i + 1 :]:
                    tail += memoryview(rest).cast("B")
                break
            head.append(view)
            cut -= len(view)
        self._writev(head)
        self._tail = tail

    def _writev(self, parts: list[memoryview]) -> None:
        assert self._fd is not None  # a local file is open until close()
        total = sum(len(p) for p in parts)
        if not total:
            return
        for at in range(0, len(parts), _IOV_MAX):
            chunk = parts[at : at + _IOV_MAX]
            written = os.writev(self._fd, chunk)
            if written != sum(len(p) for p in chunk):  # rare short write: finish it
                rest = b"".join(chunk)[written:]
                while rest:
                    rest = rest[os.write(self._fd, rest) :]
        self._pos += total

    def close(self) -> None:
        if self._remote:
            with _io.os_errors():
                self._f.close()
        elif self._fd is not None:
            try:
                tail, self._tail = self._tail, bytearray()
                self._writev([memoryview(tail)])
            finally:
                os.close(self._fd)
                self._fd = None


def open_record_file(path: str, compression: str | None) -> Any:
    if compression is None:
        return _FramedFile(path)
    import tensorflow as tf

    with _io.os_errors():
        writer = tf.io.TFRecordWriter(path, tf.io.TFRecordOptions(compression_type=compression))
    return _CompressedFile(writer)


class _CompressedFile:
    """GZIP/ZLIB shards: TensorFlow's writer frames and compresses. Its errors are raised
    as `OSError` (`_io.os_errors`)."""

    def __init__(self, writer: Any):
        self._writer = writer

    def write(self, record: Any, crc: int | None = None) -> None:
        if isinstance(record, list):
            record = b"".join(bytes(p) for p in record)
        with _io.os_errors():
            self._writer.write(record)

    def write_many(self, records: list[tuple[Any, int | None]]) -> None:
        for record, crc in records:
            self.write(record, crc)

    def close(self) -> None:
        with _io.os_errors():
            self._writer.close()


def _journal_lists(directory: str, name: str) -> bool:
    """Whether the journal on disk lists the shard file ``name`` (False when it cannot be
    read)."""
    import json

    from keras_tfr.manifest import PROGRESS_NAME

    try:
        journal = json.loads(_io.read_bytes(_io.join(directory, PROGRESS_NAME)))
        return any(s.get("file") == name for s in journal["shards"])
    except Exception:
        return False


class ShardFiles:
    """The shard files of one conversion, filled one after the other.

    A shard is written as ``<name>.tmp``; once it holds `Layout.records_per_shard`
    records (or at `close_shard`) it is closed, listed in the journal, then renamed. Its
    checksum is the CRC-32C of its records' CRC-32Cs, as the manifest records it.
    """

    def __init__(self, directory: str, layout: Layout, shards: list[ShardInfo]):
        self.directory = directory
        self.layout = layout
        self.shards = list(shards)  # complete and renamed, resumed ones included
        self._journal_entries: list[str] = []  # `write_journal`'s encoded shards
        self._file: Any = None
        # The temporary file of the shard being written or closed, from before it is
        # created until it is renamed (or removed), and whether the journal lists it:
        # what `abort` removes, or renames, after an interrupt (Ctrl-C, SIGTERM) anywhere
        # in between.
        self._tmp = ""
        self._journaled = False
        self._samples = self._records = self._crc = 0
        self._sink: _RecordSink | None = None

    def _raise_named(self, e: OSError) -> NoReturn:
        """Raises an OSError of the shard being written, naming that shard (a disk full:
        the writing thread's ``writev`` says only "No space left on device")."""
        if e.filename is None and e.errno is not None and self._tmp:
            raise type(e)(e.errno, f"Could not write the shard {self._tmp}: {e.strerror}") from e
        raise e

    def add(self, record: Any, record_crc: int, count: int) -> None:
        """Queues one record of `count` samples (bytes, or a list of buffers) and its
        CRC-32C; closes the shard when it is full."""
        try:
            if self._file is None:
                self._open_shard()
            self._crc = _crc.crc32c([struct.pack("<I", record_crc)], self._crc)
            assert self._sink is not None  # started by _open_shard
            self._sink.put((record, record_crc))
        except OSError as e:
            self._raise_named(e)
        self._records += 1
        self._samples += count
        if self._records >= self.layout.records_per_shard:
            self.close_shard()

    def release(self, arrays: list[Any], start: int, stop: int) -> None:
        """Drops rows ``[start, stop)`` of memmaps from memory once the records queued
        before are written (the sink may still be reading them)."""
        assert self._sink is not None  # records were added before
        self._sink.put(("release", arrays, start, stop))

    def wait(self) -> None:
        """Returns once every queued record is written (they may point into the caller's
        arrays), raising the writing thread's error if it had one."""
        if self._sink is not None:
            try:
                self._sink.finish_shard()
            except OSError as e:
                self._raise_named(e)

    def _open_shard(self) -> None:
        name = SHARD_FILE.format(len(self.shards))
        self._journaled = False
        self._tmp = _io.join(self.directory, name + ".tmp")  # before the file exists
        self._file = open_record_file(self._tmp, self.layout.compression)
        self._samples = self._records = self._crc = 0
        if self._sink is None:
            self._sink = _RecordSink(max(2, (64 << 20) // max(1, self.layout.record_bytes)))
        self._sink.start_shard(self._file)

    def close_shard(self) -> None:
        """Closes the open shard, if any: journal entry first, then the rename."""
        if self._file is None:
            return
        self.wait()
        try:
            self._file.close()
        except OSError as e:
            self._raise_named(e)
        self._file = None
        start_writeback(self._tmp)
        name = SHARD_FILE.format(len(self.shards))
        self.shards.append(
            ShardInfo(
                file=name,
                samples=self._samples,
                records=self._records,
                bytes=_io.size(self._tmp),
                checksum=f"crc32c:{self._crc:08x}",
            )
        )
        # Journal first, then rename: a kill in between leaves a journal entry whose file
        # is missing (resume checks and rewrites it), never a shard no journal lists.
        try:
            write_journal(self.directory, self.layout, self.shards, self._journal_entries)
        except BaseException:
            if _journal_lists(self.directory, name):
                # Interrupted (Ctrl-C, SIGTERM) once the journal on disk listed it: the
                # shard is complete, and `abort` gives it its name.
                self._journaled = True
                raise
            # A disk full: the shard the journal could not list goes.
            self.shards.pop()
            del self._journal_entries[len(self.shards) :]
            with contextlib.suppress(OSError):
                _io.remove(self._tmp)
            self._tmp = ""
            raise
        self._journaled = True
        _io.rename(self._tmp, _io.join(self.directory, name))
        self._tmp = ""

    def sync(self) -> None:
        """Makes every shard durable before the manifest names it.

        Local files: each shard is fsynced, then the directory (its renames); the manifest
        is then written with an fsync of its own (`Manifest.save`). All at the end rather
        than as each shard closes: an fsync waits for all the data written before it (ext4
        commits in order), so syncing shard by shard would stall the conversion. Write-back
        of each shard starts, without waiting, as it closes (`start_writeback`), so the
        fsyncs here wait only for the rest (``benchmarks/write_fsync.py``). URLs
        (``gs://``, ``s3://``, ``hdfs://``): `tf.io.gfile` has no fsync; a shard is as
        durable as its file system makes a closed file (an object store's upload
        completes when the file is closed).
        """
        if _io.is_remote(self.directory):
            return
        flags = os.O_RDWR if os.name == "nt" else os.O_RDONLY  # Windows syncs writable fds
        for shard in self.shards:
            path = _io.join(self.directory, shard.file)
            fd = os.open(path, flags)
            try:
                os.fsync(fd)
            except OSError as e:
                raise OSError(
                    e.errno, f"Could not sync the shard {path} to disk: {e.strerror}"
                ) from e
            finally:
                os.close(fd)
        _io._fsync_dir(self.directory)

    def stop(self) -> None:
        """Ends the writing thread (after `close_shard`)."""
        if self._sink is not None:
            self._sink.stop()
            self._sink = None

    def abort(self) -> None:
        """Ends the writing thread and removes the unfinished shard; complete ones stay."""
        self.stop()
        if self._file is not None:
            try:
                self._file.close()
            except Exception:
                pass
            self._file = None
        tmp = self._tmp
        if tmp:  # not renamed: the shard being written, or one a `close_shard` left
            with contextlib.suppress(OSError):  # (gone already: nothing to do)
                if self._journaled:  # complete and listed: it takes its name
                    _io.rename(tmp, _io.join(self.directory, self.shards[-1].file))
                else:
                    _io.remove(tmp)
            self._tmp = ""
