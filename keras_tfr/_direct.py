"""The direct read path: uncompressed fixed-layout shards read with `os.preadv` straight
into per-feature sample arrays, checked with hardware CRC-32C, gathered into batches.

Why: TensorFlow's `TFRecordDataset` copies every byte twice and computes CRC32C in
software, and the graph decode adds a `decode_raw`, a slice and a gather: seven copies
per byte in all. Here each byte is copied twice, once from the page cache into its pool
and once into its unit of batches (small batches once more, by `unbatch`), and checked at
more than 10 GB/s: a third to a fifth of the CPU per byte (docs/benchmarks.md has the
profile). The guarantees are the same: every
frame's length, both CRCs and every non-payload byte of the Example are checked before a
sample is passed on, and a damaged record is named with its file and byte offset.

How:

* A record's frame is scattered by one `os.preadv`: its header bytes into a small "meta"
  row, each feature's payload into that feature's pool array, contiguous across records.
  So a pool holds, per feature, a ``[records * samples_per_record, sample_bytes]`` array.
* Pools are groups of records (``pool_records``), in written order or, with shuffle, in a
  seeded permutation of all kept records (a global shuffle of records, not limited to a
  few open shards); each pool's samples are permuted again inside it. Reader threads
  load the next pools while units are cut from the current ones.
* Unit ``i`` covers positions ``[i * U, (i + 1) * U)`` of the epoch's stream of samples
  (``U`` a whole number of batches, about 8 MB), so cutter threads cut the next units in
  parallel and in a deterministic order: one `np.take` per feature into a recycled
  64-byte-aligned buffer, which TensorFlow adopts without a copy. Small batches: one
  Python call hands TensorFlow a unit as ``[batches, batch_size, sample_bytes]`` and
  `unbatch` cuts it; batches of 2 MB and more go one per call, as views of a unit.
* Each iterator (Keras makes one per epoch) gets its own state through the generator
  dataset behind `Dataset.from_generator`, whose finalizer stops its threads and closes
  its files even when the iterator is dropped mid-epoch. When an epoch hands out its
  last unit, the next epoch starts reading its first pools.
* ``on_corrupt="skip"`` drops just the damaged record and fills the epoch from the next
  pass, so Keras always gets the step count it was given.
"""

from __future__ import annotations

import bisect
import itertools
import os
import queue
import struct
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from keras_tfr import _crc
from keras_tfr.schema import BlockEncoder, FeatureSpec

_ALIGN = 64  # TensorFlow adopts a NumPy buffer without copying when it is aligned
_UNIT_BYTES = 8 << 20  # what one cutter call gathers: several batches
_VIEW_BYTES = 2 << 20  # batches this large go to TensorFlow as views, one call each
_TRUNCATED = "the file ends inside this record (truncated)"


def available() -> bool:
    """Whether this platform has what the direct path needs."""
    if not hasattr(os, "preadv"):
        return False
    try:
        from tensorflow.python.data.ops.from_generator_op import _GeneratorDataset  # noqa: F401
    except ImportError:
        return False
    return True


# --------------------------------------------------------------------------- layout


