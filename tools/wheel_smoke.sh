#!/usr/bin/env bash
# Release check: build the sdist and the wheel, check what they hold, then install each into
# a fresh virtual environment outside the checkout and test it there.
#
#   bash tools/wheel_smoke.sh            (from any directory; needs `python` with pip and venv)
#
# 1. `python -m build`: the sdist (meson dist = `git archive` of HEAD, minus the
#    export-ignore paths of .gitattributes), then the wheel built from the unpacked sdist,
#    so the wheel proves that the sdist is complete.  tools/check_dist.py checks both.
# 2. Wheel: a fresh venv, `pip install refgeo-*.whl[test]`; the test suite runs from the
#    unpacked sdist with the package directories deleted (nothing can shadow the install;
#    in pytest-xdist workers, as the README's test command),
#    with REFGEO_EXPECT_INSTALLED=1 (tests/test_packaging.py asserts that refgeo and
#    refgeo_ext are imported from site-packages); then `show_config()` must report the
#    cython backend (with OpenMP unless REFGEO_ALLOW_NO_OPENMP=1) and `refgeo demo --quick`
#    must write a finite report.
# 3. sdist: a second fresh venv, `pip install refgeo-*.tar.gz` (compiles from source, no
#    extras), the same smoke test (import from outside, cython backend, demo --quick; without
#    matplotlib the report has no plots, and only its numbers are checked).
#
# Writes only to a temp folder (REFGEO_DIST_OUT=DIR keeps the built files there).
# Budget on 2 cores: about 2 compiles of refgeo_ext plus one run of the test suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
PYTHON="${PYTHON:-python}"
DIST="${REFGEO_DIST_OUT:-$TMP/dist}"
export MPLBACKEND=Agg
t_start=$SECONDS

echo "== build: sdist and wheel (python -m build)"
"$PYTHON" -m pip install -q build
rm -f "$DIST"/refgeo-*
"$PYTHON" -m build --outdir "$DIST" "$ROOT" > "$TMP/build.log" 2>&1 || { tail -50 "$TMP/build.log"; exit 1; }
grep -E "OpenMP|Successfully built" "$TMP/build.log" || true
"$PYTHON" "$ROOT/tools/check_dist.py" "$DIST"
WHEEL="$(ls "$DIST"/refgeo-*.whl)"
SDIST="$(ls "$DIST"/refgeo-*.tar.gz)"
echo "built in $((SECONDS - t_start)) s"

# show_config() reports the cython backend (and OpenMP), refgeo is imported from
# site-packages, and the demo writes a finite report; run from $TMP (outside the checkout).
smoke() {
    local venv="$1"
    (cd "$TMP" && "$venv/bin/python" - <<'PY'
import os, sysconfig, pathlib
import refgeo, refgeo_ext

site = pathlib.Path(sysconfig.get_paths()["platlib"]).resolve()
for m in (refgeo, refgeo_ext):
    assert site in pathlib.Path(m.__file__).resolve().parents, f"{m.__name__} imported from {m.__file__}"
cfg = refgeo.show_config(mode="dicts")
cython = cfg["backends"]["cython"]
assert cython["available"], f"cython backend unavailable: {cython['detail']}"
if os.environ.get("REFGEO_ALLOW_NO_OPENMP", "") != "1":
    assert cfg["openmp"]["compiled"], "refgeo_ext was compiled without OpenMP"
print(f"refgeo {cfg['refgeo']} from {pathlib.Path(refgeo.__file__).parent}: cython {cython['detail']}")
PY
    )
    local t0=$SECONDS out="$TMP/demo-$(basename "$venv")"
    (cd "$TMP" && "$venv/bin/refgeo" demo --quick --out "$out" > "$TMP/demo.log" 2>&1) || { cat "$TMP/demo.log"; exit 1; }
    if "$venv/bin/python" -c "import matplotlib" 2> /dev/null; then
        "$venv/bin/python" "$ROOT/tools/check_demo_report.py" "$out"
    else
        # Without matplotlib (a plain install) the demo writes its report without plots.
        test -s "$out/report.md" || { echo "refgeo demo wrote no report.md"; exit 1; }
        if grep -qiwE "nan|inf" "$out/report.md"; then echo "refgeo demo: NaN/inf in report.md"; exit 1; fi
        echo "refgeo demo: report.md written (no matplotlib here: no plots), all numbers finite"
    fi
    echo "refgeo demo --quick in $((SECONDS - t0)) s"
}

echo "== wheel: fresh venv, pip install $(basename "$WHEEL")[test], the test suite outside the checkout"
t0=$SECONDS
"$PYTHON" -m venv "$TMP/venv-wheel"
"$TMP/venv-wheel/bin/python" -m pip install -q "$WHEEL[test]"
# The sdist's venv compiles refgeo_ext (about a minute) while the wheel's suite runs: the
# suite times nothing it checks, and the compile is checked when its smoke test comes.
( "$PYTHON" -m venv "$TMP/venv-sdist" && "$TMP/venv-sdist/bin/python" -m pip install -q "$SDIST" ) \
    > "$TMP/sdist-install.log" 2>&1 &
sdist_pid=$!
trap 'kill "$sdist_pid" 2>/dev/null || true; rm -rf "$TMP"' EXIT
mkdir "$TMP/suite"
tar -xzf "$SDIST" -C "$TMP/suite" --strip-components=1
rm -rf "$TMP/suite/refgeo" "$TMP/suite/refgeo_ext"
(cd "$TMP/suite" && REFGEO_EXPECT_INSTALLED=1 "$TMP/venv-wheel/bin/python" -m pytest -p no:cacheprovider -q \
    -n auto --maxprocesses 4 tests)
smoke "$TMP/venv-wheel"
echo "wheel tested in $((SECONDS - t0)) s"

echo "== sdist: fresh venv, pip install $(basename "$SDIST") (compiled alongside the wheel's suite)"
t0=$SECONDS
wait "$sdist_pid" || { cat "$TMP/sdist-install.log"; echo "pip install of the sdist failed" >&2; exit 1; }
smoke "$TMP/venv-sdist"
echo "sdist tested in $((SECONDS - t0)) s"

echo "wheel $(basename "$WHEEL"): $(( $(stat -c %s "$WHEEL") / 1024 )) KiB; packaging check in $((SECONDS - t_start)) s"
