"""GPU check: several capped processes at once on one GPU, each held to its cap.

For a machine with an NVIDIA GPU. It starts N processes at once with
`keras_tfr.parallel.launch` (what ``keras-tfr parallel --gpu-memory-mb MB`` does), each
capped at MB MiB through ``KERAS_TFR_GPU_MEMORY_MB``. Each process

1. applies the cap with ``limit_gpu_memory()`` (read from the environment, as every
   child of the launcher does; ``import keras_tfr`` already applied it);
2. trains a small Keras model (a convolution and a dense layer, 2 epochs on 4,096
   in-memory samples) on the GPU, when Keras is importable (``--no-train`` skips it): a
   real trainer's libraries (cuBLAS, cuDNN, XLA's compiled kernels) are then loaded, so
   the overhead measured below is a training process's, and the model trains under the
   cap while the other processes do the same;
3. allocates 64 MiB blocks on the GPU until the framework refuses (out of memory) or
   twice the cap is reached, then holds them for a few seconds, while the others do
   the same;
4. prints one ``RESULT {json}`` line: the cap, the framework's own view of its limit,
   the peak, the amount it managed to allocate, the device total, when it held, and
   the training step's device, loss and time.

The parent samples ``nvidia-smi`` meanwhile, to see what the processes take beyond
their caps (the CUDA context and libraries), and prints one table. It passes when each
process was stopped by its cap (allocated no more than the cap, and at least half of
it) and all of them held their memory at the same time.

Backends: JAX or torch (through Keras' backend setting; Keras itself is optional),
or TensorFlow where it is installed. ``--backend auto`` takes the first importable of
jax, torch, tensorflow.

Usage::

    python benchmarks/gpu_check.py                       # 3 processes x 2048 MiB
    python benchmarks/gpu_check.py -n 4 --gpu-memory-mb 4096 --backend torch
    python benchmarks/gpu_check.py --cpu-smoke           # no GPU: checks the plumbing only

Exit code: 0 passed, 1 a check failed, 2 nothing to check (no GPU, no framework).
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout without installing

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

CHUNK_MIB = 64
MIB = 1 << 20


# -- the child: fill the GPU up to the cap ------------------------------------------------


def _allocator(backend: str):
    """Returns (allocate one 64 MiB block on the GPU, is this an out-of-memory error)."""
    n = CHUNK_MIB * MIB // 4  # float32 elements
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        def alloc():  # on JAX's default device: GPU 0 where there is one
            return jax.block_until_ready(jnp.zeros((n,), jnp.float32))

    elif backend == "torch":
        import torch

        dev = "cuda" if torch.cuda.is_available() else "cpu"

        def alloc():
            return torch.zeros(n, dtype=torch.float32, device=dev)

    else:
        import tensorflow as tf

        def alloc():
            with tf.device("/GPU:0" if tf.config.list_logical_devices("GPU") else "/CPU:0"):
                return tf.Variable(tf.zeros([n], tf.float32))

    def is_oom(error: BaseException) -> bool:
        text = f"{type(error).__name__} {error}".lower()
        return any(
            s in text for s in ("out of memory", "resource_exhausted", "resourceexhausted", "oom")
        )

    return alloc, is_oom


def _framework_limit_mb(backend: str) -> float | None:
    """The framework's own view of its allocator limit, where it exposes one."""
    try:
        if backend == "jax":
            import jax

            stats = jax.local_devices()[0].memory_stats() or {}
            return stats["bytes_limit"] / MIB if "bytes_limit" in stats else None
        if backend == "torch":
            import torch

            if not torch.cuda.is_available():
                return None
            getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
            fraction = getter(0) if getter is not None else None
            total = torch.cuda.get_device_properties(0).total_memory
            return None if fraction is None else fraction * total / MIB
    except Exception:  # a diagnostic only
        return None
    return None  # TensorFlow exposes no getter for memory_limit once set


def _train(backend: str) -> dict:
    """Trains a small Keras model where the backend puts it (the GPU when there is one)."""
    try:
        import keras
    except ImportError:
        return {"train_device": None, "train_error": "keras is not importable"}
    import numpy as np

    if backend == "jax":
        import jax

        device = jax.devices()[0].platform
    elif backend == "torch":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        import tensorflow as tf

        device = "gpu" if tf.config.list_logical_devices("GPU") else "cpu"
    rng = np.random.default_rng(int(os.environ.get("KERAS_TFR_PARALLEL_INDEX", "0")))
    x = rng.random((4096, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, 4096)
    model = keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(10),
        ]
    )
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    started = time.perf_counter()
    try:
        history = model.fit(x, y, batch_size=256, epochs=2, verbose=0)
    except Exception as e:  # reported, and judged by the parent
        return {"train_device": device, "train_error": f"{type(e).__name__}: {str(e)[:200]}"}
    return {
        "train_device": device,
        "train_loss": [round(float(v), 4) for v in history.history["loss"]],
        "train_seconds": round(time.perf_counter() - started, 2),
        "train_error": None,
    }


