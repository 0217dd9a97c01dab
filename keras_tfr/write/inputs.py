"""Input normalization: arrays, memmaps, h5py data sets, dicts, lists and iterables of
batches become validated `Batch`es of array-likes, one per feature in key order.

Nothing here reads more than a slice of the input: arrays are kept as given (a memmap or
an h5py data set stays on disk) and sliced by the writer chunk by chunk. Variable-length
features (lists of arrays or of byte strings) become `Variable`s, which slice like arrays.
The memmap page advice (`populate_pages`, `release_pages`) keeps a conversion's memory
flat when its input is a file mapping larger than RAM.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from keras_tfr._io import HUGE_PAGE
from keras_tfr.schema import SUPPORTED_DTYPES, FeatureSpec, bool_bytes, check_dtype


def is_array_like(v: Any) -> bool:
    return hasattr(v, "shape") and hasattr(v, "dtype") and hasattr(v, "__getitem__")


def is_pandas(v: Any) -> bool:
    """A pandas ``DataFrame`` or ``Series`` (told by its module: pandas is not imported)."""
    return type(v).__module__.split(".")[0] == "pandas" and callable(getattr(v, "to_numpy", None))


def _pandas_values(v: Any, argument: str) -> np.ndarray:
    """A pandas ``DataFrame``'s or ``Series``' values, as Keras reads them (in memory
    already). A DataFrame's columns of numbers and bools become one array of their common
    dtype (``np.result_type``: bool and float32 columns give float32, not the object
    array ``to_numpy`` gives); a column of anything else is refused by name."""
    columns = getattr(v, "columns", None)
    if columns is None:  # a Series: object values (lists, strings) are looked at below
        return np.asarray(v.to_numpy())
    dtypes = list(v.dtypes)
    if not dtypes:
        raise ValueError(
            f"Expected `{argument}` (a pandas DataFrame) to have at least one column. "
            f"Received: a DataFrame of {len(v)} rows and no columns"
        )
    bad = [
        (c, d)
        for c, d in zip(columns, dtypes)
        if not (isinstance(d, np.dtype) and d.kind in "biuf")
    ]
    if bad:
        c, d = bad[0]
        raise TypeError(
            f"Expected the columns of `{argument}` (a pandas DataFrame) to hold numbers or "
            f"bools, as an array does. Received: column {c!r} of dtype {d}. Convert it "
            f"first (df[{c!r}].astype('float32'), or one-hot encode a category), or give "
            "it as a feature of its own in a dict."
        )
    return np.asarray(v.to_numpy(dtype=np.result_type(*dtypes)))


def _flatten(
    role: str, value: Any, variable: frozenset = frozenset()
) -> tuple[str, list[tuple[str, Any]]] | None:
    """Returns (structure, [(name, array_like)]) for one role, or None when absent.

    `variable` holds the feature keys declared variable-length (``variable_length=``).
    """
    if value is None:
        return None
    if role in variable and isinstance(value, (list, tuple)):
        return "array", [("", Variable.from_values(value, role))]
    if isinstance(value, Mapping):
        if not value:
            raise ValueError(f"Expected `{role}` to be a non-empty dict of arrays. Received: {{}}")
        items = []
        for k in value:  # the order given: the data set keeps it (`Batch.key_order`)
            if not isinstance(k, str) or not k or "/" in k or "\x00" in k or len(k) > 255:
                raise ValueError(
                    f"Expected the keys of `{role}` to be non-empty strings without '/'. "
                    f"Received: key {k!r}"
                )
            items.append((k, _as_array_like(value[k], f"{role}[{k!r}]", f"{role}/{k}" in variable)))
        return "dict", items
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"Expected `{role}` to be a non-empty list of arrays. Received: []")
        return "list", [
            (str(i), _as_array_like(v, f"{role}[{i}]", f"{role}/{i}" in variable))
            for i, v in enumerate(value)
        ]
    return "array", [("", _as_array_like(value, role, role in variable))]


def _as_array_like(v: Any, argument: str, variable: bool = False) -> Any:
    if variable or (isinstance(v, np.ndarray) and v.dtype == object and v.ndim == 1):
        return Variable.from_values(v, argument)
    if is_pandas(v):
        v = _pandas_values(v, argument)
        if v.dtype == object and v.ndim == 1:  # a column of lists or arrays
            return Variable.from_values(v, argument)
    if callable(getattr(v, "numpy", None)) and not isinstance(getattr(v, "dtype", None), np.dtype):
        # A tensor (TensorFlow's, Keras', torch's): in memory already; its dtype is not
        # NumPy's, so the writer takes its NumPy view (host memory for a GPU tensor).
        if callable(getattr(v, "detach", None)) and callable(getattr(v, "cpu", None)):
            v = v.detach().cpu()  # torch: a tensor with a gradient, or on a GPU
        try:
            values = np.asarray(v.numpy())
            if values.dtype == object and values.ndim == 1:  # a tf.RaggedTensor's rows
                return Variable.from_values(values, argument)
            if hasattr(v, "row_splits") and hasattr(v, "flat_values") and values.ndim >= 1:
                # A tf.RaggedTensor whose rows happen to be of one length: `numpy()` gives a
                # dense array, yet the feature stays variable-length (its other batches).
                return Variable.from_values(list(values), argument)
            return values
        except TypeError as e:  # torch's bfloat16 and others without a NumPy dtype
            raise TypeError(
                f"Expected `{argument}` to have one of the dtypes {sorted(SUPPORTED_DTYPES)}. "
                f"Received: a {type(v).__name__} of dtype {v.dtype}, which has no NumPy "
                f"dtype ({e}); cast it first, e.g. to float32."
            ) from e
    if is_array_like(v):
        return v
    if isinstance(v, Mapping):
        raise TypeError(
            f"Expected `{argument}` to be an array: inputs nest one level (a dict or a list "
            f"of arrays). Received: a {type(v).__name__} with keys {sorted(map(str, v))[:5]}"
        )
    if isinstance(v, (int, float, bool, np.generic)):
        raise ValueError(
            f"Expected `{argument}` to be an array whose first axis indexes samples. "
            f"Received: the scalar {v!r}"
        )
    try:
        return np.asarray(v)
    except Exception as e:
        raise TypeError(
            f"Expected `{argument}` to be a NumPy array, np.memmap, h5py data set or any "
            f"array-like with `shape`, `dtype` and slicing. Received: {type(v).__name__}"
        ) from e


class Variable:
    """A variable-length feature's samples: arrays of varying first axis, or byte strings.

    Looks like an array of ``len(items)`` samples to the writer (``shape``, ``dtype``,
    slicing); `FeatureSpec.from_array` reads ``feature_kind`` and ``row_shape``.
    """

    def __init__(self, items: list, kind: str, dtype: np.dtype, row_shape: tuple[int, ...]):
        self.items = items
        self.feature_kind = kind
        self.dtype = dtype
        self.row_shape = row_shape
        self.shape = (len(items),)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: slice) -> Variable:
        return Variable(self.items[index], self.feature_kind, self.dtype, self.row_shape)

    @property
    def nbytes(self) -> int:
        if self.feature_kind == "bytes":
            return sum(len(v) for v in self.items)
        return sum(a.nbytes for a in self.items)

    @classmethod
    def from_values(cls, values: Any, argument: str) -> Variable:
        if isinstance(values, np.ndarray) and values.dtype != object:
            if values.ndim < 2:
                raise ValueError(
                    f"Expected `{argument}` (declared variable-length) to hold samples of at "
                    f"least one dimension. Received: an array of shape {values.shape}"
                )
            values = list(values)
        items = list(values)
        if not items:
            raise ValueError(f"Expected at least one sample in `{argument}`. Received: none.")
        if all(isinstance(v, (bytes, bytearray, memoryview, np.bytes_)) for v in items):
            items = [bytes(v) if not isinstance(v, bytes) else v for v in items]
            return cls(items, "bytes", np.dtype(np.uint8), ())
        arrays = []
        first = None
        for i, v in enumerate(items):
            if isinstance(v, (str, bytes, bytearray, memoryview, dict)) or v is None:
                raise TypeError(
                    f"Expected `{argument}` to be a list (or 1-D object array) of NumPy arrays "
                    "of at least one dimension, or of byte strings (all of one kind). "
                    f"Received: element {i} of type {type(v).__name__}"
                    + (" (encode strings to bytes first)" if isinstance(v, str) else "")
                )
            a = np.asarray(v)
            if a.dtype == object or a.ndim == 0:
                hint = ""
                if a.ndim == 0 and a.dtype != object:
                    # e.g. pandas' `.values` of a column of numbers: an object array.
                    hint = (
                        f". For one number per sample, give `{argument}` as a numeric array: "
                        f"`np.asarray({argument}, dtype={a.dtype.name!r})`"
                    )
                raise TypeError(
                    f"Expected `{argument}` to be a list (or 1-D object array) of NumPy arrays "
                    "of at least one dimension, or of byte strings. Received: element "
                    f"{i} of dtype {a.dtype} and shape {a.shape}" + hint
                )
            if first is None:
                first = a
                try:
                    dt = check_dtype(a.dtype, argument=argument)
                except TypeError as e:  # name the element, as for the later ones
                    raise TypeError(f"{e} Received at element {i} of `{argument}`.") from e
            elif a.dtype != first.dtype or a.shape[1:] != first.shape[1:]:
                raise ValueError(
                    f"Expected every sample of `{argument}` to have dtype {first.dtype} and "
                    f"shape (length, *{first.shape[1:]}). Received: element {i} of dtype "
                    f"{a.dtype} and shape {a.shape}"
                )
            arrays.append(a)
        assert first is not None  # `items` is not empty (checked above)
        le = dt.newbyteorder("<") if dt.itemsize > 1 else dt
        if dt == np.bool_:
            arrays = [bool_bytes(a) for a in arrays]
        else:
            arrays = [np.ascontiguousarray(a, dtype=le) for a in arrays]
        return cls(arrays, "ragged", dt, tuple(int(d) for d in first.shape[1:]))

    def payload(self) -> tuple[bytes, bytes]:
        """The block's values back to back, and per sample its length (rows or bytes)."""
        if self.feature_kind == "bytes":
            lengths = [len(v) for v in self.items]
        else:
            lengths = [a.shape[0] for a in self.items]
            values = b"".join(a.reshape(-1).view(np.uint8) for a in self.items)
            return values, np.asarray(lengths, dtype="<i8").tobytes()
        return b"".join(self.items), np.asarray(lengths, dtype="<i8").tobytes()


