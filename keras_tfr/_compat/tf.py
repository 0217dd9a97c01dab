"""The private TensorFlow APIs keras-tfr uses, each behind one accessor.

Every name here is listed in `keras_tfr._compat.PRIVATE_APIS` (with the TensorFlow
versions it was verified on) and resolved by `keras_tfr._compat.check_all`, so that
``tests/test_compat.py`` names the API when a TensorFlow release moves it. Nothing is
imported until an accessor runs: importing this module does not load TensorFlow.

* ``tensorflow.python.data.ops.iterator_ops.OwnedIterator``: the eager iterator of a
  `tf.data.Dataset`; the source subclasses it to convert damaged-data errors, to read
  eagerly from the memory-mapped reader (``_next_internal``), to make the iterator
  resource only when needed (``_create_iterator``) and to refuse checkpoints in sample
  mode (``_serialize_to_tensors``).
* ``tensorflow.python.eager.context.context()._seed``: the global seed that
  `tf.random.set_seed` sets; `keras_tfr._seeds` hides it while a pipeline is built.
* ``tensorflow.python.data.ops.dataset_ops.DatasetV2._inputs``: the data sets a
  `tf.data.Dataset` reads (``source.map(f)`` reads the source), so that Keras' JAX and
  torch trainers' build from one batch uses up no epoch of a source inside one
  (`keras_tfr._compat.keras_build`).
* ``tensorflow.python.ops.script_ops._internal_py_func`` keeps every Python function that
  `tf.numpy_function` or `tf.py_function` traces outside a graph in the process's default
  graph (``ops.get_default_graph()._py_funcs_used_in_graph``) for as long as the process
  runs (TensorFlow issue 61344): a source's pipeline functions, and through them its
  memory map, outlived the source. `eager_py_funcs` hands that list to the source, which
  takes its own functions out of it when it is collected.
* ``tensorflow.python.lib.io._pywrap_record_io.RandomRecordReader``: reads one TFRecord
  at a byte offset, so that `keras_tfr.verifier` can name the offset of a bad record.
* ``tensorflow.python.data.ops.structured_function.StructuredFunctionWrapper.__init__``:
  traces each function of a tf.data stage (``map``, ``flat_map``, ...); its
  ``defun_kwargs`` become the function's attributes. `one_device_functions` marks the
  source's own functions ``experimental_ints_on_device``
  (``tensorflow.python.eager.polymorphic_function.attributes.INTS_ON_DEVICE``), so that
  each new iterator prepares them without Grappler, and traces them without AutoGraph.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for annotations only: TensorFlow loads when an accessor runs
    from tensorflow.python.data.ops.iterator_ops import OwnedIterator

__all__ = [
    "OwnedIterator",
    "dataset_inputs",
    "eager_py_funcs",
    "get_global_seed",
    "no_inject_prefetch",
    "one_device_functions",
    "owned_iterator",
    "random_record_reader",
    "set_global_seed",
    "wrapper_init",
]


def owned_iterator() -> type[OwnedIterator]:
    """TensorFlow's ``OwnedIterator`` class, the eager iterator of a `tf.data.Dataset`."""
    from tensorflow.python.data.ops.iterator_ops import OwnedIterator

    return OwnedIterator


def __getattr__(name: str) -> Any:
    # `from keras_tfr._compat.tf import OwnedIterator` (a base class, needed at import
    # time of the module that subclasses it) resolves here, lazily.
    if name == "OwnedIterator":
        return owned_iterator()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dataset_inputs(dataset: Any) -> list[Any]:
    """The data sets ``dataset`` reads (``DatasetV2._inputs``); none for an object that is
    not a `tf.data.Dataset` or whose inputs cannot be listed."""
    inputs = getattr(dataset, "_inputs", None)
    if not callable(inputs):
        return []
    try:
        return list(inputs())
    except Exception:  # a data set type that does not implement it
        return []


