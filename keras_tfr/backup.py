"""Exact mid-epoch resume inside ``fit``: `BackupAndRestore`.

Keras 3's `keras.callbacks.BackupAndRestore(save_freq=N)` saves the weights every N
batches, but a restarted ``fit`` begins the interrupted epoch again at step 0: every batch
before the backup is trained twice, and the data's order need not match. This callback
saves, at each backup point, everything the rest of ``fit`` depends on and, on restart,
continues at the step after the backup with the batches the uninterrupted run would have
trained:

- the model's weights and the optimizer's variables (``model.save_weights``, as Keras
  does; the optimizer's ``iterations`` drive learning-rate schedules);
- the model's non-trainable variables again, seed generators included (dropout), which
  ``save_weights`` leaves out, and the metrics' running totals, so the epoch's logged
  loss and metrics average over all its batches;
- the epoch, the step within it, the `keras.callbacks.History` so far and the count of
  batches since the last backup (so later backups fall where they would have).

On restart it restores all of it, starts ``fit`` at that epoch and step, and asks the
training source (`TFRecordSequenceSource`, or any `tf.data.Dataset` with the same
``set_epoch(epoch, step)``) for exactly that epoch's remaining batches. At every epoch's
start it also calls ``set_epoch(epoch)`` on the training and validation sources, so the
order of epoch ``e`` is a function of the seed and ``e`` only, never of how many
iterators Keras made.

Keras' ``fit`` cannot start an epoch at a step through public APIs; the private ones used
are named and version-checked in `keras_tfr._compat.keras_resume`. Without a resumable source in
``fit`` (NumPy arrays, a plain `tf.data.Dataset`), or outside the verified Keras range,
the callback behaves exactly like Keras' own (Keras' code runs).

On-disk layout (``backup_dir``)::

    ckpt-000002-000000040/          # epoch 2 (0-based) in progress, 40 of its steps done
      model.weights.h5              # model.save_weights: weights and optimizer variables
      state.npz                     # non-trainable and metrics variables, by position
      metadata.json                 # written last, atomically: its presence = complete

``metadata.json`` holds the format name and version, ``epoch``, ``step``,
``steps_per_epoch``, ``batches_since_backup``, the History (``epoch`` list and
``history`` dict), each file's size and CRC-32C, and the Keras, backend and keras-tfr
versions. A directory without it was cut short by a kill and is ignored; a file whose
size or CRC does not match is damaged. After each new backup is complete the older ones
are deleted (the newest two are kept with ``double_checkpoint=True``), so a kill at any
moment leaves at least one complete backup.
"""

from __future__ import annotations

import copy
import io
import json
import logging
import os
import re
import shutil
import warnings
from typing import Any, cast

import keras
import numpy as np

from keras_tfr import _io
from keras_tfr._compat import keras_resume
from keras_tfr._crc import crc32c
from keras_tfr._version import __version__
from keras_tfr.errors import KerasTFRError

__all__ = ["BackupAndRestore", "BackupRestoreError"]

log = logging.getLogger("keras_tfr")

FORMAT = "keras-tfr-backup"
FORMAT_VERSION = 1
WEIGHTS_NAME = "model.weights.h5"
STATE_NAME = "state.npz"
METADATA_NAME = "metadata.json"
_CKPT = re.compile(r"^ckpt-(\d{6,})-(\d{9,})$")
_CHUNK = 8 << 20


class BackupRestoreError(KerasTFRError, OSError):
    """No backup in ``backup_dir`` could be restored (each is named with its problem)."""


