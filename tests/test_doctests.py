"""Run the docstring examples of every public module and the README's example; check that
the docstrings' references to docs pages resolve."""

from __future__ import annotations

import doctest
import importlib
import pathlib
import pkgutil
import re

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


# References from the package to the theory pages, in the two forms docstrings use:
# ``:doc:`/theory/rows``` (rendered by Sphinx) and a plain ``docs/theory/rows.md``.
_DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
_DOC_ROLE = re.compile(r":doc:`(?:[^`<]*<)?/?([\w/.-]+?)(?:\.md)?>?`")
_DOC_PATH = re.compile(r"\bdocs/([\w/-]+\.md)\b")


def _doc_references():
    root = pathlib.Path(refgeo.__file__).resolve().parent
    ext = root.parent / "refgeo_ext"  # the kernel sources, in a source checkout
    paths = sorted(root.rglob("*.py"))
    if ext.is_dir():
        paths += sorted(p for p in ext.rglob("*") if p.suffix in {".py", ".tp", ".pxd", ".pyx", ".h"})
    for path in paths:
        text = path.read_text(encoding="utf-8")
        for target in _DOC_ROLE.findall(text):
            yield path.relative_to(root.parent), _DOCS / f"{target}.md"
        for target in _DOC_PATH.findall(text):
            yield path.relative_to(root.parent), _DOCS / target


@pytest.mark.skipif(not _DOCS.is_dir(), reason="docs/ is not in this checkout")
def test_docstring_references_to_docs_pages_resolve():
    refs = list(_doc_references())
    missing = sorted({f"{src}: {dst.relative_to(_DOCS.parent)}" for src, dst in refs if not dst.is_file()})
    assert not missing, "references to docs pages that do not exist:\n" + "\n".join(missing)
    assert refs, "no docstring refers to a docs page"
