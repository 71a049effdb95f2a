#!/usr/bin/env python
"""Check what the source distribution and the wheel of refgeo hold.

Usage::

    python tools/check_dist.py DIST_DIR

``DIST_DIR`` holds exactly one ``refgeo-*.tar.gz`` and one ``refgeo-*.whl`` (the output of
``python -m build``).  Exit status 0 when every check passes, 1 otherwise, one line per
problem; the sizes are printed either way.

* sdist: everything a build needs (``pyproject.toml``, every ``meson.build``, the Tempita
  templates ``*.pyx.tp``, ``tools/tempita.py``, the C headers and ``.pxd``, the package,
  ``LICENSE``) and nothing that is not needed (build directories, caches, compiled
  files, the CI scripts and the benchmark suite).
* wheel: the compiled ``refgeo_ext`` modules, the pure package, ``refgeo/py.typed``,
  the license in ``.dist-info/licenses/`` and the ``refgeo`` console script; no tests,
  no caches, no sources of the templates.
"""

from __future__ import annotations

import glob
import os
import re
import sys
import tarfile
import zipfile

# Path components that never belong in a distribution.
JUNK = re.compile(
    r"(^|/)(build|builddir|dist|__pycache__|\.hypothesis|\.pytest_cache|\.mypy_cache|\.git|\.asv|"
    r"[^/]*\.egg-info|refgeo-demo[^/]*)(/|$)|\.(pyc|pyo|so|pyd|o)$"
)


def _one(pattern: str) -> str:
    found = sorted(glob.glob(pattern))
    if len(found) != 1:
        sys.exit(f"expected exactly one {os.path.basename(pattern)}, found {found}")
    return found[0]


def check_sdist(path: str) -> list[str]:
    problems = []
    with tarfile.open(path) as tar:
        names = [m.name for m in tar.getmembers() if m.isfile()]
    top = {n.split("/", 1)[0] for n in names}
    if len(top) != 1:
        return [f"sdist: one top-level directory expected, got {sorted(top)}"]
    prefix = top.pop() + "/"
    rel = {n[len(prefix):] for n in names}
    required = {"pyproject.toml", "meson.build", "refgeo_ext/meson.build", "tools/tempita.py", "LICENSE",
                "README.md", "PKG-INFO", "refgeo/__init__.py", "refgeo/py.typed", "refgeo_ext/__init__.py"}
    problems += [f"sdist: missing {r}" for r in sorted(required - rel)]
    if not any(r.endswith(".pyx.tp") for r in rel):
        problems.append("sdist: no Tempita templates (*.pyx.tp)")
    if not any(r.startswith("tests/test_") for r in rel):
        problems.append("sdist: no tests")
    for r in sorted(rel):
        if JUNK.search(r) or r.startswith((".ci/", "asv_benchmarks/")):
            problems.append(f"sdist: should not hold {r}")
    return problems


def check_wheel(path: str) -> list[str]:
    problems = []
    with zipfile.ZipFile(path) as whl:
        names = whl.namelist()
        entry_points = next((whl.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt")), "")
    ext = [n for n in names if n.startswith("refgeo_ext/") and n.endswith((".so", ".pyd"))]
    for kernel in ("_extreme_pairs", "_knn", "_knn_blocks", "_tropical"):
        if not any(os.path.basename(n).startswith(kernel + ".") for n in ext):
            problems.append(f"wheel: no compiled refgeo_ext/{kernel}")
    for need in ("refgeo/__init__.py", "refgeo/py.typed", "refgeo/testing/__init__.py"):
        if need not in names:
            problems.append(f"wheel: missing {need}")
    if not any(re.search(r"\.dist-info/licenses/LICENSE$", n) for n in names):
        problems.append("wheel: no .dist-info/licenses/LICENSE")
    if "refgeo = refgeo.cli:main" not in entry_points:
        problems.append("wheel: no `refgeo` console script")
    for n in names:
        if n in ext:
            continue
        if JUNK.search(n) or n.startswith("tests/") or n.endswith(".pyx.tp"):
            problems.append(f"wheel: should not hold {n}")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    sdist = _one(os.path.join(argv[1], "refgeo-*.tar.gz"))
    wheel = _one(os.path.join(argv[1], "refgeo-*.whl"))
    for path in (sdist, wheel):
        print(f"{os.path.basename(path)}: {os.path.getsize(path) / 1024:.0f} KiB")
    problems = check_sdist(sdist) + check_wheel(wheel)
    for p in problems:
        print(p)
    print("distributions OK" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
