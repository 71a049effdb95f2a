r"""Max-min spreading: approximately equidistant rows (see :doc:`/theory/spreading`).

For :math:`V > d + 1` points no configuration in :math:`\mathbb{R}^d` is equidistant;
the v1 update asks for the next best thing,

.. math:: \max_X \; m(X) \quad \text{subject to} \quad D(X) \le \eta,

equivalently the largest distance ratio :math:`\rho = m/D`.  This module has the
solver, which starts from the algebraic constructions of :mod:`refgeo.codes` where they
exist, reaches the known optima in small cases and improves on the constructions at
scale, and the gradient-coupled form that trades loss decrease against :math:`m(S)`.

.. autosummary::

   spread
   spread_update
   SpreadResult
   SpreadProgress
   SpreadUpdate

Every result reports how far it is from the limit: ``SpreadResult.upper_bound`` is
:func:`refgeo.ratio_upper_bound` for ``(V, d)``.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _memory, _progress
from ._interop import fields_to_caller, from_foreign
from ._threads import blas_single_thread
from ._validate import (
    as_float_array,
    check_choice,
    check_int,
    check_min_rows,
    check_open_unit_interval,
    check_real,
)
from .bounds import RatioBound, ratio_upper_bound
from .codes import _candidates
from .rows import _engine_is_compiled

__all__ = [
    "SpreadProgress",
    "SpreadResult",
    "SpreadUpdate",
    "spread",
    "spread_update",
]


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


# =========================================================================== results


@dataclasses.dataclass(frozen=True, slots=True)
class SpreadProgress:
    """One progress report of :func:`spread` (passed to ``callback``).

    Attributes
    ----------
    phase : str
        ``"start"`` (a multistart local solve finished), ``"round"`` (a round of the
        smoothed iteration finished) or ``"done"``.
    iteration : int
        Starts or rounds so far; in the ``"done"`` report, the result's ``n_iter``
        (local solves, or the smooth method's iteration steps).
    elapsed : float
        Seconds since the call began.
    ratio : float
        Best distance ratio so far (measured, not yet certified).
    upper_bound : float
        :func:`refgeo.ratio_upper_bound` for ``(V, d)``.
    """

    phase: str
    iteration: int
    elapsed: float
    ratio: float
    upper_bound: float


@dataclasses.dataclass(frozen=True, slots=True)
class SpreadResult:
    """A spread configuration with its certified ratio and the gap to the bound.

    Attributes
    ----------
    points : ndarray of shape (V, d)
        float64 rows, centered (mean row 0), scaled so that the diameter is ``eta``
        (to a few ulps, the reported ``diameter`` never above it; read-only).
    min_dist : float
        :math:`m(X)`, the closest-pair distance.
    diameter : float
        :math:`D(X)`.
    ratio : float
        :math:`\\rho = m/D`.
    upper_bound : float
        :func:`refgeo.ratio_upper_bound` ``(V, d).value``: no configuration does better.
    certified : bool
        True when ``min_dist`` and ``diameter`` are certified: computed by the certified
        engine (:func:`refgeo.closest_pair`, :func:`refgeo.row_diameter`), or known
        algebraically for an unmodified exact construction (see ``certificate``).
    certificate : str
        ``"engine"``, ``"algebraic"`` or ``"none"``.
    error_bound : float
        Bound on the relative error of ``min_dist`` and ``diameter`` against the exact
        distances of the returned rows (computed by the engine on those rows: the
        rounding of the refined float64 values, ``gamma(ceil(d/8) + 5, 2**-53)``, a
        few ulps; for an algebraic certificate, the rounding of the scaled
        coordinates (centered, then scaled), ``2**-51 max ||x_i|| / min_dist`` beside
        8 ulps: a few ulps for the codes, about ``V`` ulps for ``V`` points on the
        line), and budgets near the smallest normal float64 add the absolute
        rounding of subnormal coordinates, ``sqrt(d) 2**-1074 / min_dist``, or, from
        the engine, of a subnormal ``min_dist``, ``2**-1074 / min_dist``).  With
        ``certificate="none"`` (``certify=False`` on the reference backend) it is the
        a-priori bound of the float64 Gram expansion relative to ``min_dist**2``, large
        (even inf) when the closest pair is short against the row norms.
    min_pair, diameter_pair : tuple of int
        A closest pair and a diameter pair ``(i, j)``, ``i < j`` (``(-1, -1)`` when
        not computed, with the algebraic certificate).
    bound : RatioBound
        All four bounds and which one binds.
    method : str
        ``"construction"``: the start (``init``; with ``init="auto"`` the construction
        of largest certified ratio, ``candidates[0]``) is returned unchanged, either
        because no iteration ran or because the iterate's certified ratio did not beat
        it; ``"epigraph"`` or ``"smooth"``: the iterate of that method (from the
        construction, or, with ``method="auto"`` where the construction is a code,
        lattice shell or ball, from random points; kept only when its certified ratio
        beats the start's, the construction's, which ``init`` still names, or the
        user's or random start's).
    init : str
        Name of the starting construction (or ``"random"``, ``"user"``).
    n_iter : int
        Local solves (epigraph) or iteration steps (smooth) run, also when their
        iterate was discarded (``method == "construction"``).
    elapsed : float
        Seconds.
    history : tuple of (float, float)
        ``(elapsed, best ratio)`` after each start or round (of the iteration, also
        when its iterate was discarded).
    candidates : tuple of (str, float)
        Every construction offered for ``(V, d)`` with its certified ratio (closed
        form, checked against the engine in the tests, or the engine's for the lattice
        balls; only the start is built by :func:`spread`), largest first: the start
        (``init``) is the first, and ``method == "construction"`` says that it is
        returned unchanged.  The ratios are those of the constructions as built, in
        their own coordinates; ``ratio`` is certified on the returned rows, scaled to
        ``eta`` (each coordinate rounded once), and may differ from its candidate's by
        a few ulps.  Empty for ``init="random"`` or a user start.
    """

    points: np.ndarray
    min_dist: float
    diameter: float
    ratio: float
    upper_bound: float
    certified: bool
    certificate: str
    error_bound: float
    min_pair: tuple[int, int]
    diameter_pair: tuple[int, int]
    bound: RatioBound
    method: str
    init: str
    n_iter: int
    elapsed: float
    history: tuple[tuple[float, float], ...]
    candidates: tuple[tuple[str, float], ...] = ()

    @property
    def gap(self) -> float:
        """``upper_bound - ratio`` (how far from the limit)."""
        return self.upper_bound - self.ratio


# =========================================================================== helpers


def _pair_sq(X: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All pairs i < j and their squared distances (small V only)."""
    i, j = np.triu_indices(X.shape[0], 1)
    diff = X[i] - X[j]
    return i, j, np.einsum("pk,pk->p", diff, diff)


def _ratio_small(X: np.ndarray) -> float:
    _, _, e = _pair_sq(X)
    return math.sqrt(float(e.min()) / float(e.max())) if e.max() > 0 else 0.0


class _Clock:
    def __init__(self, max_time: float | None):
        self.t0 = time.perf_counter()
        self.deadline = None if max_time is None else self.t0 + max_time

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return math.inf if self.deadline is None else self.deadline - time.perf_counter()


# --------------------------------------------------------------------------- small: epigraph


def _tied_start_seconds(X: np.ndarray) -> float:
    r"""Estimated seconds of SLSQP's first iteration from ``X`` when its extreme pairs are tied.

    A lattice ball or a code has many pairs at the closest distance and at the diameter,
    so many constraints of the epigraph problem are active at once, and the first
    iteration's least-squares subproblem is far slower than from points in general
    position: about :math:`10^{-8}\, m n^2` seconds with :math:`m = V (V - 1)`
    constraints and :math:`n = V d + 1` unknowns (measured with SciPy 1.17 up to
    :math:`8 \cdot 10^{-9}`: 3.9 s at (40, 20) from the tagged Kerdock code, 0.1 s from
    random points).  Returns 0 when no more than V pairs are at the two extremes.
    """
    V, d = X.shape
    _, _, e = _pair_sq(X)
    lo, hi = float(e.min()), float(e.max())
    n_tied = int(np.count_nonzero(e <= lo * (1 + 1e-9))) + int(np.count_nonzero(e >= hi * (1 - 1e-9)))
    if n_tied <= V:
        return 0.0
    return 1e-8 * float(V * (V - 1)) * float(V * d + 1) ** 2


def _epigraph_solve(X0: np.ndarray, *, maxiter: int = 500, deadline: float | None = None) -> np.ndarray:
    r"""Local solve of max t s.t. t <= ||x_i - x_j||^2 <= 1 over all pairs (SLSQP, analytic
    Jacobians), stopped at ``deadline`` (time.perf_counter()); never worse than X0."""
    iu, ju, e = _pair_sq(X0)
    X = X0 / math.sqrt(max(float(e.max()), 1e-300))
    Y = _epigraph_slsqp(X, iu, ju, iu, ju, maxiter, deadline)
    return Y if _ratio_small(Y) >= _ratio_small(X) else X


