"""File access for local paths and every file system TensorFlow knows (gs://, s3://, hdfs://, ram://).

Local paths use `os` directly (exclusive create, fsync, atomic rename); paths with a URL
scheme go through `tf.io.gfile`, imported only when such a path is used, so reading a
manifest from a local directory stays quick.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any, BinaryIO

from keras_tfr.errors import DatasetLockedError


def is_remote(path: str) -> bool:
    """True for paths with a URL scheme (``gs://``, ``ram://``, ...)."""
    return "://" in str(path)


def _gfile() -> Any:
    import tensorflow as tf

    return tf.io.gfile


def join(directory: str, name: str) -> str:
    directory = str(directory)
    if is_remote(directory):
        return directory.rstrip("/") + "/" + name
    return os.path.join(directory, name)


def exists(path: str) -> bool:
    if is_remote(path):
        return _gfile().exists(path)
    return os.path.exists(path)


def isdir(path: str) -> bool:
    if is_remote(path):
        return _gfile().isdir(path)
    return os.path.isdir(path)


def makedirs(path: str) -> None:
    if is_remote(path):
        _gfile().makedirs(path)
    else:
        os.makedirs(path, exist_ok=True)


def listdir(path: str) -> list[str]:
    if is_remote(path):
        return [n.rstrip("/") for n in _gfile().listdir(path)]
    return os.listdir(path)


def size(path: str) -> int:
    if is_remote(path):
        return int(_gfile().stat(path).length)
    return os.stat(path).st_size


def remove(path: str, missing_ok: bool = True) -> None:
    try:
        if is_remote(path):
            _gfile().remove(path)
        else:
            os.remove(path)
    except (FileNotFoundError, OSError) as e:
        if not missing_ok or exists(path):
            raise e


def rename(src: str, dst: str) -> None:
    """Atomic on local file systems (``os.replace``); a copy and delete on object stores."""
    if is_remote(src):
        _gfile().rename(src, dst, overwrite=True)
    else:
        os.replace(src, dst)


def read_bytes(path: str) -> bytes:
    if is_remote(path):
        with _gfile().GFile(path, "rb") as f:
            return f.read()
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
    if is_remote(path):
        with _gfile().GFile(tmp, "wb") as f:
            f.write(data)
    else:
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DirectoryLock:
    """One writer per data set directory: a lock file created exclusively.

    A lock left by a killed process on this host (its pid no longer runs) is taken over,
    so a conversion killed with SIGKILL can be resumed. On remote file systems there is
    no exclusive create; the lock is then advisory (checked, then written).
    """

    NAME = ".keras-tfr.lock"

    def __init__(self, directory: str):
        self.path = join(directory, self.NAME)
        self._held = False

    def acquire(self) -> None:
        info = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}
        payload = json.dumps(info).encode()
        if is_remote(self.path):
            if exists(self.path):
                self._refuse_or_take_over()
            with _gfile().GFile(self.path, "wb") as f:
                f.write(payload)
            self._held = True
            return
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

    def _refuse_or_take_over(self) -> None:
        try:
            holder = json.loads(read_bytes(self.path).decode())
        except (OSError, ValueError):
            holder = {}
        pid, host = holder.get("pid"), holder.get("host")
        if host == socket.gethostname() and isinstance(pid, int) and not _pid_alive(pid):
            remove(self.path)  # stale: its writer was killed
            return
        raise DatasetLockedError(
            f"Another writer (pid {pid} on {host}) is writing to this directory: its lock "
            f"file {self.path} exists. Wait for it to finish, or delete the lock file if "
            "that writer is gone."
        )

    def release(self) -> None:
        if self._held:
            remove(self.path)
            self._held = False
