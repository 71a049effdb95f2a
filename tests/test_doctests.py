"""Run the docstring examples of every public module and the README's example; check that
the docstrings' references to docs pages resolve."""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import importlib.util
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


# ---------------------------------------------------------------- signatures and docstrings

def _public_callables(module):
    """(qualified name, object) of the functions and classes in ``module.__all__``."""
    import inspect

    for name in getattr(module, "__all__", []):
        obj = getattr(module, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            yield f"{module.__name__}.{name}", obj


def test_public_functions_take_arrays_and_sizes_by_position_and_options_by_name():
    """docs/api/index.md: arrays and the numbers that define the problem are
    positional-only, every option keyword-only; no argument may be passed both ways."""
    import inspect

    both = []
    for qual, obj in _public_callables(refgeo):
        if inspect.isfunction(obj):
            params = inspect.signature(obj).parameters.values()
            both += [f"{qual}({p.name})" for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert not both, "positional-or-keyword arguments: " + ", ".join(both)


_SECTION = re.compile(r"^(\w[\w ]*)\n-{3,}\n", re.M)


def _documented_parameters(doc: str) -> list[str] | None:
    """Names listed under the numpydoc ``Parameters`` heading (None without one)."""
    heads = list(_SECTION.finditer(doc))
    for n, m in enumerate(heads):
        if m.group(1) == "Parameters":
            body = doc[m.end(): heads[n + 1].start() if n + 1 < len(heads) else len(doc)]
            names = []
            for line in body.splitlines():
                if line and not line[0].isspace():
                    names += [s.strip().lstrip("*") for s in line.split(" : ")[0].split(",")]
            return names
    return None


def _adapter_modules():
    """refgeo.testing, and the adapters whose framework is installed (refgeo.torch builds
    its classes on first access, which needs torch; refgeo.hf needs torch and
    transformers to be of use)."""
    mods = [importlib.import_module("refgeo.testing")]
    if importlib.util.find_spec("torch") is not None:
        mods.append(importlib.import_module("refgeo.torch"))
        if importlib.util.find_spec("transformers") is not None:
            mods.append(importlib.import_module("refgeo.hf"))
    return mods


def test_docstring_parameters_are_the_signature_parameters():
    """Every public function (and class constructor) documents exactly the parameters it
    takes, under ``Parameters``, in the numpydoc form ``name : type``."""
    import inspect

    wrong = []
    for module in [refgeo] + _adapter_modules():
        for qual, obj in _public_callables(module):
            if inspect.isclass(obj) and (dataclasses.is_dataclass(obj) or issubclass(obj, BaseException)):
                continue  # results (documented under Attributes) and exceptions
            try:
                sig = inspect.signature(obj)
            except (TypeError, ValueError):  # pragma: no cover - builtins
                continue
            taken = [p.name for p in sig.parameters.values() if p.name not in ("self", "args", "kwargs")]
            documented = _documented_parameters(inspect.getdoc(obj) or "")
            if documented is None:
                if taken:
                    wrong.append(f"{qual}: no Parameters section for {taken}")
                continue
            if sorted(documented) != sorted(taken):
                wrong.append(f"{qual}: documents {sorted(set(documented) - set(taken))} "
                             f"but lacks {sorted(set(taken) - set(documented))}")
    assert not wrong, "\n".join(wrong)
