"""Sphinx configuration for the refgeo documentation.

Build (from outside the source tree, so that ``import refgeo`` finds the *installed*
package and its compiled extension)::

    cd /tmp && python -m sphinx -W --keep-going -b html /path/to/refgeo/docs /path/to/out

What happens at build time:

* ``docs/api/generated/*.rst`` is written from ``refgeo.<module>.__all__`` (one page per
  module, autosummary stubs per object), so the API reference follows the code as
  modules fill in; nothing is hard-coded here.
* Tutorials draw their plots with ``matplotlib.sphinxext.plot_directive`` (Agg backend).
  A tutorial may list in its front matter the refgeo names it needs
  (``refgeo_requires: [rows.row_diameter, ...]``); each is looked up at the top level
  (``refgeo.row_diameter``: the module prefix only says where it is documented, and
  modules may be renamed), and a missing one is a build warning naming it, so an error
  under ``-W``: a renamed function cannot silently empty a tutorial.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import pathlib
import re
import sys

import matplotlib

matplotlib.use("Agg")

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent

# ``python -m sphinx`` run from the repository root puts the source tree first on
# sys.path, where refgeo_ext is not built: drop it so the installed package is used.
sys.path[:] = [p for p in sys.path if pathlib.Path(p or os.getcwd()).resolve() != ROOT]
for _name in [m for m in sys.modules if m == "refgeo" or m.startswith("refgeo.")]:
    del sys.modules[_name]

import refgeo  # noqa: E402

# -- project -------------------------------------------------------------------------
project = "refgeo"
author = "The refgeo developers"
copyright = "2026, The refgeo developers"
release = refgeo.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "myst_parser",
    "numpydoc",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "matplotlib.sphinxext.plot_directive",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "**/.ipynb_checkpoints", "_templates"]
templates_path = ["_templates"]

# -- MyST --------------------------------------------------------------------------------
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3
myst_dmath_double_inline = True

# -- autodoc / autosummary / numpydoc ----------------------------------------------------
autosummary_generate = True
autosummary_imported_members = True
autodoc_typehints = "none"  # numpydoc's Parameters section carries the types
autodoc_default_options = {"members": False}
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False
numpydoc_attributes_as_param_list = True

# -- plots -----------------------------------------------------------------------------
plot_include_source = True
plot_html_show_source_link = False
plot_html_show_formats = False
plot_formats = [("png", 110)]
plot_rcparams = {"figure.figsize": (6.4, 4.0), "savefig.bbox": "tight", "axes.grid": True}
plot_pre_code = "import numpy as np\nimport matplotlib.pyplot as plt\nimport refgeo\n"
plot_working_directory = str(DOCS)

# -- HTML ------------------------------------------------------------------------------
html_theme = "alabaster"
html_title = f"refgeo {release}"
html_static_path: list[str] = []
html_theme_options = {
    "description": "Update geometry for language models",
    "fixed_sidebar": True,
    "show_relbars": True,
}

# -- API pages generated from __all__ ----------------------------------------------------
# (page, title).  ``core`` is the part of the flat namespace not owned by a module; every
# other page documents the module ``refgeo.<page>``.
API_MODULES = [
    ("core", "Backends and configuration"),
    ("hilbert", "Hilbert projective distance"),
    ("rows", "Row geometry of an update"),
    ("lmo", "Steepest descent under the row diameter"),
    ("optim", "Head optimizers"),
    ("spreading", "Max-min spreading"),
    ("codes", "Spherical codes and lattices"),
    ("bounds", "Upper bounds on the distance ratio"),
    ("tokenwise", "Tokenwise decomposition of layer updates"),
    ("testing", "Testing your own kernels"),
    ("torch", "PyTorch adapter"),
    ("hf", "Hugging Face adapter"),
]
# The theory page (the specification) of each API page.
API_THEORY = {
    "hilbert": "hilbert", "rows": "rows", "lmo": "lmo", "optim": "lmo", "spreading": "spreading",
    "codes": "spreading", "bounds": "spreading", "tokenwise": "tokenwise",
}
# Earlier module names of a page, tried when ``refgeo.<page>`` is not in this build.
API_EARLIER_NAMES = {"spreading": ("spread",)}


def _api_module(key: str):
    """``refgeo.<key>`` (or the module under an earlier name), or None if absent."""
    for name in (key,) + API_EARLIER_NAMES.get(key, ()):
        try:
            return importlib.import_module(f"refgeo.{name}")
        except ModuleNotFoundError:
            continue
    return None
CORE_NAMES = ["ExtensionUnavailableError", "get_backend", "show_config", "use_backend"]
# Pages of namespaces that are not re-exported at the top level: the testing kit and the
# optional adapters (importing them does not import their frameworks).
OWN_NAMESPACES = ("testing", "torch", "hf")
# The frameworks an adapter's objects need to exist.
ADAPTER_FRAMEWORKS = {"torch": ("torch",), "hf": ("torch", "transformers")}


def _summary(module) -> str:
    """First paragraph of a module docstring, without rST directives."""
    doc = inspect.getdoc(module) or ""
    para = doc.split("\n\n")[0].strip()
    return "" if para.startswith("..") else para


def _public(module) -> list[str]:
    """Sorted ``__all__`` without submodules (those get their own section) and without
    objects that another API page's module defines (one page per object: a module that
    re-exports, e.g. the spreading solver listing a code, leaves it to its own page)."""
    names = getattr(module, "__all__", []) or []
    pages = {m.__name__ for m in map(_api_module, (k for k, _ in API_MODULES if k not in
                                                   ("core",) + OWN_NAMESPACES)) if m is not None}

    def elsewhere(obj) -> bool:
        home = getattr(obj, "__module__", None)
        return home in pages and home != module.__name__

    return sorted(
        n for n in names
        if not inspect.ismodule(getattr(module, n, None)) and not elsewhere(getattr(module, n, None))
    )


def _api_page(key: str, title: str) -> str:
    if key == "core":
        heading = f"Core: {title}"
        current, names, summary = "refgeo", CORE_NAMES, (
            "Backend selection and the installation report, at the top level of ``refgeo``."
        )
        sections = [("", names)]
    elif key in OWN_NAMESPACES:
        mod = importlib.import_module(f"refgeo.{key}")
        heading = f"``refgeo.{key}``: {title}"
        current, summary = f"refgeo.{key}", _summary(mod)
        missing = [f for f in ADAPTER_FRAMEWORKS.get(key, ()) if importlib.util.find_spec(f) is None]
        # refgeo.torch builds its classes on first access, which needs torch: without the
        # framework the page says so instead of failing the build
        sections = [("", [] if missing else _public(mod))]
        if missing:
            summary += f"\n\nThis build of the docs ran without {', '.join(missing)}: install it to list the API here."

        for sub in ("strategies",) if key == "testing" else ():
            try:
                submod = importlib.import_module(f"refgeo.testing.{sub}")
            except ImportError:
                continue
            subnames = [n for n in _public(submod) if n not in sections[0][1]]
            sections.append((f"refgeo.testing.{sub}", subnames))
    else:
        mod = _api_module(key)
        modname = mod.__name__ if mod is not None else f"refgeo.{key}"
        heading = f"``{modname}``: {title}"
        current, summary = "refgeo", _summary(mod) if mod is not None else ""
        names = _public(mod) if mod is not None else []
        flat = [n for n in names if getattr(refgeo, n, None) is getattr(mod, n)]
        sections = [("", flat)]
        if len(flat) < len(names):  # not re-exported at the top level
            sections.append((modname, [n for n in names if n not in flat]))
        if names:
            summary += (
                f"\n\nEverything here is exported at the top level: ``{modname}.f`` is "
                "``refgeo.f``."
            )
    if key in API_THEORY:
        summary += f"\n\nThe mathematics (definitions, statements, proofs): :doc:`/theory/{API_THEORY[key]}`."
    lines = [heading, "=" * len(heading), "", f".. currentmodule:: {current}", "", summary, ""]
    if not any(names for _, names in sections):
        lines += [
            ".. note::",
            "",
            f"   No public objects: ``refgeo.{key}`` is absent or its ``__all__`` is empty "
            "in this build.",
            "",
        ]
    for submodule, names in sections:
        if not names:
            continue
        if submodule:
            lines += [f"``{submodule}``", "-" * (len(submodule) + 4), "",
                      f".. currentmodule:: {submodule}", ""]
        lines += [".. autosummary::", "   :toctree: .", "   :nosignatures:", ""]
        lines += [f"   {n}" for n in names] + [""]
    return "\n".join(lines)


def _write_if_changed(path: pathlib.Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def _generate_api() -> None:
    out = DOCS / "api" / "generated"
    out.mkdir(parents=True, exist_ok=True)
    keep = set()
    for key, title in API_MODULES:
        path = out / f"{key}.rst"
        _write_if_changed(path, _api_page(key, title))
        keep.add(path.name)
    # Stubs of names that left __all__ would become orphan pages: remove them.
    listed = set()
    for key, _ in API_MODULES:
        listed.update(re.findall(r"^   (\S+)$", (out / f"{key}.rst").read_text(), re.M))
    for stub in out.glob("*.rst"):
        if stub.name in keep:
            continue
        name = stub.stem.rsplit(".", 1)[-1]
        if name not in listed:
            stub.unlink()


_generate_api()

# -- tutorials: the refgeo names they need ----------------------------------------------
_FRONT = re.compile(r"\A---\n(.*?)\n---\n", re.S)


def _missing(requires: list[str]) -> list[str]:
    """The required names (``module.name``) that ``refgeo`` does not export."""
    return [req for req in requires if req.rpartition(".")[2] not in refgeo.__all__]


def _check_tutorial_requires(app, docname, source):
    """Warn (an error under -W) when a page needs a refgeo name this build lacks."""
    m = _FRONT.match(source[0])
    if not m or "refgeo_requires" not in m.group(1):
        return
    req = re.search(r"refgeo_requires:\s*\[(.*?)\]", m.group(1), re.S)
    requires = [r.strip().strip("'\"") for r in req.group(1).split(",") if r.strip()]
    gone = _missing(requires)
    if gone:
        from sphinx.util import logging

        names = ", ".join(f"refgeo.{g.rpartition('.')[2]}" for g in gone)
        logging.getLogger(__name__).warning(
            f"{docname} needs {names}, which refgeo {release} does not export",
            location=docname,
        )


def setup(app):
    app.connect("source-read", _check_tutorial_requires)