def _is_resumable(data: Any) -> bool:
    """A training source that can deliver epoch ``e`` from step ``k``: it has
    ``set_epoch(epoch, step)`` and a length (batches per epoch)."""
    return callable(getattr(data, "set_epoch", None)) and hasattr(data, "__len__")


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """`keras.callbacks.BackupAndRestore` that resumes mid-epoch exactly.

    Same arguments as Keras' callback. With a `TFRecordSequenceSource` as the training
    data of ``fit``, a run killed at any step (SIGKILL included) and started again with
    the same command continues at the step after the last backup, trains every
    remaining sample of that epoch exactly once, and ends with the weights, optimizer
    state and `keras.callbacks.History` of a run that was never interrupted. Without
    such a source it is Keras' own callback.

    A backup that falls on an epoch's last step is written at that epoch's end instead
    (after validation), as the backup of the next epoch's start: Keras cannot start an
    epoch with no training steps left.

    Args:
        backup_dir: directory (local or a `tf.io.gfile` URL) for the backups; used by this
            callback only.
        save_freq: ``"epoch"`` (back up at each epoch's end) or an int N (every N
            training batches, counted across epochs).
        double_checkpoint: keep the previous backup as well, to fall back on when the
            newest is found damaged.
        delete_checkpoint: delete ``backup_dir`` when ``fit`` finishes.

    Callbacks that keep state of their own (``EarlyStopping``, ``ReduceLROnPlateau``'s
    wait counters) are not backed up, as with Keras' callback.

    Example:
        >>> from keras_tfr import BackupAndRestore, TFRecordSequenceSource
        >>> train = TFRecordSequenceSource("data/train", batch_size=256, seed=0)
        >>> model.fit(train, epochs=10,
        ...           callbacks=[BackupAndRestore("backup/", save_freq=500)])
    """

    def __init__(
        self,
        backup_dir: str,
        save_freq: str | int = "epoch",
        double_checkpoint: bool = False,
        delete_checkpoint: bool = True,
    ):
        if isinstance(save_freq, bool) or (isinstance(save_freq, int) and save_freq < 1):
            raise ValueError(
                "Expected `save_freq` to be 'epoch' or a positive integer. "
                f"Received: save_freq={save_freq!r}"
            )
        super().__init__(
            backup_dir,
            save_freq=save_freq,
            double_checkpoint=double_checkpoint,
            delete_checkpoint=delete_checkpoint,
        )
        self.backup_dir = str(backup_dir)
        self._exact = False  # True while a fit runs with mid-epoch resume
        self._context: keras_resume.FitContext | None = None
        self._resume: dict[str, Any] | None = None

    # -- the mode of this fit --------------------------------------------------------------

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._exact = False
        self._resume = None
        self._context = None
        context, problem = keras_resume.fit_context(self.model)
        resumable = context is not None and _is_resumable(context.x)
        if context is not None and resumable and problem is None:
            problem = context.iterates_source_directly()
            if problem is None and getattr(getattr(context.x, "config", None), "service", None):
                problem = (
                    "its source reads from the tf.data service, whose workers choose each "
                    "epoch's order, so an epoch cannot start at a given step"
                )
            if problem is None and context.steps_per_epoch != len(context.x):
                problem = (
                    f"Keras counts {context.steps_per_epoch} steps per epoch but the source "
                    f"has {len(context.x)} batches"
                )
        if context is None or not resumable or problem is not None:
            own = self._complete_backups()
            if own:
                raise BackupRestoreError(
                    f"The directory {self.backup_dir} holds a keras-tfr mid-epoch backup "
                    f"({own[0][2]}), but this `fit` cannot resume mid-epoch: "
                    f"{problem or 'its training data has no `set_epoch(epoch, step)`'}. "
                    "Run the same command (data, Keras version) as the one that wrote it, "
                    "or delete the directory to start over."
                )
            if problem is not None and (resumable or context is None):
                warnings.warn(
                    "keras_tfr.BackupAndRestore falls back to Keras' own callback (an "
                    f"interrupted epoch starts again at step 0): {problem}.",
                    stacklevel=2,
                )
            return super().on_train_begin(logs)
        self._exact = True
        self._context = context
        self._steps = len(context.x)
        self._epoch = 0
        self._done = 0  # steps of the current epoch trained so far
        self._since_backup = 0
        self._pending = False  # a backup due at an epoch's last step, written at its end
        self._resume = self._restore()
        if self._resume is not None:
            self._since_backup = self._resume["batches_since_backup"]
            keras_resume.set_initial_epoch(self.model, self._resume["epoch"])

    @property
    def _fit(self) -> keras_resume.FitContext:
        if self._context is None:  # pragma: no cover - only between on_train_begin and end
            raise RuntimeError("BackupAndRestore is not inside a running `fit`.")
        return self._context

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if not self._exact:
            return super().on_epoch_begin(epoch, logs)
        context = self._fit
        step = 0
        resume, self._resume = self._resume, None
        if resume is not None:
            self._restore_history(resume)
            if resume["epoch"] == epoch and resume["step"] > 0:
                step = resume["step"]
                self._restore_metrics(resume)
                keras_resume.start_epoch_at_step(context.epoch_iterator, step)
        context.x.set_epoch(epoch, step)
        val = context.validation_data
        if val is not context.x and _is_resumable(val):
            val.set_epoch(epoch, 0)
        self._epoch, self._done, self._pending = epoch, step, False

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if not self._exact:
            return super().on_train_batch_end(batch, logs)
        done = batch + 1
        self._since_backup += done - self._done
        self._done = done
        if self.save_freq != "epoch" and self._since_backup >= self.save_freq:
            self._since_backup = 0
            if done >= self._steps:
                self._pending = True
            else:
                self._save(self._epoch, done)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not self._exact:
            return super().on_epoch_end(epoch, logs)
        if self.save_freq == "epoch" or self._pending:
            self._pending = False
            self._save(epoch + 1, 0, epoch_logs=(epoch, logs or {}))

    def on_train_end(self, logs: dict | None = None) -> None:
        if not self._exact:
            return super().on_train_end(logs)
        if self._resume is not None:  # restored at the end: no epoch was left to run
            self._restore_history(self._resume)
            self._resume = None
        self._exact = False
        self._context = None
        # Keras leaves it set, which would make a later fit of this model skip epochs.
        keras_resume.set_initial_epoch(self.model, None)
        if self.delete_checkpoint and _io.exists(self.backup_dir):
            _rmtree(self.backup_dir)

    # -- writing ---------------------------------------------------------------------------

    def _history_snapshot(self, epoch_logs: tuple[int, dict] | None) -> dict:
        history = self._context.history() if self._context else None
        epochs = list(getattr(history, "epoch", []) or [])
        values = copy.deepcopy(getattr(history, "history", {}) or {})
        if epoch_logs is not None and (not epochs or epochs[-1] != epoch_logs[0]):
            # This callback runs before History's on_epoch_end: add what it will add.
            epochs.append(epoch_logs[0])
            for key, value in epoch_logs[1].items():
                values.setdefault(key, []).append(value)
        return {"epoch": epochs, "history": _jsonable(values)}

    def _save(self, epoch: int, step: int, epoch_logs: tuple[int, dict] | None = None) -> None:
        model = self.model  # with JAX, this syncs the training state into the variables
        name = f"ckpt-{epoch:06d}-{step:09d}"
        path = _io.join(self.backup_dir, name)
        if _io.exists(path):
            _rmtree(path)  # a damaged leftover of this same point, from before a restore
        _io.makedirs(path)
        weights = _io.join(path, WEIGHTS_NAME)
        model.save_weights(weights, overwrite=True)
        _fsync(weights)
        state = io.BytesIO()
        np.savez(state, **cast(dict[str, Any], _state_arrays(model)))
        _io.write_atomic(_io.join(path, STATE_NAME), state.getvalue())
        metadata = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "epoch": epoch,
            "step": step,
            "steps_per_epoch": self._steps,
            "batches_since_backup": self._since_backup,
            "history": self._history_snapshot(epoch_logs),
            "files": {n: _file_info(_io.join(path, n)) for n in (WEIGHTS_NAME, STATE_NAME)},
            "keras_version": keras.version(),
            "backend": keras.backend.backend(),
            "keras_tfr_version": __version__,
        }
        _io.write_json_atomic(_io.join(path, METADATA_NAME), metadata)
        # Only now that the new backup is complete do older ones go.
        keep = {name}
        if self.double_checkpoint:
            older = [n for (_, _, n) in self._complete_backups() if n < name]
            keep.update(older[:1])
        for entry in self._backup_dirs():
            if entry[2] not in keep:
                _rmtree(_io.join(self.backup_dir, entry[2]))

    # -- reading ---------------------------------------------------------------------------

    def _backup_dirs(self) -> list[tuple[int, int, str]]:
        """``(epoch, step, name)`` of every backup directory, newest first."""
        if not _io.isdir(self.backup_dir):
            return []
        found = []
        for name in _io.listdir(self.backup_dir):
            match = _CKPT.match(name)
            if match:
                found.append((int(match.group(1)), int(match.group(2)), name))
        return sorted(found, reverse=True)

    def _complete_backups(self) -> list[tuple[int, int, str]]:
        return [
            e
            for e in self._backup_dirs()
            if _io.exists(_io.join(_io.join(self.backup_dir, e[2]), METADATA_NAME))
        ]

    def _restore(self) -> dict[str, Any] | None:
        failures = []
        chosen = None
        entries = self._backup_dirs()
        for epoch, step, name in entries:
            path = _io.join(self.backup_dir, name)
            if not _io.exists(_io.join(path, METADATA_NAME)):
                log.info("Ignoring the backup %s: it was cut short (no %s).", path, METADATA_NAME)
                continue
            try:
                metadata = _read_metadata(path, epoch, step)
            except (OSError, ValueError, KeyError, TypeError) as e:
                failures.append(f"{path}: {e}")
                continue
            if metadata["steps_per_epoch"] != self._steps or not 0 <= step < self._steps:
                raise BackupRestoreError(
                    f"The backup {path} was written for {metadata['steps_per_epoch']} steps "
                    f"per epoch, but the training source of this `fit` has {self._steps}. "
                    "Resume with the same data and batch size, or delete the directory "
                    f"{self.backup_dir} to start over."
                )
            try:
                metrics = self._load_state(path)
            except (OSError, ValueError, KeyError, TypeError) as e:
                failures.append(f"{path}: {e}")
                continue
            chosen = dict(metadata, metrics=metrics, path=path)
            break
        if chosen is None and failures:
            raise BackupRestoreError(
                f"No backup in {self.backup_dir} could be restored:\n  "
                + "\n  ".join(failures)
                + "\nDelete the directory to start over."
            )
        if chosen is not None and failures:
            warnings.warn(
                f"Restored the previous backup {chosen['path']}, because the newer one "
                f"could not be: {'; '.join(failures)}.",
                stacklevel=3,
            )
        # Damaged, newer and cut-short backups would otherwise be kept by the next prune.
        kept = chosen["path"] if chosen else None
        for epoch, step, name in entries:
            path = _io.join(self.backup_dir, name)
            newer = chosen is not None and (epoch, step) > (chosen["epoch"], chosen["step"])
            if path != kept and (newer or not _io.exists(_io.join(path, METADATA_NAME))):
                _rmtree(path)
        return chosen

    def _load_state(self, path: str) -> list[np.ndarray]:
        model = self.model
        if model.optimizer is not None and not model.optimizer.built:
            # The optimizer's variables must exist before they can be loaded (as in Keras).
            model.optimizer.build(model.trainable_variables)
        model.load_weights(_io.join(path, WEIGHTS_NAME))
        raw = _io.read_bytes(_io.join(path, STATE_NAME))
        with np.load(io.BytesIO(raw), allow_pickle=False) as state:
            arrays = {k: state[k] for k in state.files}
        non_trainable = _numbered(arrays, "non_trainable")
        _check_shapes(path, "non-trainable", model.non_trainable_variables, non_trainable)
        for variable, value in zip(model.non_trainable_variables, non_trainable):
            variable.assign(value)
        return _numbered(arrays, "metrics")

    def _restore_metrics(self, resume: dict[str, Any]) -> None:
        # Called after fit's reset_metrics(): the epoch's running totals go on from the
        # backup's, so the epoch's logged loss and metrics average over all its batches.
        model = self.model
        if len(model.metrics_variables) != len(resume["metrics"]):
            keras_resume.build_metrics(model, self._fit.x.element_spec)
        _check_shapes(resume["path"], "metrics", model.metrics_variables, resume["metrics"])
        for variable, value in zip(model.metrics_variables, resume["metrics"]):
            variable.assign(value)

    def _restore_history(self, resume: dict[str, Any]) -> None:
        history = self._context.history() if self._context else None
        if history is None:
            return
        history.epoch = list(resume["history"]["epoch"])
        history.history = copy.deepcopy(resume["history"]["history"])
        self.model.history = history


