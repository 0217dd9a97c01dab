"""Every Python example in README.md and docs/*.md, run as printed, so that none can rot.

Each fenced ``python`` block is executed word for word in a fresh working directory
(`tmp_path`), with the names it assumes (``np``, ``model``, ``x``, ``y``, ...) set up
beforehand, and what it claims is checked afterwards (bit for bit where it writes or
reads data; the Hyperband examples run with ``max_epochs`` capped, see
`_hyperband_capped`). A block that cannot run here (a cluster, a GPU-only claim) is listed in
`NOT_RUN` with the test that covers its calls instead; a new block that is in neither
list fails `test_every_example_is_run`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from keras_tfr._compat import keras_shuffle

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", *sorted(f"docs/{f}" for f in os.listdir(os.path.join(REPO, "docs")))]
_FENCE = re.compile(r"^([ \t]*)```python\n(.*?)^[ \t]*```", re.M | re.S)

N = 1000  # samples of the examples' data: small data is what people try first
D = 8


@dataclass(frozen=True)
class Block:
    path: str
    line: int
    code: str

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def _blocks() -> list[Block]:
    out = []
    for path in DOCS:
        if not path.endswith(".md"):
            continue
        with open(os.path.join(REPO, path), encoding="utf-8") as f:
            text = f.read()
        for m in _FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            out.append(Block(path, line, textwrap.dedent(m.group(2))))
    return out


BLOCKS = _blocks()


def _find(path: str, first: str) -> Block:
    """The block of `path` whose code starts with `first`."""
    found = [b for b in BLOCKS if b.path == path and b.code.startswith(first)]
    assert len(found) == 1, f"{path}: {len(found)} python blocks start with {first!r}"
    return found[0]


# ----------------------------------------------------------------------------- data


def learnable(n: int = N, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``x`` [n, 8] float32 and 10-class int64 labels a linear model can learn, sorted by
    class (as arrays built class by class are)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, D)).astype(np.float32)
    w = rng.standard_normal((D, 10)).astype(np.float32)
    y = np.argmax(x @ w, axis=1).astype(np.int64)
    order = np.argsort(y, kind="stable")
    return x[order], y[order]


def make_model():
    import keras

    model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(10)])
    model.compile(
        "adam",
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def build(hp):
    import keras

    model = keras.Sequential(
        [
            keras.Input((D,)),
            keras.layers.Dense(hp.Int("units", 4, 8, step=4), "relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        "adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
    )
    return model


def read_all(directory: str) -> list[np.ndarray]:
    """Every batch of the data set at `directory`, in written order, concatenated."""
    from keras_tfr import TFRecordSequenceSource

    parts = list(TFRecordSequenceSource(directory, batch_size=128, shuffle=False))
    first = parts[0] if isinstance(parts[0], tuple) else (parts[0],)
    return [np.concatenate([np.asarray(p[i]) for p in parts]) for i in range(len(first))]


def ids_of(source) -> np.ndarray:
    """The first feature of every sample a source reads in one epoch, as row keys."""
    rows = np.concatenate([np.asarray(b[0]) for b in source])
    return np.ascontiguousarray(rows).view(f"V{rows.dtype.itemsize * rows.shape[1]}").ravel()


def run(block: Block, ns: dict) -> dict:
    """Executes the block word for word in `ns` (in the current directory)."""
    code = compile(block.code, f"{block.path}:{block.line}", "exec")
    exec(code, ns)
    return ns


def base_ns(**names) -> dict:
    """The names a block may take from the blocks above it: the usual imports."""
    import keras
    import tensorflow as tf

    from keras_tfr import ArraysToRecords, TFRecordSequenceSource

    common = {"np": np, "tf": tf, "keras": keras}
    common.update(ArraysToRecords=ArraysToRecords, TFRecordSequenceSource=TFRecordSequenceSource)
    return {**common, **names}


def save_xy() -> tuple[np.ndarray, np.ndarray]:
    x, y = learnable()
    np.save("x.npy", x)
    np.save("y.npy", y)
    return x, y


def write_train(directory: str = "data/train") -> tuple[np.ndarray, np.ndarray]:
    from keras_tfr import ArraysToRecords

    x, y = learnable()
    ArraysToRecords.from_arrays(x, y, directory, verbose=0)
    return x, y


# ----------------------------------------------------------------------------- README


def readme_before(block: Block) -> None:
    save_xy()
    ns = run(block, base_ns(model=make_model()))
    assert ns["model"].history.epoch == list(range(10))


def readme_after(block: Block) -> None:
    x, y = save_xy()
    ns = run(block, base_ns(model=make_model()))
    assert ns["model"].history.epoch == list(range(10))
    assert "val_loss" in ns["model"].history.history
    train, val = ns["train"], ns["val"]
    n_val = int(0.1 * N)  # as Keras' own utilities count it
    assert (train.num_samples, val.num_samples) == (N - n_val, n_val)
    a, b = ids_of(train), ids_of(val)
    assert len(np.intersect1d(a, b)) == 0
    keys = np.ascontiguousarray(x).view(f"V{4 * D}").ravel()
    assert np.array_equal(np.sort(np.concatenate([a, b])), np.sort(keys))  # complete
    # Drawn across the class-sorted data, not its last tenth: every class is in it.
    val_labels = np.concatenate([np.asarray(b[1]) for b in val])
    assert len(np.unique(val_labels)) == len(np.unique(y))
    np.testing.assert_array_equal(read_all("data/train")[0], x)


def readme_writer(block: Block) -> None:
    """Three alternative calls, each run alone in its own directory."""
    import ast

    x, y = learnable()
    batches = [(x[i : i + 300], y[i : i + 300]) for i in range(0, N, 300)]
    weights = np.linspace(0, 1, N, dtype=np.float32)
    chunks = [(x[i : i + 300], y[i : i + 300], weights[i : i + 300]) for i in range(0, N, 300)]
    statements = ast.parse(block.code).body
    assert len(statements) == 3
    expected = [(x, y), (x, y), (x, y, weights)]
    for k, (statement, want) in enumerate(zip(statements, expected)):
        os.makedirs(f"s{k}")
        with _chdir(f"s{k}"):
            code = ast.get_source_segment(block.code, statement)
            ns = base_ns(x=x, y=y, batches=batches, chunks=chunks)
            run(Block(block.path, block.line + statement.lineno - 1, code), ns)
            got = read_all("data/train")
            assert len(got) == len(want)
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g, w)
            if k == 2:
                with open("data/train/manifest.json") as f:
                    shards = json.load(f)["shards"]
                assert all(s["bytes"] <= 128 << 20 for s in shards)


@contextlib.contextmanager
def _chdir(path: str):
    """`contextlib.chdir` (Python 3.11+) for 3.10."""
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def _source(shuffle: bool = False):
    from keras_tfr import TFRecordSequenceSource

    write_train()
    return TFRecordSequenceSource("data/train", batch_size=256, shuffle=shuffle, seed=0)


def readme_numpy_loop(block: Block) -> None:
    source = _source()
    seen: list[tuple[np.ndarray, np.ndarray]] = []

    def train_step(x, y):
        assert isinstance(x, np.ndarray) and isinstance(y, np.ndarray)
        seen.append((x, y))
        return 0.0

    run(block, base_ns(source=source, train_step=train_step))
    x, y = learnable()
    np.testing.assert_array_equal(np.concatenate([s[0] for s in seen]), x)
    np.testing.assert_array_equal(np.concatenate([s[1] for s in seen]), y)


def readme_tensor_loop(block: Block) -> None:
    source = _source(shuffle=True)
    assert N % 256  # a short last batch: still one trace
    ns = run(block, base_ns(source=source))
    assert ns["train_step"].experimental_get_tracing_count() == 1


def gpu_block(block: Block, **names) -> None:
    from keras_tfr import _quiet

    if not _quiet._no_nvidia_device():
        pytest.skip("a GPU is present: tests/test_gpu*.py cover the cap there")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        ns = run(block, base_ns(**names))
    gpu = ns["gpu"]
    # Without a GPU it does nothing and the training runs as it would without it.
    assert gpu.devices == [] and gpu.peak_mb is None
    assert buf.getvalue().strip().splitlines()[-1] == "None []"  # after fit's progress bars
    assert ns["model"].history.epoch


def readme_gpu(block: Block) -> None:
    from keras_tfr import TFRecordSequenceSource

    write_train()
    gpu_block(block, model=make_model(), train=TFRecordSequenceSource("data/train", seed=0))


def _train_val() -> dict:
    from keras_tfr import TFRecordSequenceSource

    write_train()
    kw = {"batch_size": 128, "seed": 0, "validation_split": 0.1}
    train = TFRecordSequenceSource("data/train", subset="training", **kw)
    val = TFRecordSequenceSource("data/train", subset="validation", shuffle=False, **kw)
    return {"train": train, "val": val}


def check_tuner(ns: dict, values: dict[str, list]) -> None:
    tuner = ns["tuner"]
    trials = list(tuner.oracle.trials.values())
    assert trials and all(t.status == "COMPLETED" for t in trials)
    for t in trials:
        for name, allowed in values.items():
            assert t.hyperparameters.get(name) in allowed
    best = tuner.get_best_hyperparameters(1)[0]
    assert best.get("batch_size") in values["batch_size"]


def readme_tuner(block: Block) -> None:
    """Run as printed, Hyperband's ``max_epochs`` capped (`_hyperband_capped`)."""
    import keras_tuner

    with _hyperband_capped() as full:
        ns = run(block, base_ns(keras_tuner=keras_tuner, build=build, **_train_val()))
    assert isinstance(ns["tuner"], full)
    check_tuner(ns, {"batch_size": [64, 256, 1024]})


