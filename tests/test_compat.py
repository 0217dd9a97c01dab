"""Every private API keras-tfr uses is still where it was: `keras_tfr._compat`.

`keras_tfr._compat.PRIVATE_APIS` names each private TensorFlow, Keras, JAX and
keras-tuner API; these tests fail loudly, naming the API, when a library moves one or
the installed version was never verified, so an upgrade is re-verified here rather than
discovered by users. They also check that no keras-tfr module outside `keras_tfr._compat`
imports a private module of those libraries.
"""

from __future__ import annotations

import importlib
import inspect
import re
import warnings
from pathlib import Path

from keras_tfr import _compat
from keras_tfr._compat import keras_dist, keras_resume, keras_shuffle

PACKAGE = Path(__file__).resolve().parent.parent / "keras_tfr"
_PRIVATE_IMPORT = re.compile(
    r"^\s*(?:from|import)\s+(tensorflow\.python|keras\.src|keras_tuner\.src|jax\._src)\b", re.M
)


def test_every_registered_private_api_resolves():
    problems = _compat.check_all()
    assert problems == [], "private APIs moved:\n" + "\n".join(problems)


def test_installed_versions_were_verified():
    unverified = _compat.unverified_versions()
    assert unverified == [], (
        "re-verify the private APIs in keras_tfr/_compat/ on these versions, then add "
        "them to PRIVATE_APIS' `verified`:\n" + "\n".join(unverified)
    )


def test_check_all_names_an_api_that_moved(monkeypatch):
    gone = _compat.PrivateAPI(
        "keras.src.trainers.epoch_iterator",
        "EpochIterator.no_such_method",
        "keras",
        ("3.15",),
        "a test entry",
        ("keras_tfr.source",),
        "keras_tfr._compat.keras_shuffle",
    )
    monkeypatch.setattr(_compat, "PRIVATE_APIS", (*_compat.PRIVATE_APIS, gone))
    (problem,) = _compat.check_all()
    assert "keras.src.trainers.epoch_iterator.EpochIterator.no_such_method" in problem
    assert "keras_tfr.source" in problem and "AttributeError" in problem


def test_registry_points_at_real_modules():
    for api in _compat.PRIVATE_APIS:
        for module in (*api.used_by, api.home):
            importlib.import_module(module)  # ImportError names a stale entry
        assert api.verified and all(re.fullmatch(r"\d+\.\d+", v) for v in api.verified), api