def _wait_for_the_others(timeout: float = 300.0) -> None:
    """A barrier through files: hold only once every process has filled its share."""
    barrier = os.environ.get("GPU_CHECK_BARRIER")
    if not barrier:
        return
    index = os.environ.get("KERAS_TFR_PARALLEL_INDEX", "0")
    count = int(os.environ.get("KERAS_TFR_PARALLEL_COUNT", "1"))
    open(os.path.join(barrier, f"ready-{index}"), "w").close()
    deadline = time.monotonic() + timeout
    while len(os.listdir(barrier)) < count and time.monotonic() < deadline:
        time.sleep(0.1)


def child(args: argparse.Namespace) -> int:
    from keras_tfr import limit_gpu_memory

    started = time.time()
    result: dict = {"index": int(os.environ.get("KERAS_TFR_PARALLEL_INDEX", "-1"))}
    with limit_gpu_memory() as gpu:  # the launcher's KERAS_TFR_GPU_MEMORY_MB
        result.update(backend=gpu.backend, cap_mb=gpu.limit_mb, devices=gpu.devices)
        result["device_total_mb"] = gpu.total_mb[0] if gpu.total_mb else None
        if args.train:
            result.update(_train(gpu.backend))
        alloc, is_oom = _allocator(gpu.backend)
        blocks, error = [], None
        ceiling = 2 * (gpu.limit_mb or 1024)
        try:
            while len(blocks) * CHUNK_MIB < ceiling:
                blocks.append(alloc())
        except Exception as e:  # the cap (or the device) refused
            error = e
        result["allocated_mb"] = len(blocks) * CHUNK_MIB
        result["stopped_by_oom"] = error is not None and is_oom(error)
        result["error"] = None if error is None else f"{type(error).__name__}: {str(error)[:200]}"
        result["framework_limit_mb"] = _framework_limit_mb(gpu.backend)
        _wait_for_the_others()
        result["hold_start"] = time.time()
        time.sleep(args.hold)  # all processes hold their memory at the same time
        result["hold_end"] = time.time()
        result["peak_mb"] = gpu.peak_mb
        del blocks
    result["seconds"] = round(time.time() - started, 2)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


# -- the parent: launch, watch nvidia-smi, judge ------------------------------------------


