"""`fit`, `evaluate` and `predict` with a source under each Keras backend, each in its own
process (the backend is chosen when Keras is first imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from keras_tfr import ArraysToRecords

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import keras
    from keras_tfr import TFRecordSequenceSource

    d = sys.argv[1]
    keras.utils.set_random_seed(0)
    train = TFRecordSequenceSource(
        d, batch_size=32, seed=0, validation_split=0.2, subset="training"
    )
    val = TFRecordSequenceSource(
        d, batch_size=32, seed=0, validation_split=0.2, subset="validation", shuffle=False
    )
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(2)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    hist = model.fit(train, validation_data=val, epochs=12, verbose=0)
    loss, acc = model.evaluate(val, verbose=0)
    x = TFRecordSequenceSource(d, batch_size=32, shuffle=False)
    pred = model.predict(x, verbose=0)
    xs = np.load(sys.argv[2])
    direct = keras.ops.convert_to_numpy(model(xs[:64]))
    print(json.dumps({
        "backend": keras.backend.backend(),
        "steps": [len(train), len(val)],
        "loss0": hist.history["loss"][0], "loss": hist.history["loss"][-1],
        "val_acc": float(acc), "pred_rows": int(pred.shape[0]),
        "pred_match": bool(np.allclose(pred[:64], direct, atol=1e-5)),
    }))
    """
)


@pytest.fixture(scope="module")
def learnable(tmp_path_factory):
    base = tmp_path_factory.mktemp("backends")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1000, 8)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    d = str(base / "ds")
    ArraysToRecords.from_arrays(x, y, d, verbose=0)  # one record: split by sample
    np.save(base / "x.npy", x)
    return d, str(base / "x.npy")


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
def test_fit_evaluate_predict_under_each_backend(learnable, backend):
    pytest.importorskip(backend, reason=f"the {backend} backend is not installed")
    d, xs = learnable
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, d, xs], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["backend"] == backend
    assert res["steps"] == [25, 7]  # 800 and 200 samples by 32
    assert res["loss"] < 0.6 * res["loss0"]
    assert res["val_acc"] > 0.85
    assert res["pred_rows"] == 1000
    assert res["pred_match"], "predict's rows are not the written samples in order"