def _epigraph_slsqp(X0, li, lj, hi_i, hi_j, maxiter, deadline=None):
    from scipy.optimize import minimize

    V, d = X0.shape
    n = V * d
    L, H = li.shape[0], hi_i.shape[0]
    e_lo = np.einsum("pk,pk->p", X0[li] - X0[lj], X0[li] - X0[lj])
    z0 = np.concatenate([X0.ravel(), [e_lo.min()]])
    grad_obj = np.zeros(n + 1)
    grad_obj[n] = -1.0
    ii = np.concatenate([li, hi_i])
    jj = np.concatenate([lj, hi_j])
    rows = np.arange(L + H)
    sign = np.concatenate([np.ones(L), -np.ones(H)])

    def sq(z):
        X = z[:n].reshape(V, d)
        diff = X[ii] - X[jj]
        return np.einsum("pk,pk->p", diff, diff), diff

    def cons(z):
        e, _ = sq(z)
        return np.concatenate([e[:L] - z[n], 1.0 - e[L:]])

    def jac(z):
        _, diff = sq(z)
        J = np.zeros((L + H, V, d))
        J[rows, ii] = 2.0 * diff * sign[:, None]
        J[rows, jj] = -2.0 * diff * sign[:, None]
        A = np.zeros((L + H, n + 1))
        A[:, :n] = J.reshape(L + H, n)
        A[:L, n] = -1.0
        return A

    def stop_at_deadline(_):
        # the time budget is honored inside a solve, not only between starts (one
        # SLSQP solve at (50, 8) takes seconds)
        if deadline is not None and time.perf_counter() > deadline:
            raise StopIteration

    res = minimize(
        lambda z: -z[n],
        z0,
        jac=lambda z: grad_obj,
        constraints=[{"type": "ineq", "fun": cons, "jac": jac}],
        method="SLSQP",
        options={"maxiter": maxiter, "ftol": 1e-16},
        callback=stop_at_deadline,
    )
    X = res.x[:n].reshape(V, d)
    return X if np.all(np.isfinite(X)) else X0


def _sphere_prephase(X: np.ndarray, betas=(4.0, 8.0, 16.0, 32.0, 64.0)) -> np.ndarray:
    """Annealed log-sum-exp of pairwise cosines on the sphere (L-BFGS), small V."""
    from scipy.optimize import minimize

    V, d = X.shape
    x = X.ravel().copy()
    mask = ~np.eye(V, dtype=bool)
    for beta in betas:

        def f(x, beta=beta):
            Y = x.reshape(V, d)
            nr = np.linalg.norm(Y, axis=1, keepdims=True)
            U = Y / nr
            G = U @ U.T
            mx = G[mask].max()
            W = np.where(mask, np.exp(beta * (G - mx)), 0.0)
            S = W.sum() / 2.0
            gU = (W @ U) / S
            gY = (gU - np.sum(gU * U, axis=1, keepdims=True) * U) / nr
            return mx + math.log(S) / beta, gY.ravel()

        x = minimize(f, x, jac=True, method="L-BFGS-B", options={"maxiter": 200}).x
    Y = x.reshape(V, d)
    return Y / np.linalg.norm(Y, axis=1, keepdims=True)


# --------------------------------------------------------------------------- large: smoothed


