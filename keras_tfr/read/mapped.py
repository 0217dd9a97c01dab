"""The memory-mapped reader: sample-level random access, straight from the page cache.

Used for ``access="samples"`` (the default for uncompressed data sets of fixed-size
features on a local file system). Why: every full record of a data set has the same
layout, so sample ``j`` of record ``r`` sits at a known byte offset. With the shards
mapped read-only, a batch is one NumPy gather straight from the page cache into the
buffer TensorFlow adopts, as a memory-mapped ``.npy`` gathered by index would make it
(samples under 24 KB pass through a cache-sized temporary, see `MappedPlan.gather`),
plus what an array lacks (the CRC check, the layout check).

How:

* **One address range.** All shards are mapped, in order, into one reserved range of
  addresses (`_Region`), so a byte of the data set has one integer address and a unit of
  several batches is gathered by one fancy index per feature, over a read-only
  "sliding window" view (a row per byte offset, ``sample_bytes`` wide).
* **Order.** `keras_tfr.read.order.SampleOrder` says which written samples each stream
  position of an epoch holds (split, worker share, seeded shuffle); the reader only
  follows it. Unit ``i`` covers whole batches (about 8 MB); the next units are gathered
  while the current one is consumed. With the windowed shuffle (data larger than
  memory), each window's records are read ahead with ``madvise(MADV_WILLNEED)`` and
  dropped from the mapping (``MADV_DONTNEED``) once the order has moved past them.
* **Checks.** Before a sample of record ``r`` is handed out, record ``r`` has passed its
  checks: it lies inside the file, its length field and the length's CRC are what the
  layout says, the CRC-32C of its data matches (hardware CRC over the mapped bytes, in
  place, more than 5 GB/s per core), and every non-payload byte of the Example matches
  the layout. ``verify="first_read"`` (default) checks each record the first time this
  source reads it, and again after its shard changes on disk (size, modification time or
  inode, looked at when each epoch starts); ``verify="every_epoch"`` checks every record
  again in every epoch (one more read pass over the data per epoch).
* **Damage.** ``on_corrupt="raise"`` stops with the file, byte offset and record.
  ``"skip"`` drops the damaged record's samples and fills their places with other
  samples of the same share, drawn at random (seeded), so the epoch keeps its step
  count; draws are bounded, so a data set whose records are all damaged ends with an
  error instead of looping.
* **Hand-off to tf.data on a lattice** (`lattice_dataset`, for data sets written on a
  `keras_tfr.schema.Lattice`, the writer's default). Each shard starts at a multiple of
  the lattice period, so every sample of feature ``f`` is a whole number of rows of one
  ``[rows, row_bytes]`` tensor over the whole range: a tensor TensorFlow gets through
  DLPack, aliasing the mapped pages (no copy). Python runs once per unit (8,192 samples
  or more, ``readers`` at a time): order, checks, row numbers; TensorFlow then gathers
  each batch with `tf.gather` in its own threads, as Keras does for in-memory arrays
  (one batch at a time, in a plain ``map`` the prefetch reads).
* **Hand-off to tf.data otherwise** (`dataset`, data sets written before the lattice or
  with ``lattice=False``). Each unit is one Python call in a parallel ``map``
  (``readers`` at a time, in TensorFlow's threads), gathered into recycled
  64-byte-aligned buffers that TensorFlow adopts without a copy; a buffer is reused once
  nothing refers to it any more (a weak-reference finalizer on the array handed out, not
  a reference count). Nothing is read ahead past an iterator.
* **Hand-off to NumPy** (`keras_tfr.read.numpy_iter`). Each batch is an array per
  feature, copied once (`MappedPlan.gather_batches`); on a lattice every array is
  64-byte aligned (``aligned``: `np.take` from the ``[rows, row_bytes]`` view into an
  aligned array, still one copy), so JAX takes it on the CPU without a copy. Each
  iterator owns ``readers`` threads and releases them when it ends or is dropped.
* **Hand-off to a Python loop over the source** (`keras_tfr.read.numpy_iter.TensorBatches`,
  on a lattice). The NumPy hand-off's aligned arrays, each handed to TensorFlow through
  DLPack as a tensor over that memory.
* **Memory maps and truncation.** A shard replaced on disk (written anew and renamed
  over, as keras-tfr's writer does) keeps its old mapping until the next epoch starts,
  where the change is found and the shard is mapped again and checked again. A shard
  cut short *in place* while it is mapped makes any access past its new end fail with
  SIGBUS, as it would for `np.memmap`; the reader guards against it where it can (sizes
  are checked when each epoch starts, and records past a file's end are never touched),
  see docs/reliability.md.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import functools
import math
import mmap
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import numpy as np

from keras_tfr import _crc
from keras_tfr._io import HUGE_PAGE
from keras_tfr.format import framing
from keras_tfr.read.order import SampleOrder
from keras_tfr.schema import BlockEncoder, FeatureSpec, Lattice, tf_bytes_to_feature

_ALIGN = 64  # TensorFlow adopts a NumPy buffer without copying when it is aligned
_UNIT_BYTES = 8 << 20  # what one unit holds: several batches
# ... but at most this many: a unit handed to NumPy or to a Python loop is a list of
# arrays, one per batch, made before its first batch is handed out. Sized by bytes only,
# 1,000,000 samples of 1 byte in batches of 1 were one unit of a million arrays: 15.7 s
# and 395 MB before the first batch of `as_numpy_iterator()` (30.6 s and 1.5 GB in a
# Python loop).
_UNIT_BATCHES = 1024
_CHUNK_BYTES = 120 << 10  # small samples are gathered in cache-sized pieces (see `gather`)
_LATTICE_UNIT_ROWS = 8192  # samples per unit, at least, on a lattice (row numbers only)
_ORDER_ROWS = 32768  # stream positions whose order is computed at once (a few units)
_MAX_DRAWS = 64  # rounds of replacement draws for skipped samples, per unit
# Threads that check records not yet checked, beside the reader that needs them: a check
# reads its record through the map, so from a cold page cache it waits on the disk, and
# with only the readers checking (2 on a 2-core machine) the disk had 2 requests to work
# on at a time (`benchmarks/cold_read.py`).
_CHECK_THREADS = 8
_CLAIM = 8  # records a checking thread takes at a time
_EPOCHS_KEPT = 4  # epochs whose order a plan keeps for tf.data iterators
_TRUNCATED = "the file ends inside this record (truncated)"
_PROT_READ = 1
_MAP_FIXED = 0x10  # the same value on Linux and macOS
_MADV_WILLNEED = 3  # the same values on Linux and macOS
_MADV_DONTNEED = 4
_HUGE_ALIGN = sys.platform.startswith("linux")  # shards on huge-page boundaries (`_Region`)
# A fault on a file's page maps the page cache's pages around it: 64 KB (Linux's
# fault-around), and on recent kernels (6.18 here) the whole large folio that holds it,
# up to a huge page where the file was just written. Dropped records are rounded out to this.
_MAP_AROUND = HUGE_PAGE


def available() -> bool:
    """Whether this platform can map shards into one address range."""
    if sys.platform not in ("linux", "darwin"):
        return False
    return _libc() is not None


_LIBC: Any = None


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_int64,
            ]
            libc.munmap.restype = ctypes.c_int
            libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            libc.malloc.restype = ctypes.c_void_p
            libc.malloc.argtypes = [ctypes.c_size_t]
            libc.free.argtypes = [ctypes.c_void_p]
            libc.madvise.restype = ctypes.c_int
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):  # pragma: no cover
            return None
        _LIBC = libc
    return _LIBC


# --------------------------------------------------------------------------- layout


class _Layout:
    """Where the bytes of a record of ``count`` samples sit in its frame."""

    def __init__(self, specs: list[FeatureSpec], count: int, lattice: Lattice | None = None):
        offsets, headers, length = BlockEncoder(specs, lattice).fixed_layout(count)
        self.count = count
        self.length = length
        self.frame = framing.frame_size(length)
        h = framing.HEADER_BYTES
        # Per spec: offset of its first sample inside the frame.
        self.feature_offsets = np.array([h + offsets[s.key] for s in specs], dtype=np.int64)
        # Every byte of the frame that is not payload or the final CRC, and its value.
        positions = [np.arange(h)]
        expected = [np.frombuffer(framing.header(length), dtype=np.uint8)]
        for o, b in headers:
            positions.append(np.arange(h + o, h + o + len(b)))
            expected.append(np.frombuffer(b, dtype=np.uint8))
        self.meta_positions = np.concatenate(positions)
        self.meta_expected = np.concatenate(expected)


def frame_bytes(
    specs: list[FeatureSpec], samples_per_record: int, lattice: Lattice | None = None
) -> int:
    """Size of a full record's frame (TFRecord framing included)."""
    return _Layout(specs, samples_per_record, lattice).frame


