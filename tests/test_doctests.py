"""Run the docstring examples of every public module and the README's example."""

from __future__ import annotations

import doctest
import importlib
import pathlib
import pkgutil

import pytest

import refgeo

MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(refgeo.__path__, prefix="refgeo.")
    if m.name not in ("refgeo.__main__",)
)


@pytest.mark.parametrize("name", MODULES)
def test_module_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} doctest failure(s) in {name}"


def test_readme_example():
    readme = pathlib.Path(__file__).resolve().parents[1] / "README.md"
    result = doctest.testfile(str(readme), module_relative=False, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
    assert result.attempted > 0, "README.md has no doctested example"