class _Layout:
    """The frame of a record of ``count`` samples, as preadv pieces."""

    def __init__(self, specs: list[FeatureSpec], count: int):
        offsets, headers, length = BlockEncoder(specs).fixed_layout(count)
        self.count = count
        self.frame = length + 16
        frame_header = struct.pack("<Q", length)
        frame_header += _crc.masked_bytes(_crc.crc32c([frame_header]))
        # Pieces in frame order: ("meta", start, length) into the meta row, or
        # ("feat", spec index, bytes).
        self.pieces: list[tuple[str, int, int]] = []
        meta = [frame_header]
        meta_len = 12
        pos = 0  # in the payload
        by_offset = sorted(headers)
        feats = sorted((offsets[s.key], i) for i, s in enumerate(specs))
        events = [(o, 0, b) for o, b in by_offset] + [(o, 1, i) for o, i in feats]
        pending = 12  # meta bytes not yet emitted as a piece (the frame header)
        meta_start = 0
        for o, kind, what in sorted(events):
            if o != pos:
                raise AssertionError("fixed layout has a gap")  # pragma: no cover
            if kind == 0:
                meta.append(what)
                pending += len(what)
                meta_len += len(what)
                pos += len(what)
            else:
                if pending:
                    self.pieces.append(("meta", meta_start, pending))
                    meta_start += pending
                    pending = 0
                n = count * specs[what].sample_bytes
                self.pieces.append(("feat", what, n))
                pos += n
        if pos != length:
            raise AssertionError("fixed layout does not cover the record")  # pragma: no cover
        pending += 4  # the payload's CRC
        self.pieces.append(("meta", meta_start, pending))
        self.meta_len = meta_len + 4
        self.expected = np.frombuffer(b"".join(meta), dtype=np.uint8)  # all but the CRC

    def crc_parts(self, meta_row: np.ndarray, feats: list[np.ndarray]) -> list[np.ndarray]:
        """The payload's bytes in order (the frame header and the final CRC left out)."""
        parts = []
        for kind, a, n in self.pieces:
            if kind == "meta":
                lo, hi = max(a, 12), min(a + n, self.meta_len - 4)
                if hi > lo:
                    parts.append(meta_row[lo:hi])
            else:
                parts.append(feats[a])
        return parts


def frame_bytes(specs: list[FeatureSpec], samples_per_record: int) -> int:
    """Size of a full record's frame (TFRecord framing included)."""
    return _Layout(specs, samples_per_record).frame


# --------------------------------------------------------------------------- plan


