"""`keep_tensorflow_off_gpus`: TensorFlow gets no GPU under the JAX and torch backends.

This machine has no GPU, so TensorFlow's device calls are replaced by a fake that keeps
TensorFlow's rules (``set_visible_devices`` refuses a change once the runtime started).
The subprocess tests run each Keras backend for real; the last one checks our translation
of TensorFlow's own refusal, with the CPU standing in for a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
from _results import result_of

from keras_tfr import gpu as gpu_module
from keras_tfr import limit_gpu_memory
from keras_tfr.gpu import ENV_TF_GPU, TensorFlowGpuWarning, keep_tensorflow_off_gpus

PY = sys.executable
REFUSAL = "Visible devices cannot be modified after being initialized"  # TensorFlow's text


class FakeConfig:
    """``tf.config``'s device calls with TensorFlow's rules, over a made-up device list."""

    def __init__(self, gpus: int = 2, visible: int | None = None, started: bool = False):
        self.gpus = [f"/physical_device:GPU:{i}" for i in range(gpus)]
        self.visible = list(self.gpus if visible is None else self.gpus[:visible])
        self.started = started
        self.calls: list[tuple] = []

    def list_physical_devices(self, device_type=None):
        self.calls.append(("list_physical_devices", device_type))
        assert device_type == "GPU"
        return list(self.gpus)

    def get_visible_devices(self, device_type=None):
        self.calls.append(("get_visible_devices", device_type))
        assert device_type == "GPU"
        return list(self.visible)

    def set_visible_devices(self, devices, device_type=None):
        self.calls.append(("set_visible_devices", list(devices), device_type))
        if devices == self.visible:
            return  # TensorFlow accepts a repeat of the current setting
        if self.started:
            raise RuntimeError(REFUSAL)
        self.visible = list(devices)


@pytest.fixture
def fresh(monkeypatch):
    """A process in which nothing was decided yet and the opt-out is unset."""
    monkeypatch.setattr(gpu_module, "_TF_GPUS", None)
    monkeypatch.delenv(ENV_TF_GPU, raising=False)
    monkeypatch.delenv(gpu_module.ENV_MEGABYTES, raising=False)
    monkeypatch.delenv(gpu_module.ENV_FRACTION, raising=False)


def _use(monkeypatch, backend: str, config: FakeConfig) -> list[str]:
    """Makes `backend` the Keras backend and `config` TensorFlow's devices; returns the
    list of backend reads (to show that a second call decides nothing again)."""
    import tensorflow as tf

    reads: list[str] = []

    def read_backend() -> str:
        reads.append(backend)
        return backend

    monkeypatch.setattr(gpu_module, "_keras_backend", read_backend)
    for name in ("list_physical_devices", "get_visible_devices", "set_visible_devices"):
        monkeypatch.setattr(tf.config, name, getattr(config, name))
    return reads


# -- the decision, in this process --------------------------------------------------------


@pytest.mark.parametrize("backend", ["jax", "torch", "numpy"])
def test_hides_the_gpus_under_other_backends_once(fresh, monkeypatch, caplog, backend):
    config = FakeConfig(gpus=2)
    reads = _use(monkeypatch, backend, config)
    with caplog.at_level("INFO", logger="keras_tfr.gpu"):
        assert keep_tensorflow_off_gpus() == "hidden"
    assert config.visible == []
    assert config.calls == [
        ("list_physical_devices", "GPU"),
        ("get_visible_devices", "GPU"),
        ("set_visible_devices", [], "GPU"),
    ]
    assert [r.getMessage() for r in caplog.records if r.name == "keras_tfr.gpu"] == [
        f"keras-tfr: hid 2 GPU(s) from TensorFlow: Keras trains on "
        f"{gpu_module._BACKEND_NAMES.get(backend, backend)}, and the tf.data pipeline runs "
        "on the CPU (KERAS_TFR_TF_GPU=1 keeps them)."
    ]
    # The second call answers from memory: no backend read, no TensorFlow call.
    assert keep_tensorflow_off_gpus() == "hidden"
    assert len(reads) == 1 and len(config.calls) == 3


def test_tensorflow_backend_keeps_its_devices(fresh, monkeypatch):
    config = FakeConfig(gpus=2)
    _use(monkeypatch, "tensorflow", config)
    monkeypatch.setenv(ENV_TF_GPU, "not read with the TensorFlow backend")
    assert keep_tensorflow_off_gpus() == "tensorflow-backend"
    assert config.calls == []  # not even a query
    assert config.visible == config.gpus


def test_already_started_tensorflow_gets_one_clear_warning(fresh, monkeypatch):
    config = FakeConfig(gpus=1, started=True)
    _use(monkeypatch, "jax", config)
    with pytest.warns(TensorFlowGpuWarning) as record:
        assert keep_tensorflow_off_gpus() == "too-late"
    assert len(record) == 1
    message = str(record[0].message)
    assert message.startswith(
        "keras-tfr could not hide the GPUs from TensorFlow: TensorFlow already started on "
        f"['/physical_device:GPU:0'] in this process ({REFUSAL}), so it holds GPU memory "
        "that the Keras JAX backend now lacks"
    )
    assert "Fix the call order" in message
    assert "keep_tensorflow_off_gpus()" in message and "limit_gpu_memory" in message
    assert "tf.config.set_visible_devices([], 'GPU')` right after `import tensorflow`" in message
    assert f"Set {ENV_TF_GPU}=1 if TensorFlow is meant to use the GPUs" in message
    assert config.visible == config.gpus  # TensorFlow refused; nothing changed
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would fail here
        assert keep_tensorflow_off_gpus() == "too-late"


@pytest.mark.parametrize("value", ["1", "true", " TRUE ", "yes"])
def test_opt_out_keeps_tensorflow_on_the_gpus(fresh, monkeypatch, value):
    config = FakeConfig(gpus=2)
    _use(monkeypatch, "jax", config)
    monkeypatch.setenv(ENV_TF_GPU, value)
    assert keep_tensorflow_off_gpus() == "opted-out"
    assert config.calls == [] and config.visible == config.gpus


@pytest.mark.parametrize("value", ["0", "false", "", "No"])
def test_opt_out_off_values_hide(fresh, monkeypatch, value):
    config = FakeConfig(gpus=1)
    _use(monkeypatch, "torch", config)
    monkeypatch.setenv(ENV_TF_GPU, value)
    assert keep_tensorflow_off_gpus() == "hidden"
    assert config.visible == []


def test_invalid_opt_out_is_named(fresh, monkeypatch):
    config = FakeConfig(gpus=1)
    _use(monkeypatch, "jax", config)
    monkeypatch.setenv(ENV_TF_GPU, "maybe")
    with pytest.raises(ValueError, match=r"KERAS_TFR_TF_GPU to be 1 .*Received: 'maybe'"):
        keep_tensorflow_off_gpus()
    assert config.calls == [] and gpu_module._TF_GPUS is None  # nothing decided


@pytest.mark.parametrize(
    ("config", "expected"),
    [(FakeConfig(gpus=0), "no-gpu"), (FakeConfig(gpus=2, visible=0), "already-hidden")],
)
def test_nothing_to_hide(fresh, monkeypatch, config, expected):
    _use(monkeypatch, "jax", config)
    assert keep_tensorflow_off_gpus() == expected
    assert not [c for c in config.calls if c[0] == "set_visible_devices"]


def test_without_tensorflow(fresh, monkeypatch):
    monkeypatch.setattr(gpu_module, "_keras_backend", lambda: "torch")
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # `import tensorflow` fails
    assert keep_tensorflow_off_gpus() == "no-tensorflow"


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_limit_gpu_memory_applies_it(fresh, monkeypatch, backend):
    if backend == "torch":
        pytest.importorskip("torch", reason="torch is in the dev extra (torch==2.13.0)")
    config = FakeConfig(gpus=1)
    _use(monkeypatch, backend, config)
    limit = limit_gpu_memory(512)
    assert limit.tensorflow_gpus == "hidden" and config.visible == []
    assert limit.devices == []  # no GPU for JAX or torch on this machine
    assert limit.report() == (
        f"limit_gpu_memory: no GPU ({backend}); no limit; TensorFlow GPUs: hidden"
    )


# -- the TensorFlow backend's cap, over made-up GPUs -----------------------------------------

_MIB = 1 << 20


class FakeGpus:
    """TensorFlow's GPU memory calls over made-up GPUs, with TensorFlow's rules
    (``tensorflow/python/eager/context.py``): a repeat of the current setting is accepted,
    a change after the runtime started is refused, and memory growth is refused on a GPU
    with a logical device configuration, even before the runtime starts."""

    def __init__(self, gpus: int = 2, hidden: tuple[int, ...] = (), started: bool = False):
        import tensorflow as tf

        self.gpus = [
            tf.config.PhysicalDevice(name=f"/physical_device:GPU:{i}", device_type="GPU")
            for i in range(gpus)
        ]
        self.visible = [g for i, g in enumerate(self.gpus) if i not in hidden]
        self.logical: dict = {}
        self.growth: dict = {}
        self.started = started
        self.peaks: dict[str, int] = {}
        self.calls: list[tuple] = []

    def list_physical_devices(self, device_type=None):
        assert device_type == "GPU"
        return list(self.gpus)

    def get_visible_devices(self, device_type=None):
        assert device_type == "GPU"
        return list(self.visible)

    def set_logical_device_configuration(self, device, logical_devices):
        self.calls.append(("logical", device.name[-5:], [c.memory_limit for c in logical_devices]))
        if self.logical.get(device) == logical_devices:
            return
        if self.started:
            raise RuntimeError("Virtual devices cannot be modified after being initialized")
        self.logical[device] = logical_devices

    def get_logical_device_configuration(self, device):
        return self.logical.get(device)

    def set_memory_growth(self, device, enable):
        self.calls.append(("growth", device.name[-5:], enable))
        if device in self.logical:
            raise ValueError("Cannot set memory growth on device when virtual devices configured")
        if self.growth.get(device) == enable:
            return
        if self.started:
            raise RuntimeError("Physical devices cannot be modified after being initialized")
        self.growth[device] = enable

    def get_memory_growth(self, device):
        return self.growth.get(device)

    def get_memory_info(self, device):
        return {"current": 0, "peak": self.peaks.get(device, 0)}

    def reset_memory_stats(self, device):
        self.calls.append(("reset", device))


@pytest.fixture
def tf_gpus(fresh, monkeypatch):
    """Makes TensorFlow the backend; ``tf_gpus(...)`` installs a `FakeGpus` and the
    driver's totals (MiB per GPU, or None: no driver answer)."""
    import tensorflow as tf

    monkeypatch.setattr(gpu_module, "_keras_backend", lambda: "tensorflow")
    monkeypatch.setattr(gpu_module, "_ENVIRONMENT_LIMIT", None)
    monkeypatch.setattr(gpu_module, "_JAX_SET", {})
    for name in gpu_module._JAX_VARIABLES:
        monkeypatch.setenv(name, "")  # so that teardown restores it, or its absence
        monkeypatch.delenv(name)

    def install(totals=(16384, 8192), **kwargs) -> FakeGpus:
        fake = FakeGpus(**kwargs)
        for name in (
            "list_physical_devices",
            "get_visible_devices",
            "set_logical_device_configuration",
            "get_logical_device_configuration",
        ):
            monkeypatch.setattr(tf.config, name, getattr(fake, name))
        for name in ("set_memory_growth", "get_memory_growth", "get_memory_info"):
            monkeypatch.setattr(tf.config.experimental, name, getattr(fake, name))
        monkeypatch.setattr(tf.config.experimental, "reset_memory_stats", fake.reset_memory_stats)
        monkeypatch.setattr(
            gpu_module, "_cuda_device_totals_mb", lambda: None if totals is None else list(totals)
        )
        return fake

    return install


