"""Split and mixing on class-sorted data, sample mode against block mode.

10 classes x 6,000 samples of 256 float32, sorted by class (as arrays built class by
class are), written with default settings (62 records of 1 MB); ``validation_split=0.1``,
batch 256. Prints, per mode, the validation subset's size and class shares, and the share
of full training batches in which one class holds more than 20 % of the batch (a global
shuffle gives about 0 %). Block mode splits data sets of up to 64 records by sample, so
it is also shown on the same data written in 512 KB records (122 records), which it
splits by whole records, in the order given and with ``shuffle_seed=0`` (the samples
written in a seeded order). Sample mode is also shown with ``shuffle_window`` (the
windowed shuffle of data larger than memory) on the 122 records, in windows of 15, 31
and 62 records: how the mixing depends on the records a window holds.
`tests/test_split_shuffle.py`, `tests/test_write_order.py` and `tests/test_windowed.py`
assert the targets.

Usage::

    python benchmarks/split_mix.py
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

CLASSES, PER_CLASS, FEATURES, BATCH, SPLIT = 10, 6000, 256, 256, 0.1


def main() -> int:
    from keras_tfr import ArraysToRecords, TFRecordSequenceSource

    with tempfile.TemporaryDirectory(prefix="keras-tfr-split-") as tmp:
        y = np.repeat(np.arange(CLASSES, dtype=np.int32), PER_CLASS)
        x = y.astype(np.float32)[:, None] * np.ones(FEATURES, np.float32)
        written = {}
        for record_size, seed in (("1MB", None), ("512KB", None), ("512KB", 0)):
            d = os.path.join(tmp, f"{record_size}-{seed}")
            written[record_size, seed] = d
            ArraysToRecords.from_arrays(
                x, y, d, record_size=record_size, shuffle_seed=seed, verbose=0
            )
        for access, record_size, seed, window in (
            ("samples", "1MB", None, "auto"),
            ("samples", "512KB", None, "8MB"),
            ("samples", "512KB", None, "16MB"),
            ("samples", "512KB", None, "32MB"),
            ("blocks", "1MB", None, "auto"),
            ("blocks", "512KB", None, "auto"),
            ("blocks", "512KB", 0, "auto"),
        ):
            d = written[record_size, seed]
            kw = dict(batch_size=BATCH, seed=0, validation_split=SPLIT, access=access)
            va = TFRecordSequenceSource(d, subset="validation", shuffle=False, **kw)
            tr = TFRecordSequenceSource(d, subset="training", shuffle_window=window, **kw)
            windows = getattr(tr._order, "window_records", None)
            yva = np.concatenate([b[1] for b in va.as_numpy_iterator()])
            shares = np.bincount(yva, minlength=CLASSES) / len(yva)
            full = [b[1] for b in tr.as_numpy_iterator() if len(b[1]) == BATCH]
            skewed = np.mean([np.bincount(b, minlength=CLASSES).max() / BATCH > 0.2 for b in full])
            print(
                f"access={access!r}, {va.manifest.total_records} records"
                f"{f', windows of {windows} records' if windows else ''}"
                f"{', written with shuffle_seed=0' if seed is not None else ''}: validation "
                f"{len(yva):,} samples, "
                f"{np.count_nonzero(shares)} of {CLASSES} classes, shares "
                f"{np.round(shares, 3).tolist()} (at most "
                f"{np.abs(shares - 1 / CLASSES).max() * 100:.1f} points off); training "
                f"batches with a class above 20 %: {skewed * 100:.1f} %"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