# --------------------------------------------------------------------------- region


class MapLimitError(OSError):
    """A shard could not be mapped for want of room in the process's memory maps: Linux
    allows a process ``vm.max_map_count`` of them (65,530 by default), and sample mode
    takes one per shard. Raised, not counted as that shard's damage: it says nothing of
    the data."""

    def __init__(self, path: str, index: int, shards: int):
        try:
            with open("/proc/sys/vm/max_map_count") as f:
                limit = f"vm.max_map_count = {int(f.read())}"
            with open("/proc/self/maps") as f:
                used = f"{sum(1 for _ in f)} in use"
        except (OSError, ValueError):
            limit, used = "the system's limit", "count unknown"
        super().__init__(
            errno.ENOMEM,
            f"keras-tfr: cannot memory-map {path} (shard {index + 1} of {shards}): the "
            f"process has run out of memory maps ({limit}, {used}); sample mode maps "
            "each shard. Read this data set with access='blocks', write it in fewer, "
            "larger shards, or raise the limit (sysctl -w vm.max_map_count=...).",
        )


class _Region:
    """Every shard mapped read-only, in order, into one reserved range of addresses.

    Each shard starts at a multiple of ``align`` (a multiple of the page size: the
    lattice period's, for a lattice data set); ``starts[k]`` is shard ``k``'s offset in the
    range. Pages past a file's end are never touched (records are checked against the
    file's size first). Unmapped when the region is closed or collected.

    The sources of one process that read the same shards share one region (`shared_region`:
    a data set's training and validation subsets, its re-batched copies): the page cache
    holds the data once either way, but each mapping counts in the process's RSS, so two
    mappings of a 2 GB data set showed as 4 GB.
    """

    def __init__(self, files: list[str], sizes: list[int], align: int = 1, huge: bool = True):
        libc = _libc()
        self.lock = threading.Lock()  # held while shards are found changed and remapped
        self.remaps = 0  # shards mapped again so far: a plan that saw fewer looks again
        slots = _slots(sizes, math.lcm(mmap.PAGESIZE, align))
        # On Linux, where it costs at most twice the address space, every shard starts on
        # a huge-page boundary (2 MB), so that the kernel maps the page cache's huge pages
        # whole (one TLB entry for 2 MB instead of 512): a random gather then misses the
        # TLB far less, as it does from an array in memory (NumPy asks for huge pages for
        # its arrays). The writer writes shards in whole, aligned 2 MB pieces, so that a
        # data set just written is cached in huge pages (`keras_tfr.write.sink`); one read
        # from disk is cached in the pieces the kernel's read-ahead makes (128 KB here).
        # ``MADV_HUGEPAGE`` would have cold shards read into huge pages, in a tenth of the
        # disk requests, but the first epoch from disk then ran 2.5-3x slower
        # (docs/benchmarks.md, "Huge pages"). Not ``huge`` (reading in windows, where the
        # pages kept mapped must not grow with the data): 4 KB boundaries, as a touch of
        # a sample then maps less than its whole 2 MB.
        huge_slots = _slots(sizes, math.lcm(mmap.PAGESIZE, align, HUGE_PAGE))
        self.huge = huge and _HUGE_ALIGN and sum(huge_slots) <= 2 * sum(slots) + HUGE_PAGE
        if self.huge:
            slots = huge_slots
        self.files = files
        self.total = int(sum(slots))
        self.starts = np.cumsum([0, *slots])[:-1].astype(np.int64)
        anon = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        pad = HUGE_PAGE if self.huge else 0
        reserved = libc.mmap(None, self.total + pad, 0, anon, -1, 0)
        if reserved in (None, ctypes.c_void_p(-1).value):
            err = ctypes.get_errno()
            raise OSError(err, f"keras-tfr: cannot reserve {self.total} bytes of addresses")
        self.base = -(-int(reserved) // HUGE_PAGE) * HUGE_PAGE if self.huge else int(reserved)
        self._closer = weakref.finalize(self, libc.munmap, int(reserved), self.total + pad)
        # Not at interpreter exit (the process's end unmaps it anyway): an iterator still
        # open then has TensorFlow's threads copying from the range while Python shuts
        # down, and unmapping it under them crashed the process (SIGSEGV).
        self._closer.atexit = False
        self.sizes = np.zeros(len(files), dtype=np.int64)  # bytes mapped of each file
        self.signatures: list[tuple[int, int, int] | None] = [None] * len(files)
        # Why a file could not be mapped (None: mapped, or an empty slot to be named by
        # the checks as missing or unreadable).
        self.problems: list[str | None] = [None] * len(files)
        for k in range(len(files)):
            self.map(k)
        # Writable only as far as NumPy knows (the pages are mapped read-only): what
        # `MappedPlan.lattice_tensors` hands to DLPack, which cannot say "read-only".
        self.buffer = (ctypes.c_uint8 * self.total).from_address(self.base)
        self.array = np.frombuffer(memoryview(self.buffer), dtype=np.uint8)
        self.array.flags.writeable = False

    def map(self, k: int) -> None:
        """Maps shard ``k`` (again) over its slot; a file that cannot be opened or mapped
        leaves the slot empty, and its records are named by the checks."""
        path = self.files[k]
        self.sizes[k] = 0
        self.signatures[k] = None
        self.problems[k] = None
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            self.problems[k] = f"the file cannot be opened ({e.strerror or e})"
            return
        try:
            st = os.fstat(fd)
            slot = int(
                (self.starts[k + 1] if k + 1 < len(self.starts) else self.total) - self.starts[k]
            )
            size = min(int(st.st_size), slot)
            # Anonymous zero pages under the whole slot first: a remapped shard that shrank
            # leaves no stale mapping of the old file past its new end.
            anon = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED
            _libc().mmap(self.base + int(self.starts[k]), slot, _PROT_READ, anon, -1, 0)
            if size > 0:
                got = _libc().mmap(
                    self.base + int(self.starts[k]),
                    size,
                    _PROT_READ,
                    mmap.MAP_SHARED | _MAP_FIXED,
                    fd,
                    0,
                )
                if got != self.base + int(self.starts[k]):
                    err = ctypes.get_errno()
                    if err == errno.ENOMEM:
                        raise MapLimitError(path, k, len(self.files))
                    self.problems[k] = f"the file cannot be memory-mapped ({os.strerror(err)})"
                    return
            self.sizes[k] = size
            self.signatures[k] = _signature(st)
        finally:
            os.close(fd)

    def changed(self) -> list[int]:
        """Shards whose file on disk is no longer the one mapped (size, mtime, inode)."""
        out = []
        for k, path in enumerate(self.files):
            try:
                sig: tuple[int, int, int] | None = _signature(os.stat(path))
            except OSError:
                sig = None
            if sig != self.signatures[k]:
                out.append(k)
        return out

    def close(self) -> None:
        self._closer()

    def remap_changed(self) -> None:
        """Maps again every shard whose file on disk is no longer the one mapped."""
        with self.lock:
            for k in self.changed():
                self.map(k)
                self.remaps += 1


_REGIONS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_regions_lock = threading.Lock()


def _slots(sizes: list[int], align: int) -> list[int]:
    """Each shard's slot in a `_Region`: its size rounded up to ``align`` (one at least)."""
    return [max(align, -(-int(s) // align) * align) for s in sizes]


def shared_region(files: list[str], sizes: list[int], align: int, huge: bool = True) -> _Region:
    """The process's `_Region` of these shards (paths, sizes, alignment, huge pages or
    not), made on first use and unmapped once nothing holds it."""
    key = (tuple(files), tuple(int(s) for s in sizes), int(align), bool(huge))
    with _regions_lock:
        region = _REGIONS.get(key)
        if region is None:
            region = _REGIONS[key] = _Region(files, sizes, align, huge)
        return region


def _signature(st: os.stat_result) -> tuple[int, int, int]:
    return (int(st.st_size), int(st.st_mtime_ns), int(st.st_ino))


# --------------------------------------------------------------------------- plan


class MappedPlan:
    """Everything the epochs of one source share: layout, order, mapping, checks."""

    def __init__(
        self,
        *,
        specs: list[FeatureSpec],
        files: list[str],
        shard_records: list[int],
        shard_bytes: list[int],
        samples_per_record: int,
        total_samples: int,
        order: SampleOrder,
        num_batches: int,
        batch_size: int,
        readers: int,
        verify: str,
        skip: Callable[[str, int, int, int, str], None] | None,
        lattice: Lattice | None = None,
        checksums: list[str] | None = None,
        written_again: Callable[[], bool] | None = None,
    ):
        self.specs = specs
        # Whether the data set's manifest.json no longer lists these shards (asked once,
        # when the shards are first mapped).
        self._written_again = written_again
        self.files = files
        # The manifest's `crc32c:xxxxxxxx` per shard: a shard changed on disk must still
        # hold the records the manifest lists (`_forget_remapped`).
        self.checksums = list(checksums) if checksums is not None else None
        # Per shard: why its records are all refused (another shard's copy put in its
        # place), or None.
        self._shard_problems: list[str | None] = [None] * len(files)
        self.shard_records = [int(r) for r in shard_records]
        self.shard_bytes = [int(b) for b in shard_bytes]
        self.spr = int(samples_per_record)
        self.total_samples = int(total_samples)
        self.order = order
        self.num_batches = int(num_batches)
        self.batch_size = int(batch_size)
        self.total_rows = min(order.size, self.num_batches * self.batch_size)
        self.readers = max(1, int(readers))
        self.verify = verify
        self.skip = skip
        self.sample_bytes = [s.sample_bytes for s in specs]
        self.batch_bytes = batch_bytes = batch_size * sum(self.sample_bytes)
        unit_batches = max(
            1, min(self.num_batches, _UNIT_BYTES // max(1, batch_bytes), _UNIT_BATCHES)
        )
        # When TensorFlow gathers (`lattice_dataset`), a unit holds row numbers, not data:
        # larger units cost no memory and cut the per-unit overhead (a Python call, a
        # slice of the order).
        lattice_batches = max(unit_batches, -(-_LATTICE_UNIT_ROWS // batch_size))
        self.order_rows = _ORDER_ROWS
        # A subset scanned in written order (an unshuffled validation subset where
        # windows are asked for: `SampleOrder.scan`) has its samples spread over every
        # record: a unit of it spans as many written samples as the unit's rows over the
        # subset's density, and the records of its units in flight stay mapped
        # (`Epoch._drop_behind`). So its units and order steps are cut by that density
        # (at least a batch): they span about what a unit of the whole data set spans.
        # Uncut, a 5 % subset of 3 GB kept all of its records mapped.
        if order.scan:
            density = order.size / max(1, order.total)
            unit_batches, lattice_batches = (
                max(1, int(b * density)) for b in (unit_batches, lattice_batches)
            )
            self.order_rows = max(batch_size, int(_ORDER_ROWS * density))
        self.unit_batches = unit_batches
        self.unit_rows = unit_batches * batch_size
        self.lattice_unit_rows = min(self.num_batches, lattice_batches) * batch_size
        self.lattice = lattice
        self.full = _Layout(specs, self.spr, lattice)
        total_records = int(sum(self.shard_records))
        self.total_records = total_records
        last = self.total_samples - (total_records - 1) * self.spr if total_records else self.spr
        self.short = _Layout(specs, last, lattice) if last != self.spr else None
        self.shard_of = np.repeat(
            np.arange(len(files), dtype=np.int64), self.shard_records
        )  # per record
        first = np.cumsum([0, *self.shard_records])[:-1].astype(np.int64)
        self.index_in_shard = np.arange(total_records, dtype=np.int64) - first[self.shard_of]
        self._region: _Region | None = None
        self._checked_files: list[tuple[int, int, int] | None] = []
        self._seen_remaps = 0
        self._region_lock = threading.Lock()
        self._feature_base: list[np.ndarray] = []
        self._row_base: list[np.ndarray] = []
        # Per record: 0 unchecked, 1 good, 2 damaged. Claimed records are being checked.
        self.state = np.zeros(total_records, dtype=np.uint8)
        self._claimed = np.zeros(total_records, dtype=bool)
        self._problems: dict[int, str] = {}  # damaged record -> why, as its check said
        self._check_lock = threading.Condition()
        self.buffers = [_Buffers(self.unit_rows, sb) for sb in self.sample_bytes]
        self.windows: list[np.ndarray] = []
        # The tf.data iterators' epochs, by (epoch, first batch), most recent last.
        self._epochs: dict[tuple[int, int], Epoch] = {}
        self._epochs_lock = threading.Lock()
        # tf.data's epochs whose units are all handed out: TensorFlow may still gather
        # from the last ones, so the pieces they read ahead are dropped when the next
        # iterator starts (`begin_epoch`).
        self._ended: list[Epoch] = []

    # ---------------------------------------------------------------- mapping

    def region(self) -> _Region:
        with self._region_lock:
            if self._region is None:
                period = self.lattice.period if self.lattice is not None else 1
                # Huge pages only for one order over every sample: read in windows (or a
                # subset scanned), each touch of a sample mapped its whole 2 MB, and the
                # pages kept mapped grew with the data (`_Region`).
                huge = not (self.order.windowed or self.order.scan)
                self._region = shared_region(self.files, self.shard_bytes, period, huge)
                # The files this plan's checks were made on (another plan may remap the
                # shared region): a shard whose mapped file is not one of them is
                # checked again. A region some plan has mapped again, or a data set
                # written again since this plan's manifest was read, may map files
                # other than the manifest's, whose records pass their own checks: then
                # every shard is checked again, its checksum against the manifest's
                # (`_other_records`), when the first epoch starts.
                self._checked_files = list(self._region.signatures)
                if self._region.remaps or (self._written_again and self._written_again()):
                    self._checked_files = [None] * len(self.files)
                self._seen_remaps = self._region.remaps
                arr = self._region_array = self._region.array
                # Per feature, a read-only "sliding window": row i is the sample_bytes
                # bytes at address i (a [rows, sample_bytes] uint8 view with strides
                # (1, 1)), so a fancy index on rows copies whole samples, and NumPy
                # releases the GIL while it copies (it does not for an opaque void dtype
                # gathered in small pieces), so the reader threads copy in parallel.
                self.windows = [
                    np.ndarray(
                        shape=(max(1, len(arr) - sb + 1), sb),
                        dtype=np.uint8,
                        buffer=arr,
                        strides=(1, 1),
                    )
                    for sb in self.sample_bytes
                ]
                self._feature_base = self._feature_bases(self._region)
                # On a lattice every feature starts on a row: the same bases in rows.
                self._row_base = [
                    b // g for b, g in zip(self._feature_base, self.lattice_rows or [])
                ]
            return self._region

    def begin_epoch(self) -> None:
        """Called when an epoch starts: drops from the mapping what the epochs ended
        before it read ahead and kept (`Epoch.drop_all`), maps again the shards changed on
        disk, and forgets the checks of every shard whose mapped file is not the one this
        plan checked (changed now, or since remapped by another plan sharing the
        region)."""
        region = self.region()
        with self._epochs_lock:
            ended, self._ended = self._ended, []
        for epoch in ended:
            epoch.drop_all()
        with self._check_lock:
            region.remap_changed()
            self._forget_remapped()
            if self.verify == "every_epoch":
                self.state[self.state == 1] = 0

    def _forget_remapped(self) -> None:
        """Forgets the checks of every shard whose mapped file is not the one they were
        made on (under `_check_lock`)."""
        region = self.region()
        with region.lock:  # not while another plan maps a shard again
            self._seen_remaps = region.remaps
            for k, signature in enumerate(region.signatures):
                if signature != self._checked_files[k]:
                    self.state[self.shard_of == k] = 0
                    self._checked_files[k] = signature
                    self._shard_problems[k] = self._other_records(k)

    def _other_records(self, k: int) -> str | None:
        """Why shard ``k``, mapped again, does not hold the records its manifest lists
        (sound records of another shard, or moved), or None. Its records' own CRCs, read
        from their frames (4 bytes per record), against the manifest's checksum: a shard
        replaced by a copy of another passes every record's check but not this one."""
        region = self.region()
        if self.checksums is None or region.signatures[k] is None:
            return None  # nothing to compare, or a file the record checks name
        n = self.shard_records[k]
        records = np.flatnonzero(self.shard_of == k)
        if not n or len(records) != n:
            return None
        h = framing.HEADER_BYTES
        at = self.index_in_shard[records] * self.full.frame + h + self.full.length
        ends = self.index_in_shard[records] * self.full.frame + self.full.frame
        if self.short is not None and records[-1] == self.total_records - 1:
            at[-1] += self.short.length - self.full.length
            ends[-1] += self.short.frame - self.full.frame
        if int(ends[-1]) > int(region.sizes[k]):
            return None  # cut short: the record checks name where
        base = int(region.starts[k])
        picks = (base + at)[:, None] + np.arange(4)
        crcs = framing.unmasked(region.array[picks].copy().view("<u4").ravel())
        checksum = f"crc32c:{_crc.crc32c([crcs.astype('<u4').tobytes()]):08x}"
        if checksum == self.checksums[k]:
            return None
        return (
            f"the shard changed on disk and no longer holds the records its manifest "
            f"lists (checksum {checksum}, the manifest's {self.checksums[k]}): another "
            "file was put in its place"
        )

    def epoch(self, number: int, start_batch: int, unit_rows: int | None = None) -> Epoch:
        """The `Epoch` that tf.data's units of epoch ``number`` come from.

        Units are pure functions of ``(epoch, first batch, unit)``; the `Epoch` object
        only caches the order. A few are kept (an iterator dropped mid-epoch leaves its
        own behind until newer ones push it out); one pushed out while still read is made
        again, with the same order.
        """
        key = (int(number), int(start_batch))
        with self._epochs_lock:
            epoch = self._epochs.pop(key, None) or Epoch(self, *key, unit_rows=unit_rows)
            self._epochs[key] = epoch
            while len(self._epochs) > _EPOCHS_KEPT:
                del self._epochs[next(iter(self._epochs))]
            return epoch

    def forget(self, epoch: Epoch) -> None:
        with self._epochs_lock:
            key = (epoch.number, epoch.start_batch)
            if self._epochs.get(key) is epoch:
                del self._epochs[key]
            if epoch._advised is not None:
                self._ended.append(epoch)

    def advise(self, records: np.ndarray, advice: int) -> None:
        """``madvise`` over the frames of ``records``: `_MADV_WILLNEED` has the kernel read
        them ahead (whole records, not the page by page of faults), `_MADV_DONTNEED`
        takes their pages out of this process's mapping (the page cache keeps them; a
        later touch maps them again from it, or from the file)."""
        if not len(records):
            return
        region = self.region()
        libc = _libc()
        page = mmap.PAGESIZE
        records = np.sort(records)
        shards = self.shard_of[records]
        starts = (
            region.base + region.starts[shards] + self.index_in_shard[records] * self.full.frame
        )
        # Never past what is mapped of the file: a short last record's frame (or one of a
        # truncated file) would reach beyond it, into the next mapping of the process.
        first = region.base + region.starts[shards]
        ends = np.minimum(starts + self.full.frame, first + region.sizes[shards])
        if advice == _MADV_DONTNEED:
            # Reading a record maps the pages around it (`_MAP_AROUND`), of neighbours
            # in windows read before: dropped with it (within the file's mapping). Left
            # mapped, a freshly written 2 GB grew by 190 MB over an epoch in windows of
            # 128 MB (`benchmarks/run_all.py --only rss`).
            # Folios are aligned in the file: rounded from the file's first byte.
            starts = first + (starts - first) // _MAP_AROUND * _MAP_AROUND
            ends = np.minimum(
                first + -(-(ends - first) // _MAP_AROUND) * _MAP_AROUND,
                first + region.sizes[shards],
            )
        # Adjacent frames in one call (a scan in written order drops records in runs).
        runs = np.flatnonzero(starts[1:] > ends[:-1]) + 1
        for a, b in zip(starts[np.r_[0, runs]].tolist(), ends[np.r_[runs - 1, -1]].tolist()):
            lo = a - a % page
            if b > lo:
                libc.madvise(lo, b - lo, advice)

    def locate(self, record: int) -> tuple[str, int, int, int]:
        """``(path, byte offset, index in shard, records in shard)`` of a record."""
        k = int(self.shard_of[record])
        index = int(self.index_in_shard[record])
        return self.files[k], index * self.full.frame, index, self.shard_records[k]

    # ---------------------------------------------------------------- checks

    def _check_record(self, record: int) -> str | None:
        """The problem with one record, or None when it is sound."""
        region = self.region()
        layout = (
            self.short
            if (self.short is not None and record == self.total_records - 1)
            else self.full
        )
        k = int(self.shard_of[record])
        start = int(self.index_in_shard[record]) * self.full.frame
        if region.signatures[k] is None:
            return region.problems[k] or "the file cannot be opened (missing or unreadable)"
        if self._shard_problems[k] is not None:
            return self._shard_problems[k]
        if start + layout.frame > int(region.sizes[k]):
            return _TRUNCATED
        at = int(region.starts[k]) + start
        frame = region.array[at : at + layout.frame]
        h = framing.HEADER_BYTES
        if not np.array_equal(frame[:h], layout.meta_expected[:h]):
            return "its length field or the length's CRC is damaged"
        crc = framing.masked(_crc.crc32c([frame[h : h + layout.length]]))
        if crc != int(frame[h + layout.length :].view("<u4")[0]):
            return "the record failed its TFRecord CRC check"
        if not np.array_equal(frame[layout.meta_positions], layout.meta_expected):
            return (
                "the record passed its CRC check but does not have the layout its manifest "
                "describes; the data set was modified after it was written"
            )
        return None

    def ensure_checked(self, records: np.ndarray) -> np.ndarray:
        """Checks the (unique) records not yet checked; returns the damaged among them.

        Threads that need the same records share the work: each claims a few unchecked
        records at a time, and waits for the ones others are checking. Where there are
        many, up to `_CHECK_THREADS` - 1 threads of a shared pool help.
        """
        state = self.state
        helpers = min(_CHECK_THREADS - 1, int(np.count_nonzero(state[records] == 0)) // _CLAIM)
        futures = [_check_pool().submit(self._check_claims, records, False) for _ in range(helpers)]
        try:
            self._check_claims(records, True)
        finally:
            for f in futures:
                f.cancel()  # not started yet: nothing left for it
        # A helper's error (a damaged record; skip mode's "too many dropped") is this
        # thread's to raise.
        for f in futures:
            error = None if f.cancelled() else f.exception()
            if error is not None:
                raise error
        bad = records[state[records] == 2]
        if len(bad) and self.skip is None:
            first = int(bad[0])
            problem = self._problems.get(first) or self._check_record(first)
            self._damaged(first, problem or "damaged")
        return bad

    def _check_claims(self, records: np.ndarray, wait: bool) -> None:
        """Claims and checks unchecked records of ``records`` until none is left; with
        ``wait``, also until the ones other threads claimed are checked. Skip mode reports
        each damaged record here; raise mode marks it and stops claiming: `ensure_checked`
        then raises at the first damaged record of ``records``, whichever thread found
        it (records are claimed in increasing order, so every record before a damaged one
        is claimed, and checked, by then)."""
        state = self.state
        while True:
            with self._check_lock:
                todo = records[state[records] == 0]
                if not len(todo):
                    return
                if self.skip is None and bool((state[records] == 2).any()):
                    if not wait or not self._claimed[todo].any():
                        return
                    self._check_lock.wait(0.05)  # for the records others are checking
                    continue
                mine = todo[~self._claimed[todo]][:_CLAIM]
                if not len(mine):
                    if not wait:
                        return
                    self._check_lock.wait(0.05)
                    continue
                self._claimed[mine] = True
            results: list[str | None] = []
            try:
                results = [self._check_record(int(r)) for r in mine]
            finally:
                with self._check_lock:
                    for r, problem in zip(mine, results):
                        state[r] = 1 if problem is None else 2
                        if problem is not None:
                            self._problems[int(r)] = problem
                    self._claimed[mine] = False
                    self._check_lock.notify_all()
            if self.skip is not None:
                for r, problem in zip(mine, results):
                    if problem is not None:
                        self._damaged(int(r), problem)

    def _damaged(self, record: int, problem: str) -> None:
        path, offset, index, n_records = self.locate(record)
        from keras_tfr.manifest import written_again

        checksums: list[str | None] = [None] * len(self.files)
        if self.checksums is not None:
            checksums = list(self.checksums)
        why = written_again(
            os.path.dirname(path),
            [
                (os.path.basename(f), int(b), c)
                for f, b, c in zip(self.files, self.shard_bytes, checksums)
            ],
        )
        if why is not None:
            problem = (
                f"the data set {why}: make a new TFRecordSequenceSource. This source's "
                f"view of that shard: {problem}"
            )
        if self.skip is None:
            raise ValueError(
                f"keras-tfr: corrupt record in {path} at byte offset {offset} "
                f"(record {index} of {n_records}): {problem}; run `keras-tfr verify` on "
                "the data set"
            )
        self.skip(path, offset, index, n_records, problem)

    # ---------------------------------------------------------------- gather

    def good_samples(self, ids: np.ndarray, epoch: int, unit: int) -> np.ndarray:
        """``ids`` with every sample of a damaged record replaced (skip mode), checked."""
        records = ids // self.spr
        if self._region is not None and self._region.remaps != self._seen_remaps:
            # Another source over these shards mapped one again mid-epoch: check anew.
            with self._check_lock:
                self._forget_remapped()
        unsure = records[self.state[records] != 1]  # all checked and sound: nothing to do
        if not len(unsure):
            return ids
        bad = self.ensure_checked(np.unique(unsure))
        if not len(bad):
            return ids
        rng = np.random.default_rng([self.order.seed & 0xFFFFFFFF, epoch, unit, 7])
        for _ in range(_MAX_DRAWS):
            holes = np.flatnonzero(self.state[ids // self.spr] == 2)
            if not len(holes):
                return ids
            draws = self.order.subset_samples(rng.integers(0, self.order.size, len(holes)))
            ids = ids.copy() if not ids.flags.writeable else ids
            ids[holes] = draws
            self.ensure_checked(np.unique(draws // self.spr))
        path = self.files[0] if len(self.files) == 1 else f"{len(self.files)} shards"
        raise ValueError(
            f"keras-tfr: corrupt record: with on_corrupt='skip', {_MAX_DRAWS} rounds of "
            f"replacement draws found only damaged records in {path}; the data set is "
            "unreadable. Run `keras-tfr verify` on the data set"
        )

    def _feature_bases(self, region: _Region) -> list[np.ndarray]:
        """Per feature, per record, the address in the region of the record's first
        sample of the feature (the short last record's own layout included)."""
        record_base = region.starts[self.shard_of] + self.index_in_shard * self.full.frame
        out = []
        for f in range(len(self.specs)):
            first = record_base + self.full.feature_offsets[f]
            if self.short is not None and self.total_records:
                first[-1] += self.short.feature_offsets[f] - self.full.feature_offsets[f]
            out.append(first)
        return out

    def offsets(self, ids: np.ndarray) -> list[np.ndarray]:
        """Per feature, the address in the region of each sample of ``ids``: one
        multiply-add per sample and feature."""
        self.region()
        records, j = np.divmod(ids, self.spr)
        return [base[records] + j * sb for base, sb in zip(self._feature_base, self.sample_bytes)]

    def gather(self, ids: np.ndarray) -> list[np.ndarray]:
        """Rows of ``ids`` (checked, written sample indices), per feature, in an aligned
        buffer that TensorFlow adopts without a copy."""
        outs = []
        for offsets, sb, window, buffers in zip(
            self.offsets(ids), self.sample_bytes, self.windows, self.buffers
        ):
            out = buffers.take(len(ids))
            step = _CHUNK_BYTES // sb
            if step > 4:
                # Fancy indexing gathers into a temporary: pieces of about 120 KB stay in
                # cache for the copy into the aligned `out`.
                for a in range(0, len(ids), step):
                    out[a : a + step] = window[offsets[a : a + step]]
            else:  # samples of 24 KB and more: one slice copy each, no temporary at all
                arr = self._region_array
                for a, at in enumerate(offsets.tolist()):
                    out[a] = arr[at : at + sb]
            outs.append(out)
        return outs

    @property
    def lattice_rows(self) -> list[int] | None:
        """Per feature, the lattice's row size in bytes; None without a lattice."""
        if self.lattice is None:
            return None
        return [self.lattice.rows[s.key] for s in self.specs]

    def lattice_tensors(self) -> list[Any]:
        """Per feature, the whole region as a ``[rows, row_bytes / itemsize]`` `tf.Tensor`
        in the feature's dtype (``[rows, row_bytes]`` uint8 for ``bool`` and where a row is
        not whole items; ``[rows, *shape]`` where a row is one sample, so that a gather
        gives a batch with no reshape) that aliases the mapped shards (no copy; it keeps
        the mapping alive). Little-endian, as the records are: on a big-endian host, uint8.

        Made through DLPack, the one way to an eager tensor over memory TensorFlow does
        not own (`tf.constant` copies; so does `tf.numpy_function` run eagerly). DLPack
        (the version TensorFlow speaks) cannot say "read-only", so the NumPy view handed
        over is marked writable; the pages are mapped read-only and the tensors are only
        ever read by `tf.gather` (a write would fault, not change a file).
        """
        import tensorflow as tf

        rows = self.lattice_rows
        assert rows is not None
        region = self.region()
        pinned = np.frombuffer(memoryview(region.buffer), dtype=np.uint8).view(_Pinned)
        pinned.region = region
        out = []
        for g, spec in zip(rows, self.specs):
            view = pinned[: len(pinned) // g * g].reshape(-1, g)
            if _typed(spec, g):
                view = view.view(spec.np_dtype)
                if g == spec.sample_bytes:  # a row is a sample: gathered in its shape
                    view = view.reshape(-1, *spec.shape)
            out.append(tf.experimental.dlpack.from_dlpack(view.__dlpack__()))
        return out

    def rows(self, ids: np.ndarray) -> list[np.ndarray]:
        """Per feature, the rows of `lattice_tensors` that hold the samples ``ids``
        (``[len(ids) * rows_per_sample]`` int64, sample by sample)."""
        rows = self.lattice_rows
        assert rows is not None
        self.region()
        records, j = np.divmod(ids, self.spr)
        out = []
        for base, g, sb in zip(self._row_base, rows, self.sample_bytes):
            k = sb // g
            first = base[records] + (j * k if k != 1 else j)  # as offsets // g, no division
            out.append(first if k == 1 else (first[:, None] + np.arange(k)).reshape(-1))
        return out

    def gather_batches(self, ids: np.ndarray, aligned: bool = False) -> list[list[np.ndarray]]:
        """Rows of ``ids`` cut in batches: per batch, per feature, a new ``[rows,
        sample_bytes]`` uint8 array, copied once from the page cache (what a NumPy
        consumer gets: no alignment needed, so no second copy).

        ``aligned`` (a data set on a lattice only): each array starts on a 64-byte
        boundary, as TensorFlow needs of a buffer it is handed through DLPack, still with
        one copy: `np.take` from the region seen as ``[rows, row_bytes]`` into the
        aligned array."""
        b = self.batch_size
        if aligned:
            return self._gather_aligned(ids)
        offsets = self.offsets(ids)
        return [
            [window[o[a : a + b]] for o, window in zip(offsets, self.windows)]
            for a in range(0, len(ids), b)
        ]

    def _gather_aligned(self, ids: np.ndarray) -> list[list[np.ndarray]]:
        g_rows = self.lattice_rows
        assert g_rows is not None
        self.region()
        arr = self._region_array
        views = [arr[: len(arr) // g * g].reshape(-1, g) for g in g_rows]
        rows = self.rows(ids)
        b = self.batch_size
        n_ids = len(ids)
        if all(b * sb % 64 == 0 for sb in self.sample_bytes):
            # Every batch of the unit starts 64-byte aligned inside one buffer per feature:
            # one `np.take` per feature for the whole unit, the batches are views of it.
            whole = []
            for r, g, sb, view in zip(rows, g_rows, self.sample_bytes, views):
                dst = aligned_empty(n_ids * sb)
                np.take(view, r, axis=0, out=dst.reshape(-1, g), mode="clip")
                whole.append(dst.reshape(n_ids, sb))
            return [[w[a : a + b] for w in whole] for a in range(0, n_ids, b)]
        out = []
        for a in range(0, len(ids), b):
            n = min(b, len(ids) - a)
            batch = []
            for r, g, sb, view in zip(rows, g_rows, self.sample_bytes, views):
                k = sb // g
                dst = aligned_empty(n * sb)
                # mode="clip": no bounds-check buffer (the rows are in range by construction)
                np.take(
                    view, r[a * k : (a + n) * k], axis=0, out=dst.reshape(n * k, g), mode="clip"
                )
                batch.append(dst.reshape(n, sb))
            out.append(batch)
        return out


def aligned_empty(nbytes: int, align: int = 64) -> np.ndarray:
    """A new uint8 array of ``nbytes`` whose data starts on an ``align``-byte boundary."""
    buf = np.empty(nbytes + align, dtype=np.uint8)
    at = -buf.ctypes.data % align
    return buf[at : at + nbytes]


# --------------------------------------------------------------------------- epochs


class Epoch:
    """One iterator over the source: epoch ``number`` from batch ``start_batch`` on."""

    def __init__(
        self,
        plan: MappedPlan,
        number: int,
        start_batch: int = 0,
        batches: bool = False,
        unit_rows: int | None = None,
        aligned: bool = False,
        finish: Callable[[list[list[np.ndarray]]], Any] | None = None,
    ):
        self.plan = plan
        self.number = number
        self.unit_rows = unit_rows or plan.unit_rows
        # ``batches``: units come as lists of batches of new arrays (`gather_batches`,
        # for NumPy consumers; 64-byte aligned with ``aligned``, on a lattice: for JAX
        # and for tensors made through DLPack), else as aligned recycled buffers
        # (`gather`, for tf.data). ``finish``
        # turns a unit's batches into what the consumer is handed, in the reader thread:
        # the consumer's thread only takes them.
        self._gather: Callable[[np.ndarray], Any] = plan.gather
        if batches:
            gather = functools.partial(plan.gather_batches, aligned=aligned)
            self._gather = gather if finish is None else lambda ids: finish(gather(ids))
        self.start_batch = start_batch
        self.first_row = min(plan.total_rows, start_batch * plan.batch_size)
        # Units of ``unit_rows`` rows (whole batches); the rows after the last whole unit
        # are cut in two units, their whole batches and then the partial batch, so that
        # every unit is a block of equal batches.
        rows = plan.total_rows - self.first_row
        self._whole_units, rest = divmod(rows, self.unit_rows)
        self._rest = [r for r in (rest - rest % plan.batch_size, rest % plan.batch_size) if r]
        self.num_units = self._whole_units + len(self._rest)
        self._done = 0  # units handed to tf.data (`block`)
        self._pool = _DaemonPool(plan.readers, "keras_tfr_read")
        self._lock = threading.Lock()
        self._units: dict[int, Future] = {}
        self._next_unit = 0
        self._closed = False
        self._started = False
        # The order is computed for several units at once (its cost is mostly per call),
        # in read-only pieces that the units slice; at most a few pieces are kept.
        self._group = max(1, plan.order_rows // self.unit_rows)
        self._orders: dict[int, Future] = {}
        # Read ahead (`_advise`) and dropped behind (`_drop_behind`): per window of the
        # windowed shuffle, or per record of a subset read in written order.
        self._advised: np.ndarray | None = None
        self._advising = threading.Lock()  # held from marking pieces to advising them

    def _order(self, g: int) -> np.ndarray:
        """Written sample indices of the stream positions of units ``g * group`` on."""
        with self._lock:
            fut = self._orders.get(g)
            mine = fut is None
            if fut is None:
                fut = self._orders[g] = Future()
                for old in [k for k in self._orders if k < g - 1]:
                    del self._orders[old]
        if mine:
            plan = self.plan
            lo = self.first_row + g * self._group * self.unit_rows
            hi = min(lo + self._group * self.unit_rows, plan.total_rows)
            try:
                ids = plan.order.samples(self.number, lo, hi)
                if (plan.order.windowed or plan.order.scan) and hi > lo:
                    self._advise(lo, hi)
            except BaseException as e:
                fut.set_exception(e)
                raise
            ids.flags.writeable = False
            fut.set_result(ids)
        return fut.result()

    def _pieces(self) -> tuple[Callable[[np.ndarray], np.ndarray], Callable[[int], np.ndarray]]:
        """The pieces an order is read in, for `_advise` and `_drop_behind`: windows (the
        windowed shuffle reads a window's records, then the next window's) or single
        records (a subset scanned in written order, unshuffled where windows are asked
        for: `SampleOrder.scan`). Returns the piece of each stream position and the
        records of a piece."""
        order, number = self.plan.order, self.number
        if order.windowed:
            return (
                functools.partial(order.window_of, number),
                functools.partial(order.window_records_of, number),
            )
        return order.record_of, functools.partial(np.array, ndmin=1, dtype=np.int64)

    def _piece_state(self) -> np.ndarray:
        """Per piece (under `_lock`): 0 untouched, 1 read ahead, 2 dropped."""
        if self._advised is None:
            order = self.plan.order
            count = order.window_count if order.windowed else self.plan.total_records
            self._advised = np.zeros(count, dtype=np.uint8)
        return self._advised

    def _advise(self, lo: int, hi: int) -> None:
        """Reads ahead the pieces of stream positions ``[lo, hi)`` (an order step), and
        the next ones once these positions come within ``hi - lo`` of them, with
        `_MADV_WILLNEED`: the kernel reads a window's records (or a scan's) from disk in
        large requests while the pieces before them are consumed. `_drop_behind` drops
        them from the mapping once read through."""
        piece_of, _ = self._pieces()
        ahead_of = min(hi + (hi - lo), self.plan.order.size) - 1
        first, last = (int(k) for k in piece_of(np.array([lo, ahead_of])))
        # The order's steps may be worked out by several threads at once: a step whose
        # pieces another thread has marked waits until that thread has advised them, so
        # that no unit reads a piece before it is read ahead (and, in `_drop_before`, a
        # unit that finds its pieces marked dropped does not go on before they are).
        with self._advising:
            with self._lock:
                state = self._piece_state()
                ahead = first + np.flatnonzero(state[first : last + 1] == 0)
                state[ahead] = 1
            self._advise_pieces(ahead, _MADV_WILLNEED)

    def _advise_pieces(self, pieces: np.ndarray, advice: int) -> None:
        """`MappedPlan.advise` over the records of ``pieces``, in one call."""
        if len(pieces):
            _, records_of = self._pieces()
            self.plan.advise(np.concatenate([records_of(k) for k in pieces.tolist()]), advice)

    def _drop_before(self, past: int) -> None:
        """Drops the pieces before piece ``past`` that were read ahead and not dropped
        (once this returns, they are: see `_advise`)."""
        with self._advising:
            with self._lock:
                state = self._piece_state()
                done = np.flatnonzero(state[:past] == 1)
                state[done] = 2
            self._advise_pieces(done, _MADV_DONTNEED)

    def _drop_behind(self, i: int, lag: int) -> None:
        """Drops from the mapping (`_MADV_DONTNEED`) the pieces read ahead that end
        ``lag`` units or more before unit ``i``: no unit in flight reads them any more.
        A random read of a window maps nearly all of its pages within its first few
        percent (a fault maps the pages around the one touched), so an epoch keeps at
        most about two windows mapped, the one read and the one before it, until the
        lag is past; a subset scanned in written order (`SampleOrder.scan`), the
        records its units in flight span (a few units' worth: its units are cut by its
        density, see `MappedPlan`). What an ended epoch kept is dropped when the next
        one starts (`drop_all`).

        Called for each unit as it is gathered (``lag``: the readers' units, which may
        still be gathering) or, where TensorFlow gathers (`row_block`), as it is handed
        out (``lag``: the readers' and four more, for TensorFlow's buffers after them:
        with two more, `fit` in a memory cgroup smaller than the data read some runs'
        data twice from disk, its late gathers mapping pages already dropped, and
        evicted, again). In a 1.5 GiB cgroup over 3 GB (`benchmarks/larger_than_memory.py`)
        bytes read per byte delivered stayed at 1.01 reading, 1.04-1.05 in `fit`.
        """
        order = self.plan.order
        if not (order.windowed or order.scan):
            return
        pos = self.first_row + self.span(i)[0] - lag * self.unit_rows
        if pos <= 0:
            return
        piece_of, _ = self._pieces()
        self._drop_before(int(piece_of(np.array([pos]))[0]))  # the pieces before it are read

    def drop_all(self) -> None:
        """Drops every piece read ahead and not dropped (the epoch is over)."""
        if self._advised is not None:
            self._drop_before(len(self._advised))

    def span(self, i: int) -> tuple[int, int]:
        """Stream positions ``[lo, hi)`` of unit ``i``, counted from ``first_row``."""
        u = self.unit_rows
        if i < self._whole_units:
            return i * u, (i + 1) * u
        lo = self._whole_units * u + sum(self._rest[: i - self._whole_units])
        return lo, lo + self._rest[i - self._whole_units]

    def _ids(self, lo: int, hi: int) -> np.ndarray:
        """Written sample indices of stream positions ``[lo, hi)`` (within one unit)."""
        g = lo // (self._group * self.unit_rows)
        base = g * self._group * self.unit_rows
        return self._order(g)[lo - base : hi - base]

    def unit(self, i: int) -> Any:
        lo, hi = self.span(i)
        ids = self.plan.good_samples(self._ids(lo, hi), self.number, i)
        out = self._gather(ids)
        self._drop_behind(i, self.plan.readers)
        return out

    def block(self, i: int) -> list[np.ndarray]:
        """Unit ``i`` as ``[batches, rows, sample_bytes]`` per feature (views of the
        aligned buffers, no copy), for tf.data; the plan forgets this epoch once every
        unit has been handed out."""
        unit = self.unit(i)
        rows = min(len(unit[0]), self.plan.batch_size)
        self._handed_out()
        return [u.reshape(-1, rows, u.shape[1]) for u in unit]

    def row_block(self, i: int) -> list[np.ndarray]:
        """Unit ``i`` as lattice rows: per feature ``[batches, rows of a batch]`` int64
        indices into `MappedPlan.lattice_tensors`, for TensorFlow to gather; every record
        they touch has passed its checks."""
        lo, hi = self.span(i)
        ids = self.plan.good_samples(self._ids(lo, hi), self.number, i)
        batches = -(-len(ids) // self.plan.batch_size)
        self._drop_behind(i, self.plan.readers + 4)
        self._handed_out()
        return [r.reshape(batches, -1) for r in self.plan.rows(ids)]

    def _handed_out(self) -> None:
        with self._lock:
            self._done += 1
            last = self._done == self.num_units
        if last:
            self.plan.forget(self)

    def _submit(self, k: int) -> None:
        for q in range(k, min(k + 1 + self.plan.readers, self.num_units)):
            if q not in self._units:
                self._units[q] = self._pool.submit(self.unit, q)

    def next_unit(self) -> Any:
        if not self._started:
            self._started = True
            self.plan.begin_epoch()
        k = self._next_unit
        if k >= self.num_units:
            self.drop_all()  # every unit is gathered
            raise StopIteration
        self._next_unit = k + 1
        with self._lock:
            if self._closed:
                raise StopIteration
            self._submit(k)
            fut = self._units.pop(k)
        return fut.result()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for fut in self._units.values():
                fut.cancel()
            self._units.clear()
        self._pool.shutdown()
        self.drop_all()  # (a gather still running may map some of it again)


class _DaemonPool:
    """A minimal pool of daemon threads, started on first use.

    `concurrent.futures.ThreadPoolExecutor` joins its threads at interpreter exit; these
    threads only read and copy, so dropping them at exit loses nothing, and an iterator
    abandoned mid-epoch never holds the exit.
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
                t.start()  # listed once started: `shutdown` joins only started threads
                self._threads.append(t)
            self._queue.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:  # handed to whoever waits on the future
                    fut.set_exception(e)
            # Nothing of the job stays referenced while the thread waits for the next:
            # the process's checking threads outlive every source, and a job's bound
            # method held its plan, so a dropped source's shards stayed mapped (their
            # pages in the RSS, a deleted shard's disk space taken) until the thread's
            # next job.
            del item, fut, fn, args

    def shutdown(self) -> None:
        """Cancels what has not started, lets running work finish, and joins."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in threads:
            self._queue.put(None)
        for t in threads:
            if t is not threading.current_thread():
                t.join()


_CHECKERS: _DaemonPool | None = None
_checkers_lock = threading.Lock()


def _check_pool() -> _DaemonPool:
    """The process's pool of checking threads (daemon threads, started on first use)."""
    global _CHECKERS
    with _checkers_lock:
        if _CHECKERS is None:
            _CHECKERS = _DaemonPool(_CHECK_THREADS - 1, "keras_tfr_check")
        return _CHECKERS


def _forget_check_pool() -> None:  # a forked child has none of its parent's threads
    global _CHECKERS
    _CHECKERS = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_check_pool)


class _Pinned(np.ndarray):
    """The mapped region's array, holding the `_Region` alive: views of it (and the
    tensors TensorFlow makes of them) keep the mapping until nothing refers to them."""

    region: Any = None


class _Lease(np.ndarray):
    """A unit buffer handed out. Views of it keep it alive (NumPy stops collapsing a view
    chain at a change of array type), so its finalizer runs only once nothing, TensorFlow's
    adopted tensors included, refers to the buffer any more."""


class _Buffers:
    """Hands out ``[rows, cols]`` uint8 arrays, 64-byte aligned, reusing returned ones.

    Fresh memory costs a page fault per 4 KB; recycled buffers do not. A buffer comes back
    through a `weakref.finalize` on the array handed out, which holds on any Python
    version (no assumption about reference counts).
    """

    def __init__(self, rows: int, cols: int):
        self._rows, self._cols = rows, cols
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        self.allocated = 0

    def take(self, rows: int) -> np.ndarray:
        n = self._rows * self._cols
        try:
            raw = self._free.get_nowait()
        except queue.Empty:
            raw = np.empty(n + _ALIGN, dtype=np.uint8)
            self.allocated += 1
        off = (-raw.ctypes.data) % _ALIGN
        lease = raw[off : off + rows * self._cols].reshape(rows, self._cols).view(_Lease)
        weakref.finalize(lease, self._free.put, raw)
        return lease


# --------------------------------------------------------------------------- tf.data


class _QuietAtExit:
    """Stops TensorFlow's threads calling into Python before the interpreter exits.

    With an iterator still open at the end of the program (``next(iter(source))`` in a
    script, say), TensorFlow's threads keep calling into Python to gather units. When
    the interpreter then destroys the iterator, TensorFlow waits for the calls in
    flight, which wait for the GIL the interpreter holds: the process hung at exit.
    At exit (`atexit`, while Python still runs) every new call fails at once, so the
    pipeline's buffers fill up with errors nobody reads and its threads go idle; this
    waits, at most 2 s, until no call has run for 50 ms.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._last = 0.0
        self._exiting = False
        self._installed = False

    def install(self) -> None:
        with self._lock:
            if not self._installed:
                self._installed = True
                atexit.register(self.drain)

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """Around each call from TensorFlow: refused once the program is exiting."""
        with self._lock:
            if self._exiting:
                raise RuntimeError("keras-tfr: the program is exiting")
            self._running += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                self._last = time.monotonic()

    def drain(self, quiet: float = 0.05, limit: float = 2.0) -> bool:
        """Refuses new calls and waits until none has run for ``quiet`` seconds."""
        with self._lock:
            self._exiting = True
            self._last = time.monotonic()
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            with self._lock:
                if self._running == 0 and time.monotonic() - self._last >= quiet:
                    return True
            time.sleep(0.01)
        return False


_quiet_at_exit = _QuietAtExit()


def _epoch_starter(
    plan: MappedPlan, next_epoch: Callable[[], tuple[int, int]], unit_rows: int | None = None
) -> Callable[[Any], np.ndarray]:
    """The Python call that starts each tf.data iterator: takes its ``(epoch, first
    batch)``, looks for shards changed on disk, and returns ``[epoch, first batch,
    units]``."""
    _quiet_at_exit.install()

    def start(_unused: Any) -> np.ndarray:
        with _quiet_at_exit.call():
            number, start_batch = next_epoch()
            plan.begin_epoch()
            units = plan.epoch(number, start_batch, unit_rows).num_units
            return np.array([number, start_batch, units], dtype=np.int64)

    return start


_NO_DAMAGE = np.array(b"")


@contextlib.contextmanager
def _damage_as_output(dtype: Any, ndim: int, n_specs: int) -> Iterator[list[Any]]:
    """Runs a unit's Python call for tf.data: the list it fills is its outputs, the
    arrays then an empty message. Damage found (a `ValueError` whose text starts
    ``keras-tfr: corrupt record``) is returned as the message instead, with empty arrays,
    for `_raise_damage` to raise inside the graph: raised here, TensorFlow would log it
    with its Python traceback (twice, about 90 lines) before `fit` raised it."""
    out: list[Any] = []
    try:
        yield out
    except ValueError as e:
        if not str(e).startswith("keras-tfr: corrupt record"):
            raise
        out[:] = [np.zeros((0,) * ndim, dtype)] * n_specs + [np.array(str(e).encode())]


def _raise_damage(outputs: list[Any]) -> list[Any]:
    """The arrays of a `_damage_as_output` call, once its message is known to be empty:
    otherwise the message is raised as TensorFlow's `InvalidArgumentError` ("assertion
    failed: [keras-tfr: corrupt record ...]"), which `fit` and iteration turn into
    `CorruptRecordError`, as block mode's checks do."""
    import tensorflow as tf

    *arrays, message = outputs
    ok = tf.equal(tf.strings.length(message), 0)
    with tf.control_dependencies([tf.debugging.Assert(ok, [message], summarize=1)]):
        return [tf.identity(a) for a in arrays]


def dataset(plan: MappedPlan, next_epoch: Callable[[], tuple[int, int]]) -> Any:
    """A `tf.data.Dataset` of blocks of batches: a tuple of uint8
    ``[batches, rows, sample_bytes]`` tensors, one per spec (in ``plan.specs`` order).
    ``next_epoch()`` gives each new iterator its ``(epoch, first batch)``.

    Each iterator asks for its epoch when its first element is pulled (inside a
    `flat_map`, so an iterator made and dropped unread takes none), then maps the unit
    numbers ``0 .. units - 1`` through one Python call each (about 8 MB), ``readers`` of
    them at a time in TensorFlow's threads, in order. No thread of keras-tfr's own and no
    generator data set: TensorFlow's generator kernel costs twice as much per call, and
    creating one fixes malloc's mmap threshold for the whole process (docs/benchmarks.md).
    The buffers are 64-byte aligned, so TensorFlow adopts them without a copy.
    """
    import tensorflow as tf

    n_specs = len(plan.specs)
    shapes = [tf.TensorShape([None, None, sb]) for sb in plan.sample_bytes]

    start = _epoch_starter(plan, next_epoch)

    def block(info: np.ndarray, i: Any) -> list[np.ndarray]:
        with _quiet_at_exit.call(), _damage_as_output(np.uint8, 3, n_specs) as out:
            out[:] = [*plan.epoch(int(info[0]), int(info[1])).block(int(i)), _NO_DAMAGE]
        return out

    def one(info: Any, i: Any) -> tuple:
        outs = tf.numpy_function(block, [info, i], [tf.uint8] * n_specs + [tf.string], True)
        outs = _raise_damage(outs)
        return tuple(tf.ensure_shape(o, s) for o, s in zip(outs, shapes))

    def iterator(unused: Any) -> tf.data.Dataset:
        info = tf.numpy_function(start, [unused], tf.int64, stateful=True)
        info = tf.ensure_shape(info, [3])
        return tf.data.Dataset.range(info[2]).map(
            lambda i: one(info, i), num_parallel_calls=plan.readers, deterministic=True
        )

    # Decoding and cutting into batches are the caller's (once per block; TensorFlow
    # aliases aligned slices of the adopted buffer instead of copying them).
    return tf.data.Dataset.from_tensors(np.int64(0)).flat_map(iterator)


def _typed(spec: FeatureSpec, row_bytes: int) -> bool:
    """Whether `MappedPlan.lattice_tensors` gives ``spec``'s tensor in its own dtype."""
    return sys.byteorder == "little" and spec.dtype != "bool" and row_bytes % spec.itemsize == 0


def lattice_dataset(
    plan: MappedPlan,
    region: list[Any],
    next_epoch: Callable[[], tuple[int, int]],
    finish: Callable[[list[Any]], Any],
    full_batches: bool = False,
) -> Any:
    """A `tf.data.Dataset` of batches, for a data set written on a lattice: TensorFlow
    gathers each batch with `tf.gather` from tensors that alias the mapped shards
    (``region``, from `MappedPlan.lattice_tensors`), so no Python call and no buffer of ours is on a
    batch's path. Python runs once per unit of batches (8,192 samples or more),
    ``readers`` at a time: it works out the unit's samples (order, split, share), checks
    every record they touch, and hands over their row numbers.

    ``finish`` turns one batch, a list of ``[rows, *shape]`` tensors in each feature's
    dtype (one per spec, in ``plan.specs`` order), into the element the caller wants.
    With ``full_batches`` (every batch of every epoch holds ``plan.batch_size`` samples),
    ``rows`` is static: set once per unit of batches, not by an op on each batch.
    Each iterator asks for its epoch when its first element is pulled, as `dataset`
    does. Every function sits in the outer pipeline (none inside the `flat_map`), so
    TensorFlow prepares them once per iterator, not again when each epoch starts.
    """
    import tensorflow as tf

    rows = plan.lattice_rows
    assert rows is not None
    n_specs = len(plan.specs)
    unit_rows = plan.lattice_unit_rows
    start = _epoch_starter(plan, next_epoch, unit_rows)

    def row_block(info: np.ndarray, i: Any) -> list[np.ndarray]:
        with _quiet_at_exit.call(), _damage_as_output(np.int64, 2, n_specs) as out:
            epoch = plan.epoch(int(info[0]), int(info[1]), unit_rows)
            out[:] = [*epoch.row_block(int(i)), _NO_DAMAGE]
        return out

    def epoch(unused: Any) -> Any:
        info = tf.numpy_function(start, [unused], tf.int64, stateful=True)
        return tf.ensure_shape(info, [3])

    def units(info: Any) -> tf.data.Dataset:
        numbers = tf.data.Dataset.range(info[2])
        return tf.data.Dataset.zip((numbers, tf.data.Dataset.from_tensors(info).repeat()))

    # A batch's rows per feature: a sample's rows (one where a row is a sample) times the
    # batch size, known where every batch is full.
    per_batch = [
        plan.batch_size * (s.sample_bytes // g) if full_batches else None
        for s, g in zip(plan.specs, rows)
    ]

    def unit(i: Any, info: Any) -> tuple:
        out = tf.numpy_function(row_block, [info, i], [tf.int64] * n_specs + [tf.string], True)
        return tuple(tf.ensure_shape(o, [None, n]) for o, n in zip(_raise_damage(out), per_batch))

    def gather(batch_rows: Any, views: Any) -> Any:
        out = []
        for view, r, spec, g in zip(views, batch_rows, plan.specs, rows):
            got = tf.gather(view, r)
            if _typed(spec, g) and g == spec.sample_bytes:  # gathered in its shape
                out.append(got)
            elif _typed(spec, g):  # already the feature's dtype: one reshape
                batch = -1 if r.shape[0] is None else r.shape[0] // (spec.sample_bytes // g)
                out.append(tf.reshape(got, [batch, *spec.shape]))
            else:
                out.append(tf_bytes_to_feature(tf.reshape(got, [-1, spec.sample_bytes]), spec))
        return finish(out)

    batches = (
        tf.data.Dataset.from_tensors(np.int64(0))
        .map(epoch)
        .flat_map(units)
        .map(unit, num_parallel_calls=plan.readers, deterministic=True)
        # `unbatch` costs less per batch than a `flat_map` of `from_tensor_slices`.
        .unbatch()
    )
    # The mapped tensors travel with each element, as Keras' in-memory arrays do, rather
    # than as captured inputs of `gather`.
    views = tf.data.Dataset.from_tensors(tuple(region)).repeat()
    # Each batch is gathered in turn, in a plain `map` the prefetch reads (a large
    # `tf.gather` still spreads its copy over TensorFlow's threads), not several at once: in
    # `fit` that leaves the model's step more of the CPU than gathers in parallel. On
    # 12.5 MB batches `fit` ran 15-20 % faster so (2026-12-04); on 0.8 MB batches 2.4 %
    # faster (120 paired rounds, interval 1.002x-1.047x) with less CPU per epoch; an eager
    # loop over tf.data's iterator read 0.90x-1.06x as fast, within noise (docs/benchmarks.md).
    return tf.data.Dataset.zip((batches, views)).map(gather)