def test_tensorflow_one_logical_device_per_gpu(tf_gpus):
    fake = tf_gpus()
    gpu = limit_gpu_memory(1024)
    assert fake.calls == [("logical", "GPU:0", [1024]), ("logical", "GPU:1", [1024])]
    assert gpu.devices == ["GPU:0", "GPU:1"] and gpu.total_mb == [16384, 8192]
    assert gpu.limit_mb == 1024 and gpu.tensorflow_gpus == "tensorflow-backend"


def test_tensorflow_fraction_of_each_gpu_from_the_driver(tf_gpus):
    fake = tf_gpus(totals=(16384, 8192))
    gpu = limit_gpu_memory(fraction=0.25)
    assert fake.calls == [("logical", "GPU:0", [4096]), ("logical", "GPU:1", [2048])]
    assert gpu.limit_mb == 2048  # the smallest over the GPUs
    tf_gpus(totals=None)
    with pytest.raises(gpu_module.GpuMemoryError, match="Pass `megabytes` instead"):
        limit_gpu_memory(fraction=0.25)


def test_tensorflow_devices_by_physical_index_named_as_logical(tf_gpus):
    # GPU:0 is hidden from TensorFlow, so physical GPU 2 is TensorFlow's logical GPU:1.
    fake = tf_gpus(totals=(100, 200, 300), gpus=3, hidden=(0,))
    gpu = limit_gpu_memory(50, devices=[2])
    assert fake.calls == [("logical", "GPU:2", [50])]
    assert gpu.devices == ["GPU:1"] and gpu.total_mb == [300]
    with pytest.raises(ValueError, match=r"index the 3 GPU\(s\) visible to TensorFlow"):
        limit_gpu_memory(50, devices=[3])