class DirectPlan:
    """Everything an epoch needs, computed once per source."""

    def __init__(
        self,
        *,
        specs: list[FeatureSpec],
        files: list[str],
        shard_records: list[int],
        samples_per_record: int,
        total_samples: int,
        kept_records: np.ndarray,
        num_samples: int,
        num_batches: int,
        batch_size: int,
        shuffle: bool,
        seed: int | None,
        pool_bytes: int,
        readers: int,
        skip: Callable[[str, int, int, int, str], None] | None,
    ):
        self.specs = specs
        self.files = files
        self.shard_records = shard_records
        self.spr = samples_per_record
        self.first = np.cumsum([0, *shard_records])[:-1].astype(np.int64)
        total_records = int(sum(shard_records))
        self.counts = np.full(total_records, samples_per_record, dtype=np.int64)
        if total_records:
            self.counts[-1] = total_samples - (total_records - 1) * samples_per_record
        self.kept = np.asarray(kept_records, dtype=np.int64)
        self.num_batches = num_batches
        self.batch_size = batch_size
        # Cutter threads cut "units" of several batches (fewer, larger gathers, and one
        # Python call per unit for TensorFlow).
        self.total_rows = min(num_samples, num_batches * batch_size)
        self.batch_bytes = batch_bytes = batch_size * sum(s.sample_bytes for s in specs)
        self.unit_batches = max(1, min(num_batches, _UNIT_BYTES // max(1, batch_bytes)))
        self.unit_rows = self.unit_batches * batch_size
        self.num_units = -(-num_batches // self.unit_batches)
        self.shuffle = shuffle
        self.seed = seed
        self.full = _Layout(specs, samples_per_record)
        last = int(self.counts[-1]) if total_records else samples_per_record
        self.short = _Layout(specs, last) if last != samples_per_record else None
        record_bytes = self.full.frame
        self.pool_records = max(1, pool_bytes // record_bytes)
        self.readers = readers
        self.skip = skip
        self.sample_bytes = [s.sample_bytes for s in specs]
        self._epochs = itertools.count()
        self._prepared: list[Epoch | None] = [None]  # a box, for the finalizer
        self._prepared_lock = threading.Lock()
        weakref.finalize(self, _close_prepared, self._prepared)
        # Buffers are reused across epochs (Keras makes an iterator per epoch).
        rows = self.pool_records * samples_per_record
        self.pool_buffers = [_Recycler(rows, sb) for sb in self.sample_bytes]
        self.unit_buffers = [_Recycler(self.unit_rows, sb) for sb in self.sample_bytes]

    def new_epoch(self) -> Epoch:
        """The next epoch: the one prepared while the last ended, or a new one."""
        with self._prepared_lock:
            epoch, self._prepared[0] = self._prepared[0], None
        return epoch if epoch is not None else Epoch(self, next(self._epochs))

    def prepare_epoch(self) -> None:
        """Starts reading the next epoch's first pools (Keras asks for its iterator when
        the current epoch's last steps, callbacks and validation are done)."""
        with self._prepared_lock:
            if self._prepared[0] is None:
                epoch = self._prepared[0] = Epoch(self, next(self._epochs))
                epoch.start()

    def locate(self, record: int) -> tuple[int, int]:
        shard = int(np.searchsorted(self.first, record, side="right") - 1)
        return shard, int(record - self.first[shard])


# --------------------------------------------------------------------------- pools


class _Pool:
    __slots__ = ("feats", "size", "valid")

    def __init__(self, feats: list[np.ndarray], valid: np.ndarray | None, size: int):
        self.feats = feats  # per spec: [records * spr, sample_bytes] uint8
        self.valid = valid  # sample rows in the order batches take them (None: 0..size-1)
        self.size = size


class Epoch:
    """One pass (one iterator) over the source: its record order, reader threads, files."""

    def __init__(self, plan: DirectPlan, number: int):
        self.plan = plan
        base = plan.seed if plan.seed is not None else int(np.random.SeedSequence().entropy)
        self._base = [base & 0xFFFFFFFFFFFFFFFF, number]
        self._executor = _DaemonPool(plan.readers, "keras_tfr_read")
        self._lock = threading.Lock()  # futures, files, pool bookkeeping
        self._pos_lock = threading.RLock()  # pool start positions
        self._order_lock = threading.Lock()
        self._fds: dict[int, int] = {}
        self._futures: dict[int, Future] = {}
        self._starts = [0]  # start position of pools 0, 1, ... (as far as known)
        self._done: dict[int, int] = {}  # batches done per pool
        self._orders: dict[int, np.ndarray] = {}  # record order of each pass
        self._closed = False
        self._cutter = _DaemonPool(plan.readers, "keras_tfr_cut")
        self._units: dict[int, Future] = {}
        self._next_unit = 0
        self._tail: list[np.ndarray] | None = None  # a unit's partial last batch
        self._unit: list[np.ndarray] | None = None  # the unit batches are cut from
        self._offset = 0
        n = len(plan.kept)
        self._pools_per_pass = max(1, -(-n // plan.pool_records))

    # ---------------------------------------------------------------- order

    def _pass_order(self, k: int) -> np.ndarray:
        """Record order of pass ``k`` (pass 1 and later only fill what skip mode dropped)."""
        if not self.plan.shuffle:
            return self.plan.kept
        with self._order_lock:
            order = self._orders.get(k)
            if order is None:
                rng = np.random.default_rng([*self._base, k])
                order = self.plan.kept[rng.permutation(len(self.plan.kept))]
                self._orders = {j: o for j, o in self._orders.items() if j >= k - 1}
                self._orders[k] = order
            return order

    def _pool_records(self, p: int) -> np.ndarray:
        k, j = divmod(p, self._pools_per_pass)
        size = self.plan.pool_records
        return self._pass_order(k)[j * size : (j + 1) * size]

    def _expected_size(self, p: int) -> int:
        return int(self.plan.counts[self._pool_records(p)].sum())

    # ---------------------------------------------------------------- reading

    def _fd(self, shard: int) -> int:
        with self._lock:
            fd = self._fds.get(shard)
            if fd is None:
                if self._closed:
                    raise RuntimeError("keras-tfr: the iterator was closed")
                fd = os.open(self.plan.files[shard], os.O_RDONLY | getattr(os, "O_BINARY", 0))
                self._fds[shard] = fd
            return fd

    def _load(self, p: int) -> _Pool:
        plan = self.plan
        records = self._pool_records(p)
        k = len(records)
        spr = plan.spr
        feats = [r.take(k * spr) for r in plan.pool_buffers]
        counts = plan.counts[records]
        good = np.ones(k, dtype=bool)
        for j, record in enumerate(records):
            layout = plan.short if (plan.short is not None and counts[j] != spr) else plan.full
            row = slice(j * spr, j * spr + layout.count)
            parts = [f[row] for f in feats]
            problem = self._read_record(int(record), layout, parts)
            if problem is not None:
                shard, index = plan.locate(int(record))
                path = plan.files[shard]
                offset = index * plan.full.frame
                n_records = plan.shard_records[shard]
                if plan.skip is None:
                    raise ValueError(
                        f"keras-tfr: corrupt record in {path} at byte offset {offset} "
                        f"(record {index} of {n_records}): {problem}; run `keras-tfr "
                        "verify` on the data set"
                    )
                plan.skip(path, offset, index, n_records, problem)
                good[j] = False
        if good.all() and (counts == spr).all():
            valid = None
            size = k * spr
        else:
            rows = [np.arange(j * spr, j * spr + counts[j]) for j in range(k) if good[j]]
            valid = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
            size = len(valid)
        if plan.shuffle and size:
            rng = np.random.default_rng([*self._base, p, 1])
            valid = rng.permutation(size) if valid is None else rng.permutation(valid)
        return _Pool(feats, valid, size)

    def _read_record(self, record: int, layout: _Layout, feats: list[np.ndarray]) -> str | None:
        """Reads one frame into ``feats`` (each ``[count, sample_bytes]``); a problem or None."""
        shard, index = self.plan.locate(record)
        offset = index * self.plan.full.frame
        try:
            fd = self._fd(shard)
        except OSError as e:
            return f"the file cannot be opened ({e.strerror or e})"
        meta = np.empty(layout.meta_len, dtype=np.uint8)
        views = []
        for kind, a, n in layout.pieces:
            views.append(meta[a : a + n] if kind == "meta" else feats[a])
        try:
            got = os.preadv(fd, views, offset)
        except OSError as e:
            return f"the file cannot be read ({e.strerror or e})"
        if got < layout.frame:
            return _TRUNCATED
        if not np.array_equal(meta[:12], layout.expected[:12]):
            return "its length field or the length's CRC is damaged"
        crc = _crc.masked(_crc.crc32c(layout.crc_parts(meta, feats)))
        if crc != int(meta[-4:].view("<u4")[0]):
            return "the record failed its TFRecord CRC check"
        if not np.array_equal(meta[:-4], layout.expected):
            return (
                "the record passed its CRC check but does not have the layout its manifest "
                "describes; the data set was modified after it was written"
            )
        return None

    def _future(self, p: int) -> Future:
        with self._lock:
            fut = self._futures.get(p)
            if fut is None:
                if self._closed:
                    raise RuntimeError("keras-tfr: the iterator was closed")
                fut = self._executor.submit(self._load, p)
                self._futures[p] = fut
            # Read ahead: the next pools load while this one is cut into batches (within
            # the first pass: later passes only fill in for records skip mode dropped).
            for q in range(p + 1, min(p + 1 + self.plan.readers, self._pools_per_pass)):
                if q not in self._futures and q not in self._done:
                    self._futures[q] = self._executor.submit(self._load, q)
            return fut

    def _start(self, p: int) -> int:
        """Start position of pool ``p`` in the epoch's stream of samples."""
        with self._pos_lock:
            while len(self._starts) <= p:
                q = len(self._starts) - 1
                if self.plan.skip is None:
                    size = self._expected_size(q)
                else:  # what skip mode dropped is known only once the pool is read
                    size = self._future(q).result().size
                self._starts.append(self._starts[-1] + size)
            return self._starts[p]

    # ---------------------------------------------------------------- batches

    def unit(self, i: int) -> list[np.ndarray]:
        """Rows ``[i * unit_rows, (i + 1) * unit_rows)`` of the epoch, per feature."""
        plan = self.plan
        b = plan.unit_rows
        lo = i * b
        hi = min(lo + b, plan.total_rows)
        outs = [r.take(hi - lo) for r in plan.unit_buffers]
        p = self._pool_at(lo)
        used = []
        pos = lo
        while pos < hi:
            fut = self._future(p)
            pool = fut.result()
            start = self._start(p)
            end = start + pool.size
            a, z = pos - start, min(hi, end) - start
            if z > a:
                idx = None if pool.valid is None else pool.valid[a:z]
                for out, feat in zip(outs, pool.feats):
                    dst = out[pos - lo : pos - lo + (z - a)]
                    if idx is None:
                        dst[...] = feat[a:z]
                    else:
                        # mode="clip": with the default "raise", NumPy gathers into a
                        # fresh temporary and copies that into `out` (indices are valid).
                        np.take(feat, idx, axis=0, out=dst, mode="clip")
                pos += z - a
            used.append(p)
            p += 1
        self._release(i, used)
        return outs

    def start(self) -> None:
        """Starts cutting the first units (and so reading the first pools)."""
        with self._lock:
            self._submit_units(0)

    def _submit_units(self, k: int) -> None:
        for q in range(k, min(k + 1 + self.plan.readers, self.plan.num_units)):
            if q not in self._units:
                self._units[q] = self._cutter.submit(self.unit, q)

    def next_unit(self) -> list[np.ndarray]:
        """The epoch's next unit; the ones after it are cut in the background meanwhile."""
        k = self._next_unit
        if k >= self.plan.num_units:
            raise StopIteration
        self._next_unit = k + 1
        with self._lock:
            if self._closed:
                raise StopIteration
            self._submit_units(k)
            fut = self._units.pop(k)
        unit = fut.result()
        if k == self.plan.num_units - 1:
            self.plan.prepare_epoch()
        return unit

    def next_batch(self) -> list[np.ndarray]:
        """The epoch's next batch: a view of the current unit (no copy)."""
        b = self.plan.batch_size
        if self._unit is None or self._offset >= len(self._unit[0]):
            self._unit = self.next_unit()
            self._offset = 0
        lo = self._offset
        self._offset = lo + b
        return [u[lo : lo + b] for u in self._unit]

    def next_block(self) -> list[np.ndarray]:
        """The epoch's next block of batches, ``[batches, rows, sample_bytes]`` per feature:
        a whole unit (a view, no copy), and a unit's last, partial batch on its own."""
        if self._tail is not None:
            block, self._tail = self._tail, None
            return block
        unit = self.next_unit()
        b = self.plan.batch_size
        rows = len(unit[0])
        full = rows - rows % b
        if full == rows:
            return [u.reshape(-1, b, u.shape[1]) for u in unit]
        tail = [u[full:].reshape(1, rows - full, u.shape[1]) for u in unit]
        if full == 0:
            return tail
        self._tail = tail
        return [u[:full].reshape(-1, b, u.shape[1]) for u in unit]

    def _pool_at(self, pos: int) -> int:
        """Index of the pool holding stream position ``pos``."""
        with self._pos_lock:
            p = bisect.bisect_right(self._starts, pos) - 1
        while True:
            end = self._start(p + 1)
            if pos < end:
                return p
            p += 1

    def _release(self, i: int, used: list[int]) -> None:
        """Drops pools whose every unit is cut."""
        b = self.plan.unit_rows
        last_batch = self.plan.num_units - 1
        bounds = [(self._start(p), self._start(p + 1)) for p in used]
        with self._lock:
            for p, (start, end) in zip(used, bounds):
                first = start // b
                last = min(last_batch, max(first, (end - 1) // b))
                self._done[p] = self._done.get(p, 0) + 1
                if self._done[p] >= last - first + 1:
                    self._futures.pop(p, None)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for fut in list(self._futures.values()) + list(self._units.values()):
                fut.cancel()
            self._futures.clear()
            self._units.clear()
        self._cutter.shutdown()
        self._executor.shutdown()
        with self._lock:
            for fd in self._fds.values():
                try:
                    os.close(fd)
                except OSError:  # pragma: no cover
                    pass
            self._fds.clear()


class _DaemonPool:
    """A minimal thread pool of daemon threads, started on first use.

    `concurrent.futures.ThreadPoolExecutor` joins its threads when the interpreter exits
    and stops running queued work first: a cutter waiting for a pool read that will never
    run would then hold the exit forever (an epoch read ahead and never iterated has
    both). These threads only read and copy; dropping them at exit loses nothing.
    """

    def __init__(self, workers: int, name: str):
        self._workers = max(1, workers)
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("keras-tfr: the iterator was closed")
            if len(self._threads) < self._workers:
                t = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._threads.append(t)
                t.start()
            self._queue.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to whoever waits on the future
                fut.set_exception(e)

    def shutdown(self) -> None:
        """Cancels what has not started, lets running work finish, and joins."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        pending = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                pending.append(item[0])
        for fut in pending:
            fut.cancel()
        for _ in threads:
            self._queue.put(None)
        for t in threads:
            if t is not threading.current_thread():
                t.join()


def _close_prepared(box: list) -> None:
    epoch, box[0] = box[0], None
    if epoch is not None:
        epoch.close()


class _Recycler:
    """Hands out ``[rows, cols]`` uint8 arrays, 64-byte aligned, reusing buffers.

    Fresh memory costs a page fault per 4 KB (on the benchmark machine an epoch of fresh
    batch and pool arrays spent more time in the kernel than copying). A buffer is free
    again once nothing refers to it any more, TensorFlow's tensors made from it included
    (TensorFlow adopts aligned NumPy arrays without copying and holds a reference to them):
    its reference count falls back to the one held here.
    """

    def __init__(self, rows: int, cols: int):
        self._rows, self._cols = rows, cols
        self._bufs: list[tuple[np.ndarray, int]] = []
        self._lock = threading.Lock()
        self._next = 0

    def take(self, rows: int) -> np.ndarray:
        n = self._rows * self._cols
        with self._lock:
            count = len(self._bufs)
            for j in range(count):
                k = (self._next + j) % count
                raw, off = self._bufs[k]
                if sys.getrefcount(raw) == 3:  # the list's tuple, `raw`, the argument
                    self._next = k + 1
                    return raw[off : off + n].reshape(self._rows, self._cols)[:rows]
            raw = np.empty(n + _ALIGN, dtype=np.uint8)
            off = (-raw.ctypes.data) % _ALIGN
            self._bufs.append((raw, off))
            return raw[off : off + n].reshape(self._rows, self._cols)[:rows]


# --------------------------------------------------------------------------- tf.data


_registry: dict[int, Epoch] = {}
_registry_lock = threading.Lock()
_ids = itertools.count(1)


def dataset(plan: DirectPlan) -> Any:
    """A `tf.data.Dataset` of batches: a tuple of uint8 ``[rows, sample_bytes]`` tensors,
    one per spec (in ``plan.specs`` order), in the epoch's order."""
    import tensorflow as tf
    from tensorflow.python.data.ops.from_generator_op import _GeneratorDataset

    def init(_unused):
        eid = next(_ids)
        with _registry_lock:
            _registry[eid] = plan.new_epoch()
        return np.int64(eid)

    def call(method):
        def fn(eid):
            epoch = _registry.get(int(eid))
            if epoch is None:  # pragma: no cover - the iterator is gone
                raise StopIteration
            return getattr(epoch, method)()

        return fn

    def finalize(eid):
        with _registry_lock:
            epoch = _registry.pop(int(eid), None)
        if epoch is not None:
            epoch.close()
        return np.int64(0)

    # Small batches: one Python call per unit (about 8 MB), cut into batches by `unbatch`
    # in C++ (a copy, cheaper than TensorFlow's ~0.2 ms of CPU per Python call on the
    # benchmark machine). Large batches: one call per batch, a view of a unit that
    # TensorFlow adopts without a copy.
    views = plan.batch_bytes >= _VIEW_BYTES
    n_specs = len(plan.specs)
    dims = [None] if views else [None, None]
    spec = tuple(tf.TensorSpec([*dims, sb], tf.uint8) for sb in plan.sample_bytes)
    next_fn = call("next_batch" if views else "next_block")

    def cut(eid):
        outs = tf.numpy_function(next_fn, [eid], [tf.uint8] * n_specs)
        return tuple(tf.ensure_shape(o, s.shape) for o, s in zip(outs, spec))

    # The generator dataset calls `init` for every new iterator (Keras makes one per epoch)
    # and `finalize` when the iterator is done or dropped.
    batches = _GeneratorDataset(
        np.int64(0),
        lambda d: tf.numpy_function(init, [d], tf.int64),
        cut,
        lambda e: tf.numpy_function(finalize, [e], tf.int64),
        spec,
    )
    return batches if views else batches.unbatch()
