"""Predictions to records: the predict callback and `predict_to_records` (distillation)."""

from __future__ import annotations

import numpy as np
import pytest

from keras_tfr import ArraysToRecords, TFRecordSequenceSource
from keras_tfr.manifest import Manifest
from keras_tfr.predict import predict_to_records


def _teacher(seed=0):
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((5, 3)), keras.layers.Flatten(), keras.layers.Dense(4)])
    return model


def _read(directory):
    src = TFRecordSequenceSource(directory, batch_size=1000, shuffle=False)
    return next(iter(src))


def test_predictions_as_targets_distill_a_student(make_dataset, tmp_path, small_xy):
    import keras

    x, y = small_xy
    data = make_dataset(x, y, samples_per_record=4)
    teacher = _teacher()
    src = TFRecordSequenceSource(data, batch_size=8, shuffle=False)
    m = predict_to_records(teacher, src, str(tmp_path / "soft"), keep_inputs=True, verbose=0)
    assert m.total_samples == 34 and m.structure == {"x": "array", "y": "array"}
    xb, pb = _read(str(tmp_path / "soft"))
    assert xb.numpy().tobytes() == x.tobytes()
    expected = np.concatenate([teacher.predict_on_batch(x[i : i + 8]) for i in range(0, 34, 8)])
    assert pb.numpy().tobytes() == expected.astype(np.float32).tobytes()

    student = keras.Sequential([keras.Input((5, 3)), keras.layers.Flatten(), keras.layers.Dense(4)])
    student.compile(keras.optimizers.Adam(0.05), "mse")
    soft = TFRecordSequenceSource(str(tmp_path / "soft"), batch_size=8, seed=0)
    before = student.evaluate(soft, verbose=0)
    student.fit(soft, epochs=30, verbose=0)
    after = student.evaluate(soft, verbose=0)
    assert after < 0.1 * before


def test_layouts_with_targets(make_dataset, tmp_path, small_xy):
    x, y = small_xy
    src = TFRecordSequenceSource(make_dataset(x, y), batch_size=16, shuffle=False)
    teacher = _teacher()
    predict_to_records(teacher, src, str(tmp_path / "a"), keep_targets=True, verbose=0)
    pb, yb = _read(str(tmp_path / "a"))
    assert pb.shape == (34, 4) and np.array_equal(yb.numpy(), y)
    predict_to_records(
        teacher, src, str(tmp_path / "b"), keep_inputs=True, keep_targets=True, verbose=0
    )
    _, yd = _read(str(tmp_path / "b"))
    assert set(yd) == {"predictions", "targets"} and np.array_equal(yd["targets"].numpy(), y)
    assert np.array_equal(yd["predictions"].numpy(), pb.numpy())
    with pytest.raises(ValueError, match="keep_targets"):
        inputs_only = TFRecordSequenceSource(make_dataset(x, name="xo"), 16, shuffle=False)
        predict_to_records(teacher, inputs_only, str(tmp_path / "c"), keep_targets=True, verbose=0)
    assert not (tmp_path / "c" / "manifest.json").exists()


def test_steps_and_plain_iterables(tmp_path, small_xy):
    x, _ = small_xy
    batches = [x[i : i + 10] for i in range(0, 34, 10)]
    m = predict_to_records(_teacher(), batches, str(tmp_path / "p"), steps=2, verbose=0)
    assert m.total_samples == 20
    with pytest.raises(TypeError, match="Keras model"):
        predict_to_records(object(), batches, str(tmp_path / "q"), verbose=0)


def test_writer_as_predict_callback(tmp_path, small_xy):
    x, _ = small_xy
    teacher = _teacher()
    writer = ArraysToRecords(str(tmp_path / "cb"), verbose=0)
    out = teacher.predict(x, batch_size=8, callbacks=[writer], verbose=0)
    m = Manifest.load(str(tmp_path / "cb"))
    assert m.total_samples == 34
    written = _read(str(tmp_path / "cb"))
    assert written.numpy().tobytes() == out.astype(np.float32).tobytes()


@pytest.mark.parametrize("names", [("a",), ("a", "b"), ("outputs", "z")])
@pytest.mark.parametrize("kind", ["functional", "subclassed"])
def test_writer_as_predict_callback_of_a_model_with_dict_outputs(tmp_path, small_xy, names, kind):
    """Keras merges a dict of outputs into its callbacks' logs (no "outputs" key): every
    output is written, bit for bit, also one named "outputs"."""
    import keras

    x, _ = small_xy
    keras.utils.set_random_seed(0)
    layers = {k: keras.layers.Dense(i + 1) for i, k in enumerate(names)}
    if kind == "functional":
        inp = keras.Input((5, 3))
        flat = keras.layers.Flatten()(inp)
        model = keras.Model(inp, {k: layer(flat) for k, layer in layers.items()})
    else:

        class Heads(keras.Model):
            def __init__(self):
                super().__init__()
                self.flat = keras.layers.Flatten()
                self.heads = layers

            def call(self, inputs):
                return {k: layer(self.flat(inputs)) for k, layer in self.heads.items()}

        model = Heads()
    d = str(tmp_path / "cb")
    out = model.predict(x, batch_size=8, callbacks=[ArraysToRecords(d, verbose=0)], verbose=0)
    written = _read(d)
    assert sorted(written) == sorted(names)
    for k in names:
        assert written[k].numpy().tobytes() == np.asarray(out[k], np.float32).tobytes(), k