# tf.data's data sets that hand on their input's elements one for one, as far as
# batching goes (`unbatched_source`): the walk goes on through them.
_PASSING_ON = frozenset(
    {
        "_MapDataset",
        "_ParallelMapDataset",
        "_FilterDataset",
        "_ShuffleDataset",
        "_PrefetchDataset",
        "_RepeatDataset",
        "_TakeDataset",
        "_SkipDataset",
        "CacheDataset",
        "_ZipDataset",
        "_ConcatenateDataset",
        "_OptionsDataset",
        "_ShardDataset",
        "_AssertCardinalityDataset",
        "_IgnoreErrorsDataset",
        "_RestructuredDataset",
    }
)
_SINGLE_SAMPLES = {"_TensorSliceDataset": "from_tensor_slices", "_UnbatchDataset": "unbatch"}


def unbatched_source(dataset: Any) -> str | None:
    """``"from_tensor_slices"`` or ``"unbatch"`` where ``dataset`` hands out single
    samples for certain: one of those data sets is reached from it through data sets
    that pass elements on one for one (``map``, ``shuffle``, ``zip``, ...), with no
    batching on the way. None where a batch (``batch``, ``padded_batch``, any data set
    with a ``_batch_size``) or anything else (``flat_map``, ``interleave``, a generator,
    files) stands in between: it may hand out batches."""
    todo = [dataset]
    seen: set[int] = set()
    while todo:
        d = todo.pop()
        if id(d) in seen:
            continue
        seen.add(id(d))
        name = type(d).__name__
        if hasattr(d, "_batch_size"):
            continue
        if name in _SINGLE_SAMPLES:
            return _SINGLE_SAMPLES[name]
        if name in _PASSING_ON:
            todo.extend(dataset_inputs(d))
    return None


def eager_py_funcs() -> list[Any] | None:
    """TensorFlow's list of the Python functions traced by `tf.numpy_function` and
    `tf.py_function` outside a graph (the default graph's ``_py_funcs_used_in_graph``,
    made here as TensorFlow makes it when it is not there yet); None where it is not a
    list."""
    from tensorflow.python.framework import ops

    graph = ops.get_default_graph()
    if not hasattr(graph, "_py_funcs_used_in_graph"):
        graph._py_funcs_used_in_graph = []
    funcs = graph._py_funcs_used_in_graph
    return funcs if isinstance(funcs, list) else None


def _eager_context() -> Any:
    from tensorflow.python.eager import context  # private: the global seed's only home

    return context.context()


def get_global_seed() -> int | None:
    """The global seed `tf.random.set_seed` set (None when unset or not found)."""
    return getattr(_eager_context(), "_seed", None)


def set_global_seed(seed: int | None) -> None:
    """Sets the eager context's global seed directly, without resetting its random
    sequence (which `tf.random.set_seed` would do)."""
    _eager_context()._seed = seed


def random_record_reader(path: str) -> Any:
    """TensorFlow's private ``RandomRecordReader`` on ``path``: ``read(offset)`` returns
    ``(record, next_offset)`` and raises IndexError at the end of the file."""
    from tensorflow.python.lib.io import _pywrap_record_io

    return _pywrap_record_io.RandomRecordReader(path)


_ONE_DEVICE = threading.local()  # `depth`: how many `one_device_functions` blocks are open
_one_device_lock = threading.Lock()
_ONE_DEVICE_ATTR = "experimental_ints_on_device"


def wrapper_init() -> tuple[Any, Any, inspect.Signature]:
    """tf.data's ``StructuredFunctionWrapper``, its ``__init__`` and that one's signature,
    which must take ``defun_kwargs`` and ``use_legacy_function`` (TypeError otherwise)."""
    from tensorflow.python.data.ops import structured_function
    from tensorflow.python.eager.polymorphic_function import attributes

    if attributes.INTS_ON_DEVICE != _ONE_DEVICE_ATTR:
        raise TypeError(f"the attribute is now named {attributes.INTS_ON_DEVICE!r}")
    if _ONE_DEVICE_ATTR not in attributes.POLYMORPHIC_FUNCTION_ALLOWLIST:
        raise TypeError(f"tf.function no longer takes {_ONE_DEVICE_ATTR!r}")
    cls = structured_function.StructuredFunctionWrapper
    init = getattr(cls.__init__, "__wrapped__", cls.__init__)
    signature = inspect.signature(init)
    for name in ("defun_kwargs", "use_legacy_function"):
        if name not in signature.parameters:
            raise TypeError(f"StructuredFunctionWrapper.__init__ takes no {name!r}")
    return cls, init, signature


