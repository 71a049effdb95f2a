"""One-shot measurements of the large solver cases that take minutes per call.

The asv benchmarks (``asv_benchmarks/``, ``REFGEO_BENCH_SIZE=realistic``) hold the speed
ratios measured in one process (pdist, roofline, scikit-learn, NumPy loop).  The solver
cases below (spreading, exact LMO, tokenwise ``decompose``) cost up to ten minutes a
call, and asv would repeat each call once per ``time_``/``peakmem_``/``track_`` method, so
this script calls each case once and prints wall time, quality and peak RSS together.

Usage::

    python tools/acceptance_numbers.py [spread] [lmo] [tokenwise] > numbers.md

Each case runs in a fresh subprocess so that its peak RSS is its own.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

SPREAD = [(4096, 256, None), (1000, 64, None), (50000, 1024, 100.0), (32768, 512, 240.0),
          (50257, 768, 480.0), (50000, 64, 300.0), (50000, 90, None)]
LMO = [(60, 8, 256, 1e-5, None), (2000, 64, 1024, 1e-3, 120.0), (8000, 128, 1024, 1e-2, 300.0)]
TOKENWISE = [(20000, 768, 64, "diagonal", None), (20000, 768, 64, "low_rank", 8)]

_CHILD = r"""
import json, math, resource, sys, time
import numpy as np
import refgeo
kind, args = sys.argv[1], json.loads(sys.argv[2])
out = {}
if kind == "spread":
    V, d, t = args
    t0 = time.perf_counter()
    r = refgeo.spread(V, d, seed=0, max_time=t)
    out = dict(seconds=time.perf_counter() - t0, rho=r.ratio, bound=r.upper_bound,
               certified=bool(r.certified), method=str(getattr(r, "method", "")),
               init=str(getattr(r, "init", "")))
elif kind == "lmo":
    V, d, n, rtol, t = args
    rng = np.random.default_rng(0)
    H = rng.standard_normal((n, d))
    W = rng.standard_normal((V, d)) * 2.0 / math.sqrt(d)
    Z = H @ W.T
    Z -= Z.max(axis=1, keepdims=True)
    P = np.exp(Z); P /= P.sum(axis=1, keepdims=True)
    c = (P.cumsum(axis=1) > rng.random((n, 1))).argmax(axis=1)
    P[np.arange(n), c] -= 1.0
    G = P.T @ H / n
    G -= G.mean(axis=0, keepdims=True)
    t0 = time.perf_counter()
    r = refgeo.diameter_lmo(G, rtol=rtol, max_time=t)
    half = 0.5 * float(np.linalg.norm(G, axis=1).sum())
    out = dict(seconds=time.perf_counter() - t0, gap=r.gap, lower=r.lower_bound,
               upper=r.upper_bound, exact_over_rownorm=r.lower_bound / half,
               pairs=len(r.pairs), iterations=r.iterations)
elif kind == "tokenwise":
    N, d, k, cls, rank = args
    rng = np.random.default_rng(0)
    X = rng.standard_normal((N, d))
    A = 1.0 + 0.1 * np.tanh(X @ rng.standard_normal((d, d)) / math.sqrt(d))
    Y = X + A * X + 0.05 * rng.standard_normal((N, d))
    t0 = time.perf_counter()
    r = refgeo.decompose(X, Y, k=k, cls=cls, rank=rank)
    out = dict(seconds=time.perf_counter() - t0, energy_fraction=float(r.energy_fraction),
               median_relative_error=float(np.median(r.relative_error)))
out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print(json.dumps(out))
"""


def _run(kind, args):
    p = subprocess.run([sys.executable, "-c", _CHILD, kind, json.dumps(args)], capture_output=True,
                       text=True)
    if p.returncode:
        return {"error": p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"exit {p.returncode}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return str(v)


def main(argv):
    import refgeo

    kinds = argv or ["spread", "lmo", "tokenwise"]
    cases = {"spread": SPREAD, "lmo": LMO, "tokenwise": TOKENWISE}
    print(f"refgeo {refgeo.__version__}; `python tools/acceptance_numbers.py {' '.join(kinds)}`\n")
    for kind in kinds:
        print(f"## {kind}\n")
        rows = []
        for args in cases[kind]:
            res = _run(kind, list(args))
            rows.append((args, res))
            print(f"- {kind}{tuple(args)}: " + ", ".join(f"{k}={_fmt(v)}" for k, v in res.items()),
                  flush=True)
        print()


if __name__ == "__main__":
    main(sys.argv[1:])
