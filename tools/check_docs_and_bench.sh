#!/usr/bin/env bash
# CI checks for the documentation and the asv benchmarks (needs refgeo installed with the
# `docs` and `bench` extras).  Runs from any directory; writes only to a temp folder and,
# for the HTML, to docs/_build/html (override with REFGEO_DOCS_OUT; REFGEO_SKIP_DOCS=1
# or REFGEO_SKIP_BENCH=1 skips a step; REFGEO_ASV_DURATIONS=all lists the duration of every
# benchmark, not only the 5 longest).
#
# 1. Sphinx, warnings as errors, fresh environment (-E: an incremental build would not
#    re-report warnings of unchanged pages), run from outside the source tree so that
#    `import refgeo` is the installed package (with its compiled extension), not the
#    checkout; then the >>> examples of the prose pages, and a list of public docstrings
#    without Examples or a formula (warnings).
# 2. `asv check` and a quick run of every benchmark at the small (CI) sizes in the current
#    environment: `--python=same` needs no git history, `--dry-run` saves no results, and
#    asv exits non-zero when any benchmark fails.  asv's results/machine files go to a temp
#    folder through a generated copy of asv.conf.json.  The forkserver imports the
#    benchmark modules (NumPy, refgeo, torch, Dask) once and forks a process per
#    benchmark instead of starting and importing one per benchmark (131 s against about
#    330 s here).  In a process forked after refgeo_ext was loaded the kernels run on one
#    thread (refgeo's fork safety; its warning is silenced here), so this run's numbers
#    are a smoke test, not measurements: those use asv's default launch method, spawn,
#    which the committed configuration keeps (docs/benchmarks.md).  For the same reason
#    the speed-ratio trackers time each side once (REFGEO_BENCH_REPEAT=1, not best of 3).
#
# Budget on 2 cores: docs < 3 min, asv < 3 min.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
export MPLBACKEND=Agg
DOCS_OUT="${REFGEO_DOCS_OUT:-$ROOT/docs/_build/html}"

