"""Shared pieces of refgeo's asv benchmarks.

Conventions (see ../shared/STYLE.md §11):
- one file per area (``hilbert.py``, ``extreme_pairs.py``, ``lmo.py``, ...);
- params ``(size, dtype, backend)``; ``SMALL`` sizes run in CI (``asv run --quick``),
  ``REALISTIC`` sizes are selected with ``REFGEO_BENCH_SIZE=realistic``;
- a seeded RNG in ``setup``; ``NotImplementedError`` in ``setup`` skips an absent backend;
- every ``time_*`` has a ``peakmem_*`` partner; quality and speed ratios are ``track_*``;
- ``environment()`` records dtype, backend, BLAS and threads; call it from ``setup`` so the
  benchmark log holds the precision it ran with.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

try:
    import refgeo
    from refgeo import _backend
except ImportError:  # older commits: benchmarks still load, setup skips
    refgeo = None
    _backend = None

BACKENDS = ["reference", "cython"]
DTYPES = ["float64", "float32"]


def realistic() -> bool:
    """True when realistic (hand-run) sizes are requested."""
    return os.environ.get("REFGEO_BENCH_SIZE", "small") == "realistic"


def require_backend(name: str) -> None:
    """Skip (asv: NotImplementedError in setup) when refgeo or the backend is missing."""
    if refgeo is None:
        raise NotImplementedError("refgeo is not importable")
    ok, why = _backend.available_backends()[name]
    if not ok:
        raise NotImplementedError(f"backend {name!r} unavailable: {why}")


def environment(dtype: str, backend: str) -> dict:
    """dtype, backend, BLAS and thread counts of this run (printed to the asv log)."""
    info = {"dtype": dtype, "backend": backend}
    try:
        from threadpoolctl import threadpool_info

        info["threadpools"] = [
            {k: p.get(k) for k in ("internal_api", "version", "num_threads")} for p in threadpool_info()
        ]
    except Exception:  # pragma: no cover
        info["threadpools"] = []
    if refgeo is not None:
        cfg = refgeo.show_config(mode="dicts")
        info["openmp_threads"] = cfg["openmp"]["max_threads"]
        info["refgeo"] = cfg["refgeo"]
    print("refgeo-bench-env " + json.dumps(info), file=sys.stderr)
    return info


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def best_time(fn, repeat: int = 3) -> float:
    """Best wall time of ``repeat`` calls (for speed-ratio trackers measured in-process)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def dgemm_rate(n: int = 2048, dtype=np.float64) -> float:
    """Measured GEMM rate in flop/s on an n x n product (the roofline)."""
    a = rng(1).standard_normal((n, n)).astype(dtype)
    b = rng(2).standard_normal((n, n)).astype(dtype)
    t = best_time(lambda: a @ b, repeat=3)
    return 2.0 * n**3 / t
