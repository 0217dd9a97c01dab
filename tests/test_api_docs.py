"""The public API is documented and typed: what `make docs` turns into the API reference.

Public names: ``keras_tfr.__all__`` and ``keras_tfr.tuner.__all__``. Each must have a
Google-style docstring with an ``Example:`` section, and full type annotations (every
parameter and the return of each public function and method), so that ``py.typed`` holds
for users' type checkers.
"""

from __future__ import annotations

import inspect
import re

import pytest

import keras_tfr
import keras_tfr.tuner

PUBLIC = [(keras_tfr, name) for name in keras_tfr.__all__ if name != "__version__"] + [
    (keras_tfr.tuner, name) for name in keras_tfr.tuner.__all__
]
IDS = [f"{module.__name__}.{name}" for module, name in PUBLIC]
# "Example:" then, after blank lines, an indented body or a fenced code block.
_EXAMPLE = re.compile(r"^Examples?:\n(?:[ \t]*\n)*(?:[ \t]+\S|```)", re.M)


@pytest.mark.parametrize("module, name", PUBLIC, ids=IDS)
def test_public_name_has_a_docstring_with_an_example(module, name):
    obj = getattr(module, name)
    doc = obj.__doc__
    assert doc and doc.strip(), f"{module.__name__}.{name} has no docstring"
    assert _EXAMPLE.search(inspect.cleandoc(doc)), (
        f"{module.__name__}.{name}'s docstring has no 'Example:' section with an indented body"
    )


def test_version_is_a_version_string():
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", keras_tfr.__version__)


def _public_callables(obj):
    if inspect.isfunction(obj):
        yield obj.__qualname__, obj
        return
    if inspect.isclass(obj):
        for attr, value in vars(obj).items():
            if attr.startswith("_") and attr != "__init__":
                continue
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if isinstance(value, property):
                value = value.fget
            if inspect.isfunction(value):
                yield f"{obj.__qualname__}.{attr}", value


def _missing_annotations(function) -> list[str]:
    signature = inspect.signature(function)
    missing = [
        name
        for i, (name, param) in enumerate(signature.parameters.items())
        if param.annotation is inspect.Parameter.empty and not (i == 0 and name in ("self", "cls"))
    ]
    # As for mypy, `__init__` with annotated parameters returns None without saying so.
    if signature.return_annotation is inspect.Signature.empty and function.__name__ != "__init__":
        missing.append("return")
    return missing


@pytest.mark.parametrize(
    "module, name",
    PUBLIC,
    ids=IDS,
)
def test_public_name_is_fully_annotated(module, name):
    obj = getattr(module, name)
    problems = {
        qualname: missing
        for qualname, function in _public_callables(obj)
        if (missing := _missing_annotations(function))
    }
    assert problems == {}, f"not annotated: {problems}"


def test_the_checks_can_fail():
    def untyped(a, b: int):
        """No example here."""

    assert _missing_annotations(untyped) == ["a", "return"]
    assert _EXAMPLE.search("Summary.\n\nExample:\n\n```python\nf()\n```\n")
    assert not _EXAMPLE.search(inspect.cleandoc(untyped.__doc__))
    assert _EXAMPLE.search("Summary.\n\nExample:\n    >>> f()\n")
    assert not _EXAMPLE.search("Summary.\n\nExample:\nnot indented\n")