def join_payload(spec: FeatureSpec, parts: list[Any]) -> Any:
    """One block's payload of `spec` from the parts pending for it."""
    if spec.kind == "fixed":
        return b"".join(memoryview(a).cast("B") for a in parts)
    items = [item for part in parts for item in part.items]
    return Variable(items, spec.kind, np.dtype(spec.dtype), spec.shape).payload()


def mean_sample_bytes(spec: FeatureSpec, array: Any) -> float:
    if spec.kind == "fixed":
        return float(spec.sample_bytes)
    return array.nbytes / max(1, len(array)) + 8


class Batch:
    """One validated `write` call: specs in key order, their arrays and the sample count;
    ``key_order`` holds, per role given as a dict, its names in the order the dict gave
    them (what a source's dicts keep)."""

    def __init__(
        self,
        structure: dict[str, str],
        specs: list[FeatureSpec],
        arrays: list[Any],
        key_order: dict[str, list[str]] | None = None,
    ):
        self.structure = structure
        self.specs = specs
        self.arrays = arrays
        self.key_order = key_order or {}
        self.n = int(arrays[0].shape[0])


def validate_batch(x: Any, y: Any, sample_weight: Any, variable: frozenset = frozenset()) -> Batch:
    """One `write` call's input as a `Batch`, or ValueError / TypeError that says why.

    `variable` holds the feature keys declared variable-length.
    """
    if x is None:
        raise ValueError("Expected `x` to hold at least one array. Received: x=None")
    if sample_weight is not None and y is None:
        raise ValueError(
            "Expected `y` with `sample_weight`: Keras weighs each sample's loss against "
            "its target, so a data set with sample weights needs targets. "
            f"Received: y=None and sample_weight of type {type(sample_weight).__name__}"
        )
    structure: dict[str, str] = {}
    specs: list[FeatureSpec] = []
    arrays: list[Any] = []
    key_order: dict[str, list[str]] = {}
    for role, value in (("x", x), ("y", y), ("sample_weight", sample_weight)):
        flat = _flatten(role, value, variable)
        if flat is None:
            continue
        kind, items = flat
        structure[role] = kind
        if kind == "dict":
            key_order[role] = [name for name, _ in items]
        for name, arr in items:
            argument = role if kind == "array" else f"{role}[{name!r}]"
            specs.append(FeatureSpec.from_array(role, name, arr, argument=argument))
            arrays.append(arr)
    _check_lengths(specs, arrays)
    order = sorted(range(len(specs)), key=lambda i: specs[i].key)
    return Batch(structure, [specs[i] for i in order], [arrays[i] for i in order], key_order)


