"""End-to-end demo: train on a data set larger than the memory it is trained in.

1. Generates a learnable classification data set on disk as ``.npy`` files, chunk by
   chunk (default 2 GB: 2,000,000 samples of 256 float32 features, 10 classes given by
   a hidden linear teacher).
2. Converts it to sharded TFRecords with `ArraysToRecords.from_arrays` (progress bar).
3. Trains a small model on the stream with `TFRecordSequenceSource` and a validation
   split, then evaluates it. The source reads in windows of 256 MB (``--window``), as
   ``shuffle_window="auto"`` does for a data set larger than half of the memory: each
   window's records are read ahead and dropped from the mapping once read through, so
   training's peak RSS, the mapped shards included, stays below the data size (with
   ``--window auto`` on a machine with room for the data: one order over every sample,
   whose pages all stay mapped).

Generation, conversion and training each run in their own process, so each one's peak
RSS (`resource.getrusage`) is its own (Linux carries a parent's peak RSS into the
children it starts, so the parent stays small); the demo prints both next to the data
size.

Run: ``make demo`` (or ``python examples/demo.py --size-gb 0.5`` for a quicker run).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

FEATURES = 256
CLASSES = 10
GEN_CHUNK = 65_536


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _status_kb(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class PrivatePeak:
    """Peak private (anonymous) memory, sampled every 20 ms (Linux; 0 elsewhere).

    Peak RSS also counts the pages of memory-mapped files the process touched: sample
    mode reads the shards through a memory map, so the shards' page cache shows in RSS
    (shared with other readers, and given back to the system under memory pressure
    without any write). Private memory is what the process allocates for itself.
    """

    def __init__(self) -> None:
        import threading

        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _status_kb("RssAnon") * 1024)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _status_kb("RssAnon") * 1024)


def generate(workdir: str, n: int, seed: int = 0) -> None:
    """Writes x.npy (n, 256) float32 and y.npy (n,) int64 chunk by chunk.

    With plain writes after each file's ``.npy`` header, not through a memmap: a
    written memmap's pages stay mapped, so its process' peak RSS would reach the data
    size (2.1 GB for the default 2 GB) in the step that only makes the data."""
    rng = np.random.default_rng(seed)
    teacher = rng.standard_normal((FEATURES, CLASSES)).astype(np.float32)
    with (
        open(os.path.join(workdir, "x.npy"), "wb") as fx,
        open(os.path.join(workdir, "y.npy"), "wb") as fy,
    ):
        for f, dtype, shape in ((fx, np.float32, (n, FEATURES)), (fy, np.int64, (n,))):
            descr = np.lib.format.dtype_to_descr(np.dtype(dtype))
            header = {"descr": descr, "fortran_order": False, "shape": shape}
            np.lib.format.write_array_header_1_0(f, header)
        for i in range(0, n, GEN_CHUNK):
            j = min(n, i + GEN_CHUNK)
            xb = rng.standard_normal((j - i, FEATURES), dtype=np.float32)
            fx.write(xb.tobytes())
            fy.write(np.argmax(xb @ teacher, axis=1).astype(np.int64).tobytes())


def phase_convert(workdir: str) -> dict:
    from keras_tfr import ArraysToRecords

    x = np.load(os.path.join(workdir, "x.npy"), mmap_mode="r")
    y = np.load(os.path.join(workdir, "y.npy"), mmap_mode="r")
    t = time.perf_counter()
    manifest = ArraysToRecords.from_arrays(x, y, os.path.join(workdir, "train"), overwrite=True)
    seconds = time.perf_counter() - t
    return {
        "seconds": seconds,
        "bytes": manifest.total_bytes,
        "shards": len(manifest.shards),
        "samples": manifest.total_samples,
        "peak_rss": peak_rss_bytes(),
    }


def phase_train(workdir: str, epochs: int, batch_size: int, window: str) -> dict:
    private = PrivatePeak()
    import keras

    from keras_tfr import TFRecordSequenceSource

    data = os.path.join(workdir, "train")
    common = dict(batch_size=batch_size, seed=0, validation_split=0.05, shuffle_window=window)
    train = TFRecordSequenceSource(data, shuffle=True, subset="training", **common)
    val = TFRecordSequenceSource(data, shuffle=False, subset="validation", **common)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(CLASSES),
        ]
    )
    model.compile(
        keras.optimizers.Adam(1e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    t = time.perf_counter()
    history = model.fit(train, validation_data=val, epochs=epochs, verbose=2)
    seconds = time.perf_counter() - t
    loss, acc = model.evaluate(val, verbose=0)
    return {
        "seconds": seconds,
        "train_samples": train.num_samples,
        "val_samples": val.num_samples,
        "epochs": epochs,
        "steps_per_epoch": len(train),
        "val_loss": float(loss),
        "val_accuracy": float(acc),
        "first_epoch_accuracy": float(history.history["accuracy"][0]),
        "peak_rss": peak_rss_bytes(),
        "peak_private": private.stop(),
        "mapped_file_pages": _status_kb("RssFile") * 1024,
        "access": train.access,
    }


def _run_phase(args: argparse.Namespace, phase: str) -> dict:
    result = os.path.join(args.workdir, f"{phase}.json")
    cmd = [sys.executable, __file__, "--phase", phase, "--workdir", args.workdir]
    cmd += ["--epochs", str(args.epochs), "--batch-size", str(args.batch_size)]
    cmd += ["--samples", str(args.samples), "--window", args.window]
    subprocess.run([*cmd, "--result", result], check=True)  # output (progress bars) shows live
    with open(result) as f:
        return json.load(f)


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=2.0, help="data set size (default 2)")
    parser.add_argument("--workdir", default="demo_data", help="where data goes (demo_data)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument(
        "--window", default="256MB", help="training's shuffle_window (default 256MB; or auto)"
    )
    parser.add_argument("--phase", choices=["generate", "convert", "train"], help=argparse.SUPPRESS)
    parser.add_argument("--samples", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--keep", action="store_true", help="keep demo_data afterwards")
    args = parser.parse_args()

    if args.phase:
        if args.phase != "generate":
            # TensorFlow's start-up lines that TF_CPP_MIN_LOG_LEVEL does not reach (Abseil
            # prints them before TensorFlow's level applies): left out, nothing else is.
            from keras_tfr._quiet import import_tensorflow_quietly

            import_tensorflow_quietly()
        if args.phase == "generate":
            generate(args.workdir, args.samples)
            result = {"peak_rss": peak_rss_bytes()}
        elif args.phase == "convert":
            result = phase_convert(args.workdir)
        else:
            result = phase_train(args.workdir, args.epochs, args.batch_size, args.window)
        with open(args.result, "w") as f:
            json.dump(result, f)
        return 0

    n = int(args.size_gb * 1e9 // (FEATURES * 4 + 8))
    os.makedirs(args.workdir, exist_ok=True)
    free = shutil.disk_usage(args.workdir).free
    if free < 2.2 * n * (FEATURES * 4 + 8):
        print(f"demo: needs about {gb(2.2 * n * (FEATURES * 4 + 8))} free in {args.workdir}")
        return 2
    print(f"[1/3] generating {n:,} samples ({gb(n * (FEATURES * 4 + 8))}) as .npy files ...")
    t = time.perf_counter()
    args.samples = n
    _run_phase(args, "generate")
    print(f"      done in {time.perf_counter() - t:.1f} s")
    print("[2/3] converting to sharded TFRecords with ArraysToRecords.from_arrays ...", flush=True)
    conv = _run_phase(args, "convert")
    print(f"[3/3] training on the stream for {args.epochs} epochs ...", flush=True)
    train = _run_phase(args, "train")

    data_bytes = n * (FEATURES * 4 + 8)
    seen = train["train_samples"] * train["epochs"]
    print()
    print("=" * 64)
    print(f"data set (NumPy arrays)     : {gb(data_bytes)}, {n:,} samples")
    print(f"data set (TFRecord shards)  : {gb(conv['bytes'])} in {conv['shards']} shards")
    print(
        f"conversion                  : {conv['seconds']:.1f} s, "
        f"{data_bytes / conv['seconds'] / 1e6:.0f} MB/s, peak RSS {gb(conv['peak_rss'])}"
    )
    print(
        f"training ({train['access']} mode)     : {train['seconds']:.1f} s, "
        f"{seen / train['seconds']:,.0f} samples/s ({train['steps_per_epoch']} steps/epoch), "
        f"peak private memory {gb(train['peak_private'])}, peak RSS {gb(train['peak_rss'])} "
        f"(at the end {gb(train['mapped_file_pages'])} of mapped files: libraries, "
        "the shards' pages)"
    )
    print(
        f"final validation            : accuracy {train['val_accuracy']:.4f}, "
        f"loss {train['val_loss']:.4f} (first epoch accuracy "
        f"{train['first_epoch_accuracy']:.4f})"
    )
    ratio = data_bytes / max(conv["peak_rss"], train["peak_rss"])
    print(f"data size / peak RSS        : {ratio:.1f}x (conversion and training)")
    print("=" * 64)
    if not args.keep:
        shutil.rmtree(args.workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
