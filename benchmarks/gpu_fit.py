"""`fit` on a GPU under JAX and torch, on a machine without TensorFlow.

The GPU machine this project borrows has JAX and torch but no TensorFlow (its wheel is
too large to carry there), and `TFRecordSequenceSource` is a `tf.data.Dataset`. Under
the JAX and torch Keras backends, though, nothing of TensorFlow runs per batch: Keras
reads a sample-mode source through `as_numpy_iterator` (``keras_tfr/_compat/
keras_numpy.py``), one `keras_tfr.read.numpy_iter.NumpyBatches` per epoch over the
source's `keras_tfr.read.mapped.MappedPlan`. This script builds that same reader without
TensorFlow, as ``TFRecordSequenceSource(directory, 256, seed=0)`` makes it (the defaults
``shuffle=True``, ``verify="first_read"``, ``min(8, max(2, cpu_count))`` reader
threads), and hands it to ``fit``
through a Keras ``DataAdapter`` that does what the hooked ``TFDatasetAdapter`` does: a
new `NumpyBatches` per epoch for JAX (``get_jax_iterator``), Keras' own
``get_torch_dataloader`` over those epochs for torch. ``--self-check`` (where TensorFlow
is installed) shows that it hands out what ``source.as_numpy_iterator()`` does, batch
for batch and bit for bit.

Pipelines, each measurement in its own process, rounds interleaved, data from
`run_all.py`'s shapes (``small`` 160,000 x 28x28x1, ``large`` 16,384 x 64x64x3 float32;
random values, int32 labels), written by `ArraysToRecords` (which needs no TensorFlow
for local paths), page cache warm, batch 256:

* read (no model, no GPU): the reader above in a Python loop, against run_all's
  ``memmap + threads`` peer (a sorted fancy-index gather of a permutation, 4 threads);
* fit (Flatten + Dense 10, on the GPU): ``model.fit(x, y)`` on in-memory NumPy,
  ``memmap + PyDataset(workers=4)`` and keras-tfr (run_all's ``work_fit``: the fastest
  epoch after the first).

The model is tiny on purpose: the GPU waits for the input, so ``fit`` measures the
pipeline and the copy to the GPU, the case where a slow reader shows most.

Usage::

    python benchmarks/gpu_fit.py --backends jax,torch --shapes small,large --rounds 2
    python benchmarks/gpu_fit.py --self-check --samples 3000     # needs TensorFlow

Prints a table of rates and ratios (keras-tfr / peer) and writes ``--out`` (JSON),
after every measurement, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout without installing

import numpy as np  # noqa: E402
import run_all as bench  # noqa: E402

FIT = ["numpy", "memmap-pydataset", "keras-tfr"]
READ = ["keras-tfr", "memmap-threads"]


class NumpyEpochs:
    """A sample-mode source's NumPy hand-off (what Keras' JAX and torch backends read),
    built without TensorFlow: `as_numpy_iterator` is one `NumpyBatches` per epoch,
    epochs 0, 1, 2, ... in turn, with the source's default options and ``seed``."""

    def __init__(self, directory: str, batch_size: int = bench.BATCH, seed: int = 0):
        from keras_tfr.manifest import Manifest
        from keras_tfr.read.mapped import MappedPlan
        from keras_tfr.read.order import SampleOrder

        m = Manifest.load(directory)
        if dict(m.structure) != {"x": "array", "y": "array"}:
            raise ValueError(f"{directory}: expected one x and one y array, got {m.structure}")
        specs = sorted(m.features, key=lambda s: s.key)
        order = SampleOrder(m.total_samples, seed=seed, shuffle=True, batch_size=batch_size)
        self.steps = math.ceil(order.size / batch_size)
        self.batch_size = batch_size
        self.last = order.size - (self.steps - 1) * batch_size
        self.plan = MappedPlan(
            specs=specs,
            files=[m.shard_path(s) for s in m.shards],
            shard_records=[s.records for s in m.shards],
            shard_bytes=[s.bytes for s in m.shards],
            samples_per_record=m.samples_per_record,
            total_samples=m.total_samples,
            order=order,
            num_batches=self.steps,
            batch_size=batch_size,
            readers=min(8, max(2, os.cpu_count() or 2)),
            verify="first_read",
            skip=None,
            lattice=m.lattice,
        )
        self._epoch = 0

    def _next_epoch(self) -> tuple[int, int]:
        e, self._epoch = self._epoch, self._epoch + 1
        return e, 0

    def as_numpy_iterator(self) -> Any:
        from keras_tfr.read.numpy_iter import NumpyBatches

        def raise_as_is(error: BaseException) -> None:
            return None

        return NumpyBatches(self.plan, self._next_epoch, lambda d: (d["x"], d["y"]), 0, raise_as_is)

    def __iter__(self) -> Any:
        return self.as_numpy_iterator()


