"""Every private TensorFlow, Keras, JAX and keras-tuner API keras-tfr uses, in one place.

`PRIVATE_APIS` names each one: where it lives (module and attribute), its library, the
versions it was verified on, what keras-tfr needs it for, and which keras-tfr module
relies on it. The code that touches them lives in this package only:

* `keras_tfr._compat.keras_shuffle`: Keras' "`shuffle=True` ... will be ignored" warning,
  off for keras-tfr sources (``EpochIterator.__init__``);
* `keras_tfr._compat.keras_build`: the JAX and torch trainers' build from one batch
  uses up no epoch of a source (``Trainer._symbolic_build``; JAX's ``predict``, with
  ``EpochIterator.reset``);
* `keras_tfr._compat.keras_split`: ``fit(source, validation_split=...)`` says how a
  source splits itself (``array_slicing.train_validation_split``);
* `keras_tfr._compat.keras_errors`: damaged-data errors inside ``fit`` become
  `keras_tfr.CorruptRecordError` (``EpochIterator.catch_stop_iteration``);
* `keras_tfr._compat.keras_resume`: exact mid-epoch resume for
  `keras_tfr.BackupAndRestore` (``fit``'s frame, ``EpochIterator._enumerate_iterator``);
* `keras_tfr._compat.keras_dist`: Keras 3 under MultiWorkerMirroredStrategy;
* `keras_tfr._compat.tf`, `keras_tfr._compat.jax`, `keras_tfr._compat.tuner`: one
  accessor per private TensorFlow, JAX and keras-tuner name.

Each of the four Keras modules keeps its own version gate (outside it the feature is off,
or, for ``keras_dist``, off from the release that fixes Keras). `check_all` imports and
resolves every entry and runs the deeper checks of those modules; ``tests/test_compat.py``
fails, naming the API, when anything moved. Importing this package imports nothing heavy.

Example:
    >>> from keras_tfr import _compat
    >>> _compat.check_all()  # empty when every private API is where it was
    []
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

__all__ = ["PRIVATE_APIS", "PrivateAPI", "check_all", "installed_version", "unverified_versions"]


@dataclasses.dataclass(frozen=True)
class PrivateAPI:
    """One private name keras-tfr uses.

    Attributes:
        module: the module to import, e.g. ``"keras.src.trainers.epoch_iterator"``.
        attribute: the dotted path from the module (``"EpochIterator.__init__"``); a part
            ending in ``()`` is called (``"context()._seed"``); empty for the module.
        library: the distribution it ships in (``"keras"``, ``"tensorflow"``, ...).
        verified: the ``major.minor`` versions of ``library`` it was verified on.
        purpose: what keras-tfr needs it for.
        used_by: the keras-tfr modules that rely on it (through ``home``).
        home: the `keras_tfr._compat` module that touches it.
    """

    module: str
    attribute: str
    library: str
    verified: tuple[str, ...]
    purpose: str
    used_by: tuple[str, ...]
    home: str

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attribute}" if self.attribute else self.module


_KERAS = ("3.15",)
_TF = ("2.21",)
_JAX = ("0.10",)
_TUNER = ("1.4",)
_EPOCH_ITERATOR = "keras.src.trainers.epoch_iterator"
_TF_TRAINER = "keras.src.backend.tensorflow.trainer"

PRIVATE_APIS: tuple[PrivateAPI, ...] = (
    # --- Keras: the shuffle warning (keras_shuffle) ---
    PrivateAPI(
        _EPOCH_ITERATOR,
        "EpochIterator.__init__",
        "keras",
        _KERAS,
        "wrapped to pass shuffle=False for a keras-tfr source (which shuffles itself), "
        "silencing Keras' wrong 'shuffle=True ... will be ignored' warning",
        ("keras_tfr.source",),
        "keras_tfr._compat.keras_shuffle",
    ),
    PrivateAPI(
        "keras.src.trainers.data_adapters",
        "get_data_adapter",
        "keras",
        _KERAS,
        "the function that warns; EpochIterator.__init__ must pass `shuffle` to it",
        ("keras_tfr.source",),
        "keras_tfr._compat.keras_shuffle",
    ),
    # --- Keras: the JAX/torch build from one batch uses up no epoch (keras_build) ---
    PrivateAPI(
        "keras.src.trainers.trainer",
        "Trainer._symbolic_build",
        "keras",
        _KERAS,
        "wrapped to hold a source's epoch while the JAX and torch trainers build an unbuilt "
        "model from one batch of a fresh iterator (it used up epoch 0)",
        ("keras_tfr.source",),
        "keras_tfr._compat.keras_build",
    ),
    PrivateAPI(
        "keras.src.backend.jax.trainer",
        "JAXTrainer.predict",
        "jax",
        _JAX,
        "wrapped (Keras 3.15's JAX trainer) to hold a source's epoch while predict builds an "
        "unbuilt model from one batch, until its epoch iterator's reset (it used up an epoch)",
        ("keras_tfr.source",),
        "keras_tfr._compat.keras_build",
    ),
    PrivateAPI(
        _EPOCH_ITERATOR,
        "EpochIterator.reset",
        "keras",
        _KERAS,
        "wrapped under the JAX backend: the end of JAX predict's build, where a source's "
        "held epoch is released",
        ("keras_tfr.source",),
        "keras_tfr._compat.keras_build",
    ),
    # --- Keras: fit(source, validation_split=...) says how a source splits (keras_split) ---
    PrivateAPI(
        "keras.src.trainers.data_adapters.array_slicing",
        "train_validation_split",
        "keras",
        _KERAS,
        "wrapped so that fit(source, validation_split=...) says how the source splits itself",
        ("keras_tfr.source",),
        "keras_tfr._compat.keras_split",
    ),
    # --- Keras: CorruptRecordError inside fit (keras_errors) ---
    PrivateAPI(
        _EPOCH_ITERATOR,
        "EpochIterator.catch_stop_iteration",
        "keras",
        _KERAS,
        "wrapped so that damaged-data errors inside fit/evaluate/predict become CorruptRecordError",
        ("keras_tfr.source",),
        "keras_tfr._compat.keras_errors",
    ),
    # --- Keras: mid-epoch resume (keras_resume) ---
    PrivateAPI(
        "keras.src.trainers.trainer",
        "Trainer._symbolic_build",
        "keras",
        _KERAS,
        "builds the compiled metrics' variables before a resumed epoch restores them",
        ("keras_tfr.backup",),
        "keras_tfr._compat.keras_resume",
    ),
    PrivateAPI(
        "keras.src.trainers.trainer",
        "Trainer.__init__",
        "keras",
        _KERAS,
        "sets `self._initial_epoch`, the epoch fit starts at; BackupAndRestore sets it",
        ("keras_tfr.backup",),
        "keras_tfr._compat.keras_resume",
    ),
    PrivateAPI(
        _EPOCH_ITERATOR,
        "EpochIterator._enumerate_iterator",
        "keras",
        _KERAS,
        "replaced on one EpochIterator object (with `_num_batches`) for the one epoch "
        "that resumes at step k",
        ("keras_tfr.backup",),
        "keras_tfr._compat.keras_resume",
    ),
    PrivateAPI(
        "keras.src.trainers.data_adapters.tf_dataset_adapter",
        "TFDatasetAdapter.get_tf_dataset",
        "keras",
        _KERAS,
        "checks that each epoch's iterator is made from the source itself",
        ("keras_tfr.backup",),
        "keras_tfr._compat.keras_resume",
    ),
    PrivateAPI(
        _TF_TRAINER,
        "TensorFlowTrainer.fit",
        "keras",
        _KERAS,
        "its locals (self, x, validation_data, epoch_iterator, callbacks) are read from "
        "the stack in on_train_begin (the JAX and torch fit too, checked from source)",
        ("keras_tfr.backup",),
        "keras_tfr._compat.keras_resume",
    ),
    # --- Keras: JAX/torch read a sample-mode source as NumPy (keras_numpy) ---
    PrivateAPI(
        "keras.src.trainers.data_adapters.tf_dataset_adapter",
        "TFDatasetAdapter.get_jax_iterator",
        "keras",
        _KERAS,
        "wrapped: batches of a sample-mode source come from as_numpy_iterator under JAX",
        ("keras_tfr.source",),
        "keras_tfr._compat.keras_numpy",
    ),
    PrivateAPI(
        "keras.src.trainers.data_adapters.tf_dataset_adapter",
        "TFDatasetAdapter.get_numpy_iterator",
        "keras",
        _KERAS,
        "wrapped: the same, for Keras' NumPy iteration of a data set",
        ("keras_tfr.source",),
        "keras_tfr._compat.keras_numpy",
    ),
    PrivateAPI(
        "keras.src.trainers.data_adapters.tf_dataset_adapter",
        "TFDatasetAdapter.get_torch_dataloader",
        "keras",
        _KERAS,
        "wrapped: the same under torch (a DataLoader over as_numpy_iterator's epochs)",
        ("keras_tfr.source",),
        "keras_tfr._compat.keras_numpy",
    ),
    PrivateAPI(
        "keras.src.trainers.data_adapters.data_adapter_utils",
        "get_torch_dataloader",
        "keras",
        _KERAS,
        "wraps an iterable of NumPy batches into the DataLoader Keras' torch trainer expects",
        ("keras_tfr.source",),
        "keras_tfr._compat.keras_numpy",
    ),
    # --- Keras: MultiWorkerMirroredStrategy (keras_dist) ---
    PrivateAPI(
        _TF_TRAINER,
        "TensorFlowTrainer._maybe_symbolic_build",
        "keras",
        _KERAS,
        "wrapped: build from the first batch's local values under multi-worker",
        ("keras_tfr.distribute",),
        "keras_tfr._compat.keras_dist",
    ),
    PrivateAPI(
        _TF_TRAINER,
        "reduce_per_replica",
        "keras",
        _KERAS,
        "wrapped: scalar logs averaged with axis=None under multi-worker",
        ("keras_tfr.distribute",),
        "keras_tfr._compat.keras_dist",
    ),
    PrivateAPI(
        _TF_TRAINER,
        "_collective_all_reduce_multi_worker",
        "keras",
        _KERAS,
        "Keras' own test for the multi-worker case; the fix changes only that case",
        ("keras_tfr.distribute",),
        "keras_tfr._compat.keras_dist",
    ),
    # --- TensorFlow (tf) ---
    PrivateAPI(
        "tensorflow.python.data.ops.iterator_ops",
        "OwnedIterator",
        "tensorflow",
        _TF,
        "subclassed so the source's iterator raises CorruptRecordError",
        ("keras_tfr.source",),
        "keras_tfr._compat.tf",
    ),
    PrivateAPI(
        "tensorflow.python.data.ops.iterator_ops",
        "OwnedIterator._create_iterator",
        "tensorflow",
        _TF,
        "makes the iterator resource only when a tf.function (or a checkpoint) needs it; "
        "a Python loop over a sample-mode source reads without it",
        ("keras_tfr.source",),
        "keras_tfr._compat.tf",
    ),
    PrivateAPI(
        "tensorflow.python.data.ops.iterator_ops",
        "OwnedIterator._next_internal",
        "tensorflow",
        _TF,
        "overridden: eager reads of a sample-mode source come from the memory-mapped "
        "reader (get_next and __next__ both call it)",
        ("keras_tfr.source",),
        "keras_tfr._compat.tf",
    ),
    PrivateAPI(
        "tensorflow.python.data.ops.iterator_ops",
        "OwnedIterator._serialize_to_tensors",
        "tensorflow",
        _TF,
        "overridden: a checkpoint of a sample-mode iterator names set_epoch",
        ("keras_tfr.source",),
        "keras_tfr._compat.tf",
    ),
    PrivateAPI(
        "tensorflow.python.data.ops.dataset_ops",
        "DatasetV2._inputs",
        "tensorflow",
        _TF,
        "the data sets a data set reads: finds the sources inside source.map(...) and the "
        "like, whose epoch the JAX and torch trainers' build from one batch must not use up",
        ("keras_tfr.source",),
        "keras_tfr._compat.tf",
    ),
    PrivateAPI(
        "tensorflow.python.data.ops.from_tensor_slices_op",
        "_TensorSliceDataset",
        "tensorflow",
        _TF,
        "by its class name: a data set of single samples (from_tensor_slices with no batch "
        "after it), which the writer refuses; with _UnbatchDataset and the names of the "
        "data sets that pass elements on (map, shuffle, zip, ...)",
        ("keras_tfr.write.inputs",),
        "keras_tfr._compat.tf",
    ),
    PrivateAPI(
        "tensorflow.python.data.ops.unbatch_op",
        "_UnbatchDataset",
        "tensorflow",
        _TF,
        "by its class name: a data set of single samples (unbatch with no batch after it)",
        ("keras_tfr.write.inputs",),
        "keras_tfr._compat.tf",
    ),
    PrivateAPI(
        "tensorflow.python.framework.ops",
        "get_default_graph",
        "tensorflow",
        _TF,
        "the graph whose _py_funcs_used_in_graph list holds the Python functions "
        "numpy_function traces outside a graph (see the entry below)",
        ("keras_tfr.source",),
        "keras_tfr._compat.tf",
    ),
    PrivateAPI(
        "tensorflow.python.ops.script_ops",
        "_internal_py_func",
        "tensorflow",
        _TF,
        "keeps each Python function numpy_function traces outside a graph in the default "
        "graph's _py_funcs_used_in_graph list for the process's life: a source takes its "
        "own out of that list when it is collected, so that its memory map goes with it",
        ("keras_tfr.source",),
        "keras_tfr._compat.tf",
    ),
    PrivateAPI(
        "tensorflow.python.eager.context",
        "context()._seed",
        "tensorflow",
        _TF,
        "the global seed, hidden while a pipeline is built so seed= alone sets the order",
        ("keras_tfr._seeds", "keras_tfr.source", "keras_tfr.tfrecords"),
        "keras_tfr._compat.tf",
    ),
    PrivateAPI(
        "tensorflow.python.data.ops.structured_function",
        "StructuredFunctionWrapper.__init__",
        "tensorflow",
        _TF,
        "wrapped: while a source builds its pipeline, the functions tf.data traces for it get "
        "the attribute below through `defun_kwargs` (so that each new iterator prepares them "
        "without Grappler) and are traced without AutoGraph",
        ("keras_tfr.source", "keras_tfr.tfrecords"),
        "keras_tfr._compat.tf",
    ),
    PrivateAPI(
        "tensorflow.python.eager.polymorphic_function.attributes",
        "INTS_ON_DEVICE",
        "tensorflow",
        _TF,
        "the function attribute (experimental_ints_on_device) that turns tf.data's "
        "multi-device execution, and so its Grappler pass per iterator, off for a function",
        ("keras_tfr.source", "keras_tfr.tfrecords"),
        "keras_tfr._compat.tf",
    ),
    PrivateAPI(
        "tensorflow.python.lib.io._pywrap_record_io",
        "RandomRecordReader",
        "tensorflow",
        _TF,
        "reads a record at a byte offset, so verify names the offset of a bad record",
        ("keras_tfr.verifier",),
        "keras_tfr._compat.tf",
    ),
    PrivateAPI(
        "tensorflow.python.data.ops.dataset_ops",
        "DatasetV2._variant_tensor",
        "tensorflow",
        _TF,
        "the source is a tf.data.Dataset subclass: it passes its pipeline's variant to "
        "DatasetV2.__init__ and overrides `_inputs` (used in source.py directly)",
        ("keras_tfr.source",),
        "keras_tfr.source",
    ),
    # --- JAX (jax) ---
    PrivateAPI(
        "jax._src.xla_bridge",
        "backends_are_initialized",
        "jax",
        _JAX,
        "whether JAX started (then XLA no longer reads limit_gpu_memory's variables)",
        ("keras_tfr.gpu",),
        "keras_tfr._compat.jax",
    ),
    # --- keras-tuner (tuner) ---
    PrivateAPI(
        "keras_tuner.src.engine.base_tuner",
        "BaseTuner.__init__",
        "keras-tuner",
        _TUNER,
        "wrapped in `keras-tfr tune` children: overwrite only on the chief; report the "
        "project directory and objective",
        ("keras_tfr.tuner",),
        "keras_tfr._compat.tuner",
    ),
    PrivateAPI(
        "keras_tuner.src.distribute.oracle_chief",
        "time",
        "keras-tuner",
        _TUNER,
        "replaced in `keras-tfr tune`'s chief: its 20 s sleeps become 0.5 s",
        ("keras_tfr.tuner",),
        "keras_tfr._compat.tuner",
    ),
)

_IMPORT_NAMES = {"keras-tuner": "keras_tuner"}


def installed_version(library: str) -> str | None:
    """The installed version of ``library`` (None when it is not installed)."""
    from importlib import metadata

    try:
        return metadata.version(library)
    except metadata.PackageNotFoundError:
        return None


def _installed(library: str) -> bool:
    return importlib.util.find_spec(_IMPORT_NAMES.get(library, library)) is not None


def _resolve(api: PrivateAPI) -> Any:
    owner: Any = importlib.import_module(api.module)
    for part in filter(None, api.attribute.split(".")):
        call = part.endswith("()")
        owner = getattr(owner, part.removesuffix("()"))
        if call:
            owner = owner()
    return owner


def unverified_versions() -> list[str]:
    """Libraries installed at a ``major.minor`` that no entry was verified on."""
    out = []
    for library in sorted({api.library for api in PRIVATE_APIS}):
        version = installed_version(library)
        if version is None:
            continue
        entries = [api for api in PRIVATE_APIS if api.library == library]
        verified = sorted({v for api in entries for v in api.verified})
        if ".".join(version.split(".")[:2]) not in verified:
            out.append(f"{library} {version} is installed; keras-tfr verified {verified}")
    return out


def _deep_checks() -> list[tuple[str, Callable[[], list[str]]]]:
    # The modules' own, finer checks (signatures, the code around the hooks).
    def shuffle() -> list[str]:
        from keras_tfr._compat import keras_shuffle

        return keras_shuffle.check_private_api()

    def errors() -> list[str]:
        from keras_tfr._compat import keras_errors

        try:
            keras_errors.epoch_iterator_class()
        except ImportError as e:
            return [f"{e} is gone"]
        return []

    def resume() -> list[str]:
        from keras_tfr._compat import keras_resume

        return keras_resume.check_private_api()

    def dist() -> list[str]:
        from keras_tfr._compat import keras_dist

        try:
            keras_dist._resolve()
        except keras_dist.KerasCompatError as e:
            return [str(e)]
        return []

    def build() -> list[str]:
        from keras_tfr._compat import keras_build

        return keras_build.check_private_api()

    def tf_functions() -> list[str]:
        from keras_tfr._compat import tf as compat_tf

        try:
            compat_tf.wrapper_init()
        except (ImportError, AttributeError, TypeError) as e:
            return [
                "tensorflow.python.data.ops.structured_function.StructuredFunctionWrapper"
                " (used by keras_tfr.source and keras_tfr.tfrecords through"
                f" keras_tfr._compat.tf) moved: {e}"
            ]
        return []

    return [
        ("tensorflow", tf_functions),
        ("keras", shuffle),
        ("keras", errors),
        ("keras", resume),
        ("keras", dist),
        ("jax", build),
    ]


def check_all() -> list[str]:
    """Imports and resolves every entry of `PRIVATE_APIS`; says what moved.

    Entries of libraries that are not installed are skipped. The four Keras modules'
    own checks and the JAX trainer's (signatures, the code around each hook) run too.

    Returns:
        One readable line per problem, naming the API, its home in keras-tfr and the
        installed version; empty when everything is where it was verified.

    Example:
        >>> for problem in check_all():
        ...     print(problem)
    """
    problems = []
    for api in PRIVATE_APIS:
        if not _installed(api.library):
            continue
        try:
            _resolve(api)
        except Exception as e:  # ImportError, AttributeError, or the call failed
            problems.append(
                f"{api.name} ({api.library} {installed_version(api.library)}; used by "
                f"{', '.join(api.used_by)} through {api.home}) moved: "
                f"{type(e).__name__}: {e}"
            )
    for library, check in _deep_checks():
        if _installed(library):
            problems += check()
    return problems