def _near_far(X: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """For unit rows: the k largest and k smallest inner products of every row (j != i).

    One GEMM pass over row blocks (the neighborhoods are candidate sets only; every
    value used afterwards is recomputed in float64).  float32 for large problems;
    float64 up to V^2 d = 2^30, where float32 cannot rank inner products that all lie
    within 1e-7 of 1 (crowded points in small d: the near sets were wrong and the
    measured ratio with them).  Time O(V^2 d).
    """
    V, d = X.shape
    k = min(k, V - 1)
    X32 = np.ascontiguousarray(X, dtype=np.float64 if V * V * d <= (1 << 30) else np.float32)
    near = np.empty((V, k), dtype=np.int64)
    far = np.empty((V, k), dtype=np.int64)
    b = max(1, min(V, (1 << 24) // max(V, 1)))
    for i0 in range(0, V, b):
        i1 = min(V, i0 + b)
        G = X32[i0:i1] @ X32.T
        r = np.arange(i1 - i0)
        G[r, i0 + r] = np.inf
        far[i0:i1] = np.argpartition(G, k - 1, axis=1)[:, :k]
        G[r, i0 + r] = -np.inf
        near[i0:i1] = np.argpartition(G, V - k, axis=1)[:, V - k :]
    return near, far


def _near_far_engine(X: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """For unit rows: the k nearest and the k farthest other rows, from the certified engine.

    :func:`refgeo.knn` gives the exact k nearest rows (ties to the smaller index); for
    unit rows the farthest rows from :math:`x_i` are the nearest to :math:`-x_i`, so a
    second k-NN pass of ``-X`` against ``X`` gives them (:math:`x_i` itself is the
    farthest point from :math:`-x_i` and is not among its k nearest once ``V > k + 1``).
    Time O(V^2 d) for each pass.
    """
    from .rows import knn

    V = X.shape[0]
    k = min(k, V - 1)
    near = np.asarray(knn(X, k).indices)
    far = np.asarray(knn(-X, min(k + 1, V), X).indices)
    # drop j == i where it appears (only when k + 1 >= V - 1), keep k per row
    rows = np.arange(V)[:, None]
    keep = far != rows
    far = np.array([f[m][:k] for f, m in zip(far, keep)]) if not keep.all() else far[:, :k]
    return near, far


def _pairs(nbr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    V, k = nbr.shape
    i = np.repeat(np.arange(V), k)
    j = nbr.ravel()
    lo = np.minimum(i, j)
    hi = np.maximum(i, j)
    key = np.unique(lo * V + hi)
    return key // V, key % V


def _pair_inner_products(X: np.ndarray, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    out = np.empty(i.shape[0])
    step = max(1, (1 << 22) // max(X.shape[1], 1))
    for s in range(0, i.shape[0], step):
        out[s : s + step] = np.einsum("pk,pk->p", X[i[s : s + step]], X[j[s : s + step]])
    return out


def _smooth(
    X: np.ndarray,
    *,
    k: int,
    clock: _Clock,
    max_rounds: int,
    inner: int,
    target: float,
    report: Callable[[int, float], bool],
    neighbors: Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]] | None = None,
    stats: list[dict[str, float]] | None = None,
) -> tuple[np.ndarray, float, int]:
    r"""Annealed max-min iteration on the sphere over k-NN neighborhoods.

    ``neighbors(X, k)`` gives the working set (default: the certified k-NN of the
    compiled engine, ``_near_far_engine``; one float32 GEMM pass, ``_near_far``, on the
    reference backend).
    With ``stats`` a record per round is appended: the refresh time, the working-set
    size, how many of its pairs sit at the two extremes, the rows whose k-th near
    (far) partner is still at the extreme (ties beyond the working set), and the
    gradient steps tried and accepted.

    Each round refreshes the candidate pairs (the ``k`` nearest and ``k`` farthest
    partners of every row), measures the ratio there (exact for the extreme pairs:
    they are among the candidates), then drives every candidate pair into the window
    :math:`a \le \langle x_i, x_j \rangle \le b` with :math:`(1-b)/(1-a)` a little
    above the current :math:`\rho^2` by gradient steps on the squared hinge penalty
    (all violating pairs move at once; O(V k d) per step).  Returns the best
    configuration seen at a refresh, its ratio and the number of steps.
    """
    from scipy import sparse

    V, d = X.shape
    nrm = np.linalg.norm(X, axis=1, keepdims=True)
    zero = nrm[:, 0] == 0.0
    if np.any(zero):
        # a zero row (the origin, e.g. in a user init) has no direction on the sphere:
        # give it a fixed pseudo-random one
        X = X.copy()
        X[zero] = np.random.default_rng(0).standard_normal((int(zero.sum()), d))
        nrm = np.linalg.norm(X, axis=1, keepdims=True)
    X = X / nrm
    best_X, best_rho = X.copy(), -1.0
    frac = _FRAC0  # fraction of the log-gap to the bound asked for in one round
    lr = 1e-2  # step: the largest rotation of a row, in radians
    steps = 0
    if neighbors is None:
        # the certified k-NN of the compiled engine: the exact working set (the measured
        # ratio is exact for the extreme pairs), about as fast as one float32 GEMM pass
        # with argpartition (7-27 s against 51 s at (50000, 64), 40-83 s against 42 s
        # at (32768, 512)); the reference backend keeps the GEMM pass
        neighbors = _near_far_engine if _engine_is_compiled(X) else _near_far
    nbrs = neighbors
    for r in range(max_rounds + 1):
        t_refresh = time.perf_counter()
        near, far = nbrs(X, k)
        t_refresh = time.perf_counter() - t_refresh
        In, Jn = _pairs(near)
        If, Jf = _pairs(far)
        ipn = _pair_inner_products(X, In, Jn)
        ipf = _pair_inner_products(X, If, Jf)
        M, mu = float(ipn.max()), float(ipf.min())
        rho = math.sqrt(max(1.0 - M, 0.0) / max(1.0 - mu, 1e-300))
        if stats is not None:
            tol = 1e-12
            # the k-th partner of a row is its least extreme one (the GEMM pass leaves
            # the columns unordered, so near[:, -1] is not it)
            kth_n = np.min([np.einsum("ij,ij->i", X, X[near[:, c]]) for c in range(near.shape[1])], axis=0)
            kth_f = np.max([np.einsum("ij,ij->i", X, X[far[:, c]]) for c in range(far.shape[1])], axis=0)
            stats.append({"round": r, "ratio": rho, "refresh_s": t_refresh, "pairs": float(In.size + If.size),
                          "near_at_max": float(np.sum(ipn >= M - tol)), "far_at_min": float(np.sum(ipf <= mu + tol)),
                          "rows_near_saturated": float(np.sum(kth_n >= M - tol)),
                          "rows_far_saturated": float(np.sum(kth_f <= mu + tol)), "tried": 0.0, "accepted": 0.0})
        if rho > best_rho:
            best_X, best_rho = X.copy(), rho
        if report(r, best_rho) or r == max_rounds or clock.left() <= 0:
            break
        if rho >= target:
            break
        log_gap = max(2.0 * math.log(target / rho), 1e-12) if rho > 0 else 1.0
        t = frac * log_gap
        b = 1.0 - (1.0 - M) * math.exp(t / 2.0)
        a = 1.0 - (1.0 - mu) * math.exp(-t / 2.0)
        ok = False
        lr = max(lr, 1e-4)
        for _ in range(inner):
            if clock.left() <= 0:
                break
            vn = np.maximum(ipn - b, 0.0)
            vf = np.maximum(a - ipf, 0.0)
            pen = float(vn @ vn + vf @ vf)
            if pen == 0.0:
                ok = True
                break
            W = sparse.coo_matrix(
                (np.concatenate([vn, -vf]), (np.concatenate([In, If]), np.concatenate([Jn, Jf]))), shape=(V, V)
            ).tocsr()
            G = W @ X + W.T @ X
            G -= np.sum(G * X, axis=1, keepdims=True) * X
            G /= max(float(np.sqrt(np.max(np.einsum("ij,ij->i", G, G)))), 1e-300)  # lr = largest angle
            while lr > 1e-9:
                Xn = X - lr * G
                Xn /= np.linalg.norm(Xn, axis=1, keepdims=True)
                ipn_n = _pair_inner_products(Xn, In, Jn)
                ipf_n = _pair_inner_products(Xn, If, Jf)
                vn2 = np.maximum(ipn_n - b, 0.0)
                vf2 = np.maximum(a - ipf_n, 0.0)
                if float(vn2 @ vn2 + vf2 @ vf2) < pen:
                    X, ipn, ipf = Xn, ipn_n, ipf_n
                    lr = min(lr * 1.5, 0.5)
                    if stats is not None:
                        stats[-1]["accepted"] += 1.0
                    break
                lr *= 0.5
            steps += 1
            if stats is not None:
                stats[-1]["tried"] += 1.0
        frac = min(0.5, frac * 1.5) if ok else max(1e-3, frac * 0.5)
    return best_X, best_rho, steps


# --------------------------------------------------------------------------- certification


def _gram_extremes(X: np.ndarray) -> tuple[float, float, tuple[int, int], tuple[int, int]]:
    """m and D (uncertified) by blocked float64 Gram expansion on centered rows; O(V^2 d)."""
    V = X.shape[0]
    Xc = X - X.mean(axis=0)
    nrm = np.einsum("ij,ij->i", Xc, Xc)
    lo, hi = math.inf, -math.inf
    lo_p = hi_p = (0, 1)
    b = max(1, min(V, (1 << 23) // max(V, 1)))
    for i0 in range(0, V, b):
        i1 = min(V, i0 + b)
        E = nrm[i0:i1, None] + nrm[None, :] - 2.0 * (Xc[i0:i1] @ Xc.T)
        r = np.arange(i1 - i0)
        E[r, i0 + r] = np.inf
        a = int(np.argmin(E))
        if E.flat[a] < lo:
            lo, lo_p = float(E.flat[a]), (i0 + a // V, a % V)
        E[r, i0 + r] = -np.inf
        a = int(np.argmax(E))
        if E.flat[a] > hi:
            hi, hi_p = float(E.flat[a]), (i0 + a // V, a % V)
    srt = lambda p: (min(p), max(p))  # noqa: E731
    return math.sqrt(max(lo, 0.0)), math.sqrt(max(hi, 0.0)), srt(lo_p), srt(hi_p)


# --------------------------------------------------------------------------- memory


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB"


def _check_memory(V: int, d: int, k: int) -> None:
    """Raise MemoryError before any work when (V, d) cannot fit.

    The result holds V d float64 values; the solver keeps about four more copies of the
    points (start, centered, scaled, best so far), the smooth iteration 2 V k
    neighbor indices and up to 8 V k candidate pairs and inner products, and one
    GEMM block of 2^24 float64 values.
    """
    points = 8.0 * V * d
    working = 4.0 * points + 8.0 * (10.0 * V * min(k, V)) + 8.0 * 2**24
    avail = _memory.available_memory()
    if avail is not None and points + working > avail:
        raise MemoryError(
            f"spread({V}, {d}) needs about {_gib(points)} for the points (V * d float64) and "
            f"{_gib(working)} of working memory, but only {_gib(avail)} is available: reduce V "
            f"or d (the result alone needs 8 * V * d bytes)"
            + (f", or the neighbors k = {k}" if 80.0 * V * k > points else "")
            + "."
        )


# =========================================================================== spread

_INITS = ("auto", "construction", "random")
_TINY64 = float(np.finfo(np.float64).tiny)  # smallest normal float64: the least budget
_METHODS = ("auto", "epigraph", "smooth", "construction")
_SMALL_V = 50
# one SLSQP iteration from points in general position, seconds per (V d)^3: 18 s at
# (45, 40), measured with the Fortran SLSQP of SciPy < 1.16 (the oldest SciPy supported;
# SciPy 1.17's rewrite takes 0.7 to 1.4 s there)
_SLSQP_SECONDS_PER_VAR3 = 3e-9
_FRAC0 = 0.25
_INNER = 50
_RANDOM_TRY_SECONDS = 2.0  # auto without max_time: a random-start smooth run is tried below this


def _slsqp_iteration_seconds(V: int, d: int) -> float:
    """Estimated seconds of one SLSQP iteration of the epigraph problem from points in
    general position: a dense least-squares solve in the V d unknowns, O((V d)^3)."""
    return _SLSQP_SECONDS_PER_VAR3 * float(V * d) ** 3


def _refresh_seconds(V: int, d: int) -> float:
    """Rough time of one neighborhood refresh of the smooth iteration, two exact k-NN
    passes: 1e-10 s per V^2 (d + 32) (0.19 s at (5000, 5), 2.1 s at (20000, 64), 3.9 s
    at (40000, 5): the heaps' work per pair counts in low d).  It runs before the
    iteration's first deadline check."""
    return 1e-10 * float(V) * V * (d + 32)


def _smooth_seconds(V: int, d: int, k: int, max_rounds: int) -> float:
    """Rough time of a smooth run of ``max_rounds`` rounds: about 25 gradient steps of
    O(V k d) per round (3e-8 s per V k d, measured from 2.4e-8 at (150, 40) to 6e-8 at
    (1100, 64)) and ``max_rounds + 1`` neighborhood refreshes (the first measures the
    start)."""
    return max_rounds * 25 * 3e-8 * V * min(k, V) * d + (max_rounds + 1) * _refresh_seconds(V, d)


def spread(
    V: int,
    d: int,
    /,
    *,
    eta: float = 1.0,
    init: str | Any = "auto",
    method: str = "auto",
    seed: int | None = None,
    max_time: float | None = None,
    callback: Callable[[SpreadProgress], Any] | None = None,
    progress: Any = False,
    n_starts: int | None = None,
    k: int = 16,
    max_rounds: int = 20,
    certify: bool | str = "auto",
) -> SpreadResult:
    r"""Maximize the closest-pair distance of V points in R^d under a diameter budget.

    Parameters
    ----------
    V : int
        Number of points (rows), ``V >= 2``.
    d : int
        Dimension, ``d >= 1``.
    eta : float, default=1.0
        Diameter budget, at least the smallest normal float64 (about ``2.2e-308``);
        the result has :math:`D(X) = \eta` (to a few ulps; the certified diameter is
        never above :math:`\eta`).
    init : {"auto", "construction", "random"} or array_like of shape (V, d), default="auto"
        Starting point: the best algebraic construction for ``(V, d)`` where one exists
        (``"auto"`` and ``"construction"`` are the same choice: both fall back to random
        points where no construction exists, and ``result.init`` says which start was
        taken), random points on the unit sphere (Gaussian points for ``d = 1``, whose
        sphere is two points), or a user configuration (of any scale within the float64
        range: it is first scaled by a power of 2, exactly).
    method : {"auto", "epigraph", "smooth", "construction"}, default="auto"
        ``"epigraph"``: multistart SLSQP on :math:`\max t` s.t.
        :math:`t \le \lVert x_i - x_j \rVert^2 \le 1` with analytic Jacobians (small V);
        ``"smooth"``: the annealed k-NN iteration on the sphere (large V);
        ``"construction"``: no optimization (the start is returned: the best
        construction, or random points where none exists; ``result.init`` says which).
        ``"auto"``: every construction for ``(V, d)`` is listed with its certified
        ratio (closed form, or certified by the engine for the lattice balls) and the
        one of largest ratio is the start (``result.init`` names it,
        ``result.candidates`` lists them all).  No rule looks at V or d beyond the
        estimated costs of the epigraph method, of one smooth run and of its first
        neighbor refresh.  The regular simplex (:math:`\rho = 1`) is returned; :math:`V \le 50` runs ``"epigraph"`` from it (unless one SLSQP
        iteration, about :math:`3 \cdot 10^{-9} (V d)^3` seconds, would take longer
        than both ``max_time`` and 1 s, or than 1 s without ``max_time``; from a start
        whose extreme pairs are tied, a lattice or a code, the first iteration takes
        about :math:`10^{-8} V (V - 1) (V d + 1)^2` seconds, and with ``max_time``,
        where that exceeds the same limit, only the random starts run, the construction
        being returned unless one of them beats it); a construction that the local iteration
        cannot improve is returned as is (``result.method == "construction"``): a
        packing in a ball (the iteration works on the sphere), a lattice shell subset,
        and the Kerdock, tagged Kerdock and Delsarte-Goethals codes, at which no
        tangent direction improves the ratio to first order (a linear program over
        all pairs at the two extremes has optimum 0 for the Kerdock codes of
        :math:`\mathbb{R}^{16}`, tagged or not, with or without spare dimensions;
        from the tagged Kerdock code at :math:`(32768, 512)` the smooth iteration lost
        ratio in every round of a 300 s run), except that where it is more than 1%
        below the bound and ``max_rounds`` rounds of the smooth iteration are
        estimated to fit ``max_time`` (2 s without one, :math:`O(\text{max\_rounds}\,
        V k d + (\text{max\_rounds} + 1) V^2 (d + 32))`), one ``"smooth"`` run from random points is tried
        too (a random start beats a code with a partial basis or spare dimensions:
        0.817 against 0.7746 at :math:`(150, 40)`); otherwise ``"smooth"`` runs from
        the construction.  An iterate is kept only when its certified ratio beats the
        start's, the construction's, a user start's or a random start's (else
        ``result.method`` says ``"construction"``).
    seed : int, default=None
        Seed of the random starts (results are reproducible for a given seed, up to the
        time budget).
    max_time : float, default=None
        Time budget in seconds for the optimization.  None: ``n_starts`` starts or
        ``max_rounds`` rounds.  Outside the budget: building the constructions (the
        lattice shell subsets take seconds at d = 24 to 32 with V in the thousands:
        2 to 3 s at (3000, 24) on the 2-core CI machine), the smooth iteration's first
        neighbor refresh (two exact k-NN passes, O(V^2 d): about 4 s at (40000, 5);
        ``"auto"`` starts the iteration only where that refresh is estimated to fit
        ``max_time``, else it returns the start), and the final certification.  An
        SLSQP iteration of the epigraph method cannot be interrupted either, so a call
        can overrun by one of them:
        ``"auto"`` keeps that below about ``max(max_time, 1)`` seconds by estimate,
        and ``method="epigraph"`` warns (``UserWarning``) when its estimate exceeds
        ``max_time``.
    callback : callable, default=None
        Called with a :class:`SpreadProgress` after each start or round; returning
        True stops the optimization.
    progress : bool or callable, default=False
        True: a tqdm bar (a ``UserWarning``, once, when tqdm is not installed).  A
        callable receives ``{"done", "total", "elapsed", "eta"}`` from the calling
        thread at the start, after starts or rounds at most four times a second, and
        once at the end, after the final certification, with ``done == total``; steps
        are the planned starts
        (``epigraph``) or neighborhood refreshes (``smooth``: ``max_rounds + 1``, the
        first measures the start; ``construction``: one, the final certification),
        or, with ``max_time``, the fraction of the time
        budget used (total 1.0).  "The start" is after the constructions are built
        and certified (seconds at V = 3000 and more: ``elapsed`` counts from there,
        ``max_time`` from the call), so a callable cannot stop that phase.
    n_starts : int, default=None
        Local solves of the epigraph method (default 12 for ``V <= 20``, else 4; stops
        early when the bound is reached).
    k : int, default=16
        Neighbors per row (nearest and farthest) of the smoothed iteration.
    max_rounds : int, default=20
        Rounds of the smoothed iteration, each after a neighborhood refresh (one more
        refresh measures the start: ``max_rounds + 1`` in all).
    certify : bool or "auto", default="auto"
        True: certify m and D with :func:`refgeo.closest_pair` and
        :func:`refgeo.row_diameter` (the engine).  ``"auto"``: the engine, except for an
        unmodified construction whose distances are known in closed form and whose
        engine certification would be expensive (V > 4000 and :math:`V^2 (d + 64) > 5
        \cdot 10^{10}`): that one is certified algebraically.  False: no certification is
        asked for: on the reference backend an uncertified float64 Gram estimate
        (``certified=False``); where the compiled engine is built, the certificate of
        ``"auto"``, which costs less than the estimate (1.0 s against 5.6 s at
        (20000, 64); 81 s against 243 s at V = 100,000).

    Returns
    -------
    result : SpreadResult
        Points (centered, :math:`D = \eta`), ``min_dist``, ``diameter``, ``ratio``,
        ``upper_bound`` (:func:`refgeo.ratio_upper_bound`), the certificate and the
        optimization record.

    Notes
    -----
    .. math:: \max_X \; m(X) = \min_{i<j} \lVert x_i - x_j \rVert
              \quad \text{s.t.} \quad D(X) = \max_{i<j} \lVert x_i - x_j \rVert \le \eta

    Constructions (closed-form :math:`\rho`): the regular simplex (:math:`V \le d+1`,
    :math:`\rho = 1`), two orthogonal simplices (:math:`V = d + 2`), the cross
    polytope, stacked :func:`kerdock_code` copies (:math:`\rho^2 =
    (\sqrt q - 1)/(\sqrt q + 1)`), *tagged* Kerdock copies where spare dimensions
    exist (one extra coordinate per basis; :math:`\rho^2 = \sqrt q/(\sqrt q + 2)`,
    0.9428 at :math:`d = 512`), the quadratic trace codes of :math:`GF(p^m)`
    (:func:`quadratic_trace_code`, :math:`(p - 1)p^m` coordinates, up to :math:`p^{2m}`
    rows, :math:`\rho^2 = (W - e)/(W + e)` with :math:`W = (p-1)p^{m-1}`,
    :math:`e = p^{(m-1)/2}`: 0.9459 at :math:`(32768, 512)`; with one tag coordinate per
    class :math:`\rho^2 = W/(W + 2e)`: 0.9487 at :math:`(50257, 768)`), and
    :func:`delsarte_goethals_code` beyond :math:`d^2/2`, tagged where spare
    dimensions exist (one coordinate per Kerdock class of bases: :math:`\rho^2 =
    (\sqrt q - 1)/(\sqrt q + 3)`, 0.7977 at :math:`(50000, 90)`; one per basis:
    :math:`\rho^2 = \sqrt q/(\sqrt q + 4)`, 0.8165 at :math:`(5000, 160)`); and from the lattices of
    :mod:`refgeo.codes` (:func:`refgeo.lattice_ball`, :func:`refgeo.minimal_vectors`):
    V equally spaced points on the line (:math:`\rho = 1/(V - 1)`, optimal), and the V
    points of :math:`A_2` (for :math:`V` up to about :math:`10^6`), :math:`D_n`
    (:math:`n \le 12`), :math:`E_6`, :math:`E_7` or :math:`E_8`
    (:math:`V > 2d`, while the enumeration stays within :math:`2^{20}` points:
    seconds beyond :math:`10^5`) nearest to the best of a few centers (lattice points
    and holes), e.g. 0.3015 at :math:`(5000, 8)` and 0.25 at :math:`(20000, 8)`; and
    subsets of the minimal vectors of :math:`D_n`,
    :math:`E_6, E_7, E_8`, :math:`\Lambda_{16}` and :math:`\Lambda_{24}` whose inner
    products stay above a level (the 240 roots of :math:`E_8`: :math:`\rho = 1/2`;
    :math:`\sqrt{1/3}` at :math:`(2000, 16)`, :math:`\sqrt{0.4}` at :math:`(4096, 24)`);
    between the special dimensions the largest special lattice below d, zero-padded
    (:math:`E_8` up to d = 15, :math:`\Lambda_{16}` up to 23, :math:`\Lambda_{24}`
    up to 32).

    Cost: the epigraph method is :math:`O(V^2 \cdot V d)` per SLSQP iteration; the
    smoothed iteration costs :math:`O(V k d)` per step and :math:`O(V^2 d)` per
    neighborhood refresh (one float32 GEMM pass); certification is
    :math:`O(V^2 d)`.  The returned values are certified when ``certified`` is True
    (see :class:`SpreadResult`).  Invariant to rotations of the result; the problem
    is invariant under isometries and scaling.

    References
    ----------
    .. [1] LM-head update geometry (v1, max-min spreading), arXiv:2608.22253.

    Examples
    --------
    >>> import refgeo
    >>> r = refgeo.spread(4, 3)
    >>> round(r.ratio, 12), round(r.diameter, 12), r.method
    (1.0, 1.0, 'construction')
    >>> r = refgeo.spread(4, 2, seed=0)
    >>> round(r.ratio ** 2, 9), round(r.upper_bound ** 2, 9)
    (0.5, 0.5)
    """
    clock = _Clock(None)
    d = check_int(d, "d", min_value=1)
    V = check_int(V, "V", min_value=2)
    eta = check_real(eta, "eta", min_value=0.0, strict=True)
    if eta < _TINY64:
        # subnormal coordinates round in absolute terms: at eta = 5e-324 rows collapse
        raise ValueError(f"eta == {eta!r}, must be >= {_TINY64!r} (the smallest normal float64).")
    method = check_choice(method, "method", _METHODS)
    if max_time is not None:
        max_time = check_real(max_time, "max_time", min_value=0.0)
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be callable or None, got {type(callback).__name__} instead.")
    progress = _progress.check_progress(progress)
    n_starts = check_int(n_starts, "n_starts", min_value=1, allow_none=True)
    k = check_int(k, "k", min_value=1)
    max_rounds = check_int(max_rounds, "max_rounds", min_value=0)
    _check_memory(V, d, k)
    if method == "epigraph":
        # SLSQP's dense constraint Jacobian: V (V - 1) pair constraints by V d unknowns,
        # held about three times (ours, SLSQP's copy and its least-squares workspace)
        _memory.check_memory(f"spread({V}, {d}, method='epigraph')",
                             {"the constraint Jacobian (V (V - 1) x V d float64, 3 copies)":
                              24.0 * V * (V - 1) * (V * d + 1)},
                             "Use method='smooth' (or 'auto') for this V.")
    if not (isinstance(certify, str) and certify == "auto"):
        if not isinstance(certify, (bool, np.bool_)):
            # another string is a wrong value; 1 or None a wrong type (bool(1) hid typos)
            err = ValueError if isinstance(certify, str) else TypeError
            raise err(f"certify must be True, False or 'auto', got {certify!r} instead.")
        certify = bool(certify)  # np.True_ would fail the `certify is True` test below
    user_X = None
    if isinstance(init, str):
        init = check_choice(init, "init", _INITS)
    else:
        init, _ = from_foreign(init, "init", host=True)  # a bfloat16 tensor as float32
        user_X = as_float_array(init, "init", ndim=2, shape_hint="2-D array of shape (V, d)")
        user_X = np.array(user_X, dtype=np.float64)
        if user_X.shape != (V, d):
            raise ValueError(f"init must have shape ({V}, {d}), got shape {user_X.shape} instead.")
        # the ratio is scale-invariant: a power of 2 (exact) brings the largest entry to
        # [1/2, 1), so that rows near 1e308 (whose differences overflowed: "the row
        # diameter is ... beyond the float64 range ... scale S down") and subnormal rows
        # (NaN from the scaling to the budget) are solved as well as any other
        top = float(np.max(np.abs(user_X)))
        if top > 0.0:
            user_X = np.ldexp(user_X, -math.frexp(top)[1])
        # rows compared with the first, not centered: the mean of equal rows need not
        # round back to them (three rows of 0.1), and equal rows passed as distinct
        if not np.any(user_X != user_X[:1]):
            raise ValueError(f"init must have at least two distinct rows, got {V} identical rows instead.")
    seed = check_int(seed, "seed", min_value=0, allow_none=True)
    rng = np.random.default_rng(seed)
    bound = ratio_upper_bound(V, d)
    opt_clock = _Clock(max_time)

    # ---- start
    cands = _candidates(V, d) if user_X is None and init != "random" else []
    best_c = max(cands, key=lambda c: c.rho) if cands else None
    if user_X is not None:
        X, init_name = user_X, "user"
    elif best_c is not None:
        X, init_name = best_c.build(), best_c.name
    else:
        X = rng.standard_normal((V, d))
        if d > 1:  # the 0-sphere is {-1, 1}: Gaussian points on the line stay distinct
            X /= np.linalg.norm(X, axis=1, keepdims=True)
        init_name = "random"
    start_rho = best_c.rho if (best_c is not None and user_X is None) else None
    from_random = False  # auto: the smooth run from random points, not from best_c

    auto = method == "auto"
    # the longest uninterruptible SLSQP iteration allowed: max_time, but at least 1 s
    cap = max(max_time or 0.0, 1.0)
    if method == "auto":
        if user_X is None and best_c is not None and best_c.rho >= 1.0:
            method = "construction"
        elif V <= _SMALL_V and _slsqp_iteration_seconds(V, d) <= cap:
            # one SLSQP iteration solves a dense least-squares problem in the V d
            # unknowns and cannot be stopped inside: (45, 40) takes 18 s per iteration,
            # and without max_time its four starts ran for more than five minutes
            method = "epigraph"
        elif best_c is not None and not best_c.iterate:
            # a construction the local iteration cannot improve: a packing in a ball
            # (the iteration works on the sphere), a lattice shell subset, or an
            # algebraic code (Kerdock, tagged Kerdock, Delsarte-Goethals), where no
            # tangent direction improves the ratio to first order (see the docstring),
            # or a quadratic trace code (from which four smooth rounds only lost ratio
            # at (729, 54) and (300, 60): 0.845149 against 0.845154).
            # A random start can still beat it where the code is far from the bound
            # (a partial basis or spare dimensions: 0.8172 against 0.7746 at (150, 40)
            # in 1 s), so one smooth run from random points is tried when it is cheap;
            # the certified better of the two is returned.
            method = "construction"
            budget = _RANDOM_TRY_SECONDS if max_time is None else max_time
            if best_c.rho < 0.99 * bound.value and _smooth_seconds(V, d, k, max_rounds) <= budget:
                method, from_random = "smooth", True
        elif max_time is not None and _refresh_seconds(V, d) > max_time:
            # the first neighbor refresh runs before any deadline check (the gradient
            # steps check it): 2.7 s under max_time=0.5 at (20000, 40), to return the
            # start anyway
            method = "construction"
        else:
            method = "smooth"

    history: list[tuple[float, float]] = []
    if n_starts is None:
        n_starts = 12 if V <= 20 else 4
    # Steps: the starts or rounds planned; under a time budget, the budget's fraction
    # used (total 1.0).  Either may end early (the bound reached): the end is reported.
    # smooth: round 0 measures the start and reports too (max_rounds + 1 reports; with
    # max_rounds the bar was full one round early and the end was reported twice)
    # construction: one step, the final certification (with 0 the end, done == total
    # == 0, was the start's report and was not made again)
    planned = {"epigraph": n_starts, "smooth": max_rounds + 1}.get(method, 1)
    bar = _progress.Progress(progress, planned if max_time is None else 1.0, desc="spread",
                             unit="start" if method == "epigraph" else "round")

    def report(phase: str, it: int, rho: float) -> bool:
        history.append((clock.elapsed(), rho))
        bar.postfix(ratio=f"{rho:.6f}", bound=f"{bound.value:.6f}")
        if max_time is None:
            bar.advance(1)
        elif max_time > 0:
            bar.update_to(min(opt_clock.elapsed() / max_time, 1.0))
        if callback is not None:
            return bool(callback(SpreadProgress(phase, it, clock.elapsed(), rho, bound.value)))
        return False

    n_iter = 0
    X0 = X.copy()
    if method == "epigraph":
        first = X if (user_X is not None or best_c is not None) else None
        if not auto and max_time is not None:
            # asked for by name: say what the budget cannot hold (the estimates are
            # those of "auto"'s choice; they err low on slower machines)
            est = max(_slsqp_iteration_seconds(V, d),
                      _tied_start_seconds(X) if first is not None else 0.0)
            if est > max_time:
                warnings.warn(
                    f"spread({V}, {d}, method='epigraph'): one SLSQP iteration is estimated at "
                    f"about {est:.3g} s here and cannot be interrupted (neither max_time nor "
                    f"Ctrl-C takes effect inside it), so max_time={max_time!r} will be overrun; "
                    f"method='smooth' or 'auto' keeps to it.", UserWarning, stacklevel=2)
        # SLSQP cannot stop inside an iteration, and from a tied start the first one
        # overran max_time=0.1 by 1.5 to 2.7 s at (40, 10), (50, 8) and (50, 13); the
        # start stays the result unless a random start beats it (a lattice or code is
        # mostly first-order stationary: there its own solve ended after that one
        # iteration, without a gain)
        skip = (auto and max_time is not None and user_X is None and best_c is not None
                and _tied_start_seconds(X) > cap)
        X, n_iter = _multistart(first, V, d, n_starts=n_starts, rng=rng, clock=opt_clock,
                                bound=bound.value, report=report, skip_first=skip)
    elif method == "smooth":
        if from_random or (user_X is None and best_c is not None and not best_c.on_sphere):
            # projecting a ball packing on the sphere collapses it; the codes are
            # first-order stationary (the iteration from them only loses)
            X = rng.standard_normal((V, d))
        elif user_X is None and best_c is not None:
            X = X + 1e-6 * rng.standard_normal(X.shape)  # break the ties of the construction
        X, _, n_iter = _smooth(X, k=k, clock=opt_clock, max_rounds=max_rounds, inner=_INNER,
                               target=bound.value, report=lambda r, rho: report("round", r, rho))
    if method != "construction" and not np.any(X != X[:1]):
        # every row equal: the sphere iteration in d = 1 can put all rows at +1
        # (ZeroDivisionError in the scaling to the budget); the start has distinct rows
        X, method = X0, "construction"

    # ---- scale, center, certify; an iterate is kept only when its certified ratio
    # beats the start's: the construction's (closed-form or engine-certified) or the
    # user's or random start's (engine-certified)
    modified = method != "construction"
    cert = _certify_points(X, certify, eta, best_c if not modified and user_X is None else None)

    def beats(rho0, err0):
        # by more than the certificates' relative errors (a ratio carries those of its
        # two distances): re-normalising a start no round improved moved its certified
        # ratio one ulp up, and it came back labelled as the iteration's
        # (a start of ratio 0, duplicate rows, may carry an infinite error bound)
        return cert[4] > (rho0 * (1.0 + 2.0 * (cert[7] + err0)) if rho0 > 0.0 else 0.0)

    if modified and start_rho is not None and not beats(start_rho, 0.0):
        # (with certify=False on the reference backend both sides are float64 estimates)
        X, method = X0, "construction"
        cert = _certify_points(X, certify, eta, best_c)
    elif modified and (user_X is not None or best_c is None):
        # a user or random start has no closed-form ratio: certify it too.  The smooth
        # iteration works on the sphere, and from a ball packing (the A2 points nearest
        # to a center, ratio 0.125 at V = 60) it returned ratio 0: rows on one ray
        # collapse; in d = 1 (the sphere is {-1, 1}) random points came back as two
        # values, 60 rows with ratio 0
        start = _certify_points(X0, certify, eta, None)
        if not beats(start[4], start[7]):
            X, method, cert = X0, "construction", start
    # the end after the final certification, which max_time does not cover (10 of the
    # 10.4 s of spread(20000, 64, max_time=5) came after a report of done == total)
    bar.finish()
    bar.close()
    mode, X, min_dist, diameter, ratio, pm, pd, err = cert
    certificate = mode
    if callback is not None:
        callback(SpreadProgress("done", n_iter, clock.elapsed(), ratio, bound.value))
    return SpreadResult(
        points=_readonly(X),
        min_dist=float(min_dist),
        diameter=float(diameter),
        ratio=float(ratio),
        upper_bound=bound.value,
        certified=certificate != "none",
        certificate=certificate,
        error_bound=float(err),
        min_pair=(int(pm[0]), int(pm[1])),
        diameter_pair=(int(pd[0]), int(pd[1])),
        bound=bound,
        method=method,
        init=init_name,
        n_iter=int(n_iter),
        elapsed=clock.elapsed(),
        history=tuple(history),
        candidates=tuple((c.name, float(c.rho)) for c in sorted(cands, key=lambda c: -c.rho)),
    )


def _certify_points(X, certify, eta, construction):
    """Center, scale to diameter eta and certify; returns (mode, X, m, D, ratio, min_pair,
    diameter_pair, error_bound).  ``construction``: the unmodified construction X is
    (its distances known in closed form), or None."""
    X = np.asarray(X, dtype=np.float64)
    V_ = X.shape[0]
    algebraic = construction is not None and construction.diameter is not None
    # the engine's time per pair stops falling below d = 64 (3.6 s for V = 50,000 at
    # d = 1 and at d = 8, 4.5 s at d = 64): V = 200,000 points on the line took 39 s
    cheap = V_ <= 4000 or (_engine_is_compiled(X) and V_ * V_ * (X.shape[1] + 64) <= 5e10)
    if certify is False and _engine_is_compiled(X):
        # the compiled engine's float32 filter beats the float64 Gram estimate (5x at
        # (20000, 64)), and certifies; an expensive exact construction keeps its closed
        # form (27 s in the engine at (20000, 256) against 0.3 s): as "auto"
        certify = "auto"
    if certify is True or (certify == "auto" and (cheap or not algebraic)):
        mode = "engine"
    elif certify == "auto":
        mode = "algebraic"
    else:
        mode = "none"
    X = X - X.mean(axis=0)
    if mode == "algebraic":
        # Exact construction: every pairwise distance is known in closed form (the
        # inner-product spectrum, verified in the tests); centering (the subtraction;
        # an error of the mean itself moves every row alike) and scaling by eta/D round
        # each entry once each, by at most u |x| (u = 2**-53), so row i moves by at
        # most about 2 u ||x_i|| and a distance by 4 u max ||x_i||: an ulp or two of it
        # for the codes (rows and distances of one size), but V ulps of the closest
        # pair for V points on the line (rows up to eta/2, a gap of eta/V): 3.4e-12
        # relative at V = 60,000, where 8 ulps were claimed.  Rows built from rounded
        # entries (the quadratic trace codes) add the construction's build_error.
        X = X * (eta / construction.diameter)
        diameter, min_dist = eta, construction.rho * eta
        pm, pd = (-1, -1), (-1, -1)
        top = float(np.max(np.abs(X)))  # the norms of rows near 1e-300 without underflow
        Xs = X / top if top > 0.0 else X
        moved = 2.0**-51 * top * math.sqrt(float(np.max(np.einsum("ij,ij->i", Xs, Xs)))) / min_dist
        err = 8.0 * 2.0**-52 + moved + construction.build_error + _subnormal_error(X, min_dist)
        ratio = min_dist / diameter
    elif mode == "engine":
        from ._certify import refined_distance_error
        from .rows import closest_pair, row_diameter

        # the rows returned are certified themselves, at their diameter eta: certified
        # at diameter 1 and then scaled, each coordinate's rounding (u |x|) moved a short
        # pair by far more than a few ulps of its length (1.2e-13 relative at ratio
        # 7e-5).  The engine scales rows by powers of two where their squares would
        # leave the float64 range (eta = 1e-160 or 1e160), and certifies subnormal
        # coordinates as the values they are.
        X, Dp = _within_diameter(X, row_diameter(X).value, eta)
        mp = closest_pair(X)
        pd, pm = (Dp.i, Dp.j), (mp.i, mp.j)
        diameter, min_dist = Dp.value, mp.value
        ratio = min_dist / diameter
        # the refined values carry the rounding of their float64 sums (a few ulps; 0
        # here claimed them exact), and a closest distance below the smallest normal
        # float64 (budgets near it) its final rounding, up to half of 2**-1074: 2.2e-15
        # relative at eta = 2.2e-308, V = 400, d = 2, where 6.7e-16 was reported
        err = refined_distance_error(X.shape[1])
        if 0.0 < min_dist < _TINY64:
            err += 2.0**-1074 / min_dist
    else:
        m0, D0, pm, pd = _gram_extremes(X)
        # the Gram expansion's error on a squared distance is about c (n_i + n_j) (the
        # engine's a-priori bound, rows.py): relative to m0^2 it is large when the
        # closest pair is short against the norms (cancellation), so say so
        from ._certify import rounding_bound as _rounding_bound

        c, _ = _rounding_bound(X.shape[1], "float64")
        n_max = float(np.max(np.einsum("ij,ij->i", X, X)))
        err = c * 2.0 * n_max / (m0 * m0) if m0 > 0 else math.inf
        X = X * (eta / D0)
        min_dist, diameter = m0 * eta / D0, eta
        ratio = min_dist / diameter
    return mode, X, float(min_dist), float(diameter), float(ratio), pm, pd, float(err)


def _subnormal_error(X: np.ndarray, min_dist: float) -> float:
    """Relative error that subnormal coordinates of the scaled points add to distances.

    Scaling rounds a coordinate that lands below the smallest normal float64 by up to
    half the smallest subnormal, not by a relative amount: a difference of two moves
    by at most ``2**-1074``, a distance by at most ``sqrt(d) 2**-1074``.  0 when no
    coordinate is subnormal (every budget above about ``1e-290``).
    """
    tiny = np.abs(X[X != 0.0])
    if tiny.size == 0 or float(tiny.min()) >= _TINY64 or min_dist <= 0.0:
        return 0.0
    return math.sqrt(X.shape[1]) * 2.0**-1074 / min_dist


def _multistart(X_first, V, d, *, n_starts, rng, clock, bound, report, skip_first=False):
    """Best of several epigraph solves: the given start, then alternating random starts
    (Gaussian clouds, and sphere points spread by an annealed soft-max of cosines).
    ``skip_first``: the random starts only (at least one), the same ones as with the
    given start."""
    best_X, best_rho = None, -1.0
    done = 0
    first = 1 if skip_first else 0
    for s in range(first, max(n_starts, first + 1)):
        if s > first and clock.left() <= 0:
            break
        # SLSQP's least-squares steps call BLAS on small matrices, whose threaded
        # kernels sum in another order: the iterates (and the returned ratio, 0.54664
        # against 0.54709 at (30, 5)) depended on the BLAS thread count, and more
        # threads were slower on these sizes anyway
        with blas_single_thread():
            if s == 0 and X_first is not None:
                X0 = X_first
            elif s % 2 == 1:
                X0 = _sphere_prephase(rng.standard_normal((V, d)))
            else:
                X0 = rng.standard_normal((V, d))
            X = _epigraph_solve(X0, deadline=clock.deadline)
        rho = _ratio_small(X)
        done += 1
        if rho > best_rho:
            best_X, best_rho = X, rho
        # the starts finished so far, as SpreadProgress.iteration says (it was the
        # start's 0-based index: 0 after one start, and 1 after one where the given
        # start was skipped)
        if report("start", done, best_rho) or best_rho >= bound * (1.0 - 1e-12):
            break
    return best_X, done


# =========================================================================== gradient-coupled


@dataclasses.dataclass(frozen=True, slots=True)
class SpreadUpdate:
    r"""The gradient-coupled spread step and its trade-off curve (v1 form, see :doc:`/theory/spreading`).

    Attributes
    ----------
    update : ndarray of shape (V, d)
        The chosen step S (float64, read-only): :math:`D(S) \le \eta` to a few ulps
        (the engine's diameter, within its error bound of the exact one, is at most
        :math:`\eta`; the exact one of the float rows can exceed it by about 1e-16
        relative), :math:`\mathbf{1}^T S = 0`, decrease at least ``target_decrease``.
    decrease : float
        :math:`-\langle G, S \rangle`.
    min_dist, diameter, ratio : float
        Certified :math:`m(S)`, :math:`D(S)` and :math:`m/D`.
    target_decrease : float
        :math:`(1 - \varepsilon)` times the exact LMO's decrease.
    eps : float
        The tolerated fraction of lost decrease.
    rownorm_decrease, rownorm_min_dist : float
        Decrease and :math:`m` of projected RowNorm (:func:`refgeo.projected_rownorm`).
    lmo_decrease, lmo_min_dist : float
        Decrease and :math:`m` of the exact LMO step (:func:`refgeo.diameter_lmo`).
    lmo_upper_bound : float
        :math:`\eta` times the certified upper bound on the tension: no step with
        :math:`D \le \eta` decreases more.
    spread_min_dist : float
        :math:`m` of the spread configuration alone (the largest possible at this
        budget, up to the solver): the other end of the curve.
    curve_t : ndarray of shape (n,)
        Interpolation parameter of each curve point (0: exact LMO, 1: aligned spread
        configuration).
    curve_decrease, curve_min_dist : ndarray of shape (n,)
        The trade-off curve: decrease and certified :math:`m` of each point, every point
        rescaled to :math:`D = \eta`.
    """

    update: np.ndarray
    decrease: float
    min_dist: float
    diameter: float
    ratio: float
    target_decrease: float
    eps: float
    rownorm_decrease: float
    rownorm_min_dist: float
    lmo_decrease: float
    lmo_min_dist: float
    lmo_upper_bound: float
    spread_min_dist: float
    curve_t: np.ndarray
    curve_decrease: np.ndarray
    curve_min_dist: np.ndarray


_ALIGN_STARTS = 4


def _align(X: np.ndarray, G: np.ndarray, n_rounds: int = 5) -> np.ndarray:
    """Rotate (Procrustes) and re-assign the rows of X to maximize <-G, X>.

    A local search from ``_ALIGN_STARTS`` starts, the best kept.  Each start pairs the
    rows of G, ranked by norm (ties by index), with the rows of X in a fixed order (X's
    own, then orders from a fixed seed): a start that paired row i of G with row i of X
    made the result depend on G's row order (one G and three orders of its rows gave
    min distances 0.22, 0.38 and 0.64), while norms move with the rows and do not
    change under rotations, so these starts, and the step, are equivariant under both.
    """
    from scipy.optimize import linear_sum_assignment

    V = X.shape[0]
    rank = np.argsort(np.lexsort((np.arange(V), -np.linalg.norm(G, axis=1))))
    orders = np.random.default_rng(0)
    best, best_val = X, -math.inf
    for s in range(_ALIGN_STARTS):
        Y = X[(np.arange(V) if s == 0 else orders.permutation(V))[rank]]
        val = -math.inf
        for _ in range(n_rounds):
            U, _, Wt = np.linalg.svd(Y.T @ (-G), full_matrices=False)
            Z = Y @ (U @ Wt)  # best rotation for the current assignment
            if V <= 2000:
                r, c = linear_sum_assignment(-((-G) @ Z.T))  # row i of G gets row c[i] of Z
                Z = Z[c[np.argsort(r)]]
            new = float(np.sum(-G * Z))
            if new <= val + 1e-12 * abs(val):
                break
            Y, val = Z, new
        if val > best_val:
            best, best_val = Y, val
    return best


def _within_diameter(X: np.ndarray, D: float, target: float):
    """``X`` (of certified diameter ``D > 0``) scaled to a certified diameter at most
    ``target``, and its :class:`~refgeo.ExtremePair`.

    ``X * (target / D)`` rounds every coordinate, and its certified diameter can come
    out one ulp above ``target``; the factor is then lowered by the excess (and one
    ulp) until it is not.  One certified diameter in the usual case, two otherwise.
    In the top binade the aim is 4 ulps lower: a diameter rounded one ulp above the
    largest float64 is beyond the range, and ``row_diameter`` refuses it.  X is first
    scaled by a power of two to a diameter in [1, 2), so that the factor stays within
    the range: ``target / D`` overflowed for D below ``target / 1.8e308`` (a start of
    diameter 0.25 at eta = 1e308 came back as infinite rows).
    """
    from .rows import row_diameter

    e = math.frexp(D)[1] - 1  # D = m 2**(e + 1), m in [1/2, 1): D / 2**e in [1, 2)
    X, D = np.ldexp(X, -e), math.ldexp(D, -e)  # exact but where a coordinate goes subnormal
    f = (target if target < 2.0**1023 else target * (1.0 - 2.0**-50)) / D
    while True:
        Y = X * f
        Dp = row_diameter(Y)
        if Dp.value <= target:
            return Y, Dp
        f = math.nextafter(f * (target / Dp.value), 0.0)


def _scaled_step(S: np.ndarray, eta: float):
    """Center S and scale it to a certified diameter at most eta (equal up to a few
    ulps); return (S, D, m)."""
    from .rows import closest_pair, row_diameter

    S = S - S.mean(axis=0)
    D = row_diameter(S).value
    if D == 0.0:
        return S, 0.0, 0.0
    S, Dp = _within_diameter(S, D, eta)
    return S, Dp.value, closest_pair(S).value


def spread_update(
    G: Any,
    /,
    *,
    eta: float = 1.0,
    eps: float = 0.05,
    n_points: int = 9,
    seed: int | None = None,
    n_starts: int = 4,
    lmo_rtol: float = 1e-4,
    max_time: float | None = None,
) -> SpreadUpdate:
    r"""Gradient-coupled max-min step: keep most of the best decrease, spread the rows.

    Parameters
    ----------
    G : array_like or tensor of shape (V, d)
        Gradient of the head weight (centered internally: :math:`\mathbf{1}^T S = 0`
        makes the mean row irrelevant).  For a tensor, the array fields of the result
        are tensors on its device.
    eta : float, default=1.0
        Diameter budget.
    eps : float, default=0.05
        Fraction of the exact LMO's decrease that may be given up, ``0 <= eps <= 1``.
    n_points : int, default=9
        Points of the trade-off curve (``>= 2``).
    seed : int, default=None
        Seed of :func:`spread` (small V).
    n_starts : int, default=4
        Local solves of :func:`spread` (small V).
    lmo_rtol : float, default=1e-4
        ``rtol`` of :func:`refgeo.diameter_lmo`.
    max_time : float, default=None
        Time budget of the inner :func:`spread` call.

    Returns
    -------
    step : SpreadUpdate
        The update, its certified :math:`m`, :math:`D`, decrease, the RowNorm and
        exact-LMO reference points and the trade-off curve.

    Notes
    -----
    .. math:: \max_S \; m(S) \quad \text{s.t.} \quad D(S) \le \eta,\;
              \mathbf{1}^T S = 0,\; -\langle G, S \rangle \ge (1 - \varepsilon)\,
              \eta\,\underline{T}(G)

    with :math:`\eta\,\underline{T}(G)` the decrease of the exact LMO step
    :math:`S_*` (certified within ``lmo_rtol`` of optimal).  The curve joins
    :math:`S_*` (largest decrease, :math:`m` often 0: tied rows) to the spread
    configuration :math:`X` of :func:`spread` (largest :math:`m`), rotated by
    Procrustes and re-assigned to the rows of :math:`-G` (Hungarian algorithm for
    :math:`V \le 2000`; the best of four starts) to maximize its own decrease: :math:`S_t \propto (1-t) S_* + t X`,
    each point centered and rescaled to :math:`D = \eta`.  The step is the curve point of
    largest :math:`m` meeting the decrease constraint (:math:`S_*` itself when no other
    does).  Time: one LMO solve, one spread solve, :math:`2 n` certified extreme-pair
    computations (:math:`O(V^2 d)` each).  Equivariant under row permutations and
    orthogonal maps of ``G`` (up to the solvers' tie breaking, and the order of rows
    of ``G`` of equal norm: the alignment's starts rank the rows by norm).

    References
    ----------
    .. [1] LM-head update geometry, arXiv:2608.22253 (v1: the max-min update; v2:
       the exact LMO and RowNorm).

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> G = np.array([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0]])
    >>> st = refgeo.spread_update(G, eta=2.0, eps=0.0, seed=0)
    >>> round(st.decrease, 9), round(st.lmo_decrease, 9), round(st.ratio, 9)
    (4.0, 4.0, 0.707106781)
    """
    from .lmo import diameter_lmo, projected_rownorm
    from .rows import closest_pair

    # tensors through the common converter (autograd and bfloat16 tensors as their
    # values; integer, bool and complex tensors a TypeError naming G); the array
    # fields of the result come back as tensors on G's device
    G, origin = from_foreign(G, "G", host=True)
    G = as_float_array(G, "G", ndim=2, shape_hint="2-D array of shape (V, d)")
    G = np.array(G, dtype=np.float64)
    check_min_rows(G, "G", 2)
    V, d = G.shape
    eta = check_real(eta, "eta", min_value=0.0, strict=True)
    eps = check_real(eps, "eps", min_value=0.0)
    if eps > 1.0:
        raise ValueError(f"eps == {eps}, must be <= 1.")
    n_points = check_int(n_points, "n_points", min_value=2)
    lmo_rtol = check_open_unit_interval(lmo_rtol, "lmo_rtol")
    # the curve's three arrays; the steps themselves are not kept (one at a time)
    _memory.check_memory(f"spread_update(G of shape {G.shape}, n_points={n_points})",
                         {f"the trade-off curve (3 arrays of {n_points} float64)": 24.0 * n_points},
                         "Ask for fewer n_points.")
    # Every step is positively homogeneous of degree 0 in G and every decrease of
    # degree 1: a tiny or huge G is solved at a power of 2 (exact) that brings its
    # largest entry to [1/2, 1), and the decreases are scaled back.  Near the subnormal
    # range the centering below rounds in absolute terms (G*1e-320 was refused as not
    # centered, though spread_update centers G itself); near the top of the range the
    # column sums of the centering overflow (G = 4e307 + small was refused as holding
    # infinite entries, though G was finite and its centered form small).
    top = float(np.max(np.abs(G)))
    shift = -math.frexp(top)[1] if 0.0 < top < 2.0**-900 or top > 2.0**900 else 0
    if shift:
        G = np.ldexp(G, shift)

    def unscaled(v: float, name: str) -> float:
        if v != 0.0 and math.frexp(v)[1] - shift > 1024:
            raise ValueError(
                f"spread_update: {name} == 2**{math.log2(abs(v)) - shift:.2f} for this G, beyond the "
                f"float64 range (max {float(np.finfo(np.float64).max)!r}); scale G down by "
                f"2**{math.frexp(v)[1] - shift - 1023} or more (the decreases are positively "
                "homogeneous in G, the step does not depend on its scale)."
            )
        return math.ldexp(v, -shift) + 0.0  # + 0.0: no -0.0 for a zero decrease

    Gc = G - G.mean(axis=0)

    rn = np.asarray(projected_rownorm(Gc, eta=eta), dtype=np.float64)
    with np.errstate(over="ignore"):
        rn_dec = float(-np.sum(Gc * rn))
    if not math.isfinite(rn_dec):
        raise ValueError(
            f"spread_update: the decrease of the projected RowNorm step is beyond the float64 range for "
            f"this G and eta == {eta!r}; scale G or eta down (the decreases are proportional to both)."
        )
    rn_m = closest_pair(rn).value
    lmo = diameter_lmo(Gc, eta=eta, rtol=lmo_rtol)
    S_star = np.asarray(lmo.update, dtype=np.float64)
    lmo_dec = float(lmo.decrease)
    lmo_m = closest_pair(S_star).value
    target = (1.0 - eps) * lmo_dec

    X = np.array(spread(V, d, eta=eta, seed=seed, n_starts=n_starts, max_time=max_time, certify=False).points)
    if np.any(Gc):
        X = _align(X, Gc)

    ts = np.linspace(0.0, 1.0, n_points)
    decs, ms = np.empty(n_points), np.empty(n_points)
    best = None  # (m, decrease, S, D) of the curve point picked so far
    for i, t in enumerate(ts):
        S, D, m = _scaled_step((1.0 - t) * S_star + t * X, eta)
        if D == 0.0:  # pragma: no cover - only if S_* and X cancel exactly
            S, D, m = S_star, _row_diameter_value(S_star), lmo_m
        decs[i], ms[i] = float(-np.sum(Gc * S)), m
        # the largest m meeting the decrease constraint, then the largest decrease (the
        # first such point on ties)
        if decs[i] >= target and (best is None or (m, decs[i]) > best[:2]):
            best = (m, float(decs[i]), S, D)
    if best is not None:
        m, dec, S, D = best
    else:  # pragma: no cover - t = 0 is S_* rescaled up to D = eta, so it always qualifies
        S, dec, m, D = S_star, lmo_dec, lmo_m, _row_diameter_value(S_star)
    S = np.array(S)
    return fields_to_caller(SpreadUpdate(
        update=_readonly(S),
        decrease=unscaled(dec, "decrease"),
        min_dist=m,
        diameter=D,
        ratio=m / D if D > 0 else 0.0,
        target_decrease=unscaled(target, "target_decrease"),
        eps=eps,
        rownorm_decrease=unscaled(rn_dec, "rownorm_decrease"),
        rownorm_min_dist=rn_m,
        lmo_decrease=unscaled(lmo_dec, "lmo_decrease"),
        lmo_min_dist=lmo_m,
        lmo_upper_bound=unscaled(eta * float(lmo.upper_bound), "lmo_upper_bound"),
        spread_min_dist=float(ms[-1]),
        curve_t=_readonly(ts),
        curve_decrease=_readonly(np.array([unscaled(float(v), "curve_decrease") for v in decs])),
        curve_min_dist=_readonly(ms),
    ), origin)


def _row_diameter_value(S: np.ndarray) -> float:
    from .rows import row_diameter

    return row_diameter(S).value