if [ "${REFGEO_SKIP_DOCS:-0}" != 1 ]; then
    echo "== docs: sphinx -W (output in $DOCS_OUT)"
    t0=$SECONDS
    (cd "$TMP" && python -m sphinx -E -W --keep-going -q -b html "$ROOT/docs" "$DOCS_OUT")
    echo "docs built in $((SECONDS - t0)) s"
    # The API reference shows docstrings as written: list public objects whose docstring
    # lacks an Examples section or a formula (a warning, for the module owners).
    (cd "$TMP" && python - <<'PY'
import inspect
import refgeo
missing = {}
for name in refgeo.__all__:
    obj = getattr(refgeo, name)
    if not (inspect.isfunction(obj) or inspect.isclass(obj)) or name in {
        "ExtensionUnavailableError", "get_backend", "show_config", "use_backend"}:
        continue
    doc = inspect.getdoc(obj) or ""
    lack = [what for what, ok in (("Examples", "Examples\n--------" in doc),
                                  ("formula", ".. math::" in doc or ":math:" in doc)) if not ok]
    if lack and not (inspect.isclass(obj) and "Attributes" in doc):
        missing.setdefault(", ".join(lack), []).append(name)
for lack, names in sorted(missing.items()):
    print(f"warning: docstring without {lack}: " + ", ".join(sorted(names)))
PY
    )
    # The >>> examples of the prose pages run.
    (cd "$TMP" && python - "$ROOT/docs" <<'PY'
import doctest, glob, os, sys, warnings
import numpy as np
import refgeo

docs = sys.argv[1]
pages = [os.path.join(docs, "index.md"), os.path.join(docs, "which-function.md"),
         os.path.join(docs, "architecture.md")]
pages += sorted(glob.glob(os.path.join(docs, "tutorials", "*.md")))
pages += sorted(glob.glob(os.path.join(docs, "theory", "*.md")))
failed = 0
for page in pages:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = doctest.testfile(page, module_relative=False, globs={"np": np, "refgeo": refgeo},
                               optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    failed += res.failed
sys.exit(1 if failed else 0)
PY
    )
fi

# The mathematics is cited from the theory pages (docs/theory/*.md, ``:doc:`/theory/rows```
# in docstrings), never from a file outside the repository; list sources that still cite
# one, or that name the place or the machine they were written in (a warning).
python - "$ROOT" <<'PY'
import pathlib, re, sys
root = pathlib.Path(sys.argv[1])
pattern = re.compile(r"SPEC(\.md)? ?§|SPEC\.md|ARCHITECTURE\.md|STYLE\.md|shared folder|"
                     r"\bissues? \d|this project's shared machine")
dirs = ["refgeo", "refgeo_ext", "tests", "docs", "asv_benchmarks/benchmarks", "tools"]
files = [root / "README.md"] + [f for d in dirs for f in sorted((root / d).rglob("*"))
                                if f.suffix in {".py", ".md", ".tp", ".pxd", ".pyx", ".h", ".sh"}
                                and "_build" not in f.parts and "generated" not in f.parts]
for f in files:
    if f.name == "check_docs_and_bench.sh":
        continue
    for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
        if pattern.search(line):
            print(f"warning: {f.relative_to(root)}:{n}: refers to something outside the repository: "
                  f"{line.strip()[:90]}")
PY

if [ "${REFGEO_SKIP_BENCH:-0}" = 1 ]; then
    echo "docs OK (benchmarks skipped)"
    exit 0
fi

echo "== asv: check + quick run of the small sizes (current environment)"
python "$ROOT/tools/asv_temp_config.py" "$TMP"
if [ ! -f "$HOME/.asv-machine.json" ]; then
    asv machine --yes --config "$TMP/asv.conf.json" >/dev/null
fi
cd "$TMP"
t0=$SECONDS
asv check --config "$TMP/asv.conf.json" --python=same
set +e
PYTHONWARNINGS="ignore:refgeo_ext runs single-threaded in this process:UserWarning" \
REFGEO_BENCH_SIZE=small REFGEO_BENCH_REPEAT=1 asv run --config "$TMP/asv.conf.json" \
    --python=same --quick --dry-run --launch-method forkserver --show-stderr --durations "${REFGEO_ASV_DURATIONS:-5}" 2>&1 | tee "$TMP/asv.log"
status=${PIPESTATUS[0]}
set -e
# asv exits 2 when a benchmark fails; the log check also catches errors in setup.
if [ "$status" -ne 0 ] || grep -qE '[[:space:]]failed$|Traceback' "$TMP/asv.log"; then
    echo "asv: a benchmark failed (exit $status); see the log above" >&2
    exit 1
fi
echo "asv quick run in $((SECONDS - t0)) s"

# Every result should record dtype, backend, BLAS and threads: list benchmarks whose
# parameters lack them (a warning; see asv_benchmarks/benchmarks/_common.py).
python - "$TMP/results_dir/benchmarks.json" <<'PY'
import json, sys
with open(sys.argv[1]) as f:
    benchmarks = json.load(f)
lacking = {}
for name, b in benchmarks.items():
    if not isinstance(b, dict) or "param_names" not in b:
        continue
    miss = [p for p in ("dtype", "backend", "runtime") if p not in b["param_names"]]
    if miss:
        lacking.setdefault(", ".join(miss), []).append(name)
for miss, names in sorted(lacking.items()):
    print(f"warning: {len(names)} benchmark(s) do not record {miss}: " + ", ".join(sorted(names)))
PY
# Every benchmark class prints its environment (dtype, backend, BLAS, threads) to the
# asv log from its setup: its own or an inherited one, calling `environment` (the Dask
# classes through `_start_cluster`).  An error: the asv conventions ask it of each class.
python - "$ROOT/asv_benchmarks/benchmarks" <<'PY'
import ast, pathlib, sys
bad = []
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.py")):
    tree = ast.parse(path.read_text())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    methods = {(c, f.name): f for c, n in classes.items() for f in n.body if isinstance(f, ast.FunctionDef)}

    def calls_environment(cls, name="setup", seen=()):
        if (cls, name) in seen:
            return False
        seen += ((cls, name),)
        f = methods.get((cls, name))
        if f is None:  # inherited from a base class of this module
            return any(isinstance(b, ast.Name) and b.id in classes and calls_environment(b.id, name, seen)
                       for b in classes[cls].bases)
        for call in (n for n in ast.walk(f) if isinstance(n, ast.Call)):
            if isinstance(call.func, ast.Name) and call.func.id == "environment":
                return True
            if (isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name)
                    and call.func.value.id == "self" and calls_environment(cls, call.func.attr, seen)):
                return True
        return False

    bad += [f"{path.stem}.{c}" for c in classes if not c.startswith("_") and not calls_environment(c)]
if bad:
    sys.exit("benchmark classes whose setup does not call environment(): " + ", ".join(bad))
PY
echo "docs and benchmarks OK"