def test_tensorflow_growth_applies_to_every_visible_gpu(tf_gpus):
    fake = tf_gpus(gpus=3, hidden=(2,))
    gpu = limit_gpu_memory(growth=True, devices=[0])
    # TensorFlow requires one growth setting for all visible GPUs: `devices` cannot narrow it.
    assert fake.calls == [("growth", "GPU:0", True), ("growth", "GPU:1", True)]
    assert gpu.devices == ["GPU:0"] and gpu.limit_mb is None


def test_tensorflow_peak_is_logged_then_reset(tf_gpus, caplog):
    fake = tf_gpus()
    with caplog.at_level("INFO", logger="keras_tfr.gpu"):
        with limit_gpu_memory(1024) as gpu:
            fake.peaks.update({"GPU:0": 300 * _MIB, "GPU:1": 700 * _MIB})
            assert gpu.peak_mb == 700
        fake.peaks.clear()  # as after the reset
    assert fake.calls[2:] == [("reset", "GPU:0"), ("reset", "GPU:1")]
    assert gpu.peak_mb == 700  # the block's peak, kept after the reset
    assert [r.getMessage() for r in caplog.records if r.name == "keras_tfr.gpu"] == [
        "limit_gpu_memory: tensorflow on GPU:0, GPU:1: limit 1024 MiB, peak 700 MiB, "
        "device total 16384, 8192 MiB"
    ]
    assert fake.logical  # leaving the block does not lift TensorFlow's cap