def _install_one_device() -> bool:
    """Wraps ``StructuredFunctionWrapper.__init__`` once per process (see
    `one_device_functions`); False where its signature is not the one verified."""
    import tensorflow as tf

    do_not_convert = tf.autograph.experimental.do_not_convert
    with _one_device_lock:
        try:
            cls, init, signature = wrapper_init()
        except (ImportError, AttributeError, TypeError):
            return False
        if getattr(cls.__init__, "_keras_tfr_one_device", False):
            return True

        @functools.wraps(init)
        def wrapped(self: Any, *args: Any, **kwargs: Any) -> None:
            if getattr(_ONE_DEVICE, "depth", 0):
                bound = signature.bind(self, *args, **kwargs)
                if not bound.arguments.get("use_legacy_function", False):
                    attrs = dict(bound.arguments.get("defun_kwargs") or {})
                    attrs.setdefault(_ONE_DEVICE_ATTR, True)
                    bound.arguments["defun_kwargs"] = attrs
                    bound.arguments["func"] = do_not_convert(bound.arguments["func"])
                    return init(*bound.args, **bound.kwargs)
            return init(self, *args, **kwargs)

        wrapped._keras_tfr_one_device = True  # type: ignore[attr-defined]
        cls.__init__ = wrapped
        return True


@contextlib.contextmanager
def one_device_functions() -> Iterator[bool]:
    """While the block runs, the functions this thread's tf.data stages trace (``map``,
    ``flat_map``, ``filter``, ...) are marked ``experimental_ints_on_device`` and traced
    without AutoGraph (`tf.autograph.experimental.do_not_convert`). Yields whether they
    are (False where TensorFlow's tracing is not the one verified: then nothing changes).

    AutoGraph converted every Python function these call, the layout's byte arithmetic
    included: building a block-mode source took 3.6 s for two features and 11.7 s for
    150, 0.18 s and 1.17 s without it (docs/benchmarks.md). keras-tfr's pipeline code
    has no Python control flow on tensors (it calls `tf.cond` where it needs one); the
    user's ``decode`` functions it calls are traced as `tf.function`s, which AutoGraph
    still converts (`keras_tfr.tfrecords.finish_features`).

    TensorFlow prepares every function of a pipeline again for each iterator it makes,
    and Keras makes one for every epoch and every validation pass. A tf.data function
    may run on several devices by default, and such a function goes through Grappler
    (TensorFlow's graph optimizer, MLIR included) every time it is prepared: about 4 ms
    per function on a 2-core VM, 17 ms per iterator for a sample-mode pipeline. For a
    function with this attribute tf.data turns multi-device execution off
    (``FunctionMetadata::Create``): it runs on the iterator's device, the CPU, where
    every op keras-tfr's pipelines use has its kernel and where they ran anyway, and is
    prepared without Grappler: a sample-mode iterator is then made in about 2 ms. On the
    CPU the attribute itself changes nothing (it keeps int32 tensors in the device's
    memory, which is the host's). Functions of the
    user's (``source.map(f)``) are traced outside the block and keep TensorFlow's default.
    """
    installed = _install_one_device()
    _ONE_DEVICE.depth = getattr(_ONE_DEVICE, "depth", 0) + 1
    try:
        yield installed
    finally:
        _ONE_DEVICE.depth -= 1


def no_inject_prefetch(options: Any) -> Any:
    """``options`` (a `tf.data.Options`) with TensorFlow's ``inject_prefetch`` rewrite off,
    for a pipeline whose functions `one_device_functions` marked; returns ``options``.

    TensorFlow 2.21 runs that default rewrite on tf.data functions too, and fails
    ("Expected only one fetch node") on a marked one with several outputs, an int32
    among them: its test for "this item is a function" looks for ``_Retval`` nodes, and
    a marked function returns int32 through ``_DeviceRetval``. keras-tfr's pipelines end
    in a ``prefetch``, so the rewrite has nothing to add to them.
    """
    options.experimental_optimization.inject_prefetch = False
    return options
