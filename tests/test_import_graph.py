"""The import graph of the ``refgeo`` package has no cycle.

The graph is built statically with :mod:`ast` from every module of the package, so it
sees what a run would only see on some code paths: imports at module level and inside
functions, methods and ``try`` blocks alike, absolute (``import refgeo.rows``,
``from refgeo import rows``) and relative (``from . import rows``, ``from ..rows
import x``).  ``from package import name`` points at the submodule ``package.name``
when there is one, and at ``package`` itself otherwise (the name is then an attribute
of the package's ``__init__``, which therefore has to be complete: an edge to the
package).  Only import statements make edges; that Python initialises a parent package
before its submodules is not one.
"""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

PACKAGE = "refgeo"


def _package_root() -> pathlib.Path:
    # the package that the tests import (an editable install maps it to the sources)
    return pathlib.Path(importlib.import_module(PACKAGE).__file__).parent


def _modules(root: pathlib.Path) -> dict[str, tuple[pathlib.Path, bool]]:
    """``{dotted name: (file, is_package)}`` for every ``.py`` file under ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = [PACKAGE, *rel.parts]
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_pkg)
    return out


def _resolve_relative(module: str, is_pkg: bool, level: int, target: str | None) -> str:
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _imports(module: str, path: pathlib.Path, is_pkg: bool, known: set[str]) -> set[str]:
    """Modules of the package that ``module`` imports anywhere in its source."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: set[str] = set()

    def add(name: str) -> None:
        # `import a.b.c` runs a.b.c; keep the longest prefix that is a module of ours
        parts = name.split(".")
        for n in range(len(parts), 0, -1):
            cand = ".".join(parts[:n])
            if cand in known:
                found.add(cand)
                return

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                src = _resolve_relative(module, is_pkg, node.level, node.module)
            else:
                src = node.module or ""
            if not (src == PACKAGE or src.startswith(PACKAGE + ".")):
                continue
            for alias in node.names:
                sub = f"{src}.{alias.name}"
                if sub in known:  # `from pkg import submodule`
                    found.add(sub)
                else:  # `from module import name` (or `*`): the module itself
                    add(src)
    found.discard(module)
    return found


def import_graph() -> dict[str, set[str]]:
    """``{module: modules it imports}`` over the whole package."""
    mods = _modules(_package_root())
    known = set(mods)
    return {name: _imports(name, path, is_pkg, known) for name, (path, is_pkg) in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle ``[a, b, ..., a]`` of ``graph``, or None (iterative depth-first search)."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(graph, WHITE)
    for start in sorted(graph):
        if color[start] != WHITE:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        color[start] = GREY
        while stack:
            node, children = stack[-1]
            for child in children:
                if color.get(child, BLACK) == GREY:
                    return path[path.index(child) :] + [child]
                if color.get(child) == WHITE:
                    color[child] = GREY
                    stack.append((child, iter(sorted(graph[child]))))
                    path.append(child)
                    break
            else:
                color[node] = BLACK
                stack.pop()
                path.pop()
    return None


def test_the_graph_is_read_correctly():
    """The parser sees function-level, relative and package imports (known edges)."""
    g = import_graph()
    assert "refgeo.rows" in g["refgeo"]  # `from . import ... rows ...` in __init__
    assert "refgeo._backend" in g["refgeo.rows"]  # `from . import _backend`
    assert "refgeo._certify" in g["refgeo._tiled"]
    assert "refgeo.testing.strategies" in g["refgeo.testing"]
    # function-level `import refgeo` in the kit
    assert "refgeo" in g["refgeo.testing._assertions"]


def test_find_cycle_finds_a_planted_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    cyc = find_cycle(g)
    assert cyc is not None and cyc[0] == cyc[-1] and set(cyc) == {"a", "b", "c"}
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_refgeo():
    cycle = find_cycle(import_graph())
    if cycle is not None:
        pytest.fail("import cycle in refgeo: " + " -> ".join(cycle))


# The layers of the pairwise engine, bottom first: a module imports only from layers
# below its own, so that no later edit can quietly bring a cycle back.
ENGINE_LAYERS = (
    # the certification algebra imports nothing of refgeo; the argument checks report
    # values scaled back with it
    ("refgeo._certify",),
    ("refgeo._validate", "refgeo._threads", "refgeo._interop", "refgeo._memory",
     "refgeo._duplicates"),
    ("refgeo._filter",),
    ("refgeo._progress",),
    ("refgeo._backend",),
    ("refgeo._reference", "refgeo._engine", "refgeo._tiled"),
    # the Dask tasks run the single-machine engine on the rows a block's float32 filter
    # cannot settle (docs/architecture.md)
    ("refgeo._dask",),
    ("refgeo.rows",),
)


def test_engine_modules_import_only_downward():
    g = import_graph()
    below: set[str] = set()
    for layer in ENGINE_LAYERS:
        for mod in layer:
            assert mod in g, f"{mod} is missing from the package"
            upward = sorted(g[mod] - below)
            assert not upward, f"{mod} imports {upward}, which are not below it"
        below |= set(layer)


# The layers of the whole package, bottom first, as drawn in docs/architecture.md: a
# module imports from its own layer or the layers below (the cycle test above covers
# imports within a layer).  A subpackage's modules belong to the layer of the
# subpackage.  Every module must have a layer, so a new module is placed on purpose.
PACKAGE_LAYERS = (
    ("_validate", "_threads", "_certify", "_interop", "_memory", "_lm_gradients", "_duplicates"),
    ("_progress", "_backend", "_tokenwise_fit", "_filter"),
    ("_reference", "_engine", "_tiled", "_dask", "_config"),
    ("rows", "hilbert", "bounds", "codes", "_dask_tokenwise"),
    ("lmo", "tokenwise", "spreading", "optim"),
    ("",),  # the package's __init__: the public API
    ("torch", "hf", "testing", "cli", "_demo", "__main__"),
)


def _layer_of(module: str) -> int:
    rel = module[len(PACKAGE) + 1:] if module != PACKAGE else ""
    top = rel.split(".")[0]
    for i, layer in enumerate(PACKAGE_LAYERS):
        if top in layer:
            return i
    raise AssertionError(f"{module} has no layer in PACKAGE_LAYERS (place it in docs/architecture.md too)")


def _upward_imports(g):
    """``{module: [imports from a layer above]}`` of an import graph (empty: none)."""
    found = {}
    for mod, deps in g.items():
        level = _layer_of(mod)  # every module, even one without imports, has a layer
        above = sorted(dep for dep in deps if _layer_of(dep) > level)
        if above:
            found[mod] = above
    return found


def test_every_module_imports_only_from_its_layer_or_below():
    upward = _upward_imports(import_graph())
    assert not upward, f"imports from a layer above: {upward}"


def test_the_layer_check_finds_an_upward_import():
    p = PACKAGE
    g = {f"{p}.rows": {f"{p}._certify", f"{p}.tokenwise"}, f"{p}.codes": {f"{p}.rows"},
         f"{p}.testing._assertions": {p}}
    assert _upward_imports(g) == {f"{p}.rows": [f"{p}.tokenwise"]}
    with pytest.raises(AssertionError, match="has no layer"):
        _upward_imports({f"{p}._new_module": set()})