def test_private_imports_live_in_compat_only():
    """Only keras_tfr/_compat/ imports tensorflow.python, keras.src, keras_tuner.src or
    jax._src; every other module goes through its accessors."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent.name == "_compat":
            continue
        for match in _PRIVATE_IMPORT.finditer(path.read_text(encoding="utf-8")):
            offenders.append(f"{path.relative_to(PACKAGE.parent)}: {match.group(0).strip()}")
    assert offenders == [], "\n".join(offenders)


def test_every_private_import_in_compat_is_registered():
    registered = {api.module for api in _compat.PRIVATE_APIS}
    found = set()
    for path in sorted((PACKAGE / "_compat").glob("*.py")):
        text = path.read_text(encoding="utf-8")
        found |= {m.group(1) for m in re.finditer(r"^\s*from\s+(\S+)\s+import", text, re.M)}
        found |= {m.group(1) for m in re.finditer(r"^\s*import\s+(\S+)", text, re.M)}
    private = {m for m in found if _PRIVATE_IMPORT.match(f"import {m}")}
    # `from tensorflow.python.lib.io import _pywrap_record_io` names the package.
    unregistered = {
        m for m in private if not any(r == m or r.startswith(m + ".") for r in registered)
    }
    assert unregistered == set(), unregistered


# --- keras_shuffle (Keras' shuffle warning) ------------------------------------------


def _shuffle_warnings(record):
    return [w for w in record if keras_shuffle.SHUFFLE_WARNING in str(w.message)]


def _original_init(iterator_class):
    init = iterator_class.__init__
    return getattr(init, "__wrapped__", init) if getattr(init, keras_shuffle._MARK, False) else init


def test_shuffle_filter_api_is_where_it_is_expected():
    import importlib

    import keras

    low, high = keras_shuffle.KERAS_VERIFIED
    assert keras_shuffle.keras_version_verified(), (
        f"Keras {keras.__version__} is outside the range keras_tfr/_compat/keras_shuffle.py "
        f"was verified on ({low} to {high}, exclusive): check each private API its "
        "docstring lists, then widen KERAS_VERIFIED."
    )
    epoch_iterator = importlib.import_module(keras_shuffle.EPOCH_ITERATOR_MODULE)
    iterator_class = getattr(epoch_iterator, keras_shuffle.EPOCH_ITERATOR)
    init = _original_init(iterator_class)
    params = list(inspect.signature(init).parameters)
    assert params[:2] == ["self", "x"] and "shuffle" in params, (
        f"{keras_shuffle.EPOCH_ITERATOR_MODULE}.EpochIterator.__init__ changed: {params}"
    )
    # It hands `shuffle` to get_data_adapter, which is what warns.
    body = inspect.getsource(init)
    assert f"{keras_shuffle.GET_DATA_ADAPTER}(" in body and "shuffle=shuffle" in body, body
    adapters = importlib.import_module(keras_shuffle.DATA_ADAPTERS_MODULE)
    get_data_adapter = getattr(adapters, keras_shuffle.GET_DATA_ADAPTER)
    assert {"x", "shuffle"} <= set(inspect.signature(get_data_adapter).parameters)
    # It warns for a tf.data.Dataset with shuffle=True (what the filter exists for), and
    # only then: the flag has no other effect for a data set.
    import tensorflow as tf

    dataset = tf.data.Dataset.range(4).batch(2)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        shuffled = get_data_adapter(x=dataset, shuffle=True)
        assert len(_shuffle_warnings(record)) == 1, [str(w.message) for w in record]
        plain = get_data_adapter(x=dataset, shuffle=False)
        assert len(_shuffle_warnings(record)) == 1
    assert type(shuffled) is type(plain) and vars(shuffled).keys() == vars(plain).keys()
    # Every backend's iterator goes through EpochIterator.__init__: inherited, or called
    # as super().__init__.
    for module, name in [
        ("keras.src.backend.tensorflow.trainer", "TFEpochIterator"),
        ("keras.src.backend.jax.trainer", "JAXEpochIterator"),
        ("keras.src.backend.torch.trainer", "TorchEpochIterator"),
    ]:
        try:
            sub = getattr(importlib.import_module(module), name)
        except ImportError:  # that backend's framework is not installed
            continue
        assert issubclass(sub, iterator_class)
        own = vars(sub).get("__init__")
        assert own is None or "super().__init__(" in inspect.getsource(own), f"{module}.{name}"


# --- keras_resume (BackupAndRestore's mid-epoch resume) -------------------------------


def test_resume_api_is_where_keras_tfr_expects_it():
    problems = keras_resume.check_private_api()
    assert problems == [], "Keras moved an API keras_tfr.backup relies on:\n" + "\n".join(problems)


def test_api_check_notices_a_moved_api(monkeypatch):
    from keras.src.trainers.epoch_iterator import EpochIterator

    def _enumerate_iterator(self):  # a rewritten loop
        yield from ()

    import keras

    monkeypatch.setattr(EpochIterator, "_enumerate_iterator", _enumerate_iterator)
    monkeypatch.setattr(keras, "version", lambda: "3.16.0")
    problems = keras_resume.check_private_api()
    assert any("Keras 3.16.0" in p for p in problems)
    assert any("_enumerate_iterator lost" in p for p in problems)


# --- keras_dist (MultiWorkerMirroredStrategy) -----------------------------------------


def test_private_keras_apis_are_where_the_fix_expects_them():
    """Fails loudly when Keras moves or changes a function the fix wraps."""
    for path, parameters in keras_dist.PRIVATE_APIS.items():
        module_name, _, rest = path.partition(".TensorFlowTrainer.")
        if rest:
            owner = importlib.import_module(module_name).TensorFlowTrainer
            name = rest
        else:
            module_name, _, name = path.rpartition(".")
            owner = importlib.import_module(module_name)
        function = inspect.unwrap(getattr(owner, name))
        assert tuple(inspect.signature(function).parameters) == parameters, path
    module, trainer = keras_dist._resolve()
    assert trainer is module.TensorFlowTrainer


def test_corrupt_record_patch_is_left_out_outside_the_verified_keras_versions(monkeypatch):
    """docs/reliability.md: the patch that makes `fit` raise `CorruptRecordError` is
    installed only on the Keras versions it was checked on; elsewhere nothing changes."""
    from keras_tfr._compat import keras_errors

    cls = keras_errors.epoch_iterator_class()
    before = cls.catch_stop_iteration
    monkeypatch.setattr(keras_errors, "_installed", False)
    lo, hi = keras_errors.VERIFIED_KERAS
    for outside in (hi, (hi[0], hi[1] + 5), (lo[0] - 1, 9)):
        monkeypatch.setattr(keras_errors, "keras_version", lambda v=outside: v)
        assert keras_errors.install_corrupt_record_errors(lambda e: None) is False, outside
        assert cls.catch_stop_iteration is before
    # Inside the range it is installed (undone by monkeypatch when the test ends).
    monkeypatch.setattr(cls, "catch_stop_iteration", before)
    monkeypatch.setattr(keras_errors, "keras_version", lambda: lo)
    assert keras_errors.install_corrupt_record_errors(lambda e: None) is True
    assert cls.catch_stop_iteration is not before


class _FakeBaseTuner:
    def __init__(self, hypermodel, objective=None, overwrite=False, directory=None):
        self.hypermodel, self.overwrite, self.directory = hypermodel, overwrite, directory


def test_base_tuner_patch_keeps_workers_from_overwriting_the_project():
    """docs/tuning.md: only the chief may start the project afresh; a worker built with
    ``overwrite=True`` (keyword or positional) would delete the trials of the others."""
    import types

    from keras_tfr._compat import tuner as compat_tuner

    for worker in (True, False):
        module = types.SimpleNamespace(
            BaseTuner=type("BaseTuner", (_FakeBaseTuner,), {"__init__": _FakeBaseTuner.__init__})
        )
        built = []
        compat_tuner.patch_base_tuner(module, lambda w=worker: w, built.append)
        by_keyword = module.BaseTuner("hm", overwrite=True, directory="d")
        by_position = module.BaseTuner("hm", "val_loss", True, "d")
        for tuner in (by_keyword, by_position):
            assert tuner.overwrite is (not worker), (worker, tuner.overwrite)
            assert tuner.hypermodel == "hm" and tuner.directory == "d"
        assert built == [by_keyword, by_position], "on_built gets every tuner built"


def test_oracle_chief_patch_shortens_only_the_sleeps():
    """docs/tuning.md: the chief's 20 s waits become `CHIEF_POLL_S`; the rest of `time`
    is the real module."""
    import time
    import types

    from keras_tfr._compat import tuner as compat_tuner

    module = types.SimpleNamespace(time=time)
    compat_tuner.patch_oracle_chief(module)
    assert module.time is not time and compat_tuner.CHIEF_POLL_S == 0.5
    start = time.monotonic()
    module.time.sleep(20)
    assert time.monotonic() - start < 5
    assert abs(module.time.time() - time.time()) < 1