def readme_backup(block: Block) -> None:
    ns = run(block, base_ns(model=make_model(), **_train_val()))
    assert ns["model"].history.epoch == list(range(10))
    assert ns["model"].optimizer.iterations.numpy() == 10 * len(ns["train"])


# ----------------------------------------------------------------------------- docs


def _tutorial_files() -> dict[str, np.ndarray]:
    """Two files of tutorial-style Examples (``old/train-*.tfrecord``): a serialized
    (28, 28) float32 image, a float label and a variable-length int64 list."""
    from test_tfrecords import _write_tutorial

    _, label, _ = _write_tutorial("old", n=200, files=2, seed=1, shape=(28, 28))
    return {"label": label, "n": np.array(200)}


def _image_tokens_model():
    import keras

    # `x=["image", "tokens"]` gives a dict of tensors: named inputs.
    image = keras.Input((28, 28), name="image")
    tokens = keras.Input((None,), dtype="int64", name="tokens")
    features = keras.layers.Concatenate()(
        [
            keras.layers.Flatten()(image),
            keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(100, 4)(tokens)),
        ]
    )
    model = keras.Model([image, tokens], keras.layers.Dense(1)(features))
    model.compile("adam", "mse")
    return model


def existing_from_tfrecords(block: Block) -> None:
    data = _tutorial_files()
    ns = run(block, base_ns(model=_image_tokens_model()))
    assert len(ns["train"]) == -(-int(data["n"]) // 256)
    assert ns["model"].history.epoch == list(range(5))


def existing_convert(block: Block) -> None:
    data = _tutorial_files()
    ns = run(block, base_ns())
    assert ns["train"].num_samples == int(data["n"])
    from keras_tfr import TFRecordSequenceSource

    src = TFRecordSequenceSource("data/train", batch_size=64, shuffle=False)
    labels = np.concatenate([np.asarray(b[1]).reshape(-1) for b in src])
    np.testing.assert_array_equal(labels, data["label"])


def existing_variable_length(block: Block) -> None:
    import tensorflow as tf

    rng = np.random.default_rng(2)
    n = 150
    list_of_int32_arrays = [
        rng.integers(0, 9, rng.integers(0, 7)).astype(np.int32) for _ in range(n)
    ]
    images = [rng.integers(0, 255, (rng.integers(8, 20), 10, 3)).astype(np.uint8) for _ in range(n)]
    list_of_png_bytes = [tf.io.encode_png(im).numpy() for im in images]
    labels = np.arange(n, dtype=np.int64)
    ns = run(
        block,
        base_ns(
            list_of_int32_arrays=list_of_int32_arrays,
            list_of_png_bytes=list_of_png_bytes,
            labels=labels,
        ),
    )
    src = ns["src"]
    seen = []
    for x, y in src:
        assert tuple(x["image"].shape[1:]) == (64, 64, 3)
        assert x["image"].dtype == tf.float32
        for tokens, label in zip(np.asarray(x["tokens"]), np.asarray(y)):
            want = list_of_int32_arrays[int(label)]
            np.testing.assert_array_equal(tokens[: len(want)], want)  # padded after
            assert not tokens[len(want) :].any()
        seen.append(np.asarray(y))
    assert sorted(np.concatenate(seen).tolist()) == labels.tolist()


def existing_predict(block: Block) -> None:
    x, _ = write_train()
    teacher, student = make_model(), make_model()
    student.compile("adam", "mse")  # distillation: fits the teacher's 10 outputs
    run(block, base_ns(teacher=teacher, student=student))
    px, py = read_all("data/teacher")
    np.testing.assert_array_equal(px, x)
    np.testing.assert_allclose(py, teacher.predict(x, verbose=0), rtol=1e-6, atol=1e-6)
    assert student.history.epoch == list(range(5))


def gpu_doc(block: Block) -> None:
    from keras_tfr import TFRecordSequenceSource

    write_train()
    source = TFRecordSequenceSource("data/train", seed=0)
    gpu_block(block, make_model=make_model, source=source)


def reliability_resume(block: Block) -> None:
    """A conversion stopped part way (an input that fails once 3 of its 4 chunks of the
    default 16 MB were read), then resumed by the block."""
    from keras_tfr import ArraysToRecords

    n = 1 << 21  # 2,097,152 x 8 float32: 64 MB, four chunks
    rng = np.random.default_rng(4)
    x = rng.standard_normal((n, D)).astype(np.float32)
    y = rng.integers(0, 10, n).astype(np.int64)

    class Failing:
        """``x``, until a read reaches its last quarter."""

        def __init__(self, a: np.ndarray):
            self.a, self.shape, self.dtype = a, a.shape, a.dtype

        def __len__(self) -> int:
            return len(self.a)

        def __getitem__(self, index):
            if isinstance(index, slice) and (index.stop or 0) > 3 * n // 4 + 1:
                raise OSError("the disk went away")
            return self.a[index]

    with pytest.raises(OSError, match="went away"):
        ArraysToRecords.from_arrays(Failing(x), y, "data/train", verbose=0)
    assert not os.path.exists("data/train/manifest.json")
    written = [f for f in os.listdir("data/train") if f.endswith(".tfrecord")]
    assert written, "nothing was written before the failure: the resume would not be tested"
    run(block, base_ns(x=x, y=y))
    got_x, got_y = read_all("data/train")
    np.testing.assert_array_equal(got_x, x)
    np.testing.assert_array_equal(got_y, y)


def reliability_verify(block: Block) -> None:
    write_train()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        ns = run(block, base_ns())
    assert ns["report"].problems == {}
    assert buf.getvalue().startswith("OK")


def resume_doc(block: Block) -> None:
    from keras_tfr import ArraysToRecords

    x, y = learnable(seed=3)
    write_train()
    ArraysToRecords.from_arrays(x[:300], y[:300], "data/val", verbose=0)
    ns = run(block, base_ns(model=make_model()))
    assert ns["model"].history.epoch == list(range(10))
    assert "val_loss" in ns["model"].history.history


def scaling_ram(block: Block) -> None:
    """The gs:// example with gs:// swapped for ram:// (the same tf.io.gfile path)."""
    x, y = learnable()
    code = block.code.replace("gs://my-bucket", "ram://doc-examples")
    assert code != block.code
    ns = run(Block(block.path, block.line, code), base_ns(x=x, y=y))
    assert ns["train"].num_samples == N
    assert ns["train"].access == "blocks"  # a URL: block mode
    batches = list(ns["train"].replace(shuffle=False))
    np.testing.assert_array_equal(np.concatenate([np.asarray(b[0]) for b in batches]), x)


_MWMS_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
import test_doc_examples as t

t.write_train()
code = open(sys.argv[1]).read().replace("gs://my-bucket/", "")
ns = t.base_ns(make_model=t.make_model)
exec(compile(code, "docs/scaling.md", "exec"), ns)
model = ns["model"]
steps = int(model.optimizer.iterations.numpy())
print("RESULT " + json.dumps({"epochs": model.history.epoch, "steps": steps}))
"""


def scaling_multiworker(block: Block) -> None:
    """`MultiWorkerMirroredStrategy` must come before TensorFlow starts: a new process,
    one worker (no TF_CONFIG), the bucket swapped for a local directory."""
    with open("block.py", "w") as f:
        f.write(block.code)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_BACKEND": "tensorflow"}
    env.pop("TF_CONFIG", None)
    out = subprocess.run(
        [sys.executable, "-c", _MWMS_CHILD, "block.py", os.path.dirname(__file__)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    result = json.loads(line[len("RESULT ") :])
    assert result == {"epochs": list(range(10)), "steps": 10 * -(-N // 256)}
    assert keras_shuffle.SHUFFLE_WARNING not in out.stderr


@contextlib.contextmanager
def _hyperband_capped():
    """keras_tuner.Hyperband with ``max_epochs`` capped at 3 while the example runs: the
    printed 10 makes about 30 trials, minutes of the suite; what is checked (every trial
    completed, with values from the hypermodel's choices) does not depend on it."""
    import keras_tuner

    full = keras_tuner.Hyperband

    class Capped(full):  # type: ignore[misc, valid-type]
        def __init__(self, *args, max_epochs=100, **kwargs):
            super().__init__(*args, max_epochs=min(max_epochs, 3), **kwargs)

    keras_tuner.Hyperband = Capped
    try:
        yield full
    finally:
        keras_tuner.Hyperband = full


def tuning_doc(block: Block) -> None:
    """Run as printed, Hyperband's ``max_epochs`` capped (`_hyperband_capped`)."""
    import keras_tuner

    write_train()
    with _hyperband_capped() as full:
        ns = run(block, base_ns(keras_tuner=keras_tuner))
    assert isinstance(ns["tuner"], full)
    check_tuner(ns, {"batch_size": [64, 256, 1024], "shuffle_memory": ["16MB", "64MB"]})


# ----------------------------------------------------------------------------- registry

RUN: dict[tuple[str, str], Callable[[Block], None]] = {
    ("README.md", 'x = np.load("x.npy")'): readme_before,
    ("README.md", "from keras_tfr import ArraysToRecords, TFRecordSequenceSource"): readme_after,
    ("README.md", 'ArraysToRecords.from_arrays(x, y, "data/train")  # returns'): readme_writer,
    ("README.md", "for x, y in source.as_numpy_iterator():"): readme_numpy_loop,
    ("README.md", "@tf.function(input_signature=[source.element_spec])"): readme_tensor_loop,
    ("README.md", "from keras_tfr import limit_gpu_memory"): readme_gpu,
    ("README.md", "from keras_tfr.tuner import TFRecordHyperModel"): readme_tuner,
    ("README.md", "from keras_tfr import BackupAndRestore"): readme_backup,
    ("docs/existing_data.md", "import tensorflow as tf"): existing_from_tfrecords,
    (
        "docs/existing_data.md",
        "from keras_tfr.tfrecords import convert_tfrecords",
    ): existing_convert,
    ("docs/existing_data.md", "ArraysToRecords.from_arrays(\n    {"): existing_variable_length,
    ("docs/existing_data.md", "from keras_tfr.predict import predict_to_records"): existing_predict,
    ("docs/gpu.md", "from keras_tfr import limit_gpu_memory"): gpu_doc,
    ("docs/reliability.md", "ArraysToRecords.from_arrays(x, y"): reliability_resume,
    ("docs/reliability.md", "from keras_tfr.verifier import verify"): reliability_verify,
    ("docs/resume.md", "from keras_tfr import BackupAndRestore"): resume_doc,
    ("docs/scaling.md", 'ArraysToRecords.from_arrays(x, y, "gs://'): scaling_ram,
    ("docs/scaling.md", "from keras_tfr.distribute import distribute_source"): scaling_multiworker,
    ("docs/tuning.md", "import keras, keras_tuner"): tuning_doc,
}

NOT_RUN: dict[tuple[str, str], str] = {
    ("README.md", "TFRecordSequenceSource(directory, batch_size=32"): (
        "a signature, parsed against the real one by tests/test_reader_args.py"
    ),
    ("README.md", "# many workers, one model"): (
        "a cluster and gs://; the same calls on local paths: tests/test_distribute.py, "
        "tests/test_keras_distribution.py, and the docs/scaling.md blocks run here"
    ),
    ("docs/scaling.md", "import keras\nfrom keras_tfr import keras_distribution_source"): (
        "needs KERAS_DISTRIBUTION_* for several JAX processes: "
        "tests/test_keras_distribution.py runs two"
    ),
    ("docs/scaling.md", "train = TFRecordSequenceSource(\n"): (
        "needs a tf.data service dispatcher: tests/test_distribute.py starts one"
    ),
    ("docs/tuning.md", "from keras_tfr.tuner import tune"): (
        "starts 4 worker processes on search.py: tests/test_tuner.py runs tune() with 2"
    ),
}


def _key(block: Block, table: dict) -> tuple[str, str] | None:
    keys = [k for k in table if k[0] == block.path and block.code.startswith(k[1])]
    assert len(keys) <= 1, f"{block.id} matches {keys}"
    return keys[0] if keys else None


def test_every_example_is_run():
    assert len(BLOCKS) >= 20
    missing = [b.id for b in BLOCKS if _key(b, RUN) is None and _key(b, NOT_RUN) is None]
    assert not missing, f"python examples that no test runs (add them to RUN): {missing}"
    for table in (RUN, NOT_RUN):
        for path, first in table:
            _find(path, first)  # each entry still names exactly one block


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in BLOCKS if _key(b, RUN)], ids=lambda b: b.id)
def test_example_runs_as_printed(block, tmp_path, monkeypatch):
    import keras

    monkeypatch.chdir(tmp_path)
    keras.utils.set_random_seed(0)
    key = _key(block, RUN)
    assert key is not None
    RUN[key](block)