def test_tensorflow_no_gpu_ignores_devices(tf_gpus):
    fake = tf_gpus(gpus=0, totals=None)
    gpu = limit_gpu_memory(1024, devices=[5])
    assert gpu.devices == [] and gpu.peak_mb is None and fake.calls == []


def test_tensorflow_calls_after_the_environment_cap(tf_gpus, monkeypatch):
    fake = tf_gpus()
    monkeypatch.setattr(gpu_module, "_backend_is_settled", lambda: True)
    monkeypatch.setenv(gpu_module.ENV_MEGABYTES, "512")
    assert gpu_module._limit_from_environment().limit_mb == 512
    assert [c for c in fake.calls if c[0] == "logical"][-2:] == [
        ("logical", "GPU:0", [512]),
        ("logical", "GPU:1", [512]),
    ]
    # Before TensorFlow starts, megabytes or fraction replace the limit...
    assert limit_gpu_memory(256).limit_mb == 256
    assert [c[0].memory_limit for c in fake.logical.values()] == [256, 256]
    # ...but TensorFlow refuses memory growth on a GPU with a limit.
    with pytest.raises(gpu_module.GpuMemoryError) as error:
        limit_gpu_memory(growth=True)
    assert str(error.value).startswith(
        "`growth=True` cannot apply to /physical_device:GPU:0: it already has a memory "
        "limit ([256] MiB), from an earlier limit_gpu_memory call or the environment "
        "variable KERAS_TFR_GPU_MEMORY_MB/KERAS_TFR_GPU_MEMORY_FRACTION."
    )
    fake.started = True  # once TensorFlow started, no change at all
    assert limit_gpu_memory(256).limit_mb == 256  # the same setting is accepted
    with pytest.raises(gpu_module.GpuMemoryError, match="TensorFlow already initialized"):
        limit_gpu_memory(128)


# -- the entry points call it before they run TensorFlow ----------------------------------


class _Called(Exception):
    """Raised by the stand-in: the entry point called it before doing anything else."""


def _entry_points():
    from keras_tfr import source, tfrecords

    return {
        "from_tfrecords": lambda: tfrecords.from_tfrecords("no-such-*.tfrecord"),
        "convert_tfrecords": lambda: tfrecords.convert_tfrecords("no-such-*", "out"),
        "TFRecordSequenceSource": lambda: source.TFRecordSequenceSource("no-such-dir", 4),
    }


@pytest.mark.parametrize(
    "name",
    [
        "from_tfrecords",
        "convert_tfrecords",
        "TFRecordSequenceSource",
    ],
)
def test_entry_points_call_it_first(monkeypatch, name):
    def stand_in():
        raise _Called

    # The entry points import it from keras_tfr.gpu when called, so this replaces it.
    monkeypatch.setattr(gpu_module, "keep_tensorflow_off_gpus", stand_in)
    with pytest.raises(_Called):
        _entry_points()[name]()


