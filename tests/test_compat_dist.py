"""keras_tfr/_compat/keras_dist.py: the private Keras APIs it wraps are still there, the
version gate, and a fix that changes nothing outside MultiWorkerMirroredStrategy.

The two-worker run that reproduces Keras' bugs and trains through the fix is
`tests/test_distribute.py::test_multi_worker_mirrored_strategy_two_workers`.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from keras_tfr._compat import keras_dist


@pytest.fixture
def no_fix():
    keras_dist.uninstall_multi_worker_fix()
    yield
    keras_dist.uninstall_multi_worker_fix()


@pytest.mark.parametrize(
    "version, fixed_in, needed",
    [
        ("3.15.1", None, True),
        ("3.0.0", None, True),
        ("2.15.0", None, False),
        ("3.16.0.dev2026010103", None, True),
        ("3.15.1", (3, 16), True),
        ("3.16.0", (3, 16), False),
        ("3.17", (3, 16), False),
    ],
)
def test_version_gate(monkeypatch, version, fixed_in, needed):
    monkeypatch.setattr(keras_dist, "FIXED_IN", fixed_in)
    assert keras_dist.multi_worker_fix_needed(version) is needed


def test_bad_version_string():
    with pytest.raises(ValueError, match="Keras version"):
        keras_dist.keras_version("three")


def test_install_wraps_once_and_uninstall_restores(no_fix):
    from keras.src.backend.tensorflow import trainer as module

    build, reduce = module.TensorFlowTrainer._maybe_symbolic_build, module.reduce_per_replica
    assert keras_dist.install_multi_worker_fix() is True
    wrapped = module.TensorFlowTrainer._maybe_symbolic_build
    assert wrapped.keras_tfr_fix and module.reduce_per_replica.keras_tfr_fix
    assert keras_dist.install_multi_worker_fix() is True
    assert module.TensorFlowTrainer._maybe_symbolic_build is wrapped  # not wrapped twice
    keras_dist.uninstall_multi_worker_fix()
    assert module.TensorFlowTrainer._maybe_symbolic_build is build
    assert module.reduce_per_replica is reduce
    with pytest.raises(ValueError, match="parts"):
        keras_dist.install_multi_worker_fix(parts=("everything",))


def test_moved_api_warns_and_leaves_keras_alone(no_fix, monkeypatch, caplog):
    from keras.src.backend.tensorflow import trainer as module

    monkeypatch.setitem(
        keras_dist.PRIVATE_APIS,
        "keras.src.backend.tensorflow.trainer.reduce_per_replica",
        ("values", "strategy"),
    )
    reduce = module.reduce_per_replica
    with caplog.at_level(logging.WARNING, logger="keras_tfr"):
        assert keras_dist.install_multi_worker_fix() is False
    assert "reduce_per_replica" in caplog.text and "Not applying" in caplog.text
    assert module.reduce_per_replica is reduce


def test_fix_applies_only_to_multi_worker_mirrored_strategy():
    import tensorflow as tf

    assert not keras_dist.multi_worker_fix_applies(tf.distribute.get_strategy())
    assert not keras_dist.multi_worker_fix_applies(tf.distribute.OneDeviceStrategy("/cpu:0"))


def _fit_once(strategy=None):
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    x = np.linspace(0, 1, 48, dtype=np.float32).reshape(16, 3)
    y = x.sum(axis=1, keepdims=True)
    with strategy.scope() if strategy else tf.distribute.get_strategy().scope():
        inputs = keras.Input((3,))
        model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    history = model.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False)
    return history.history, [w.tolist() for w in model.get_weights()]


def test_fix_changes_nothing_outside_multi_worker(no_fix):
    import tensorflow as tf

    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    before = _fit_once(), _fit_once(strategy)
    keras_dist.install_multi_worker_fix()
    after = _fit_once(), _fit_once(strategy)
    assert after == before
