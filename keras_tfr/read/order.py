"""Which samples an epoch reads, and in which order: the split, the shares and the shuffle.

Everything here is a pure function of the data set's size, the source's options, the
``seed`` and the epoch number: no state, no TensorFlow, and memory that does not grow
with the data set. It is the one place where the validation split, the per-worker shares
and the shuffle are defined; the readers only follow it.

Sample mode (``access="samples"``, the default where random access is cheap):

* **Split.** A seeded permutation ``S`` of all ``n`` written samples (a bijection computed
  per index, see `Permutation`). The validation subset is ``S(0) .. S(v - 1)`` with
  ``v = int(validation_split * n)`` (at least 1, at most ``n - 1``), as Keras' own
  ``*_dataset_from_directory`` utilities count it; the training subset is the rest. Both
  subsets are drawn across the whole data set, so a class-sorted array gives a
  representative validation set. Without a split the subset is the written order.
* **Shares.** With ``num_workers``, the subset's positions are cut into ``num_workers``
  contiguous runs whose sizes differ by at most one; every worker gets the same step count.
* **Shuffle.** Epoch ``e`` reads its share in the order of a permutation ``Q(seed, e)``,
  so the order of an epoch depends only on ``(seed, e)``; the samples of each batch are
  then sorted by position on disk (the batch is the same set, and reading it in file
  order is kinder to the page cache), as a memory-mapped array gathered by a sorted index
  would be.
* **Windows.** For data larger than memory (``shuffle_window``), epoch ``e`` permutes the
  records (``R(seed, e)``), cuts them into windows of ``window_records`` records, and
  reads the windows in turn, each in the order of a permutation ``W(seed, e, k)`` of the
  share's samples in its records: the pages an epoch needs at a time are one window's.
  The split and the shares are the same samples as without windows.

Block mode (``access="blocks"``: remote storage, compressed shards, variable-length
features, the tf.data service) reads whole records in sequence; its shuffle is the graph
reader's (shards, a buffer of records, pools of samples). Its split assigns whole records
(`block_split`) and its worker shares whole records, except on a small data set (up to
`SAMPLE_SPLIT_RECORDS` records and `SAMPLE_SPLIT_SAMPLES` samples): there it reads the
very samples sample mode reads (`SampleOrder.mask`: split and share), picked out of every
record it reads.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

__all__ = ["Permutation", "SampleOrder", "block_split", "validation_count", "write_order"]

# Block mode splits (and shares among workers) a data set of at most this many records
# (64 MB at the default record size) and samples by sample: reading every record for each
# subset and worker costs little there, and whole records would be coarse (one record:
# no split at all).
SAMPLE_SPLIT_RECORDS = 64
SAMPLE_SPLIT_SAMPLES = 1 << 22  # the mask of samples is a constant of the pipeline

_U64, _U32 = np.uint64, np.uint32
_ROUNDS = 6  # alternating halves: three rounds each
# The round function, a multiply-xorshift mix whose high bits are kept, in two widths:
# indices of up to 32 bits are mixed in 32-bit words (twice the elements per vector
# instruction, and a 32-bit multiply is one instruction where a 64-bit one is not).
_MIX = {
    _U64: (_U64(0xBF58476D1CE4E5B9), _U64(29), _U64(0x94D049BB133111EB), _U64(32)),
    _U32: (_U32(0x21F0AAAD), _U32(15), _U32(0x735A2D97), _U32(16)),
}

# Domain tags, so that the split, the shuffle, the in-batch order and the writer's order
# (`ArraysToRecords.from_arrays(..., shuffle_seed=)`) never share keys.
_SPLIT, _SHUFFLE = 1, 2
WRITE_ORDER = 3
_RECORDS, _WINDOW = 4, 5  # the windowed shuffle: records into windows, samples inside

# A window of the windowed shuffle holds at most this many samples (its written indices
# are listed once per window: 32 MB of int64), whatever its size in bytes.
WINDOW_SAMPLES = 1 << 22
_COUNT_CHUNK = 1 << 20  # samples looked at per step when counting a subset per record


def _round_keys(key: Sequence[int]) -> np.ndarray:
    """Round keys derived from an arbitrary tuple of non-negative ints."""
    seq = np.random.SeedSequence([int(k) & 0xFFFFFFFFFFFFFFFF for k in key])
    return seq.generate_state(_ROUNDS, dtype=np.uint64)


class Permutation:
    """A seeded bijection of ``[0, n)``, evaluated per index in O(1) memory.

    A Feistel-type network over the ``b`` bits that cover ``n`` (``b - 1 < log2(n) <= b``):
    an index is cut into a high and a low part, and each round XORs one part with a keyed
    hash (a multiply-xorshift mix) of the other. Each round can be undone, so the network
    is a bijection of ``[0, 2**b)``; indices that land at ``n`` or above are mapped again
    until they land inside (cycle walking, fewer than two rounds on average since
    ``2**b < 2n``). Grain's index sampler shuffles the same way, so a data set of a
    billion samples needs no billion-entry array per epoch.

    Example:
        >>> p = Permutation(10, key=(0,))
        >>> sorted(p(np.arange(10)).tolist()) == list(range(10))
        True
    """

    def __init__(self, n: int, key: Sequence[int]):
        if n < 0:
            raise ValueError(f"Expected `n` >= 0. Received: {n}")
        self.n = int(n)
        bits = max(2, (self.n - 1).bit_length())
        self._word = _U32 if bits <= 32 else _U64
        word = self._word
        self._low = word(bits - bits // 2)
        self._low_mask = word((1 << int(self._low)) - 1)
        self._high_mask = word((1 << (bits // 2)) - 1)
        keys = _round_keys(key)
        self._keys = keys.astype(word) if word is _U64 else (keys >> _U64(32)).astype(word)

    def _rounds(self, x: np.ndarray, backward: bool = False) -> np.ndarray:
        # In place, on two scratch arrays: the same arithmetic as
        # ``low ^= mix(high ^ k) & mask`` per round, without a temporary per operation.
        # Each round only XORs one half with a function of the other, so running the
        # rounds in reverse order undoes them (``backward``: the inverse network).
        low_bits = self._low
        mul1, shift1, mul2, shift2 = _MIX[self._word]
        high, low = x >> low_bits, x & self._low_mask
        h, t = np.empty_like(x), np.empty_like(x)
        rounds = list(enumerate(self._keys))
        for r, k in reversed(rounds) if backward else rounds:
            src, dst, mask = (
                (high, low, self._low_mask) if r % 2 == 0 else (low, high, self._high_mask)
            )
            np.bitwise_xor(src, k, out=h)
            np.multiply(h, mul1, out=h)
            np.right_shift(h, shift1, out=t)
            np.bitwise_xor(h, t, out=h)
            np.multiply(h, mul2, out=h)
            np.right_shift(h, shift2, out=h)
            np.bitwise_and(h, mask, out=h)
            np.bitwise_xor(dst, h, out=dst)
        np.left_shift(high, low_bits, out=high)
        np.bitwise_or(high, low, out=high)
        return high

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The permuted index of each position (``int64``, same shape)."""
        return self._walk(positions, backward=False)

    def inverse(self, values: np.ndarray) -> np.ndarray:
        """The position each value comes from: ``p.inverse(p(x)) == x``.

        Example:
            >>> p = Permutation(10, key=(0,))
            >>> p.inverse(p(np.arange(10))).tolist() == list(range(10))
            True
        """
        # Cycle walking backwards: the forward walk from ``x`` passes only through values
        # at ``n`` or above before it lands, so the backward walk from where it landed
        # stops at the first value below ``n``, which is ``x``.
        return self._walk(values, backward=True)

    def _walk(self, positions: np.ndarray, backward: bool) -> np.ndarray:
        x = np.asarray(positions, dtype=np.int64)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise IndexError(f"positions must lie in [0, {self.n})")
        n = self._word(self.n) if self.n < (1 << 32) or self._word is _U64 else None
        with np.errstate(over="ignore"):
            y = self._rounds(x.astype(self._word), backward)
            out = np.flatnonzero(y >= n) if n is not None else np.empty(0, np.intp)
            while len(out):  # cycle walking
                z = self._rounds(y[out], backward)
                y[out] = z
                out = out[z >= n]
        return y.astype(np.int64)


