"""File access for local paths and every file system TensorFlow knows (gs://, s3://, hdfs://, ram://).

Local paths use `os` directly (exclusive create, fsync, atomic rename); paths with a URL
scheme go through `tf.io.gfile`, imported only when such a path is used, so reading a
manifest from a local directory stays quick.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
from collections.abc import Iterator
from typing import Any, BinaryIO

from keras_tfr.errors import DatasetLockedError

# The largest piece the page cache keeps a file in (a huge page, as large folios go on
# Linux 6.x): the writer writes shards in whole, aligned pieces of it, the reader maps
# shards on its boundaries, and memory is dropped from a mapping in whole pieces of it
# (part of one dropped splits it).
HUGE_PAGE = 2 << 20

try:
    import fcntl
except ImportError:  # Windows: the lock falls back to an exclusive create
    fcntl = None  # type: ignore[assignment]


def is_remote(path: str) -> bool:
    """True for paths with a URL scheme (``gs://``, ``ram://``, ...)."""
    return "://" in str(path)


def expand_user(path: str) -> str:
    """A local path with ``~`` expanded (``os.path.expanduser``); a URL as it is."""
    return path if is_remote(path) else os.path.expanduser(path)


def _gfile() -> Any:
    import tensorflow as tf

    return tf.io.gfile


@contextlib.contextmanager
def os_errors(path: str | None = None) -> Iterator[None]:
    """Raises `tf.io.gfile`'s (and TensorFlow's record writer's) errors as the `OSError`
    that `os` raises for a local path (`FileNotFoundError` for a missing file, ...), so
    that every caller handles a URL as it handles a local path: ``missing_ok``, a
    resume's missing shard, a full disk. ``path``: the error's file name (None: none, as
    ``os.writev`` gives none)."""
    import tensorflow as tf

    try:
        yield
    except tf.errors.NotFoundError as e:
        raise FileNotFoundError(errno.ENOENT, e.message or "No such file or directory", path) from e
    except tf.errors.PermissionDeniedError as e:
        raise PermissionError(errno.EACCES, e.message or "Permission denied", path) from e
    except tf.errors.AlreadyExistsError as e:
        raise FileExistsError(errno.EEXIST, e.message or "File exists", path) from e
    except tf.errors.OpError as e:
        raise _errno_error(str(e.message or ""), type(e).__name__, path) from e


def _errno_error(message: str, kind: str, path: str | None) -> OSError:
    """TensorFlow says a failed system call as ``"<file>; <strerror>"``: "...; No space
    left on device" (`ResourceExhaustedError`: ENOSPC), "...; File too large"
    (`OutOfRangeError`: EFBIG). The `OSError` of that errno, or EIO when the text names
    none."""
    said = message.rsplit("; ", 1)[-1].strip()
    for code in sorted(errno.errorcode):
        if os.strerror(code) == said:
            return OSError(code, said, path)
    return OSError(errno.EIO, f"{kind}: {message}", path)


def join(directory: str, name: str) -> str:
    directory = str(directory)
    if is_remote(directory):
        return directory.rstrip("/") + "/" + name
    return os.path.join(directory, name)


def exists(path: str) -> bool:
    if is_remote(path):
        with os_errors(path):
            return bool(_gfile().exists(path))
    return os.path.exists(path)


def isdir(path: str) -> bool:
    if is_remote(path):
        with os_errors(path):
            return bool(_gfile().isdir(path))
    return os.path.isdir(path)


def makedirs(path: str) -> None:
    if is_remote(path):
        with os_errors(path):
            _gfile().makedirs(path)
    else:
        os.makedirs(path, exist_ok=True)


def remove_empty_directory(path: str) -> None:
    """Removes the local directory `path` if it is empty; leaves it (and says nothing)
    if not. Object stores keep no empty directories: nothing to do for a URL."""
    if is_remote(path):
        return
    try:
        os.rmdir(path)
    except OSError:
        pass


def listdir(path: str) -> list[str]:
    if is_remote(path):
        with os_errors(path):
            return [n.rstrip("/") for n in _gfile().listdir(path)]
    return os.listdir(path)


def size(path: str) -> int:
    if is_remote(path):
        with os_errors(path):
            return int(_gfile().stat(path).length)
    return os.stat(path).st_size


def remove(path: str, missing_ok: bool = True) -> None:
    try:
        if is_remote(path):
            with os_errors(path):
                _gfile().remove(path)
        else:
            os.remove(path)
    except OSError as e:
        if not missing_ok or exists(path):
            raise e


def rename(src: str, dst: str) -> None:
    """Atomic on local file systems (``os.replace``); a copy and delete on object stores."""
    if is_remote(src):
        with os_errors(src):
            _gfile().rename(src, dst, overwrite=True)
    else:
        os.replace(src, dst)


def read_bytes(path: str) -> bytes:
    if is_remote(path):
        with os_errors(path), _gfile().GFile(path, "rb") as f:
            return bytes(f.read())
    with open(path, "rb") as f:
        return f.read()


def open_read(path: str) -> BinaryIO:
    if is_remote(path):
        return _gfile().GFile(path, "rb")
    return open(path, "rb")


def write_atomic(path: str, data: bytes, durable: bool = True) -> None:
    """Writes `data` to a temporary name beside `path`, then renames it into place.

    The rename alone makes the file whole or absent for any reader, a killed process
    included; ``durable`` also syncs it to disk (against a crash of the machine). An
    `fsync` can wait for all the data written before it (ext4 commits in order): the
    writer's journal, replaced after every shard, is not synced, as a resume verifies
    every shard it lists and a journal damaged by a crash is reported.
    """
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        if is_remote(path):
            with os_errors(tmp), _gfile().GFile(tmp, "wb") as f:
                f.write(data)
        else:
            with open(tmp, "wb") as f:
                f.write(data)
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
    except BaseException as e:
        with contextlib.suppress(OSError):
            remove(tmp)  # a disk full, say: no partial file left beside `path`
        if isinstance(e, OSError) and e.filename is None and e.errno is not None:
            raise type(e)(e.errno, f"Could not write {path}: {e.strerror}") from e
        raise
    rename(tmp, path)
    if durable and not is_remote(path):
        _fsync_dir(os.path.dirname(os.path.abspath(path)))


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: str, obj: Any, durable: bool = True) -> None:
    data = (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode("utf-8")
    write_atomic(path, data, durable=durable)


def _pid_alive(pid: Any) -> bool:
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def live_writer(directory: str) -> str | None:
    """``"pid N on HOST"`` when the lock file of ``directory`` names a writer that may be
    running (its process is alive on this host, or it is on another host); else None."""
    holder = DirectoryLock(directory)._holder()
    if not holder:
        return None
    host = holder.get("host")
    if host == socket.gethostname() and not _pid_alive(holder.get("pid")):
        return None
    return f"pid {holder.get('pid')} on {host}"


class DirectoryLock:
    """One writer per data set directory: a lock file that names its writer.

    On local file systems the writer holds the file with `fcntl.flock` while it writes.
    The kernel drops that lock when the process ends, however it ends, so the file of a
    killed writer is taken over at once, even an empty one (a writer killed between
    creating the file and writing its pid), and a running writer's lock is never taken,
    whatever the file holds. A file no one holds is still respected when it names a live
    process on this host or another host (a writer that does not use `flock`, or one on
    another machine sharing the file system).

    Without `flock` (Windows, a file system that refuses it) the file is created
    exclusively: a lock whose pid no longer runs on this host is taken over, and so is an
    empty or unreadable one older than `STALE_EMPTY_S` seconds. On remote file systems
    there is no exclusive create; the lock is then advisory (checked, then written).
    """

    NAME = ".keras-tfr.lock"
    STALE_EMPTY_S = 10.0  # a live writer fills its lock file within microseconds

    def __init__(self, directory: str):
        self.path = join(directory, self.NAME)
        self._held = False
        self._fd: int | None = None

    def acquire(self) -> None:
        info = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}
        if is_remote(self.path):
            if exists(self.path):
                self._refuse_or_take_over()
            with _gfile().GFile(self.path, "wb") as f:
                f.write(json.dumps(info).encode())
            self._held = True
            return
        if fcntl is not None and self._acquire_flock({**info, "flock": True}):
            return
        payload = json.dumps(info).encode()
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._refuse_or_take_over()
                continue
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
            self._held = True
            return
        raise DatasetLockedError(f"Could not take the lock file {self.path}.")

    def _acquire_flock(self, info: dict[str, Any]) -> bool:
        """Takes the lock with `flock`; False when this file system does not support it."""
        for _ in range(8):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            keep = False
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # a running writer holds it
                    raise self._locked(self._holder()) from None
                except OSError:  # ENOLCK, EOPNOTSUPP: no flock on this file system
                    return False
                try:
                    st = os.stat(self.path)
                    current = (st.st_dev, st.st_ino) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino)
                except FileNotFoundError:
                    current = False
                if not current:  # its writer released it as we opened it: take the new one
                    continue
                holder = self._holder()
                dead = not holder or (
                    holder.get("host") == info["host"]
                    and (holder.get("flock") is True or not _pid_alive(holder.get("pid")))
                )
                if not dead:
                    raise self._locked(holder)
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(info).encode(), 0)
                keep = True
                self._fd = fd
                self._held = True
                return True
            finally:
                if not keep:
                    os.close(fd)
        raise DatasetLockedError(f"Could not take the lock file {self.path}.")

    def _holder(self) -> dict[str, Any]:
        """The lock file's content; {} when it is empty, unreadable or gone."""
        try:
            holder = json.loads(read_bytes(self.path).decode())
        except (OSError, ValueError):
            return {}
        return holder if isinstance(holder, dict) else {}

    def _locked(self, holder: dict[str, Any]) -> DatasetLockedError:
        who = f" (pid {holder.get('pid')} on {holder.get('host')})" if holder else ""
        return DatasetLockedError(
            f"Another writer{who} is writing to this directory: its lock file {self.path} "
            "exists. Wait for it to finish, or delete the lock file if that writer is gone."
        )

    def _refuse_or_take_over(self) -> None:
        holder = self._holder()
        pid, host = holder.get("pid"), holder.get("host")
        if host == socket.gethostname() and isinstance(pid, int) and not _pid_alive(pid):
            remove(self.path)  # stale: its writer was killed
            return
        if not holder and not is_remote(self.path):
            try:
                st = os.stat(self.path)
            except FileNotFoundError:
                return
            if time.time() - st.st_mtime > self.STALE_EMPTY_S:
                # Empty and old: its writer was killed before it wrote its pid. Removed only
                # if it is still that file (another writer may have just replaced it).
                again = os.stat(self.path)
                if (again.st_ino, again.st_mtime_ns) == (st.st_ino, st.st_mtime_ns):
                    remove(self.path)
                return
        raise self._locked(holder)

    def release(self) -> None:
        if self._held:
            # Removed while still held: a writer waiting on this file sees it is gone.
            remove(self.path)
            self._held = False
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