def test_writer_as_predict_callback_follows_predicts_verbose(tmp_path, small_xy, capsys):
    """`predict(..., verbose=0)` silences the writer's progress bar (its own `verbose`
    defaults to 1); `verbose=1` shows it."""
    x, _ = small_xy
    teacher = _teacher()
    teacher.predict(x, batch_size=8, callbacks=[ArraysToRecords(str(tmp_path / "q"))], verbose=0)
    assert "sample" not in capsys.readouterr().out
    assert Manifest.load(str(tmp_path / "q")).total_samples == 34
    teacher.predict(x, batch_size=8, callbacks=[ArraysToRecords(str(tmp_path / "v"))], verbose=1)
    assert "/sample" in capsys.readouterr().out


def test_every_layout_bit_for_bit(make_dataset, tmp_path, small_xy):
    x, y = small_xy
    src = TFRecordSequenceSource(make_dataset(x, y, samples_per_record=4), 8, shuffle=False)
    teacher = _teacher()
    predicted = teacher.predict(src, verbose=0).astype(np.float32)
    assert predicted.shape == (34, 4)

    m = predict_to_records(teacher, src, str(tmp_path / "default"), verbose=0)
    assert m.structure == {"x": "array"}  # no y
    assert [f.key for f in m.features] == ["x"]
    xb = _read(str(tmp_path / "default"))  # inputs only: a tensor, not a tuple
    assert xb.numpy().tobytes() == predicted.tobytes()

    predict_to_records(teacher, src, str(tmp_path / "inputs"), keep_inputs=True, verbose=0)
    xb, pb = _read(str(tmp_path / "inputs"))
    assert xb.numpy().tobytes() == x.tobytes() and pb.numpy().tobytes() == predicted.tobytes()

    predict_to_records(teacher, src, str(tmp_path / "targets"), keep_targets=True, verbose=0)
    pb, yb = _read(str(tmp_path / "targets"))
    assert pb.numpy().tobytes() == predicted.tobytes() and yb.numpy().tobytes() == y.tobytes()

    m = predict_to_records(
        teacher, src, str(tmp_path / "both"), keep_inputs=True, keep_targets=True, verbose=0
    )
    assert m.structure == {"x": "array", "y": "dict"}
    xb, yd = _read(str(tmp_path / "both"))
    assert xb.numpy().tobytes() == x.tobytes()
    assert yd["predictions"].numpy().tobytes() == predicted.tobytes()
    assert yd["targets"].numpy().tobytes() == y.tobytes()


def _warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def test_predict_on_a_shuffling_source_says_the_order_is_shuffled(make_dataset, small_xy, caplog):
    """`model.predict(x)` on arrays keeps their order; on a source that shuffles (the
    default) the predictions come shuffled, and the log says so, once per source. `fit`
    and `evaluate` on the same source, and `predict` on a source with shuffle=False, log
    nothing of it."""
    x, y = small_xy
    data = make_dataset(x, y, samples_per_record=4)
    model = _teacher()
    model.compile("sgd", "mse")
    quiet = TFRecordSequenceSource(data, batch_size=8, shuffle=False)
    shuffled = TFRecordSequenceSource(data, batch_size=8, seed=0)
    zeros = make_dataset(x, np.zeros((34, 4), np.float32), name="targets")
    targets = TFRecordSequenceSource(zeros, 8, seed=0)
    with caplog.at_level("WARNING", logger="keras_tfr"):
        np.testing.assert_allclose(
            model.predict(quiet, verbose=0), model.predict_on_batch(x), rtol=1e-6
        )
        model.fit(targets, epochs=1, verbose=0)
        model.evaluate(targets, verbose=0)
        assert not [m for m in _warnings_of(caplog) if "predict reads" in m]
        out = model.predict(shuffled, verbose=0)
        model.predict(shuffled, verbose=0)
    said = [m for m in _warnings_of(caplog) if "predict reads" in m]
    assert len(said) == 1, said
    assert data in said[0] and "shuffle=False" in said[0]
    expected = model.predict_on_batch(x)
    assert not np.allclose(out, expected)  # the warning is about something real
    np.testing.assert_allclose(np.sort(out, axis=0), np.sort(expected, axis=0), rtol=1e-6)


def test_predict_to_records_on_a_shuffling_source_says_so(make_dataset, tmp_path, small_xy, caplog):
    x, y = small_xy
    data = make_dataset(x, y, samples_per_record=4)
    with caplog.at_level("WARNING", logger="keras_tfr"):
        predict_to_records(
            _teacher(),
            TFRecordSequenceSource(data, 8, shuffle=False),
            str(tmp_path / "a"),
            verbose=0,
        )
        assert not [m for m in _warnings_of(caplog) if "shuffled" in m]
        predict_to_records(
            _teacher(), TFRecordSequenceSource(data, 8, seed=0), str(tmp_path / "b"), verbose=0
        )
    assert any("predict_to_records reads a shuffled source" in m for m in _warnings_of(caplog))