def adapter(epochs: NumpyEpochs) -> Any:
    """A Keras ``DataAdapter`` over `NumpyEpochs`: what keras-tfr's hook makes Keras'
    ``TFDatasetAdapter`` do for a sample-mode source under JAX and torch."""
    from keras.src.trainers.data_adapters import data_adapter_utils
    from keras.src.trainers.data_adapters.data_adapter import DataAdapter

    class Adapter(DataAdapter):
        def get_numpy_iterator(self) -> Any:
            return epochs.as_numpy_iterator()

        def get_jax_iterator(self) -> Any:
            return epochs.as_numpy_iterator()

        def get_torch_dataloader(self) -> Any:
            return data_adapter_utils.get_torch_dataloader(epochs)

        def get_tf_dataset(self) -> Any:
            raise NotImplementedError("this script runs where TensorFlow is not installed")

        @property
        def num_batches(self) -> int:
            return epochs.steps

        @property
        def batch_size(self) -> int:
            return epochs.batch_size

        @property
        def has_partial_batch(self) -> bool:
            return epochs.last != epochs.batch_size

        @property
        def partial_batch_size(self) -> int | None:
            return epochs.last if self.has_partial_batch else None

    return Adapter()


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    p = bench._paths(spec["data"], spec["shape_name"])
    shape = tuple(spec["shape"])
    if spec["kind"] == "read":
        if spec["pipeline"] == "memmap-threads":
            return bench._memmap_read(p)
        bench._warm(p["ktfr"])
        count, dt, cpu = bench._iterate(NumpyEpochs(p["ktfr"]))
        return {"seconds": dt, "examples": count, "cpu_seconds": cpu}

    def reader(p: dict[str, str], pipeline: str, shape: tuple[int, ...]) -> Any:
        bench._warm(p["ktfr"])
        return adapter(NumpyEpochs(p["ktfr"]))

    import keras

    res = bench.work_fit(p, spec["pipeline"], shape, reader=reader)
    res["keras_backend"] = keras.backend.backend()
    res["device"] = _device(res["keras_backend"])
    return res


def _device(backend: str) -> str:
    if backend == "jax":
        import jax

        return str(jax.devices()[0])
    if backend == "torch":
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return "?"


def run(spec: dict[str, Any], backend: str, timeout: float) -> dict[str, Any]:
    env = {**os.environ, "KERAS_BACKEND": backend, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, os.path.abspath(__file__), "--_worker", json.dumps(spec)]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in out.stdout.splitlines():
        if line.startswith("@@RESULT "):
            return json.loads(line[len("@@RESULT ") :])
    return {"error": f"rc={out.returncode}: {(out.stderr or out.stdout)[-2000:]}"}


def self_check(samples: int) -> int:
    """The reader this script builds hands out what the source's `as_numpy_iterator`
    does (needs TensorFlow): two epochs, batch for batch, bit for bit."""
    from keras_tfr import TFRecordSequenceSource

    with tempfile.TemporaryDirectory(prefix="keras-tfr-gpu-fit-") as data:
        p = bench._paths(data, "small")
        _generate(p, samples, bench.SHAPES["small"]["shape"])
        ours, src = NumpyEpochs(p["ktfr"]), TFRecordSequenceSource(p["ktfr"], 256, seed=0)
        for epoch in range(2):
            a, b = list(ours.as_numpy_iterator()), list(src.as_numpy_iterator())
            assert len(a) == len(b) == ours.steps == src.steps, (len(a), len(b))
            for (xa, ya), (xb, yb) in zip(a, b):
                assert xa.dtype == xb.dtype and np.array_equal(xa, xb), epoch
                assert ya.dtype == yb.dtype and np.array_equal(ya, yb), epoch
        print(f"self-check passed: 2 epochs x {ours.steps} batches, the same bits as the source")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="jax,torch")
    ap.add_argument("--shapes", default="small,large")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--samples", type=int, default=None, help="samples per shape")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", default=None, help="JSON results, rewritten after each run")
    ap.add_argument("--timeout", type=float, default=240, help="seconds per measurement")
    ap.add_argument("--self-check", action="store_true")
    args = ap.parse_args(argv)
    if args.self_check:
        return self_check(args.samples or 3000)
    backends = args.backends.split(",")
    shapes = args.shapes.split(",")
    tmp = None
    if args.data_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="keras-tfr-gpu-fit-")
        args.data_dir = tmp.name
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "processor": _cpu_name(), "python": sys.version},
        "results": [],
    }
    try:
        for name in shapes:
            cfg = bench.SHAPES[name]
            n, shape = args.samples or cfg["samples"], tuple(cfg["shape"])
            t0 = time.perf_counter()
            gen = {"kind": "gen", "data": args.data_dir, "shape_name": name, "shape": shape}
            res = run({**gen, "samples": n}, backends[0], 600)
            if "error" in res:
                print(res["error"], file=sys.stderr)
                return 1
            print(f"{name}: {n} x {shape} written in {time.perf_counter() - t0:.1f} s")
            base = {"data": args.data_dir, "shape_name": name, "shape": shape}
            plan = [("read", "-", pl) for pl in READ]
            plan += [("fit", b, pl) for b in backends for pl in FIT]
            for r in range(args.rounds):
                for kind, backend, pipeline in plan:
                    spec = {**base, "kind": kind, "pipeline": pipeline}
                    res = run(spec, backends[0] if backend == "-" else backend, args.timeout)
                    res.update(shape=name, kind=kind, backend=backend, pipeline=pipeline)
                    res["round"] = r
                    report["results"].append(res)
                    _say(res)
                    if args.out:
                        with open(args.out, "w") as f:
                            json.dump(report, f, indent=1)
    finally:
        if tmp is not None:
            tmp.cleanup()
    _table(report["results"])
    return 0


