"""`fit`, `evaluate` and `predict` with a source under each Keras backend, each in its own
process (the backend is chosen when Keras is first imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from keras_tfr import ArraysToRecords

SCRIPT = textwrap.dedent(
    """
    import json, logging, sys
    import numpy as np
    import keras
    from keras_tfr import TFRecordSequenceSource

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("keras_tfr").addHandler(handler)
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
    xs = np.load(sys.argv[2])
    # fit read epochs 0-11 (JAX and torch build the model from one batch of a fresh
    # iterator first, which used up epoch 0): the next iterator reads epoch 12.
    after = np.asarray(next(iter(train))[0])
    next_epoch = [e for e in range(11, 15) if np.array_equal(after, xs[train.sample_order(e)[:32]])]
    loss, acc = model.evaluate(val, verbose=0)
    x = TFRecordSequenceSource(d, batch_size=32, shuffle=False)
    pred = model.predict(x, verbose=0)
    from keras_tfr import predict_to_records
    predict_to_records(model, x, sys.argv[1] + "-pred", verbose=0, overwrite=True)
    written = np.concatenate([
        np.asarray(b)
        for b in TFRecordSequenceSource(sys.argv[1] + "-pred", batch_size=256, shuffle=False)
    ])
    direct = keras.ops.convert_to_numpy(model(xs[:64]))
    quiet = sum("predict reads" in m for m in said)
    try:
        model.fit(x, validation_split=0.2, epochs=1, verbose=0)
        hint = "no error"
    except ValueError as e:
        hint = str(e)
    model.predict(TFRecordSequenceSource(d, batch_size=32, seed=0), verbose=0)
    shuffled_said = [quiet, sum("predict reads" in m for m in said)]
    # JAX's predict builds an unbuilt model from one batch of a fresh iterator: that batch
    # used up the source's epoch 0 (predictions in epoch 1's order, then epoch 2).
    src = TFRecordSequenceSource(d, batch_size=32, seed=0)
    keras.utils.set_random_seed(1)
    unbuilt = keras.Sequential([keras.layers.Dense(2)])
    unbuilt_pred = unbuilt.predict(src, verbose=0)
    direct_e = [keras.ops.convert_to_numpy(unbuilt(xs[src.sample_order(e)])) for e in range(3)]
    after_predict = next(src.as_numpy_iterator())[0]
    print(json.dumps({
        "unbuilt_predicted": [
            e for e in range(3) if np.allclose(unbuilt_pred, direct_e[e], atol=1e-5)
        ],
        "unbuilt_next": [
            e for e in range(4) if np.array_equal(after_predict, xs[src.sample_order(e)[:32]])
        ],
        "backend": keras.backend.backend(),
        "steps": [len(train), len(val)],
        "loss0": hist.history["loss"][0], "loss": hist.history["loss"][-1],
        "val_acc": float(acc), "pred_rows": int(pred.shape[0]),
        "pred_match": bool(np.allclose(pred[:64], direct, atol=1e-5)),
        "shuffled_predict_said": shuffled_said,
        "split_hint": hint, "next_epoch": next_epoch,
        "to_records_match": bool(np.allclose(written, pred, atol=1e-5)),
    }))
    """
)


def _run_json(script, backend, *args):
    """Runs ``script`` under Keras backend ``backend`` in a new process; returns the JSON
    object its last line prints (the test fails with the child's stderr if it fails)."""
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run(
        [sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# Runs several of this file's scripts one after the other in one process (each with its
# own arguments, in a namespace of its own), so that each backend starts once: a start
# (TensorFlow, Keras and the backend imported) takes 5-10 s on a 2-core machine.
COMBINED = textwrap.dedent(
    """
    import contextlib, io, json, sys

    results = {}
    for name, code, argv in json.loads(sys.argv[1]):
        sys.argv = ["-c", *argv]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"<{name} script>", "exec"), {"__name__": "__main__"})
        results[name] = json.loads(out.getvalue().strip().splitlines()[-1])
    print(json.dumps(results))
    """
)


def _run_together(backend, scripts):
    """``{name: the JSON object its script printed}`` for ``scripts``, a list of
    ``(name, script, args)`` run in this order in one process under ``backend``."""
    return _run_json(COMBINED, backend, json.dumps(scripts))


@pytest.fixture(scope="module")
def per_backend(learnable, tmp_path_factory):
    """``get(backend)``: the results of this file's per-backend scripts, all run in one
    process per backend (made once, when a test first asks for that backend)."""
    got: dict = {}

    def get(backend):
        pytest.importorskip(backend, reason=f"the {backend} backend is not installed")
        if backend not in got:
            tuner_dir = str(tmp_path_factory.mktemp(f"tuner-{backend}"))
            scripts = [
                ("fit", SCRIPT, list(learnable)),
                ("wrapped", WRAPPED_SCRIPT, list(learnable)),
            ]
            if backend != "tensorflow":  # TensorFlow's: tests/test_tuner.py, tf.data
                scripts += [
                    ("tuner", TUNER_SCRIPT, [learnable[0], tuner_dir]),
                    # Last: it counts the batches of `NumpyBatches` by replacing its `__next__`.
                    ("adapter", ADAPTER_SCRIPT, list(learnable)),
                ]
            got[backend] = _run_together(backend, scripts)
        return got[backend]

    return get


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
def test_fit_evaluate_predict_under_each_backend(per_backend, backend):
    res = per_backend(backend)["fit"]
    assert res["backend"] == backend
    assert res["steps"] == [25, 7]  # 800 and 200 samples by 32
    assert res["loss"] < 0.6 * res["loss0"]
    assert res["val_acc"] > 0.85
    assert res["pred_rows"] == 1000
    assert res["pred_match"], "predict's rows are not the written samples in order"
    assert res["shuffled_predict_said"] == [0, 1], "predict on a shuffling source logs once"
    assert "subset='validation'" in res["split_hint"], res["split_hint"]
    assert res["next_epoch"] == [12], "fit's epoch e reads sample_order(e) on every backend"
    assert res["to_records_match"], "predict_to_records wrote predict's outputs"
    # predict building an unbuilt model reads the epoch TensorFlow's reads (JAX: it
    # read epoch 1, and the next iterator epoch 2).
    assert (res["unbuilt_predicted"], res["unbuilt_next"]) == ([0], [1]), res


ADAPTER_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import keras
    from keras.src.trainers.data_adapters import get_data_adapter
    from keras_tfr import TFRecordSequenceSource
    from keras_tfr.read import numpy_iter

    pulled = [0]
    original = numpy_iter.NumpyBatches.__next__

    def counting(self):
        pulled[0] += 1
        return original(self)

    numpy_iter.NumpyBatches.__next__ = counting
    d, xs = sys.argv[1], np.load(sys.argv[2])
    src = TFRecordSequenceSource(d, batch_size=32, seed=5)
    adapter = get_data_adapter(src)
    backend = keras.backend.backend()
    epochs = []
    for _ in range(2):  # each call is a new epoch, as Keras makes one per epoch
        if backend == "torch":
            batches = [np.asarray(b[0]) for b in adapter.get_torch_dataloader()]
        else:
            batches = [np.asarray(b[0]) for b in adapter.get_jax_iterator()]
        epochs.append(np.concatenate(batches))
    copied = None
    if backend == "jax":  # aligned NumPy batches: `jax.device_put` (as `fit` calls it) aliases
        import jax

        copied = sum(
            int(jax.device_put(b).unsafe_buffer_pointer() != b.ctypes.data) for b in batches
        )
    same = [bool(np.array_equal(epochs[e], xs[src.sample_order(e)])) for e in range(2)]
    block = TFRecordSequenceSource(d, batch_size=32, seed=5, access="blocks")
    before = pulled[0]
    n_block = sum(len(b[0]) for b in get_data_adapter(block).get_numpy_iterator())
    print(json.dumps({"same": same, "pulled": before, "block_pulled": pulled[0] - before,
                      "n_block": n_block, "copied": copied}))
    """
)


WRAPPED_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import keras
    from keras_tfr import TFRecordSequenceSource

    d, xs = sys.argv[1], np.load(sys.argv[2])
    ys = (xs[:, 0] + xs[:, 1] > 0).astype(np.int64)

    def model():
        keras.utils.set_random_seed(3)
        m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
        m.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return m

    def on_orders(epochs, src):
        m = model()
        for e in epochs:
            o = src.sample_order(e)
            m.fit(xs[o], ys[o], batch_size=32, shuffle=False, verbose=0)
        return m.get_weights()

    def same(a, b):
        return all(np.array_equal(p, q) for p, q in zip(a, b))

    ref = TFRecordSequenceSource(d, batch_size=32, seed=0)
    want = {str(e): on_orders(e, ref) for e in ([0, 1], [1, 2])}
    out = {}
    for name in ["map", "repeat", "zip"]:
        src = TFRecordSequenceSource(d, batch_size=32, seed=0)
        data, kw = {
            "map": (src.map(lambda a, b: (a * 1.0, b)), {}),
            "repeat": (src.repeat(), {"steps_per_epoch": len(src)}),
            "zip": (__import__("tensorflow").data.Dataset.zip((src,)).map(lambda t: t), {}),
        }[name]
        m = model()
        m.fit(data, epochs=2, verbose=0, **kw)
        out[name] = [json.loads(e) for e, w in want.items() if same(m.get_weights(), w)]
    print(json.dumps(out))
    """
)


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
def test_fit_on_a_data_set_made_from_a_source_reads_its_epochs_in_order(per_backend, backend):
    # JAX and torch build an unbuilt model from one batch of a fresh iterator: for
    # `source.map(f)`, `.repeat()` or a zip of sources, that batch used up the source's
    # epoch 0, so fit's epoch e read sample_order(e + 1).
    res = per_backend(backend)["wrapped"]
    assert res == {k: [[0, 1]] for k in ["map", "repeat", "zip"]}, res


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_jax_and_torch_read_a_sample_mode_source_without_tf_data(per_backend, backend):
    """Keras' JAX/torch adapters take a sample-mode source's batches from
    `as_numpy_iterator` (the epoch's sample order, bit for bit, a new epoch per call;
    under JAX, each batch aligned so that `jax.device_put` does not copy it); a
    block-mode source still goes through Keras' own tf.data iteration."""
    res = per_backend(backend)["adapter"]
    assert res["same"] == [True, True]
    assert res["pulled"] >= 2 * 32  # 32 batches of 32 per epoch, through NumpyBatches
    assert res["block_pulled"] == 0 and res["n_block"] == 1000
    if backend == "jax":  # on the CPU, JAX takes every batch without a copy
        assert res["copied"] == 0


GPU_FIT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks", "gpu_fit.py")


@pytest.mark.slow
@pytest.mark.subprocess
def test_gpu_fit_harness_reads_as_the_source_does_and_runs_without_tensorflow(tmp_path):
    """`benchmarks/gpu_fit.py`, the GPU machine's check (JAX and torch there, no
    TensorFlow): its reader hands out the source's `as_numpy_iterator` batches bit for
    bit, and with TensorFlow made unimportable it still writes, reads and fits under
    JAX, every pipeline delivering every sample."""
    pytest.importorskip("jax", reason="the jax backend is not installed")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    check = subprocess.run(
        [sys.executable, GPU_FIT, "--self-check", "--samples", "1500"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert check.returncode == 0, check.stderr[-3000:]
    assert "self-check passed" in check.stdout
    no_tf = tmp_path / "no_tf" / "tensorflow"
    no_tf.mkdir(parents=True)
    (no_tf / "__init__.py").write_text("raise ImportError('no TensorFlow on this machine')\n")
    env["PYTHONPATH"] = os.pathsep.join([str(no_tf.parent), env.get("PYTHONPATH", "")])
    out_json = tmp_path / "gpu_fit.json"
    run = subprocess.run(
        [sys.executable, GPU_FIT, "--backends", "jax", "--shapes", "small", "--rounds", "1",
         "--samples", "1000", "--data-dir", str(tmp_path / "data"), "--out", str(out_json)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(out_json.read_text())["results"]
    got = {(r["kind"], r["pipeline"]): r for r in results}
    assert set(got) == {
        ("read", "keras-tfr"),
        ("read", "memmap-threads"),
        ("fit", "numpy"),
        ("fit", "memmap-pydataset"),
        ("fit", "keras-tfr"),
    }
    for r in results:
        assert "error" not in r, r["error"]
        assert r["examples"] == 1000 and r["seconds"] > 0, r
    assert {got[("fit", p)]["keras_backend"] for p in ("numpy", "keras-tfr")} == {"jax"}


TUNER_SCRIPT = textwrap.dedent(
    """
    import json, math, sys
    import keras, keras_tuner
    from keras_tfr import TFRecordSequenceSource
    from keras_tfr.tuner import TFRecordHyperModel

    d, out = sys.argv[1], sys.argv[2]
    keras.utils.set_random_seed(0)
    split = dict(seed=0, validation_split=0.2)
    train = TFRecordSequenceSource(d, batch_size=32, subset="training", **split)
    val = TFRecordSequenceSource(d, batch_size=32, subset="validation", shuffle=False, **split)

    def build(hp):
        model = keras.Sequential([keras.Input((8,)),
                                  keras.layers.Dense(hp.Choice("units", [8, 16]), "relu"),
                                  keras.layers.Dense(2)])
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return model

    class Steps(keras.callbacks.Callback):
        runs = []
        def on_epoch_begin(self, epoch, logs=None):
            self.runs.append(0)
        def on_train_batch_end(self, batch, logs=None):
            self.runs[-1] += 1

    tuner = keras_tuner.RandomSearch(
        TFRecordHyperModel(build, batch_size=[16, 64]), objective="val_accuracy",
        max_trials=3, seed=1, directory=out, project_name="p", overwrite=True)
    tuner.search(train, validation_data=val, epochs=8, callbacks=[Steps()], verbose=0)
    trials = list(tuner.oracle.trials.values())
    print(json.dumps({
        "backend": keras.backend.backend(),
        "status": [t.status for t in trials],
        "batch_sizes": [t.hyperparameters.values["batch_size"] for t in trials],
        "steps": Steps.runs,
        "best": max(t.score for t in trials),
        "train_batch_size": train.batch_size,
    }))
    """
)


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_keras_tuner_searches_a_source_under_jax_and_torch(per_backend, backend):
    """README: a source goes into keras-tuner's `search` under each backend (TensorFlow's
    is tests/test_tuner.py), with the batch size tuned."""
    res = per_backend(backend)["tuner"]
    assert res["backend"] == backend
    assert res["status"] and set(res["status"]) == {"COMPLETED"}, res
    assert set(res["batch_sizes"]) <= {16, 64}
    # Every epoch of every trial took the steps of its own batch size over 800 samples.
    assert len(res["steps"]) == 8 * len(res["status"])
    per_trial = [res["steps"][i : i + 8] for i in range(0, len(res["steps"]), 8)]
    for bs, steps in zip(res["batch_sizes"], per_trial):
        assert steps == [-(-800 // bs)] * 8, (bs, steps)
    assert res["best"] > 0.85
    assert res["train_batch_size"] == 32, "the user's source is untouched"


KERAS_JAX_ERROR_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import keras
    from keras_tfr import CorruptRecordError, TFRecordSequenceSource

    d, call, on_corrupt = sys.argv[1], sys.argv[2], sys.argv[3]
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(np.ones((64, 8), np.float32), np.zeros(64, np.int64), verbose=0)  # trained
    weights = [w.copy() for w in model.get_weights()]
    src = TFRecordSequenceSource(d, batch_size=32, shuffle=False, on_corrupt=on_corrupt)
    raised = None
    try:
        getattr(model, call)(src, verbose=0)
    except CorruptRecordError as e:
        raised = type(e).__name__
    try:
        kept = all(np.array_equal(a, b) for a, b in zip(model.get_weights(), weights))
        after = "weights kept" if kept else "weights changed"
    except TypeError as e:
        after = f"TypeError: {e}"
    print(json.dumps({"raised": raised, "after": after}))
    """
)


@pytest.fixture(scope="module")
def jax_errors(tmp_path_factory):
    """``{"<call> <on_corrupt>": result}`` of `KERAS_JAX_ERROR_SCRIPT` for `evaluate` and
    `predict`, each in both modes, from one JAX process, on a data set with one damaged
    record."""
    pytest.importorskip("jax", reason="the jax backend is not installed")
    rng = np.random.default_rng(0)
    d = str(tmp_path_factory.mktemp("jax-errors") / "ds")
    m = ArraysToRecords.from_arrays(
        rng.standard_normal((400, 8)).astype(np.float32),
        np.arange(400) % 2,
        d,
        samples_per_record=20,
        min_shards=2,
        verbose=0,
    )
    path = m.shard_path(m.shards[1])
    raw = bytearray(Path(path).read_bytes())
    raw[3 * (m.record_bytes + 16) + 40] ^= 0x04
    Path(path).write_bytes(raw)
    runs = [
        (f"{c} {mode}", KERAS_JAX_ERROR_SCRIPT, [d, c, mode])
        for c in ("evaluate", "predict")
        for mode in ("raise", "skip")
    ]
    return _run_together("jax", runs)


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("call", ["evaluate", "predict"])
def test_keras_jax_loses_the_weights_when_evaluate_or_predict_raise(jax_errors, call):
    """docs/reliability.md, known limits: under JAX, Keras (checked on 3.15) leaves a
    trained model without its weights when `evaluate` or `predict` raise (it restores them only in
    `fit`); `on_corrupt="skip"` keeps both working. When this test fails, Keras has fixed
    it: update the docs."""
    results = {mode: jax_errors[f"{call} {mode}"] for mode in ("raise", "skip")}
    assert results["raise"]["raised"] == "CorruptRecordError"
    assert results["raise"]["after"].startswith("TypeError"), results
    assert results["skip"] == {"raised": None, "after": "weights kept"}, results