def _check_lengths(specs: list[FeatureSpec], arrays: list[Any]) -> None:
    lengths = {s.key: int(a.shape[0]) for s, a in zip(specs, arrays)}
    if len(set(lengths.values())) > 1:
        items = [f"{k}: {v}" for k, v in lengths.items()]
        received = ", ".join(items[:6]) + (f", ... ({len(items)} in all)" if len(items) > 6 else "")
        # A list of many arrays of different lengths is most likely samples of varying
        # length, which Keras' reading of a list (several inputs) does not fit.
        listed = {k.split("/")[0] for k in lengths if k.split("/")[-1].isdigit()}
        hint = "".join(
            f" A list is read as several inputs, one array each, as Keras reads it; for "
            f"samples of varying length, pass `variable_length=[{role!r}]`."
            for role in sorted(listed)
            if sum(k.startswith(role + "/") for k in lengths) > 2
        )
        raise ValueError(
            "Expected `x`, `y` and `sample_weight` to hold the same number of samples. "
            f"Received: {received}.{hint}"
        )
    if next(iter(lengths.values())) == 0:
        raise ValueError("Expected at least one sample. Received: empty arrays (0 samples).")
    for s in specs:
        if s.sample_bytes == 0:
            raise ValueError(
                f"Expected samples of `{s.key}` to hold at least one value. "
                f"Received: per-sample shape {s.shape}"
            )