def _state_arrays(model: Any) -> dict[str, np.ndarray]:
    arrays = {}
    for prefix, variables in (
        ("non_trainable", model.non_trainable_variables),
        ("metrics", model.metrics_variables),
    ):
        for i, variable in enumerate(variables):
            arrays[f"{prefix}_{i}"] = keras.ops.convert_to_numpy(variable)
    return arrays


def _numbered(arrays: dict[str, np.ndarray], prefix: str) -> list[np.ndarray]:
    count = sum(1 for k in arrays if k.startswith(prefix + "_"))
    return [arrays[f"{prefix}_{i}"] for i in range(count)]


def _check_shapes(path: str, what: str, variables: list, values: list[np.ndarray]) -> None:
    expected = [tuple(v.shape) for v in variables]
    received = [tuple(a.shape) for a in values]
    if expected != received:
        raise ValueError(
            f"Expected the {what} variables in {path} to have the shapes of this model's, "
            f"{expected}. Received: {received}. The backup was written by another model."
        )


def _file_info(path: str) -> dict[str, int]:
    crc = 0
    total = 0
    with _io.open_read(path) as f:
        while chunk := f.read(_CHUNK):
            crc = crc32c([chunk], crc)
            total += len(chunk)
    return {"bytes": total, "crc32c": crc}