def _say(res: dict[str, Any]) -> None:
    head = f"{res['shape']:6s} {res['kind']:4s} {res['backend']:6s} {res['pipeline']:18s}"
    if "error" in res:
        print(f"{head} ERROR {res['error'][-800:]}", flush=True)
        return
    rate = res["examples"] / res["seconds"]
    print(f"{head} {rate:12,.0f} ex/s  cpu {res.get('cpu_seconds', 0):.2f} s", flush=True)


def _table(results: list[dict[str, Any]]) -> None:
    """Median rate per (shape, kind, backend, pipeline), and keras-tfr / each peer."""
    groups: dict[tuple[str, str, str], dict[str, list[float]]] = {}
    cpu: dict[tuple[str, str, str, str], list[float]] = {}
    for res in results:
        if "error" in res:
            continue
        key = (res["shape"], res["kind"], res["backend"])
        rate = res["examples"] / res["seconds"]
        groups.setdefault(key, {}).setdefault(res["pipeline"], []).append(rate)
        per_gb = res["cpu_seconds"] / (res["examples"] * _sample_bytes(res["shape"]) / 1e9)
        cpu.setdefault((*key, res["pipeline"]), []).append(per_gb)
    print()
    print(
        f"{'shape':6s} {'bench':5s} {'backend':7s} {'pipeline':18s} {'examples/s':>12s} "
        f"{'CPU s/GB':>9s} {'keras-tfr / this':>17s}"
    )
    for key, rates in groups.items():
        ours = statistics.median(rates["keras-tfr"]) if "keras-tfr" in rates else None
        for pipeline, rs in rates.items():
            rate = statistics.median(rs)
            ratio = f"{ours / rate:16.2f}x" if ours else f"{'-':>17s}"
            c = statistics.median(cpu[(*key, pipeline)])
            print(
                f"{key[0]:6s} {key[1]:5s} {key[2]:7s} {pipeline:18s} {rate:12,.0f} "
                f"{c:9.2f} {ratio}  rounds {[round(r) for r in rs]}"
            )


def _sample_bytes(shape_name: str) -> int:
    return 4 * int(np.prod(bench.SHAPES[shape_name]["shape"])) + 4  # x float32, y int32


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _generate(p: dict[str, str], samples: int, shape: tuple[int, ...]) -> None:
    """run_all's random ``x.npy``/``y.npy``, and the same arrays written by keras-tfr."""
    from keras_tfr import ArraysToRecords

    bench.work_gen(p, samples, shape)
    x, y = bench._load_xy(p)
    ArraysToRecords.from_arrays(x, y, p["ktfr"], verbose=0)


def _worker_main(spec: dict[str, Any]) -> None:
    if spec["kind"] == "gen":
        p = bench._paths(spec["data"], spec["shape_name"])
        _generate(p, spec["samples"], tuple(spec["shape"]))
        result: dict[str, Any] = {}
    else:
        result = worker(spec)
    result["peak_rss_mb"] = bench._maxrss_mb()
    print("@@RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--_worker":
        _worker_main(json.loads(sys.argv[2]))
    else:
        sys.exit(main())