def check_same_schema(expected: tuple[dict[str, str], list[FeatureSpec]], batch: Batch) -> None:
    """Refuses a batch whose structure or features differ from the first batch's."""
    structure, specs = expected
    if batch.structure != structure:
        raise ValueError(
            "Expected every batch to have the structure of the first one. "
            f"Expected: {structure}. Received: {batch.structure}"
        )
    old = {s.key: s for s in specs}
    new = {s.key: s for s in batch.specs}
    if set(old) != set(new):
        raise ValueError(
            "Expected every batch to hold the features of the first one. "
            f"Expected: {sorted(old)}. Received: {sorted(new)}"
        )
    for k, s in new.items():
        o = old[k]
        if (s.dtype, s.shape, s.kind) != (o.dtype, o.shape, o.kind):
            raise ValueError(
                f"Expected `{k}` to keep dtype {o.dtype} and per-sample shape {o.shape} "
                f"({o.kind}) across batches. Received: dtype {s.dtype}, shape {s.shape} "
                f"({s.kind})"
            )


def is_batch_iterable(x: Any) -> bool:
    """Whether ``x`` is an iterable of batches rather than arrays (or a structure of them).

    A list holds one array per input, as Keras reads a list; but a non-empty list of
    tuples can only be batches (``[(x, y), ...]``: a tuple is no array-like), and is
    read as such."""
    if isinstance(x, list) and x and all(isinstance(item, tuple) for item in x):
        return True
    if x is None or is_array_like(x) or is_pandas(x):
        return False
    if isinstance(x, (Mapping, list, tuple, str, bytes)):
        return False
    return isinstance(x, Iterable) or _is_batch_sequence(x)