def _read_metadata(path: str, epoch: int, step: int) -> dict[str, Any]:
    file = _io.join(path, METADATA_NAME)
    try:
        metadata = json.loads(_io.read_bytes(file).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e})") from None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise ValueError(f"Expected {file} to be a {FORMAT} file. Received: {metadata!r:.200}")
    if metadata.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"Expected {file} to have format version {FORMAT_VERSION}. "
            f"Received: {metadata.get('version')!r}"
        )
    for key in ("epoch", "step", "steps_per_epoch", "batches_since_backup"):
        if not isinstance(metadata.get(key), int) or metadata[key] < 0:
            raise ValueError(f"Expected `{key}` in {file} to be an int >= 0.")
    if (metadata["epoch"], metadata["step"]) != (epoch, step):
        raise ValueError(f"{file} names epoch {metadata['epoch']} step {metadata['step']}")
    history = metadata.get("history")
    if (
        not isinstance(history, dict)
        or not isinstance(history.get("epoch"), list)
        or not isinstance(history.get("history"), dict)
    ):
        raise ValueError(f"Expected `history` in {file} to hold `epoch` and `history`.")
    files = metadata.get("files")
    if not isinstance(files, dict) or set(files) != {WEIGHTS_NAME, STATE_NAME}:
        raise ValueError(f"Expected `files` in {file} to list {WEIGHTS_NAME} and {STATE_NAME}.")
    for name, expected in files.items():
        target = _io.join(path, name)
        received = _file_info(target)
        if received != expected:
            raise OSError(
                f"The backup file {target} is damaged: expected {expected['bytes']} bytes "
                f"with CRC-32C {expected['crc32c']}, read {received['bytes']} bytes with "
                f"CRC-32C {received['crc32c']}."
            )
    return metadata


def _jsonable(values: dict) -> dict:
    def scalar(v: Any) -> Any:
        if isinstance(v, (int, float, str, bool)) or v is None:
            return v
        array = np.asarray(v)
        return array.item() if array.ndim == 0 else array.tolist()

    return {k: [scalar(v) for v in vs] for k, vs in values.items()}


def _fsync(path: str) -> None:
    if _io.is_remote(path):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rmtree(path: str) -> None:
    if _io.is_remote(path):
        import tensorflow as tf

        if tf.io.gfile.exists(path):
            tf.io.gfile.rmtree(path)
    else:
        shutil.rmtree(path, ignore_errors=True)