class _Tee(io.TextIOBase):
    """Writes the children's prefixed lines to stdout and keeps them."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def write(self, text: str) -> int:
        sys.stdout.write(text)
        self.lines.extend(text.splitlines())
        return len(text)

    def flush(self) -> None:
        sys.stdout.flush()


def _nvidia_smi_used_mb() -> int | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
        return int(out.strip().splitlines()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


class _Sampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.max_used: int | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            used = _nvidia_smi_used_mb()
            if used is not None:
                self.max_used = used if self.max_used is None else max(self.max_used, used)
            self.stop.wait(0.5)


def _pick_backend(requested: str) -> str | None:
    order = ["jax", "torch", "tensorflow"] if requested == "auto" else [requested]
    for name in order:
        if importlib.util.find_spec(name) is not None:
            return name
    return None


def parent(args: argparse.Namespace) -> int:
    from keras_tfr.gpu import _cuda_device_totals_mb
    from keras_tfr.parallel import launch

    backend = _pick_backend(args.backend)
    if backend is None:
        print(f"gpu_check: no importable framework for --backend {args.backend}; nothing to check")
        return 2
    totals = _cuda_device_totals_mb()
    if not totals and not args.cpu_smoke:
        print(
            "gpu_check: the CUDA driver (libcuda) reports no GPU; nothing to check. "
            "(--cpu-smoke runs the same plumbing on the CPU, proving no cap.)"
        )
        return 2
    total = totals[0] if totals else None
    env = {"KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2"}
    if args.cpu_smoke:
        env.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
    print(
        f"gpu_check: {args.processes} processes x {args.gpu_memory_mb} MiB cap, backend "
        f"{backend}, GPU 0 total {total if total is not None else '?'} MiB"
    )
    baseline = _nvidia_smi_used_mb()
    sampler = _Sampler()
    sampler.start()
    tee = _Tee()
    command = [sys.executable, os.path.abspath(__file__), "--child", "--hold", str(args.hold)]
    if not args.train:
        command.append("--no-train")
    with tempfile.TemporaryDirectory() as barrier:
        env["GPU_CHECK_BARRIER"] = barrier
        code = launch(
            command, args.processes, gpu_memory_mb=args.gpu_memory_mb, env=env, output=tee
        )
    sampler.stop.set()
    sampler.join()

    results = []
    for line in tee.lines:
        _, _, rest = line.partition("] ")
        if rest.startswith("RESULT "):
            results.append(json.loads(rest[len("RESULT ") :]))
    results.sort(key=lambda r: r["index"])

    def fmt(v, spec=".0f"):
        return "?" if v is None else format(v, spec)

    print()
    print(
        "proc  backend     cap MiB  framework limit  allocated  peak MiB  stopped by OOM"
        "  device total"
    )
    for r in results:
        print(
            f"[{r['index']}]   {r['backend']:<10}  {fmt(r['cap_mb'], 'd'):>7}  "
            f"{fmt(r['framework_limit_mb']):>15}  {r['allocated_mb']:>9}  "
            f"{fmt(r['peak_mb']):>8}  {r['stopped_by_oom']!s:>14}  "
            f"{fmt(r['device_total_mb'], 'd'):>12}"
        )
    trained = [r for r in results if "train_device" in r]
    for r in trained:
        if r["train_device"] is None:
            print(f"[{r['index']}] not trained: {r['train_error']}")
            continue
        print(
            f"[{r['index']}] trained on {r['train_device']}: loss by epoch {r.get('train_loss')}"
            f" in {r.get('train_seconds')} s"
            + (f"; {r['train_error']}" if r["train_error"] else "")
        )
    failures = []
    if code != 0:
        failures.append(f"the launcher returned {code}")
    if len(results) != args.processes:
        failures.append(f"{len(results)} of {args.processes} processes reported")
    if results:
        together = max(r["hold_start"] for r in results) < min(r["hold_end"] for r in results)
        print(f"all held their memory at the same time: {together}")
        if not together:
            failures.append("the processes did not hold their memory at the same time")
    if baseline is not None and sampler.max_used is not None and results:
        peaks = sum(r["peak_mb"] or r["allocated_mb"] for r in results)
        extra = (sampler.max_used - baseline - peaks) / len(results)
        print(
            f"nvidia-smi: {baseline} MiB used before, {sampler.max_used} MiB at most during; "
            f"beyond the peaks about {extra:.0f} MiB per process (CUDA context, libraries, "
            "allocator slack)"
        )
    if args.cpu_smoke:
        print("CPU smoke run: the plumbing works; no cap is proven without a GPU.")
        return 0 if not failures else 1
    for r in trained:
        if r["train_error"] is not None and r["train_device"] is not None:
            failures.append(f"[{r['index']}] training under the cap failed: {r['train_error']}")
        elif r["train_device"] not in (None, "gpu", "cuda"):
            failures.append(f"[{r['index']}] trained on {r['train_device']}, not on the GPU")
    for r in results:
        cap = r["cap_mb"]
        if not r["stopped_by_oom"]:
            failures.append(
                f"[{r['index']}] allocated {r['allocated_mb']} MiB, twice its cap: not capped"
            )
        elif cap is not None and not (cap / 2 <= r["allocated_mb"] <= cap):
            failures.append(
                f"[{r['index']}] stopped at {r['allocated_mb']} MiB, not between half its "
                "cap and its cap"
            )
    print("PASSED" if not failures else "FAILED:\n  " + "\n  ".join(failures))
    return 0 if not failures else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--processes", type=int, default=3)
    parser.add_argument("--gpu-memory-mb", type=int, default=2048)
    parser.add_argument("--backend", choices=["auto", "jax", "torch", "tensorflow"], default="auto")
    parser.add_argument("--hold", type=float, default=5.0, help="seconds each holds its memory")
    parser.add_argument("--cpu-smoke", action="store_true", help="no GPU: check the plumbing")
    parser.add_argument(
        "--no-train",
        dest="train",
        action="store_false",
        help="skip the small Keras model each process trains under its cap",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    return child(args) if args.child else parent(args)


if __name__ == "__main__":
    sys.exit(main())
