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
from _results import result_of

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
def test_both_environment_variables_are_a_value_error_at_import():
    """docs/gpu.md: "Setting both variables is a `ValueError` at import"."""
    both = _run(
        """
        import keras_tfr
        print("IMPORTED")
        """,
        **{ENV_MEGABYTES: "512", ENV_FRACTION: "0.5"},
    )
    assert both.returncode == 1 and "IMPORTED" not in both.stdout
    assert 'File "<string>", line 2, in <module>' in both.stderr  # `import keras_tfr`
    assert (
        "ValueError: Expected only one of the environment variables KERAS_TFR_GPU_MEMORY_MB "
        "and KERAS_TFR_GPU_MEMORY_FRACTION. Received: KERAS_TFR_GPU_MEMORY_MB='512', "
        "KERAS_TFR_GPU_MEMORY_FRACTION='0.5'"
    ) in both.stderr


@pytest.mark.subprocess
def test_launcher_caps_each_child_through_import():
    import io

    from keras_tfr.parallel import launch

    out = io.StringIO()
    code = launch(
        [
            PY,
            "-c",
            # The cap waits for Keras (it needs the backend the program chooses).
            "import keras_tfr; from keras_tfr import gpu; waiting = gpu._ENVIRONMENT_LIMIT; "
            "import keras; "
            "print(waiting, gpu._ENVIRONMENT_LIMIT.megabytes, gpu._ENVIRONMENT_LIMIT.backend)",
        ],
        2,
        gpu_memory_mb=300,
        env={"TF_CPP_MIN_LOG_LEVEL": "2", "KERAS_BACKEND": "tensorflow"},
        output=out,
    )
    assert code == 0, out.getvalue()
    lines = sorted(x for x in out.getvalue().splitlines() if x.endswith(" tensorflow"))
    assert lines == ["[0] None 300 tensorflow", "[1] None 300 tensorflow"]


# -- the Keras backend, and the environment's cap waiting for the program's choice --------


@pytest.fixture
def keras_settings(monkeypatch, tmp_path):
    """No KERAS_BACKEND and an empty KERAS_HOME in tmp_path: Keras' settings start blank."""
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize(
    ("keras_json", "variable", "expected"),
    [
        (None, None, "tensorflow"),  # Keras' default
        ('{"backend": "jax", "floatx": "float32"}', None, "jax"),
        ('{"floatx": "float32"}', None, "tensorflow"),  # no "backend" key
        ("{not json", None, "tensorflow"),  # Keras ignores invalid JSON too
        ('["jax"]', None, "tensorflow"),
        ('{"backend": "jax"}', "torch", "torch"),  # the variable wins
        ('{"backend": "jax"}', "", "jax"),  # an empty variable does not
    ],
)
def test_backend_from_keras_settings(keras_settings, monkeypatch, keras_json, variable, expected):
    if keras_json is not None:
        (keras_settings / "keras.json").write_text(keras_json)
    if variable is not None:
        monkeypatch.setenv("KERAS_BACKEND", variable)
    assert gpu_module._keras_backend_from_settings() == expected