# -- each backend for real, in its own process --------------------------------------------

_SCRIPT = """
    import json, sys
    import keras
    import tensorflow as tf
    from tensorflow.python.eager import context
    from keras_tfr import gpu, limit_gpu_memory

    # This machine has no GPU: one made-up GPU in TensorFlow's device calls.
    real = {n: getattr(tf.config, n) for n in
            ("list_physical_devices", "get_visible_devices", "set_visible_devices")}
    fake = tf.config.PhysicalDevice(name="/physical_device:GPU:0", device_type="GPU")
    visible, calls = [fake], []

    def list_physical_devices(device_type=None):
        return [fake] if device_type == "GPU" else real["list_physical_devices"](device_type)

    def get_visible_devices(device_type=None):
        return list(visible) if device_type == "GPU" else real["get_visible_devices"](device_type)

    def set_visible_devices(devices, device_type=None):
        calls.append([list(devices), device_type])
        visible[:] = devices

    tf.config.list_physical_devices = list_physical_devices
    tf.config.get_visible_devices = get_visible_devices
    tf.config.set_visible_devices = set_visible_devices

    out = {"backend": keras.config.backend()}
    if out["backend"] == "tensorflow":
        out["first"] = gpu.keep_tensorflow_off_gpus()
    else:
        # These call no keep_tensorflow_off_gpus, as they start no TensorFlow runtime
        # (checked below): plain and GZIP writing, verify, tf.data service servers.
        import numpy as np
        from keras_tfr import ArraysToRecords, verify
        from keras_tfr.distribute import start_service

        x = np.arange(96, dtype=np.float32).reshape(32, 3)
        for compression in (None, "GZIP"):
            path = f"{sys.argv[1]}/{compression}"
            ArraysToRecords.from_arrays(x, x, path, compression=compression, verbose=0)
            assert verify(path).ok
        start_service(1).stop()
        assert gpu._TF_GPUS is None and calls == []  # nothing decided yet
        out["first"] = limit_gpu_memory(512).tensorflow_gpus  # which must apply it
    out["second"] = gpu.keep_tensorflow_off_gpus()
    out["calls"] = calls
    out["visible"] = [d.name for d in visible]
    out["tensorflow_started"] = context.context()._context_handle is not None
    for name, fn in real.items():
        setattr(tf.config, name, fn)

    # TensorFlow's own refusal once started, with the CPU standing in for a GPU.
    class CpuAsGpu:
        def list_physical_devices(self, device_type):
            return tf.config.list_physical_devices("CPU")

        def get_visible_devices(self, device_type):
            return tf.config.get_visible_devices("CPU")

        def set_visible_devices(self, devices, device_type):
            tf.config.set_visible_devices(devices, "CPU")

    out["sum"] = float(tf.reduce_sum(tf.ones([3])).numpy())  # TensorFlow starts here
    out["late"] = list(gpu._hide_tensorflow_gpus(CpuAsGpu(), out["backend"]))
    out["cpus"] = len(tf.config.list_logical_devices("CPU"))
    print("RESULT " + json.dumps(out))
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
def test_each_backend_in_its_own_process(backend, tmp_path):
    pytest.importorskip(backend, reason=f"the {backend} backend is not installed")
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2"}
    for name in (ENV_TF_GPU, gpu_module.ENV_MEGABYTES, gpu_module.ENV_FRACTION):
        env.pop(name, None)
    if backend == "jax":
        env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(
        [PY, "-c", textwrap.dedent(_SCRIPT), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = result_of(result)
    assert out["backend"] == backend
    if backend == "tensorflow":
        assert out["first"] == out["second"] == "tensorflow-backend"
        assert out["calls"] == [] and out["visible"] == ["/physical_device:GPU:0"]
    else:
        assert out["first"] == out["second"] == "hidden"
        assert out["calls"] == [[[], "GPU"]] and out["visible"] == []  # once, not twice
        # Nothing above started TensorFlow's runtime (so the hiding was in time), not even
        # writing, verify or the tf.data service (so they need no call of their own).
        assert out["tensorflow_started"] is False
    assert out["sum"] == 3.0
    result_late, message = out["late"]
    assert result_late == "too-late"
    assert "TensorFlow already started on ['/physical_device:CPU:0'] in this process " in (message)
    assert f"({REFUSAL})" in message  # TensorFlow's own words, from its real refusal
    assert out["cpus"] == 1  # the refused change did not happen
