"""The demo's analyses after training: LMO certificates, final-head geometry, tokenwise fit.

Each analysis returns a plain dict of numbers (what the report, the plots and
``results.json`` show) and works within the time budgets of the :class:`DemoSize`.

* :func:`lmo_track`: the certified min-tension value T(G) of the stored minibatch
  gradients and the share of the exact decrease that RowNorm gets
  (see docs/theory/lmo.md);
* :func:`head_geometry`: the distance ratio rho = m/D of each trained head against the
  upper bound for (V, d), random unit rows and the max-min solver
  (see docs/theory/rows.md and docs/theory/spreading.md);
* :func:`tokenwise`: the tokenwise decomposition of the feature layer ``h0 -> h1`` and
  the KL of patching it (see docs/theory/tokenwise.md).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from refgeo import (
    closest_pair,
    covering_radius,
    decompose,
    diameter_lmo,
    jung_constant,
    output_perturbation,
    ratio_upper_bound,
    row_diameter,
    spearman,
    spread,
    tension_bounds,
)

from .model import Features
from .training import DemoSize, Run

__all__ = ["head_geometry", "lmo_track", "tokenwise"]


def _trained_head(run: Run) -> np.ndarray:
    """The final head ``W`` of ``run`` (set by :func:`refgeo._demo.training.train`)."""
    if run.W is None:
        raise ValueError(f"run {run.name!r} has no trained head W; train it first.")
    return run.W


def lmo_track(run: Run, size: DemoSize) -> dict[str, Any]:
    """Certified LMO gap and RowNorm/exact ratio at the stored gradients of ``run``.

    Each gradient is restricted to its ``size.lmo_rows`` rows of largest norm and
    re-centered (the rows that carry the step), so the solver can certify T(G) within
    ``size.lmo_solve_s`` seconds.
    """
    out: dict[str, Any] = {"trajectory": run.label, "rows": size.lmo_rows, "steps": [], "gap": [],
                           "lower": [], "upper": [], "half_sum": [], "ratio_lo": [], "ratio_hi": [],
                           "seconds": [], "solver_gap": []}
    t_start = time.perf_counter()
    for t in sorted(run.grads):
        G = run.grads[t]
        keep = np.sort(np.argsort(-np.linalg.norm(G, axis=1), kind="stable")[: size.lmo_rows])
        Gk = G[keep] - G[keep].mean(axis=0)
        t0 = time.perf_counter()
        res = diameter_lmo(Gk, eta=1.0, rtol=1e-3, max_time=size.lmo_solve_s)
        dt = time.perf_counter() - t0
        # the solver's bracket intersected with the closed-form one (1/2 sum, Jung, pairwise flow)
        cb = tension_bounds(Gk)
        lo, hi = max(float(res.lower_bound), float(cb.lower)), min(float(res.upper_bound), float(cb.upper))
        half = 0.5 * float(np.linalg.norm(Gk, axis=1).sum())
        out["steps"].append(t)
        out["gap"].append((hi - lo) / hi if hi > 0 else 0.0)
        out["solver_gap"].append(float(res.gap))
        out["lower"].append(lo)
        out["upper"].append(hi)
        out["half_sum"].append(half)
        out["ratio_lo"].append(half / hi if hi > 0 else 1.0)
        out["ratio_hi"].append(min(1.0, half / lo) if lo > 0 else 1.0)
        out["seconds"].append(dt)
        if time.perf_counter() - t_start > size.stage_budget_s:
            break
    return out


def head_geometry(runs: list[Run], size: DemoSize, targets: np.ndarray, rng: np.random.Generator) -> dict[str, Any]:
    """Distance ratio of each trained head (all rows, and rows of tokens seen as targets)."""
    V, d = size.vocab, size.d
    out: dict[str, Any] = {"V": V, "d": d, "methods": {}}
    out["upper_bound"] = float(ratio_upper_bound(V, d).value)
    X = rng.standard_normal((V, d))
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    out["random_sphere_rho"] = float(closest_pair(X).value / row_diameter(X).value)
    out["spread_rho"] = float(spread(V, d, seed=0, max_time=size.stage_budget_s / 4).ratio)
    t_start = time.perf_counter()
    for run in runs:
        W = _trained_head(run)
        D, m = row_diameter(W), closest_pair(W)
        # the most frequent targets of this run: rows the head has evidence on
        counts = np.bincount(targets[: run.steps_done].ravel(), minlength=V)
        seen = np.sort(np.argsort(-counts, kind="stable")[: min(size.top_rows, int(np.count_nonzero(counts)))])
        Ws = W[seen]
        Ds, ms = row_diameter(Ws), closest_pair(Ws)
        rec: dict[str, Any] = {"D": float(D.value), "m": float(m.value),
                               "rho": float(m.value / D.value) if D.value > 0 else 0.0,
                               "rho_seen": float(ms.value / Ds.value) if Ds.value > 0 else 0.0,
                               "n_seen": int(len(seen))}
        rec["upper_bound_seen"] = float(ratio_upper_bound(int(len(seen)), d).value)
        k = int(np.linalg.matrix_rank(W - W.mean(axis=0)))
        rec["rank"] = k
        if time.perf_counter() - t_start < size.stage_budget_s:
            ball = covering_radius(W, max_iter=2000, tol=1e-6)
            rec["rad"] = float(ball.radius)
            rec["rad_lower"] = float(ball.lower_bound)
        rec["jung_upper"] = float(jung_constant(k)) * rec["D"]
        out["methods"][run.name] = rec
    return out


def tokenwise(feats: Features, ids: np.ndarray, pos: np.ndarray, head: Run | None) -> dict[str, Any]:
    """Decompose the fixed feature layer h0 -> h1 and, with a trained head, the KL of patching."""
    X, Y = feats(ids, pos)
    # tokens whose context windows repeat have the same state: leave-one-out removes
    # the token itself, not its copies, which are then its neighbors at distance 0 and
    # fit it exactly (81 of 200 tokens at the tiny size, median relative error 7e-6
    # against 0.33 for the others).  One token per distinct state is kept.
    _, first = np.unique(X, axis=0, return_index=True)
    keep = np.sort(first)
    X, Y = X[keep], Y[keep]
    k = min(2 * X.shape[1], X.shape[0] - 1)
    res = decompose(X, Y, k=k, cls="full", ridge=1e-3)
    out: dict[str, Any] = {"N": int(X.shape[0]), "d": int(X.shape[1]), "k": k, "cls": "full (ridge 1e-3)",
                           "duplicates_dropped": int(len(pos) - keep.size), "per_token": {}, "scalars": {}}
    for key, v in res.summary().items():
        if isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool):
            out["scalars"][key] = float(v)
    out["per_token"]["relative_error"] = np.asarray(res.relative_error, dtype=float)
    out["per_token"]["angle_rho_tau"] = np.asarray(res.angles.rho_tau, dtype=float)
    out["per_token"]["angle_delta_tau"] = np.asarray(res.angles.delta_tau, dtype=float)
    if head is not None:
        W = _trained_head(head)
        kl = np.asarray(output_perturbation(lambda h: np.asarray(h) @ W.T, Y, res.patched(X)), dtype=float)
        out["per_token"]["kl"] = kl
        out["head"] = head.label
        out["scalars"]["mean_kl"] = float(np.mean(kl))
        e = out["per_token"]["relative_error"]
        ok = np.isfinite(e) & np.isfinite(kl)
        out["scalars"]["spearman_error_kl"] = float(spearman(e[ok], kl[ok]))
    return out