def _is_batch_sequence(x: Any) -> bool:
    """An object with ``__len__`` and ``__getitem__`` but no ``__iter__`` and no ``shape``
    (an array-like has one): batches by index (an old-style ``keras.utils.Sequence``)."""
    return (
        callable(getattr(x, "__len__", None))
        and callable(getattr(x, "__getitem__", None))
        and not hasattr(x, "shape")
    )


def iterate_batches(x: Any) -> Iterable[Any]:
    """The batches of an iterable of batches: ``x[0], ..., x[len(x) - 1]`` for a
    sequence of batches without ``__iter__`` (Python's fallback would read on past its
    end until an `IndexError`), else ``iter(x)``."""
    if not isinstance(x, Iterable) and _is_batch_sequence(x):
        return (x[i] for i in range(len(x)))
    return x


def check_batched(batches: Any) -> None:
    """Refuses a `tf.data.Dataset` of single samples (not batched): made by
    ``from_tensor_slices`` or ``unbatch`` with no ``batch`` after it (each sample's first
    axis would be read as the samples of a batch: 100 images of 28 x 28 written as 2,800
    rows), or with a component that has no first axis to index samples by (labels of
    shape ``()``). Checked on the data set's structure and element spec, before anything
    is read or written."""
    spec = getattr(batches, "element_spec", None)
    if spec is None or not callable(getattr(batches, "batch", None)):
        return
    import tensorflow as tf

    from keras_tfr._compat.tf import unbatched_source

    made_by = unbatched_source(batches)
    if made_by is not None:
        raise ValueError(
            "Expected `x` to be a tf.data.Dataset of batches, each component's first axis "
            f"indexing samples. Received: a data set of single samples (made by "
            f"`{made_by}` with no `batch` after it: {spec}). Batch it first: "
            "`dataset.batch(256)` (a data set that slices batches made already: "
            "`dataset.unbatch().batch(256)`)."
        )
    for component in tf.nest.flatten(spec):
        shape = getattr(component, "shape", None)
        if shape is not None and shape.rank == 0:
            raise ValueError(
                "Expected `x` to be a tf.data.Dataset of batches, each component's first "
                "axis indexing samples. Received: a data set of single samples (a "
                f"component of shape {shape}: {spec}). Batch it first: "
                "`dataset.batch(256)`."
            )


def split_batch(item: Any) -> tuple:
    if isinstance(item, tuple):
        if not 1 <= len(item) <= 3:
            raise ValueError(
                "Expected each batch to be `x`, `(x,)`, `(x, y)` or `(x, y, sample_weight)`. "
                f"Received: a tuple of {len(item)} elements"
            )
        return item
    return (item,)


def batch_len(parts: tuple) -> int:
    """The samples in a batch of an iterable, from its first array (the batch is checked
    whole when it is written); a ValueError for a batch that holds no array."""
    first = parts[0]
    while isinstance(first, (Mapping, list, tuple)):
        if not first:
            raise ValueError(
                "Expected each batch of `x` to hold arrays whose first axis indexes samples. "
                f"Received: an empty {type(first).__name__}"
            )
        first = next(iter(first.values())) if isinstance(first, Mapping) else first[0]
    shape = () if first is None or isinstance(first, (str, bytes)) else np.shape(first)
    if not shape:
        raise ValueError(
            "Expected each batch of `x` to hold arrays whose first axis indexes samples. "
            f"Received: {_short(first)} (a {type(first).__name__}), which has no first axis"
        )
    return int(shape[0])


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def take_rows(arr: Any, ids: np.ndarray) -> Any:
    """Rows ``ids`` of an array-like (or a `Variable`), in that order, in memory.

    Read in increasing index order (h5py's fancy indexing requires it; a memmap's disk
    prefers it), then put in the order asked for. Array-likes without fancy indexing are
    read row by row.
    """
    if isinstance(arr, Variable):
        return Variable(
            [arr.items[i] for i in ids.tolist()], arr.feature_kind, arr.dtype, arr.row_shape
        )
    order = np.argsort(ids, kind="stable")
    ascending = ids[order]
    if isinstance(arr, np.memmap):
        # A page fault maps the pages around it too (64 KB), so reading rows at random
        # maps far more than it reads: the pages go again every few hundred rows, which
        # bounds this process' memory by that, not by the file.
        got = np.empty((len(ascending), *arr.shape[1:]), dtype=arr.dtype)
        for k in range(0, len(ascending), _RELEASE_ROWS):
            got[k : k + _RELEASE_ROWS] = arr[ascending[k : k + _RELEASE_ROWS]]
            release_pages(arr, 0, len(arr))
    else:
        try:
            got = np.asarray(arr[ascending])
        except (TypeError, IndexError, ValueError):
            got = np.stack([np.asarray(arr[int(i)]) for i in ascending])
    out = np.empty_like(got)
    out[order] = got
    return out


