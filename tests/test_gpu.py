"""`limit_gpu_memory` on a CPU machine: arguments, the no-GPU path, the environment
variable, and TensorFlow's refusal once its runtime started (with TensorFlow's own state).

The caps themselves need a GPU: `benchmarks/gpu_check.py` proves them there.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import types

import pytest

from keras_tfr import gpu as gpu_module
from keras_tfr import limit_gpu_memory
from keras_tfr.gpu import ENV_FRACTION, ENV_MEGABYTES, GpuMemoryError

PY = sys.executable


@pytest.fixture(autouse=True)
def _no_cap_in_environment(monkeypatch):
    monkeypatch.delenv(ENV_MEGABYTES, raising=False)
    monkeypatch.delenv(ENV_FRACTION, raising=False)


@pytest.fixture
def no_gpu():
    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        pytest.skip("this machine has a GPU: see benchmarks/gpu_check.py")


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **env}
    for name in (ENV_MEGABYTES, ENV_FRACTION):
        if name not in env:
            full_env.pop(name, None)
    return subprocess.run(
        [PY, "-c", textwrap.dedent(code)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
    )


# -- arguments (checked before any framework is touched) ---------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((1024,), {"fraction": 0.5}, ValueError, "only one of .*megabytes, fraction"),
        ((1024,), {"growth": True}, ValueError, "only one of .*megabytes, growth"),
        ((), {"fraction": 0.5, "growth": True}, ValueError, "fraction, growth"),
        ((0,), {}, ValueError, "`megabytes` to be a positive whole number"),
        ((-5,), {}, ValueError, "`megabytes`"),
        ((1.5,), {}, ValueError, r"Received: 1\.5"),
        ((float("nan"),), {}, ValueError, "`megabytes`"),
        (("1024",), {}, TypeError, "`megabytes` to be a positive int"),
        ((True,), {}, TypeError, "`megabytes`"),
        ((), {"fraction": 0.0}, ValueError, r"`fraction` to be in \(0, 1\]"),
        ((), {"fraction": 1.5}, ValueError, "`fraction`"),
        ((), {"fraction": "half"}, TypeError, "`fraction`"),
        ((), {"growth": "yes"}, TypeError, "`growth`"),
        ((), {}, ValueError, "KERAS_TFR_GPU_MEMORY_MB.*Received none"),
        ((1024,), {"devices": "0"}, TypeError, "`devices`"),
        ((1024,), {"devices": [-1]}, ValueError, "`devices`"),
        ((1024,), {"devices": [0, 0]}, ValueError, "distinct"),
        ((1024,), {"devices": []}, ValueError, "non-empty"),
        ((1024,), {"devices": [0.0]}, ValueError, "`devices`"),
    ],
)
def test_argument_checking(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        limit_gpu_memory(*args, **kwargs)


def test_decorator_needs_its_arguments():
    with pytest.raises(TypeError, match=r"@limit_gpu_memory\(1024\)"):

        @limit_gpu_memory
        def train():
            pass


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({ENV_MEGABYTES: "1GB"}, "KERAS_TFR_GPU_MEMORY_MB to be a whole number"),
        ({ENV_MEGABYTES: "0"}, "KERAS_TFR_GPU_MEMORY_MB"),
        ({ENV_FRACTION: "2"}, r"KERAS_TFR_GPU_MEMORY_FRACTION` to be in \(0, 1\]"),
        ({ENV_FRACTION: "a quarter"}, "KERAS_TFR_GPU_MEMORY_FRACTION to be a number"),
        ({ENV_MEGABYTES: "10", ENV_FRACTION: "0.5"}, "only one of the environment variables"),
    ],
)
def test_invalid_environment_variable(monkeypatch, env, match):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        limit_gpu_memory()


# -- the no-GPU path ---------------------------------------------------------------------


def test_no_gpu_does_nothing_and_logs_one_line(no_gpu, caplog):
    import tensorflow as tf

    before = tf.config.get_logical_device_configuration(tf.config.list_physical_devices("CPU")[0])
    with caplog.at_level(logging.INFO, logger="keras_tfr.gpu"), limit_gpu_memory(1024) as gpu:
        total = tf.reduce_sum(tf.ones([4, 4])).numpy()
    assert total == 16.0  # the framework still works normally inside the block
    records = [r for r in caplog.records if r.name == "keras_tfr.gpu"]
    assert len(records) == 1
    assert records[0].getMessage() == (
        "limit_gpu_memory: no GPU visible to TensorFlow; running without a GPU memory limit."
    )
    assert gpu.devices == []
    assert gpu.peak_mb is None
    assert gpu.megabytes == 1024 and gpu.backend == "tensorflow"
    assert "no GPU" in gpu.report()
    after = tf.config.get_logical_device_configuration(tf.config.list_physical_devices("CPU")[0])
    assert after == before


def test_no_gpu_plain_call_and_decorator(no_gpu, caplog):
    with caplog.at_level(logging.INFO, logger="keras_tfr.gpu"):
        limit = limit_gpu_memory(fraction=0.25)
        assert limit.devices == [] and limit.peak_mb is None and limit.fraction == 0.25

        @limit_gpu_memory(growth=True)
        def train(a, b=1):
            """Docstring kept."""
            return a + b

        assert train(2, b=3) == 5
        assert train(1) == 2
        assert train.__name__ == "train" and train.__doc__ == "Docstring kept."
    # One line per limit made: the plain call and the decorator (calls log nothing more).
    assert len([r for r in caplog.records if r.name == "keras_tfr.gpu"]) == 2


def test_environment_variable_is_the_default(monkeypatch, no_gpu):
    monkeypatch.setenv(ENV_MEGABYTES, "768")
    assert limit_gpu_memory().megabytes == 768
    assert limit_gpu_memory(256).megabytes == 256  # explicit arguments win
    monkeypatch.delenv(ENV_MEGABYTES)
    monkeypatch.setenv(ENV_FRACTION, "0.125")
    limit = limit_gpu_memory()
    assert limit.fraction == 0.125 and limit.megabytes is None


@pytest.mark.subprocess
def test_import_imports_nothing_heavy_without_a_cap_and_checks_a_cap():
    show = """
        import sys
        import keras_tfr
        from keras_tfr import gpu
        limit = gpu._ENVIRONMENT_LIMIT
        print("tensorflow" in sys.modules, None if limit is None else limit.megabytes)
    """
    without = _run(show)
    assert without.returncode == 0, without.stderr
    assert without.stdout.split() == ["False", "None"]
    # With a valid cap: `test_launcher_caps_each_child_through_import`.
    bad = _run(show, **{ENV_MEGABYTES: "lots"})
    assert bad.returncode == 1
    assert "ValueError: Expected the environment variable KERAS_TFR_GPU_MEMORY_MB" in bad.stderr


@pytest.mark.subprocess
def test_launcher_caps_each_child_through_import():
    import io

    from keras_tfr.parallel import launch

    out = io.StringIO()
    code = launch(
        [
            PY,
            "-c",
            "import keras_tfr; from keras_tfr import gpu; "
            "print(gpu._ENVIRONMENT_LIMIT.megabytes, gpu._ENVIRONMENT_LIMIT.backend)",
        ],
        2,
        gpu_memory_mb=300,
        env={"TF_CPP_MIN_LOG_LEVEL": "2"},
        output=out,
    )
    assert code == 0, out.getvalue()
    lines = sorted(x for x in out.getvalue().splitlines() if x.endswith(" tensorflow"))
    assert lines == ["[0] 300 tensorflow", "[1] 300 tensorflow"]


# -- TensorFlow refuses changes once started: its real behaviour, our translation --------


@pytest.mark.subprocess
def test_tensorflow_already_initialized_error():
    # TensorFlow raises only for devices that exist, and here only the CPU does; its
    # logical-device rules are the same as for a GPU (no memory_limit on a CPU, though).
    result = _run(
        """
        import tensorflow as tf
        from keras_tfr.gpu import GpuMemoryError, _tf_set
        cpu = tf.config.list_physical_devices("CPU")[0]
        two = [tf.config.LogicalDeviceConfiguration()] * 2
        _tf_set(tf, cpu, logical=two)          # before the runtime starts: accepted
        try:
            _tf_set(tf, cpu, growth=True)      # a second kind of setting: refused
        except GpuMemoryError as e:
            print("GROWTH:", e)
        print("SUM:", tf.reduce_sum(tf.ones([3])).numpy())   # the runtime starts here
        _tf_set(tf, cpu, logical=two)          # the same setting again: accepted
        try:
            _tf_set(tf, cpu, logical=two + two[:1])
        except GpuMemoryError as e:
            print("CAUSE:", type(e.__cause__).__name__, e.__cause__)
            print("ERROR:", e)
        print("DEVICES:", len(tf.config.list_logical_devices("CPU")))
        """
    )
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines())
    assert lines["SUM"] == "3.0"
    assert lines["DEVICES"] == "2"  # the refused change did not happen
    assert lines["CAUSE"] == (
        "RuntimeError Virtual devices cannot be modified after being initialized"
    )
    error = lines["ERROR"]
    assert "TensorFlow already initialized /physical_device:CPU:0 with 2 logical device" in error
    assert "cannot change or undo" in error
    assert "at the top of the program" in error and ENV_MEGABYTES in error
    assert "already has a memory limit" in lines["GROWTH"]


@pytest.mark.subprocess
def test_unsupported_backend_is_named():
    result = _run(
        """
        from keras_tfr import limit_gpu_memory
        try:
            limit_gpu_memory(100)
        except ValueError as e:
            print(e)
        """,
        KERAS_BACKEND="numpy",
    )
    assert result.returncode == 0, result.stderr
    assert "Received backend: 'numpy'" in result.stdout


# -- JAX and the fraction: the pure parts, no JAX needed ---------------------------------


def test_jax_environment():
    env = gpu_module._jax_environment
    assert env(None, None, True, [1000]) == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    assert env(None, 0.25, False, None) == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.25"}
    # megabytes -> a fraction of the largest GPU, so that no GPU gets more than asked.
    assert env(1024, None, False, [40960, 81920]) == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.0125"}
    text = env(1000, None, False, [3000])["XLA_PYTHON_CLIENT_MEM_FRACTION"]
    assert text == "0.333333"  # rounded down, never up
    assert float(text) * 3000 <= 1000
    with pytest.raises(ValueError, match="at most the GPU's total memory of 3000 MiB"):
        env(4000, None, False, [3000])
    with pytest.raises(GpuMemoryError, match="Pass `fraction` instead"):
        env(1024, None, False, None)


@pytest.mark.subprocess
def test_jax_started_error_with_jax_own_state():
    pytest.importorskip("jax")
    result = _run(
        """
        import os
        import jax
        from keras_tfr.gpu import GpuMemoryError, _check_jax_not_started, _jax_started
        wanted = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.25"}
        print("BEFORE:", _jax_started())
        _check_jax_not_started(wanted)       # not started: accepted
        jax.numpy.ones(3).block_until_ready()  # JAX starts its backends here
        print("AFTER:", _jax_started())
        try:
            _check_jax_not_started(wanted)
        except GpuMemoryError as e:
            print("ERROR:", e)
        os.environ.update(wanted)            # as if set before JAX started
        _check_jax_not_started(wanted)
        print("SAME: accepted")
        """,
        XLA_PYTHON_CLIENT_MEM_FRACTION="",
        JAX_PLATFORMS="cpu",
    )
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines())
    assert lines["BEFORE"] == "False" and lines["AFTER"] == "True"
    assert "JAX already started its backends" in lines["ERROR"]
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION only when it starts" in lines["ERROR"]
    assert lines["SAME"] == "accepted"


@pytest.mark.subprocess
def test_jax_backend_without_gpu_sets_nothing():
    pytest.importorskip("jax")
    result = _run(
        """
        import logging, os, sys
        logging.basicConfig(level=logging.INFO, format="LOG: %(message)s", stream=sys.stdout)
        from keras_tfr import limit_gpu_memory
        with limit_gpu_memory(512) as gpu:
            import keras
            print("SUM:", float(keras.ops.sum(keras.ops.ones(4))))
        print("STATE:", gpu.backend, gpu.devices, gpu.peak_mb,
              os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"), gpu.tensorflow_gpus)
        """,
        KERAS_BACKEND="jax",
        JAX_PLATFORMS="cpu",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "LOG: limit_gpu_memory: no GPU visible to JAX; running without a GPU memory limit.",
        "SUM: 4.0",
        "STATE: jax [] None None no-gpu",  # TensorFlow sees no GPU here either
    ]


def test_limit_per_device_from_megabytes_or_fraction():
    per_device = gpu_module._limit_for_total
    mb = types.SimpleNamespace(megabytes=2048, fraction=None)
    fr = types.SimpleNamespace(megabytes=None, fraction=0.3)
    assert per_device(mb, 81920, "GPU:0") == 2048
    assert per_device(mb, None, "GPU:0") == 2048  # no total needed for megabytes
    assert per_device(fr, 81920, "GPU:0") == 24576
    with pytest.raises(ValueError, match="GPU:1's total memory of 1024 MiB"):
        per_device(mb, 1024, "GPU:1")
    with pytest.raises(GpuMemoryError, match="Pass `megabytes` instead"):
        per_device(fr, None, "GPU:0")


class _FakeLibcuda:
    """The four driver calls `_cuda_device_totals_mb` makes, over made-up devices."""

    def __init__(self, totals_bytes, init_rc=0, failing_call=None):
        self.totals_bytes = totals_bytes
        self.init_rc = init_rc
        self.failing_call = failing_call

    def cuInit(self, flags):
        assert flags == 0
        return self.init_rc

    def cuDeviceGetCount(self, count):
        count._obj.value = len(self.totals_bytes)
        return 1 if self.failing_call == "count" else 0

    def cuDeviceGet(self, device, ordinal):
        device._obj.value = 100 + ordinal  # a handle, not the ordinal: must be passed on
        return 1 if self.failing_call == "get" else 0

    def cuDeviceTotalMem_v2(self, size, device):
        size._obj.value = self.totals_bytes[device.value - 100]
        return 1 if self.failing_call == "total" else 0


def _with_fake_driver(monkeypatch, lib, loadable=("libcuda.so.1",)):
    import ctypes

    opened = []

    def load(name):
        opened.append(name)
        if name not in loadable:
            raise OSError(f"{name}: cannot open shared object file")
        return lib

    fake_ctypes = types.SimpleNamespace(
        CDLL=load, c_int=ctypes.c_int, c_size_t=ctypes.c_size_t, byref=ctypes.byref
    )
    if sys.platform == "win32":
        pytest.skip("the fake stands in for Linux's libcuda")
    monkeypatch.setattr(gpu_module, "ctypes", fake_ctypes)
    return opened


def test_cuda_driver_query_reads_each_device_in_mib(monkeypatch):
    gib = 1 << 30
    lib = _FakeLibcuda([80 * gib, 16 * gib + 5, (1 << 20) - 1])
    opened = _with_fake_driver(monkeypatch, lib, loadable=("libcuda.so",))
    # Whole MiB, rounded down, one per device in ordinal order.
    assert gpu_module._cuda_device_totals_mb() == [81920, 16384, 0]
    assert opened == ["libcuda.so.1", "libcuda.so"]  # the versioned name first


@pytest.mark.parametrize(
    ("lib", "loadable"),
    [
        (_FakeLibcuda([1 << 30]), ()),  # no driver library at all
        (_FakeLibcuda([], init_rc=100), ("libcuda.so.1",)),  # CUDA_ERROR_NO_DEVICE
        (_FakeLibcuda([1 << 30], failing_call="count"), ("libcuda.so.1",)),
        (_FakeLibcuda([1 << 30], failing_call="get"), ("libcuda.so.1",)),
        (_FakeLibcuda([1 << 30], failing_call="total"), ("libcuda.so.1",)),
    ],
)
def test_cuda_driver_query_says_none_when_the_driver_cannot_answer(monkeypatch, lib, loadable):
    _with_fake_driver(monkeypatch, lib, loadable)
    assert gpu_module._cuda_device_totals_mb() is None


def _libcuda_or_none():
    """This machine's CUDA driver library, opened independently of the code under test."""
    import ctypes

    for name in ("libcuda.so.1", "libcuda.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def test_cuda_driver_query_without_a_context():
    if not sys.platform.startswith("linux"):
        pytest.skip("the precondition below checks Linux's libcuda names")
    totals = gpu_module._cuda_device_totals_mb()
    lib = _libcuda_or_none()
    if lib is None:
        # This machine has no CUDA driver: the answer must be exactly None (not [] or 0).
        assert totals is None
        return
    if lib.cuInit(0) != 0:  # a driver library without a usable device
        assert totals is None
        return
    assert isinstance(totals, list) and totals and all(t > 0 for t in totals)
    torch = pytest.importorskip("torch", reason="torch's totals are the reference")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here: no reference for the totals")
    expected = [
        torch.cuda.get_device_properties(i).total_memory // (1 << 20)
        for i in range(torch.cuda.device_count())
    ]
    assert totals == expected


@pytest.mark.subprocess
def test_gpu_check_runs_trains_and_reports_on_the_cpu():
    """`benchmarks/gpu_check.py --cpu-smoke`: the launcher's capped children train a Keras
    model, fill their share and hold it together, and the parent reads their results."""
    script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks", "gpu_check.py")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    for name in (ENV_MEGABYTES, ENV_FRACTION):
        env.pop(name, None)
    args = ["--cpu-smoke", "-n", "2", "--gpu-memory-mb", "128", "--hold", "0.2", "--backend"]
    done = subprocess.run(
        [PY, script, *args, "jax"], env=env, capture_output=True, text=True, timeout=300
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    trained = [line for line in out.splitlines() if " trained on cpu: loss by epoch [" in line]
    assert sorted(line[:3] for line in trained) == ["[0]", "[1]"], out
    assert "all held their memory at the same time: True" in out
    # Each child filled twice its cap (nothing caps the CPU) and said so.
    assert out.count('"allocated_mb": 256') == 2, out