def validation_count(split: float, n: int) -> int:
    """Validation samples out of ``n``: ``int(split * n)``, at least 1, at most ``n - 1``."""
    return min(max(1, int(split * n)), n - 1)


class SampleOrder:
    """The samples one source reads, per epoch, in order (sample mode).

    Args:
        total: samples written in the data set.
        seed: the source's seed (None: drawn once, so one process still gets a fixed
            order per epoch number).
        validation_split, subset: as on the source.
        num_workers, worker_index: this worker's share (or None).
        shuffle: whether each epoch reads its share in a new order.
        batch_size: batches are sorted inside when shuffling.
        samples_per_record, window_records: the windowed shuffle (data larger than
            memory): each epoch permutes the records, cuts them into windows of
            ``window_records`` records (at most `WINDOW_SAMPLES` samples) and reads the
            windows one after the other, each in a new order of its share's samples.
            None (or a window as large as the data set): one order over all samples.

    Example:
        >>> order = SampleOrder(1000, seed=0, validation_split=0.2, subset="validation",
        ...                     shuffle=False, batch_size=32)
        >>> order.size
        200
    """

    def __init__(
        self,
        total: int,
        *,
        seed: int | None,
        validation_split: float | None = None,
        subset: str | None = None,
        num_workers: int | None = None,
        worker_index: int | None = None,
        shuffle: bool,
        batch_size: int,
        samples_per_record: int = 0,
        window_records: int | None = None,
    ):
        self.total = int(total)
        entropy = np.random.SeedSequence().entropy
        self.seed = int(seed) if seed is not None else int(entropy)  # type: ignore[arg-type]
        self.shuffle = bool(shuffle)
        self.batch_size = int(batch_size)
        # The subset as a run [lo, hi) of positions of the split permutation (or of the
        # written order when there is no split).
        lo, hi = 0, self.total
        self._split: Permutation | None = None
        if validation_split is not None:
            n_val = validation_count(validation_split, self.total)
            self._split = Permutation(self.total, key=(self.seed, _SPLIT))
            lo, hi = (0, n_val) if subset == "validation" else (n_val, self.total)
        if num_workers is not None and worker_index is not None:
            n = hi - lo
            lo, hi = (
                lo + n * worker_index // num_workers,
                lo + n * (worker_index + 1) // num_workers,
            )
        self._lo, self._hi = lo, hi
        self.spr = int(samples_per_record)
        self.records = -(-self.total // self.spr) if self.spr > 0 else 0
        self.window_records: int | None = None
        # Unshuffled, a subset of a split (each worker's share of it) is read in written
        # order, as data without a split is and as block mode reads it: the samples the
        # split's permutation picked, in increasing written index. Where windows are asked
        # for (data larger than memory) that read is a scan whose records are read ahead
        # and dropped once read (`scan`, see `keras_tfr.read.mapped`).
        self.in_written_order = not self.shuffle and self._split is not None
        self.scan = False
        if window_records is not None and self.spr > 0:
            w = max(1, min(int(window_records), WINDOW_SAMPLES // self.spr))
            if w < self.records:
                if self.shuffle:
                    self.window_records = w
                else:
                    self.scan = self.in_written_order
        if self.spr <= 0:
            # No records given (an order on its own): runs of samples stand in for them
            # where the subset is counted per record to be read in written order.
            self.spr = max(1, min(self.total, _COUNT_CHUNK >> 4))
            self.records = -(-self.total // self.spr)
        self._lock = threading.Lock()
        self._counts: np.ndarray | None = None  # per record: samples of this share
        self._before: np.ndarray | None = None  # per record: share samples before it
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._windows: dict[tuple[int, int], np.ndarray] = {}
        self._written: np.ndarray | None = None  # the share in written order, where small

    @property
    def windowed(self) -> bool:
        """Whether each epoch is read window by window (see the class docstring)."""
        return self.window_records is not None

    @property
    def window_count(self) -> int:
        """Windows per epoch (windowed)."""
        assert self.window_records is not None
        return -(-self.records // self.window_records)

    @property
    def size(self) -> int:
        """Samples in this share of this subset (read once per epoch)."""
        return self._hi - self._lo

    def subset_samples(self, positions: np.ndarray) -> np.ndarray:
        """Written sample index of each position of this share (0 to ``size - 1``)."""
        p = positions + self._lo
        return p if self._split is None else self._split(p)

    def mask(self) -> np.ndarray:
        """A boolean mask over the ``total`` written samples, True for this share's (what
        block mode reads of a small data set).

        Example:
            >>> SampleOrder(1003, seed=0, validation_split=0.2, subset="validation",
            ...             shuffle=False, batch_size=32).mask().sum()
            np.int64(200)
        """
        out = np.zeros(self.total, dtype=bool)
        out[self.subset_samples(np.arange(self.size, dtype=np.int64))] = True
        return out

    def in_share(self, ids: np.ndarray) -> np.ndarray:
        """Whether each written sample index belongs to this share of this subset."""
        p = ids if self._split is None else self._split.inverse(ids)
        return (p >= self._lo) & (p < self._hi)

    # ------------------------------------------------------------ windowed shuffle

    def _record_counts(self) -> np.ndarray:
        """Samples of this share in each record (computed once, in bounded steps)."""
        with self._lock:
            return self._counts_unlocked()

    def _counts_unlocked(self) -> np.ndarray:
        if self._counts is None:
            counts = np.zeros(self.records, dtype=np.int64)
            # Without a split the share is the run [lo, hi) of written samples.
            lo, hi = (0, self.total) if self._split is not None else (self._lo, self._hi)
            for a in range(lo, hi, _COUNT_CHUNK):
                ids = np.arange(a, min(hi, a + _COUNT_CHUNK), dtype=np.int64)
                if self._split is not None:
                    ids = ids[self.in_share(ids)]
                counts += np.bincount(ids // self.spr, minlength=self.records)
            self._counts = counts
        return self._counts

    def _epoch_windows(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Epoch ``epoch``'s records in window order, and the stream position at which
        each window starts (one more entry: ``size``)."""
        with self._lock:
            cached = self._epochs.get(epoch)
        if cached is not None:
            return cached
        w = self.window_records
        assert w is not None
        records = Permutation(self.records, key=(self.seed, _RECORDS, epoch))(
            np.arange(self.records, dtype=np.int64)
        )
        per_window = np.add.reduceat(self._record_counts()[records], np.arange(0, self.records, w))
        starts = np.concatenate([[0], np.cumsum(per_window)]).astype(np.int64)
        with self._lock:
            self._epochs[epoch] = (records, starts)
            while len(self._epochs) > 2:
                del self._epochs[next(iter(self._epochs))]
        return records, starts

    def _window(self, epoch: int, k: int) -> np.ndarray:
        """The written indices of window ``k``'s share samples, in its records' order."""
        key = (epoch, k)
        with self._lock:
            cached = self._windows.get(key)
        if cached is not None:
            return cached
        records, _ = self._epoch_windows(epoch)
        w = self.window_records
        assert w is not None
        recs = records[k * w : (k + 1) * w]
        ids = (recs[:, None] * self.spr + np.arange(self.spr, dtype=np.int64)).ravel()
        ids = ids[ids < self.total]
        ids = ids[self.in_share(ids)]
        ids.flags.writeable = False
        with self._lock:
            self._windows[key] = ids
            while len(self._windows) > 3:
                del self._windows[next(iter(self._windows))]
        return ids

    def window_of(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The window that holds each stream position of epoch ``epoch`` (windowed)."""
        _, starts = self._epoch_windows(epoch)
        return np.searchsorted(starts, positions, side="right") - 1

    def window_records_of(self, epoch: int, k: int) -> np.ndarray:
        """The records of window ``k`` of epoch ``epoch`` (windowed), ``[]`` past the end."""
        records, _ = self._epoch_windows(epoch)
        w = self.window_records
        assert w is not None
        return records[k * w : (k + 1) * w]

    def _windowed(self, epoch: int, start: int, stop: int) -> np.ndarray:
        _, starts = self._epoch_windows(epoch)
        out = []
        k = int(np.searchsorted(starts, start, side="right")) - 1
        while start < stop:
            lo, hi = int(starts[k]), int(starts[k + 1])
            end = min(stop, hi)
            if end > start:
                ids = self._window(epoch, k)
                n = hi - lo
                q = np.arange(start - lo, end - lo, dtype=np.int64)
                if n > 1:
                    q = Permutation(n, key=(self.seed, _WINDOW, epoch, k))(q)
                out.append(ids[q])
                start = end
            k += 1
        return np.concatenate(out) if out else np.empty(0, np.int64)

    def _records_before(self) -> np.ndarray:
        with self._lock:
            if self._before is None:
                self._before = np.concatenate([[0], np.cumsum(self._counts_unlocked())])
            return self._before

    def record_of(self, positions: np.ndarray) -> np.ndarray:
        """The record that holds each stream position (read in written order)."""
        return np.searchsorted(self._records_before(), positions, side="right") - 1

    def _in_written_order(self, start: int, stop: int) -> np.ndarray:
        """The share's samples ``start`` to ``stop - 1`` in increasing written index.

        The same in every epoch: a share of at most `WINDOW_SAMPLES` samples (32 MB of
        indices) is worked out once and kept, as a validation subset read after every
        epoch is; a larger one is worked out step by step, memory bounded.
        """
        if self.size > WINDOW_SAMPLES:
            return self._scan(start, stop)
        written = self._written
        if written is None:  # (two threads may both work it out: the same array)
            written = self._scan(0, self.size)
            written.flags.writeable = False
            self._written = written
        return written[start:stop].copy()

    def _scan(self, start: int, stop: int) -> np.ndarray:
        before = self._records_before()
        r, last = (int(k) - 1 for k in np.searchsorted(before, [start, stop - 1], side="right"))
        out, skip, want = [], start - int(before[r]), stop - start
        while want > 0 and r < self.records:
            # The records that hold these positions, in steps of about a million samples:
            # memory does not grow with a small subset's spread.
            r_end = min(last + 1, r + max(1, _COUNT_CHUNK // self.spr))
            ids = np.arange(r * self.spr, min(r_end * self.spr, self.total), dtype=np.int64)
            ids = ids[self.in_share(ids)][skip : skip + want]
            out.append(ids)
            skip, want, r = 0, want - len(ids), r_end
        return np.concatenate(out) if out else np.empty(0, np.int64)

    # ------------------------------------------------------------ the epoch's order

    def samples(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """Written indices of the epoch's stream positions ``[start, stop)``, batch by batch.

        ``start`` must fall on a batch boundary; inside each batch the indices are sorted
        when shuffling (the same set of samples, read in file order).
        """
        stop = min(stop, self.size)
        if self.windowed:
            ids = self._windowed(epoch, start, stop)
        elif self.in_written_order:
            ids = self._in_written_order(start, stop)
        else:
            positions = np.arange(start, stop, dtype=np.int64)
            if self.shuffle and self.size > 1:
                positions = Permutation(self.size, key=(self.seed, _SHUFFLE, epoch))(positions)
            ids = self.subset_samples(positions)
        if self.shuffle or self._split is not None:
            b = self.batch_size
            full = (len(ids) // b) * b
            ids[:full].reshape(-1, b).sort(axis=1)
            ids[full:].sort()
        return ids

    def epoch(self, epoch: int) -> np.ndarray:
        """All of the epoch's written indices in order (``size`` of them)."""
        return self.samples(epoch, 0, self.size)


def write_order(total: int, seed: int) -> Permutation:
    """The order `ArraysToRecords.from_arrays(..., shuffle_seed=seed)` writes ``total``
    samples in: written sample ``i`` is input sample ``write_order(total, seed)(i)``.

    Example:
        >>> sorted(write_order(5, seed=0)(np.arange(5)).tolist())
        [0, 1, 2, 3, 4]
    """
    return Permutation(total, key=(seed, WRITE_ORDER))


def block_split(
    total_records: int, split: float, subset: str, seed: int, directory: str
) -> np.ndarray:
    """Block mode's split: a boolean mask over records (whole records are assigned).

    A seeded permutation of the records; the first ``round(split * records)`` of it (at
    least one, at most all but one) are validation. The unit is the record, so the split
    is exact in records and approximate in samples, and a data set needs 2 records.
    """
    if total_records < 2:
        raise ValueError(
            f"`validation_split` with access='blocks' assigns whole records and needs at "
            f"least 2; {directory} holds {total_records}. Use access='samples' (local, "
            "uncompressed data), or write with a smaller `samples_per_record`."
        )
    n_val = min(max(1, round(split * total_records)), total_records - 1)
    perm = np.random.default_rng(seed).permutation(total_records)
    is_val = np.zeros(total_records, dtype=bool)
    is_val[perm[:n_val]] = True
    return is_val if subset == "validation" else ~is_val