_RELEASE_ROWS = 256  # rows of a memmap read at random between releases of its pages


def slice_parts(part: Any, start: int, stop: int) -> Any:
    if part is None:
        return None
    if isinstance(part, Mapping):
        return {k: slice_parts(v, start, stop) for k, v in part.items()}
    if isinstance(part, (list, tuple)):
        return type(part)(slice_parts(v, start, stop) for v in part)
    return part[start:stop]


@functools.lru_cache(maxsize=1)
def libc() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def release_pages(arr: Any, start: int, stop: int) -> None:
    """Drops the converted rows of a read-only or shared memmap from this process' memory.

    Pages of a file mapping that were read stay mapped, and count in RSS, until unmapped:
    converting a memmap larger than RAM would look like it loads the whole file.
    ``MADV_DONTNEED`` on a read-only or shared mapping only drops the mapping's pages (the
    data stays in the file and the page cache); copy-on-write (mode ``"c"``) maps are left alone.

    Dropped in whole, aligned 2 MB pieces, as conversion passes them: from the 2 MB
    boundary at or below row ``start`` (the rows before it were converted before: rows
    are released in order) to the one at or below row ``stop`` (the rows past it wait
    for the next call; at most 2 MB stays mapped). The kernel maps a huge page of the
    page cache whole, and dropping part of one split it: converting so from a memmap,
    the shards written after the first were cached in small pieces, which the reader
    cannot map as huge pages (`keras_tfr.write.sink._FramedFile`).
    """
    if not isinstance(arr, np.memmap) or getattr(arr, "mode", "c") not in ("r", "r+", "readonly"):
        return
    if not arr.flags.c_contiguous or arr.ndim == 0:
        return
    import mmap

    _madvise(arr, start, stop, mmap.MADV_DONTNEED, inward=True, grain=HUGE_PAGE)


def _madvise(arr: Any, start: int, stop: int, advice: int, inward: bool, grain: int = 0) -> None:
    """`madvise` on rows ``[start, stop)`` of a C-contiguous array: on the whole pages
    inside them (``inward``) or on every page they touch. With ``grain`` (a multiple of
    the page size) and ``inward``: on the whole ``grain`` pieces from the one that holds
    row ``start`` (never before the array's first page) to the one that holds row
    ``stop``. Errors are ignored (an advice)."""
    try:
        import ctypes
        import mmap

        row = arr.strides[0]
        base = arr.__array_interface__["data"][0]
        page = max(mmap.PAGESIZE, grain)
        lo = base + start * row
        hi = base + stop * row
        if inward and grain:  # whole pieces from the one that holds ``lo``, in the array
            first = (base + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
            lo, hi = max(first, lo // page * page), hi // page * page
        elif inward:
            lo, hi = (lo + page - 1) // page * page, hi // page * page
        else:
            lo, hi = lo // page * page, (hi + page - 1) // page * page
        if hi <= lo:
            return
        libc().madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), advice)
    except (OSError, AttributeError, ValueError):
        pass


_MADV_POPULATE_READ = 22  # Linux 5.14+: maps a range of pages in one call


def populate_pages(arr: Any, start: int, stop: int) -> None:
    """Maps rows of a memmap with one `madvise` instead of a page fault per 4 KB page."""
    if not isinstance(arr, np.memmap) or not arr.flags.c_contiguous or arr.ndim == 0:
        return
    _madvise(arr, start, stop, _MADV_POPULATE_READ, inward=False)
