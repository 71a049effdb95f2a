#!/usr/bin/env bash
# The GPU checks, by hand on a machine with a CUDA device (CI has none):
#
#   bash tools/gpu_check.sh [OUT_DIR]      (refgeo installed with CuPy, torch, asv, pytest)
#
# 1. what was found: the GPU, refgeo's configuration (the cupy backend must be available);
# 2. the tests that touch the GPU: every test run on the cupy backend (the `backend`
#    fixture's cupy parameter, marked `gpu`), the CUDA-tensor tests and the torch CUDA
#    kernels of the verification kit (`-k "cupy or cuda or gpu"`), against the reference
#    and the compiled engine, under hypothesis where the tests use it;
# 3. the GPU benchmarks (asv_benchmarks/benchmarks/gpu.py) in this environment
#    (`asv run --python=same`), the LM-head sizes (REFGEO_BENCH_SIZE=realistic) first,
#    then a quick pass over the small sizes; asv prints each result, and the logs go to
#    OUT_DIR.
#
# Runs from any directory, and from outside the checkout so that `import refgeo` is the
# installed package (`python -P`).  Each stage has its own time limit (GPU_CHECK_TESTS_S,
# GPU_CHECK_BENCH_S seconds); the exit status is non-zero when a stage fails.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$(mktemp -d)}"
mkdir -p "$OUT"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
PY="${PYTHON:-python3}"
export MPLBACKEND=Agg HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}" PYTHONUNBUFFERED=1
# asv drops PYTHONPATH in the benchmark processes unless ASV_PYTHONPATH carries it
if [ -n "${PYTHONPATH:-}" ]; then export ASV_PYTHONPATH="${ASV_PYTHONPATH:-$PYTHONPATH}"; fi
status=0
t0=$SECONDS
lap() { echo "== [$((SECONDS - t0)) s] $*"; }

lap "what is here"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
(cd "$TMP" && "$PY" -P -c "import refgeo, cupy, torch; refgeo.show_config(); \
print('cupy', cupy.__version__, 'cuda runtime', cupy.cuda.runtime.runtimeGetVersion(), \
'torch', torch.__version__, torch.cuda.is_available())") || status=1

lap "tests on the GPU"
# with pytest-timeout installed, a test that hangs on the device fails alone
per_test=(); "$PY" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=120)
(cd "$ROOT" && timeout "${GPU_CHECK_TESTS_S:-300}" "$PY" -P -m pytest -p no:cacheprovider -q \
    -m "not slow" -k "cupy or cuda or gpu" -rfEs --tb=short --durations=15 ${per_test[@]+"${per_test[@]}"} tests \
    2>&1 | tee "$OUT/gpu-tests.log")
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

lap "GPU benchmarks (asv, this environment)"
"$PY" "$ROOT/tools/asv_temp_config.py" "$TMP"
(cd "$TMP" && "$PY" -m asv machine --yes --config "$TMP/asv.conf.json" >/dev/null)
for size in realistic small; do
    lap "asv: $size sizes"
    rm -rf "$TMP/results_dir"
    quick=(); [ "$size" = small ] && quick=(--quick)
    (cd "$TMP" && REFGEO_BENCH_SIZE=$size timeout "${GPU_CHECK_BENCH_S:-400}" "$PY" -m asv run \
        --config "$TMP/asv.conf.json" --python=same --bench '^gpu\.' --show-stderr ${quick[@]+"${quick[@]}"} \
        2>&1 | tee "$OUT/asv-gpu-$size.log")
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
lap "done (status $status)"
exit "$status"
