"""Packaging: one version, the license, the type marker and what the source distribution holds.

The checks that read the source tree (meson.build, pyproject.toml, .gitattributes) skip
when the suite runs against an installed wheel from outside the checkout; there,
``REFGEO_EXPECT_INSTALLED=1`` makes the suite assert that it really tests the installed
package (CI sets it in the wheel smoke test).
"""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import os
import pathlib
import re
import shutil
import subprocess
import sysconfig

import pytest

import refgeo

ROOT = pathlib.Path(__file__).resolve().parents[1]
IN_CHECKOUT = (ROOT / "meson.build").is_file() and (ROOT / "pyproject.toml").is_file()
source_tree = pytest.mark.skipif(not IN_CHECKOUT, reason="needs the source tree (meson.build, pyproject.toml)")

# PEP 440, as far as a release of refgeo needs it: N.N.N with an optional pre-release,
# post-release or dev suffix.
PEP440 = re.compile(r"^\d+\.\d+\.\d+((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?$")


def _meson_version() -> str:
    text = (ROOT / "meson.build").read_text()
    m = re.search(r"project\((?:[^()]|\([^()]*\))*?\bversion\s*:\s*'([^']+)'", text, re.S)
    assert m, "meson.build has no project(..., version: '...')"
    return m.group(1)


def _pyproject() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomli = pytest.importorskip("tomli")
        return tomli.loads((ROOT / "pyproject.toml").read_text())
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_is_the_installed_distribution_version():
    assert refgeo.__version__ == importlib.metadata.version("refgeo")
    assert PEP440.match(refgeo.__version__), refgeo.__version__


@source_tree
def test_version_comes_from_meson_only():
    project = _pyproject()["project"]
    assert "version" not in project, "pyproject.toml must not repeat the version (meson.build has it)"
    assert "version" in project.get("dynamic", [])
    assert _meson_version() == refgeo.__version__ == importlib.metadata.version("refgeo")


@source_tree
def test_changelog_first_entry_is_this_release():
    text = (ROOT / "CHANGELOG.md").read_text()
    first = re.search(r"^## (\S+)", text, re.M)
    assert first, "CHANGELOG.md has no release entry"
    release = re.sub(r"(\.dev\d+|(a|b|rc)\d+|\.post\d+)+$", "", _meson_version())
    assert first.group(1) == release


def test_license_ships_with_the_distribution():
    dist = importlib.metadata.distribution("refgeo")
    assert dist.metadata["License-Expression"] == "BSD-3-Clause"
    files = [f for f in (dist.files or []) if f.name == "LICENSE"]
    assert files, "the distribution's metadata has no LICENSE file"
    text = files[0].read_text()
    assert "The refgeo developers" in text
    # The three clauses of BSD-3-Clause, the last one being the no-endorsement clause.
    assert "Redistributions of source code must retain" in text
    assert "Redistributions in binary form must reproduce" in text
    assert "Neither the name of the copyright holder" in text


@source_tree
def test_license_file_in_the_checkout_is_the_shipped_one():
    dist = importlib.metadata.distribution("refgeo")
    shipped = [f for f in (dist.files or []) if f.name == "LICENSE"][0].read_text()
    assert (ROOT / "LICENSE").read_text() == shipped
    assert _pyproject()["project"]["license"] == "BSD-3-Clause"


def test_package_is_typed():
    assert importlib.resources.files("refgeo").joinpath("py.typed").is_file()


@pytest.mark.skipif(os.environ.get("REFGEO_EXPECT_INSTALLED", "") != "1",
                    reason="only when testing an installed wheel (REFGEO_EXPECT_INSTALLED=1)")
def test_tests_run_against_the_installed_package():
    import refgeo_ext

    site = pathlib.Path(sysconfig.get_paths()["platlib"]).resolve()
    for module in (refgeo, refgeo_ext):
        path = pathlib.Path(module.__file__).resolve()
        assert site in path.parents, f"{module.__name__} is imported from {path}, not from {site}"
    ok, why = refgeo._backend.available_backends()["cython"]
    assert ok, why


def _export_ignored(paths: list[str]) -> dict[str, bool]:
    out = subprocess.run(["git", "check-attr", "export-ignore", "--", *paths], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    # One line per path: "<path>: export-ignore: set|unset|unspecified".
    return {path: value == "set" for path, _, value in (line.split(": ") for line in out.splitlines())}


@source_tree
@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_sdist_keeps_what_a_build_needs_and_drops_the_rest():
    # The sdist is `git archive` of HEAD (meson dist) minus the export-ignore paths.
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    ignored = _export_ignored(tracked)
    needed = [p for p in tracked if p.endswith(("meson.build", ".pyx.tp", ".pxd", ".pyi", ".h"))
              or p.startswith(("refgeo/", "tests/", "docs/"))
              or p in ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md", "tools/tempita.py")]
    assert "tools/tempita.py" in needed and "refgeo/py.typed" in tracked
    kept_out = [p for p in needed if ignored.get(p)]
    assert not kept_out, f"needed by a build from the sdist but export-ignored: {kept_out}"
    for p in tracked:
        if p.startswith((".ci/", "asv_benchmarks/")) or (p.startswith("tools/") and p != "tools/tempita.py"):
            assert ignored.get(p), f"{p} would be shipped in the sdist"


def test_console_script_is_installed():
    eps = importlib.metadata.entry_points(group="console_scripts")
    assert any(ep.name == "refgeo" and ep.value == "refgeo.cli:main" for ep in eps)


def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, re.S)]


@pytest.mark.skipif(not (ROOT / ".ci" / "run").is_file(), reason="needs the checkout's .ci/run (not in the sdist)")
def test_ci_runs_the_readme_install_and_test_commands_verbatim():
    """The two commands of the README are what CI runs on a clean clone: a change to one
    that CI does not make (or the reverse) fails here, not on a user's machine."""
    readme = _bash_blocks((ROOT / "README.md").read_text())
    install = next(b for b in readme if "pip install" in b and "-e" in b)
    test = next(b for b in readme if b.startswith("python -m pytest"))
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert install in ci, f"CI does not run the README's install command {install!r}"
    assert test in ci, f"CI does not run the README's test command {test!r}"
    # the test command comes before the optional extras are installed (their tests must
    # skip cleanly without them)
    extras = next(i for i, line in enumerate(ci) if line.startswith("python -m pip install") and "[test," in line)
    assert ci.index(test) < extras