def test_backend_from_keras_json_in_the_home_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    monkeypatch.delenv("KERAS_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".keras").mkdir()
    (tmp_path / ".keras" / "keras.json").write_text('{"backend": "torch"}')
    assert gpu_module._keras_backend_from_settings() == "torch"


def test_backend_from_keras_json_in_tmp_when_the_home_folder_is_not_writable(monkeypatch, tmp_path):
    """docs/gpu.md: the `keras.json` in `~/.keras` or, when the home folder is not
    writable, in `/tmp/.keras` (as Keras decides). For root a read-only folder is still
    writable, so `os.access` is made to say no; and the `/tmp/.keras/keras.json` read is
    made up rather than written outside `tmp_path`."""
    import io

    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    monkeypatch.delenv("KERAS_HOME", raising=False)
    home = tmp_path / "home"
    (home / ".keras").mkdir(parents=True)
    (home / ".keras" / "keras.json").write_text('{"backend": "torch"}')  # not to be read
    monkeypatch.setenv("HOME", str(home))
    access = os.access
    monkeypatch.setattr(
        os,
        "access",
        lambda path, mode, **kw: (
            False if str(path) == str(home) and mode & os.W_OK else access(path, mode, **kw)
        ),
    )
    opened = []

    def fake_open(path, *args, **kwargs):
        opened.append(path)
        if path == "/tmp/.keras/keras.json":
            return io.StringIO('{"backend": "jax"}')
        raise FileNotFoundError(path)

    monkeypatch.setattr(gpu_module, "open", fake_open, raising=False)
    assert gpu_module._keras_backend_from_settings() == "jax"
    assert opened == ["/tmp/.keras/keras.json"]


def test_backend_asks_keras_once_imported(keras_settings, monkeypatch):
    monkeypatch.setenv("KERAS_BACKEND", "jax")
    fake = types.SimpleNamespace(config=types.SimpleNamespace(backend=lambda: "torch"))
    monkeypatch.setitem(sys.modules, "keras", fake)
    assert gpu_module._keras_backend() == "torch" and gpu_module._backend_is_fixed()
    # Keras in the middle of its own import (no `keras.config` yet): its settings decide.
    monkeypatch.setitem(sys.modules, "keras", types.ModuleType("keras"))
    assert gpu_module._keras_backend() == "jax" and not gpu_module._backend_is_fixed()


@pytest.fixture
def waiting(monkeypatch):
    """The environment's cap waiting in `_WhenImported`; what would apply is recorded.
    Keras and TensorFlow are imported first, so that only the test's own calls fire it
    (a first real import, as by the `no_gpu` fixture, would apply it)."""
    import keras  # noqa: F401
    import tensorflow  # noqa: F401

    applied = []
    monkeypatch.setattr(gpu_module, "_apply_environment_limit", lambda *cap: applied.append(cap))
    gpu_module._WhenImported.install(512, None)
    yield applied
    gpu_module._WhenImported.cancel()
    gpu_module._WhenImported._depth = 0


def test_waiting_cap_applies_after_the_outermost_import(waiting, monkeypatch):
    when = gpu_module._WhenImported
    assert when._finder in sys.meta_path
    when._depth = 2  # `import tensorflow`, which imports Keras
    when.imported("keras")
    assert waiting == [] and when._finder in sys.meta_path  # inside TensorFlow's import
    when.imported("tensorflow")
    assert waiting == [(512, None)]
    assert when._finder not in sys.meta_path and when._cap is None  # once


@pytest.mark.parametrize(("backend", "applies"), [("tensorflow", False), ("torch", True)])
def test_waiting_cap_after_torch_only_for_the_torch_backend(waiting, monkeypatch, backend, applies):
    monkeypatch.setattr(gpu_module, "_keras_backend", lambda: backend)
    gpu_module._WhenImported._depth = 1
    gpu_module._WhenImported.imported("torch")
    assert waiting == ([(512, None)] if applies else [])
    assert (gpu_module._WhenImported._cap is None) is applies


def test_a_call_replaces_the_waiting_cap(waiting, no_gpu):
    limit_gpu_memory(256)
    assert gpu_module._WhenImported._cap is None
    assert gpu_module._WhenImported._finder not in sys.meta_path
    gpu_module._WhenImported.imported("keras")
    assert waiting == []  # the environment's cap never applies over the call


_CAP_WAITS = """
    import json, os, sys
    import keras_tfr
    from keras_tfr import gpu
    out = {"heavy": sorted(m for m in ("keras", "tensorflow", "torch") if m in sys.modules),
           "waiting": gpu._ENVIRONMENT_LIMIT is None}
    if sys.argv[1]:
        os.environ["KERAS_BACKEND"] = sys.argv[1]  # chosen in code, after `import keras_tfr`
    if sys.argv[2] == "torch":
        import torch
    elif sys.argv[2] == "keep_tensorflow_off_gpus":  # it imports TensorFlow, and so Keras
        out["hidden"] = gpu.keep_tensorflow_off_gpus()
    out["applied_first"] = gpu._ENVIRONMENT_LIMIT is not None
    import keras
    out["keras"] = keras.config.backend()
    limit = gpu._ENVIRONMENT_LIMIT
    out["limit"] = [limit.backend, limit.megabytes, limit.tensorflow_gpus]
    print("RESULT " + json.dumps(out))
"""


@pytest.mark.subprocess
@pytest.mark.parametrize(
    ("keras_json", "chosen", "first", "expected"),
    [
        # KERAS_BACKEND set in code after `import keras_tfr`; keras-tfr imports TensorFlow.
        (None, "jax", "keep_tensorflow_off_gpus", "jax"),
        ('{"backend": "torch"}', "", "torch", "torch"),  # keras.json; the cap after torch
    ],
)
def test_environment_cap_follows_the_backend_the_program_chooses(
    tmp_path, keras_json, chosen, first, expected
):
    pytest.importorskip(expected)
    if keras_json is not None:
        (tmp_path / "keras.json").write_text(keras_json)
    result = subprocess.run(
        [PY, "-c", textwrap.dedent(_CAP_WAITS), chosen, first],
        env={
            **{k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", ENV_FRACTION)},
            "TF_CPP_MIN_LOG_LEVEL": "2",
            "KERAS_HOME": str(tmp_path),
            "JAX_PLATFORMS": "cpu",
            ENV_MEGABYTES: "512",
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = result_of(result)
    # `import keras_tfr` imported none of them, so Keras' backend was still open.
    assert out["heavy"] == [] and out["waiting"] is True
    assert out["keras"] == expected
    assert out["limit"] == [expected, 512, "no-gpu"]  # TensorFlow sees no GPU here
    assert out["applied_first"] is True  # by the first trigger, before `import keras`
    assert out.get("hidden", "no-gpu") == "no-gpu"


@pytest.mark.subprocess
def test_an_error_in_applying_the_waiting_cap_is_raised_by_the_import_that_applied_it(tmp_path):
    """docs/gpu.md: "An error in applying it ... is raised by the import statement that
    applied it". Keras' numpy backend is one no cap applies to: `import keras_tfr`
    succeeds (the cap waits for Keras), and `import keras` raises the cap's error."""
    code = textwrap.dedent(
        """
        import json, traceback
        import keras_tfr
        from keras_tfr import gpu
        out = {"waiting": gpu._WhenImported._cap}
        try:
            import keras
        except ValueError as e:
            out["error"] = str(e)
            out["line"] = traceback.extract_tb(e.__traceback__)[0].lineno
        out["cap_after"] = gpu._WhenImported._cap
        print("RESULT " + json.dumps(out))
        """
    )
    result = _run(
        code,
        KERAS_BACKEND="numpy",
        KERAS_HOME=str(tmp_path),
        JAX_PLATFORMS="cpu",
        **{ENV_MEGABYTES: "512"},
    )
    out = result_of(result)
    assert out["waiting"] == [512, None]
    assert out.get("error") == (
        "limit_gpu_memory supports the Keras backends 'tensorflow', 'jax' and 'torch'. "
        "Received backend: 'numpy'"
    ), result.stderr
    assert code.splitlines()[out["line"] - 1].strip() == "import keras"
    assert out["cap_after"] is None  # it was tried once, not left waiting


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
        with limit_gpu_memory(512, devices=[0]) as gpu:  # no GPU: `devices` is not checked
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


@pytest.fixture
def jax_gpu(monkeypatch):
    """The JAX backend on one made-up 1000 MiB GPU that JAX has not started on."""
    for name in gpu_module._JAX_VARIABLES:
        monkeypatch.setenv(name, "")  # so that teardown restores it, or its absence
        monkeypatch.delenv(name)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(gpu_module, "_JAX_SET", {})
    monkeypatch.setattr(gpu_module, "_ENVIRONMENT_LIMIT", None)
    monkeypatch.setattr(gpu_module, "_cuda_device_totals_mb", lambda: [1000])
    monkeypatch.setattr(gpu_module, "_jax_started", lambda: False)
    monkeypatch.setattr(gpu_module, "_keras_backend", lambda: "jax")
    monkeypatch.setattr(gpu_module, "_backend_is_settled", lambda: True)
    monkeypatch.setattr(gpu_module, "keep_tensorflow_off_gpus", lambda: "hidden")


def _xla() -> dict[str, str]:
    return {k: os.environ[k] for k in gpu_module._JAX_VARIABLES if k in os.environ}


def test_jax_a_later_call_replaces_the_environment_cap(jax_gpu, monkeypatch):
    monkeypatch.setenv(ENV_MEGABYTES, "250")
    from_environment = gpu_module._limit_from_environment()
    assert from_environment.backend == "jax" and from_environment.limit_mb == 250
    assert from_environment.devices == ["GPU:0"] and from_environment.total_mb == [1000]
    assert _xla() == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.25"}
    assert limit_gpu_memory(growth=True).limit_mb is None
    assert _xla() == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}  # no fraction left behind
    limit_gpu_memory(fraction=0.5)
    assert _xla() == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the user's own: it stays
    limit_gpu_memory(100)
    assert _xla() == {
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.1",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
    }


def test_jax_started_keeps_its_cap(jax_gpu, monkeypatch):
    monkeypatch.setenv(ENV_MEGABYTES, "250")
    gpu_module._limit_from_environment()
    monkeypatch.setattr(gpu_module, "_jax_started", lambda: True)
    assert limit_gpu_memory(250).limit_mb == 250  # what XLA read: accepted
    with pytest.raises(GpuMemoryError) as error:
        limit_gpu_memory(growth=True)
    assert "XLA reads XLA_PYTHON_CLIENT_MEM_FRACTION, XLA_PYTHON_CLIENT_PREALLOCATE only" in (
        str(error.value)
    )
    assert _xla() == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.25"}  # nothing changed


def test_environment_cap_sets_xla_variables_while_it_waits(jax_gpu, monkeypatch):
    """A program that picks JAX after `import keras_tfr` is capped before JAX starts."""
    monkeypatch.setattr(gpu_module, "_backend_is_settled", lambda: False)
    monkeypatch.setenv(ENV_FRACTION, "0.3")
    try:
        assert gpu_module._limit_from_environment() is None  # waits for Keras
        assert gpu_module._WhenImported._cap == (None, 0.3)
    finally:
        gpu_module._WhenImported.cancel()
    assert _xla() == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3"}
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # JAX gets no GPU: nothing to set
    try:
        gpu_module._limit_from_environment()
    finally:
        gpu_module._WhenImported.cancel()
    assert _xla() == {}


def test_jax_devices_is_refused_only_with_a_gpu(jax_gpu, monkeypatch):
    with pytest.raises(ValueError, match=r"CUDA_VISIBLE_DEVICES.*Received: devices=\[0\]"):
        limit_gpu_memory(512, devices=[0])
    assert _xla() == {}
    monkeypatch.setattr(gpu_module, "_cuda_device_totals_mb", lambda: None)
    assert limit_gpu_memory(512, devices=[0]).devices == []


class FakeCuda:
    """The ``torch.cuda`` calls `limit_gpu_memory` makes, over made-up GPUs."""

    def __init__(self, totals_mib, fractions):
        self.totals_mib = totals_mib
        self.fractions = dict(fractions)
        self.reserved: dict[int, int] = {}
        self.calls: list[tuple] = []

    def is_available(self):
        return True

    def device_count(self):
        return len(self.totals_mib)

    def get_device_properties(self, i):
        return types.SimpleNamespace(total_memory=self.totals_mib[i] << 20)

    def get_per_process_memory_fraction(self, i):
        return self.fractions.get(i, 1.0)

    def set_per_process_memory_fraction(self, fraction, i):
        self.calls.append(("set", i, fraction))
        self.fractions[i] = fraction

    def max_memory_reserved(self, i):
        return self.reserved.get(i, 0)

    def reset_peak_memory_stats(self, i):
        self.calls.append(("reset", i))


@pytest.fixture
def torch_gpus(monkeypatch):
    torch = pytest.importorskip("torch")
    cuda = FakeCuda([16384, 8192], {1: 0.9})
    for name in [n for n in vars(FakeCuda) if not n.startswith("_")]:
        monkeypatch.setattr(torch.cuda, name, getattr(cuda, name))
    monkeypatch.setattr(gpu_module, "_keras_backend", lambda: "torch")
    monkeypatch.setattr(gpu_module, "keep_tensorflow_off_gpus", lambda: "hidden")
    monkeypatch.setattr(gpu_module, "_ENVIRONMENT_LIMIT", None)
    return cuda


def test_torch_sets_the_fraction_and_restores_the_previous_one(torch_gpus, caplog):
    with caplog.at_level(logging.INFO, logger="keras_tfr.gpu"):
        with limit_gpu_memory(1024, devices=[1]) as gpu:
            assert torch_gpus.calls == [("set", 1, 0.125)]  # 1024 of 8192 MiB
            torch_gpus.reserved[1] = 700 << 20
            assert gpu.peak_mb == 700
        torch_gpus.reserved[1] = 0
    assert torch_gpus.calls[1:] == [("reset", 1), ("set", 1, 0.9)]  # the previous value
    assert gpu.devices == ["GPU:1"] and gpu.limit_mb == 1024 and gpu.total_mb == [8192]
    assert gpu.peak_mb == 700  # the block's peak, kept after the reset
    assert [r.getMessage() for r in caplog.records if r.name == "keras_tfr.gpu"] == [
        "limit_gpu_memory: torch on GPU:1: limit 1024 MiB, peak 700 MiB, device total "
        "8192 MiB; TensorFlow GPUs: hidden"
    ]
    with pytest.raises(ValueError, match=r"index the 2 GPU\(s\) visible to torch"):
        limit_gpu_memory(1024, devices=[2])


def test_torch_growth_lifts_the_environment_cap_until_the_block_ends(torch_gpus):
    gpu_module._apply_environment_limit(None, 0.25)
    assert torch_gpus.fractions == {0: 0.25, 1: 0.25}
    with limit_gpu_memory(growth=True) as gpu:
        assert torch_gpus.fractions == {0: 1.0, 1: 1.0} and gpu.limit_mb is None
    assert torch_gpus.fractions == {0: 0.25, 1: 0.25}


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
