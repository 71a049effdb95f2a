"""Projected RowNorm, tension bounds, closed forms and the exact diameter LMO
(docs/theory/lmo.md).

The exact LMO is checked against an independent solver written here (the potential
form max <G, X> s.t. ||x_i - x_j||^2 <= 1 for all pairs, solved with scipy's SLSQP),
against the closed forms of the theory page and against its bounds.
"""

from __future__ import annotations

import decimal
import math
import re
import time

import numpy as np
import pytest
import scipy.spatial.distance
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from scipy.optimize import minimize

import refgeo
import refgeo._progress

from ._layouts import assert_same_result, other_layouts

# ------------------------------------------------------------------ helpers


def _centered(A):
    return A - A.mean(axis=0, keepdims=True)


def _brute_diameter(S):
    diff = S[:, None, :] - S[None, :, :]
    return float(np.sqrt(np.max(np.einsum("ijk,ijk->ij", diff, diff))))


def independent_tension(G):
    """T(G) = max <G, X> s.t. ||x_i - x_j||^2 <= 1 (all pairs), by SLSQP in the row space.

    Returns the value of the best feasible point found (the SLSQP point rescaled by its
    diameter, so it is a valid lower bound that SLSQP drives to the optimum).
    """
    Gc = _centered(np.asarray(G, dtype=np.float64))
    U, s, Vt = np.linalg.svd(Gc, full_matrices=False)
    r = int(np.sum(s > s[0] * 1e-12))
    H = U[:, :r] * s[:r]
    V = H.shape[0]
    I, J = np.triu_indices(V, 1)
    m = len(I)

    def obj(z):
        return -float(np.sum(H.ravel() * z)), -H.ravel()

    def cons(z):
        X = z.reshape(V, r)
        D = X[I] - X[J]
        return 1.0 - np.einsum("ij,ij->i", D, D)

    def cons_jac(z):
        X = z.reshape(V, r)
        D = X[I] - X[J]
        Jm = np.zeros((m, V, r))
        Jm[np.arange(m), I, :] = -2.0 * D
        Jm[np.arange(m), J, :] = 2.0 * D
        return Jm.reshape(m, V * r)

    x0 = 0.49 * H / np.linalg.norm(H, axis=1, keepdims=True).clip(1e-300)
    res = minimize(
        obj,
        x0.ravel(),
        jac=True,
        method="SLSQP",
        constraints=[{"type": "ineq", "fun": cons, "jac": cons_jac}],
        options={"ftol": 1e-15, "maxiter": 2000},
    )
    X = res.x.reshape(V, r)
    return float(np.sum(H * X)) / max(1.0, _brute_diameter(X))


def random_gradient(rng, V, d):
    return _centered(rng.standard_normal((V, d)))


def ce_gradient(rng, V, d, n_tokens, scale=2.0):
    """Cross-entropy gradient of a linear head W (V, d) on hidden states (n, d).

    Logits z_t = W h_t; dL/dW = sum_t (p_t - e_{c_t}) h_t^T / n: shape (V, d), rows are
    vocabulary rows and they sum to zero.
    """
    Hs = rng.standard_normal((n_tokens, d))
    W = rng.standard_normal((V, d)) * scale / math.sqrt(d)
    Z = Hs @ W.T
    Z -= Z.max(axis=1, keepdims=True)
    P = np.exp(Z)
    P /= P.sum(axis=1, keepdims=True)
    c = (P.cumsum(axis=1) > rng.random((n_tokens, 1))).argmax(axis=1)
    R = P.copy()
    R[np.arange(n_tokens), c] -= 1.0
    G = R.T @ Hs / n_tokens
    assert G.shape == (V, d)
    return G


def simplex_gradient(k):
    """k+1 rows: the vertices of a regular simplex of dimension k (in R^(k+1), centered)."""
    return _centered(np.eye(k + 1))


# ------------------------------------------------------------------ center / normalize / RowNorm


def test_center_rows_and_row_normalize():
    A = np.array([[1.0, 2.0], [3.0, 6.0], [2.0, 1.0]])
    C = refgeo.center_rows(A)
    np.testing.assert_allclose(C.sum(axis=0), 0.0, atol=1e-15)
    np.testing.assert_allclose(C, A - A.mean(axis=0))
    N = refgeo.row_normalize(np.array([[3.0, 4.0], [0.0, 0.0], [0.0, -2.0]]))
    np.testing.assert_array_equal(N, [[0.6, 0.8], [0.0, 0.0], [0.0, -1.0]])
    Ne = refgeo.row_normalize(np.array([[3.0, 4.0], [0.0, 0.0]]), eps=1.0)
    np.testing.assert_allclose(Ne, [[0.5, 4.0 / 6.0], [0.0, 0.0]])
    assert refgeo.row_normalize(np.ones((2, 2), dtype=np.float32)).dtype == np.float32
    # the documented dtypes: float32 stays float32, every other input is read as float64
    A = np.array([[3.0, 4.0], [0.0, -2.0]])
    for dt in (np.float16, np.longdouble, np.int64):
        N = refgeo.row_normalize(A.astype(dt))
        assert N.dtype == np.float64, dt
        np.testing.assert_array_equal(N, [[0.6, 0.8], [0.0, -1.0]])



@pytest.mark.parametrize("scale", [1e300, 3.4e307, 1e-300, 1e-320])
@pytest.mark.parametrize("eps", [0.0, 1e-8, 1.0])
def test_row_normalize_at_extreme_scales_is_the_definition_without_warnings(scale, eps):
    """a / (||a|| + eps) for rows near the float64 limits; the branch not taken (a / eps
    for large rows, eps / max|a| for tiny ones) overflowed with a RuntimeWarning."""
    A = np.array([[3.0, 4.0], [-3.0, -4.0], [0.0, 0.0], [1.0, -2.0]]) * scale
    got = refgeo.row_normalize(A, eps=eps)  # RuntimeWarnings are errors in this test suite
    with decimal.localcontext() as ctx:  # the definition in 50 digits (no subnormal norms)
        ctx.prec = 50
        for a, g in zip(A, got):
            da = [decimal.Decimal(float(v)) for v in a]
            n = sum(v * v for v in da).sqrt() + decimal.Decimal(eps)
            want = [float(v / n) if n > 0 else 0.0 for v in da]
            np.testing.assert_allclose(g, want, rtol=1e-12, atol=0)
    W = np.zeros_like(A)
    refgeo.RowNorm(lr=0.1, eps=eps).step(W, A)
    assert np.all(np.isfinite(W))


@pytest.mark.parametrize("seed", range(4))
def test_projected_rownorm_budget_and_decrease(seed):
    rng = np.random.default_rng(seed)
    G = random_gradient(rng, 15, 4)
    eta = 0.7
    S = refgeo.projected_rownorm(G, eta=eta)
    assert _brute_diameter(S) <= eta * (1 + 1e-12)
    np.testing.assert_allclose(S.sum(axis=0), 0.0, atol=1e-12)
    dec = -np.sum(G * S)
    assert dec == pytest.approx(eta / 2 * np.linalg.norm(G, axis=1).sum(), rel=1e-12)
    # the inner P: a common row shift changes nothing
    np.testing.assert_allclose(refgeo.projected_rownorm(G + 3.0, eta=eta), S, atol=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_rescaled_rownorm(seed):
    rng = np.random.default_rng(seed)
    G = random_gradient(rng, 20, 5)
    S = refgeo.rescaled_rownorm(G, eta=2.0)
    D = _brute_diameter(S)
    assert D <= 2.0 and D == pytest.approx(2.0, rel=1e-13)
    N = refgeo.row_normalize(G)
    np.testing.assert_allclose(S, -2.0 * _centered(N) / _brute_diameter(N), rtol=1e-12, atol=1e-14)
    # at least RowNorm's decrease, at most the optimum
    dec = -np.sum(G * S)
    assert dec >= -np.sum(G * refgeo.projected_rownorm(G, eta=2.0)) * (1 - 1e-12)
    assert dec <= 2.0 * refgeo.diameter_lmo(G, rtol=1e-6).upper_bound * (1 + 1e-12)
    assert np.all(refgeo.rescaled_rownorm(np.zeros((3, 2))) == 0.0)


# ------------------------------------------------------------------ closed forms


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_regular_simplex_ratio(k):
    """RowNorm / optimum = sqrt((k+1)/(2k)) for regular-simplex gradients."""
    G = simplex_gradient(k)
    rn = -np.sum(G * refgeo.projected_rownorm(G, eta=1.0))
    res = refgeo.diameter_lmo(G, rtol=1e-11)
    assert res.gap <= 1e-11
    expected = math.sqrt((k + 1) / (2 * k))
    assert rn / res.lower_bound == pytest.approx(expected, rel=1e-8)
    assert rn / res.upper_bound == pytest.approx(expected, rel=1e-8)
    # Jung's bound is exact here (all cosines = -1/k)
    b = refgeo.tension_bounds(G)
    assert b.rank == k
    assert b.jung == pytest.approx(res.lower_bound, rel=1e-8)


@pytest.mark.parametrize("seed", range(3))
def test_rank_one_closed_form(seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(9)
    a -= a.mean()
    b = rng.standard_normal(4)
    G = np.outer(a, b)
    T = 0.5 * np.abs(a).sum() * np.linalg.norm(b)
    tb = refgeo.tension_bounds(G)
    assert tb.closed_form == "rank1" and tb.rank == 1
    assert tb.lower == pytest.approx(T, rel=1e-12) and tb.upper == pytest.approx(T, rel=1e-12)
    res = refgeo.diameter_lmo(G, eta=0.5)
    assert res.method == "rank1" and res.gap <= 1e-12 and res.converged
    assert res.decrease == pytest.approx(0.5 * T, rel=1e-12)
    assert _brute_diameter(res.update) <= 0.5
    # RowNorm is exactly optimal at rank 1
    assert -np.sum(G * refgeo.projected_rownorm(G, eta=0.5)) == pytest.approx(0.5 * T, rel=1e-12)
    # the returned flow is a valid flow: divergence = G, cost = T
    div = np.zeros_like(G)
    dirs = np.sign(a)[res.pairs[:, 0]][:, None] * b / np.linalg.norm(b)
    for (i, j), f, u in zip(res.pairs, res.flows, dirs):
        div[i] += f * u
        div[j] -= f * u
    np.testing.assert_allclose(div, G, atol=1e-12)
    assert res.flows.sum() == pytest.approx(T, rel=1e-12)
    assert independent_tension(G) == pytest.approx(T, rel=1e-7)


def test_two_rows_closed_form():
    G = np.array([[3.0, -4.0, 0.0], [-3.0, 4.0, 0.0]])
    tb = refgeo.tension_bounds(G)
    assert tb.closed_form == "two_rows" and tb.lower == tb.upper == 5.0
    res = refgeo.diameter_lmo(G, eta=2.0)
    assert res.method == "two_rows" and res.lower_bound == pytest.approx(5.0, rel=1e-15)
    assert res.decrease == pytest.approx(10.0, rel=1e-14)
    assert _brute_diameter(res.update) <= 2.0


def test_zero_gradient():
    res = refgeo.diameter_lmo(np.zeros((4, 3)), eta=1.0)
    assert res.method == "zero" and res.decrease == 0.0 and res.gap == 0.0
    # +0.0, not -0.0 (-<0, 0> printed as "-0" in the command's report)
    assert math.copysign(1.0, res.decrease) == math.copysign(1.0, res.lower_bound) == 1.0
    assert np.all(res.update == 0.0)
    tb = refgeo.tension_bounds(np.zeros((4, 3)))
    assert tb.lower == tb.upper == 0.0


def test_antipodal_symmetry_makes_half_sum_exact():
    rng = np.random.default_rng(7)
    base = rng.standard_normal((6, 3))
    G = np.concatenate([base, -base])  # direction measure symmetric under g -> -g
    res = refgeo.diameter_lmo(G, rtol=1e-9)
    half = 0.5 * np.linalg.norm(G, axis=1).sum()
    assert res.lower_bound <= half * (1 + 1e-12)
    assert res.upper_bound == pytest.approx(half, rel=1e-8)
    assert refgeo.tension_bounds(G).half_sum == pytest.approx(half, rel=1e-14)


# ------------------------------------------------------------------ exact LMO vs independent solver


@pytest.mark.parametrize("V, d, seed", [(5, 2, 0), (8, 3, 1), (12, 3, 2), (16, 4, 3), (20, 3, 4)])
def test_matches_independent_solver(V, d, seed):
    rng = np.random.default_rng(seed)
    G = random_gradient(rng, V, d)
    ref = independent_tension(G)
    res = refgeo.diameter_lmo(G, eta=1.0, rtol=1e-9)
    assert res.converged and res.gap <= 1e-9
    assert res.lower_bound == pytest.approx(ref, rel=1e-6)
    # the certificate brackets the independent value (which is a feasible value, <= T)
    assert res.lower_bound <= res.upper_bound
    assert ref <= res.upper_bound * (1 + 1e-10)
    assert res.lower_bound >= ref * (1 - 1e-6)


def lm_like_gradient(seed, V, d, n_collinear, n_duplicates):
    """An LM-like gradient (Zipf prior, anisotropic hidden states) with extra tiny rows
    that are exact positive multiples of one direction and exact duplicates of other
    rows; the last row balances the sum (so the rows sum to zero to rounding)."""
    from refgeo._lm_gradients import lm_gradient

    rng = np.random.default_rng(seed)
    base = lm_gradient(V - n_collinear - n_duplicates, d, n_tokens=16, seed=seed)
    u = base[np.argmin(np.linalg.norm(base, axis=1))]
    tiny = rng.uniform(0.01, 0.2, n_collinear)[:, None] * u
    dups = base[rng.integers(0, len(base) - 1, n_duplicates)]
    G = np.concatenate([base[:-1], tiny, dups])
    return np.concatenate([G, -G.sum(axis=0, keepdims=True)])


@pytest.mark.parametrize(
    "seed, V, d, n_collinear, n_duplicates",
    [  # the independent SLSQP solve takes ~20 s on the two larger cases
        pytest.param(0, 20, 4, 8, 3, marks=pytest.mark.slow),
        pytest.param(1, 24, 3, 10, 4, marks=pytest.mark.slow),
        (2, 16, 5, 4, 4),
    ],
)
def test_lm_like_gradients_match_independent_solver(seed, V, d, n_collinear, n_duplicates):
    """Rows merged (exactly collinear tiny rows, duplicates, Zipf-small rows): the merged
    solve's bracket must still contain the optimum of the full problem."""
    G = lm_like_gradient(seed, V, d, n_collinear, n_duplicates)
    half = 0.5 * np.linalg.norm(G, axis=1).sum()
    ref = independent_tension(G)  # feasible, so <= T(G); within about 1e-6 of it here
    for rtol in (1e-7, 1e-4):
        agg = refgeo.lmo._aggregate(refgeo.center_rows(G), 0.25 * rtol * half)
        assert agg is not None and agg.rows.shape[0] <= V - n_collinear - n_duplicates + 1  # the merged path runs
        assert agg.error <= 0.25 * rtol * half
        res = refgeo.diameter_lmo(G, rtol=rtol)
        assert res.converged and res.gap <= rtol
        assert ref <= res.upper_bound * (1 + 1e-12)
        assert ref * (1 - rtol - 1e-6) <= res.lower_bound <= ref * (1 + 1e-6)
        S = np.asarray(res.update)
        assert _brute_diameter(S) <= 1.0
        assert res.decrease == pytest.approx(-np.sum(G * S), rel=1e-13)
        # merged rows share their step: the exactly collinear tiny rows move together
        np.testing.assert_array_equal(S[V - n_duplicates - 1 - n_collinear], S[V - n_duplicates - 2])


@pytest.mark.parametrize("V, d, rtol", [(40, 6, 1e-10), pytest.param(100, 4, 1e-9, marks=pytest.mark.slow)])
def test_tight_rtol_on_lm_gradients_is_reached(V, d, rtol, monkeypatch):
    """LM gradients at tight tolerances: the ADMM crawled there (at (40, 6) and rtol
    1e-10 it stopped at a gap of 3.6e-8 after 30 s), and the barrier method's
    certificate stalled near 1e-7 (its multipliers' divergence carried the slacks'
    rounding).  The bracket must overlap an independent solve's (IRLS at 1e-4)."""
    from refgeo._lm_gradients import lm_gradient

    G = lm_gradient(V, d)
    res = refgeo.diameter_lmo(G, rtol=rtol, max_time=60)
    assert res.method == "barrier" and res.converged and res.gap <= rtol
    S = np.asarray(res.update)
    assert _brute_diameter(S) <= 1.0
    assert res.decrease == pytest.approx(-np.sum(G * S), rel=1e-12)
    with monkeypatch.context() as m:
        # IRLS alone (not IRLS in a 2 s probe, which a loaded machine can end first)
        m.setattr(refgeo.lmo, "_BARRIER_LIMIT", 0)
        m.setattr(refgeo.lmo, "_BARRIER_TIGHT_LIMIT", 0)
        loose = refgeo.diameter_lmo(G, rtol=1e-4)
    assert loose.method == "irls"
    assert loose.lower_bound <= res.upper_bound and res.lower_bound <= loose.upper_bound
    assert np.all(np.asarray(res.flows) > 0) and float(np.sum(res.flows)) <= res.upper_bound * (1 + 1e-12)


@pytest.mark.parametrize("kind, method", [("lm", "barrier"), ("isotropic", "admm")])
def test_tight_rtol_probes_the_first_order_solver_then_takes_the_barrier(kind, method):
    """Between the barrier method's small-problem limit and its tight-tolerance limit
    the ADMM gets a probe first: it converges at once on well-spread gradients
    (0.07 s at (60, 40), where the barrier method took 25 s) and crawls on LM ones,
    which the barrier method then finishes.  The progress counts keep growing across
    the switch."""
    from refgeo._lm_gradients import isotropic_gradient, lm_gradient

    G = lm_gradient(70, 8) if kind == "lm" else isotropic_gradient(60, 40)
    assert 70 * 8 > refgeo.lmo._BARRIER_LIMIT and 60 * 40 <= refgeo.lmo._BARRIER_TIGHT_LIMIT
    seen = []
    res = refgeo.diameter_lmo(G, rtol=1e-8, max_time=60, callback=lambda info: seen.append(info))
    assert res.method == method and res.converged and res.gap <= 1e-8
    its = [info["iteration"] for info in seen]
    rounds = [info["rounds"] for info in seen]
    assert its == sorted(its) and rounds == sorted(rounds)
    assert res.iterations >= its[-1] and res.rounds >= rounds[-1] and res.elapsed >= seen[-1]["elapsed"]
    assert _brute_diameter(res.update) <= 1.0


@pytest.mark.parametrize("case", ["isotropic_200_2", "flat_8", "flat_25", "random_5_2"])
def test_where_the_barrier_method_stops_short_the_first_order_solver_takes_over(case):
    """Small problems go to the barrier method first.  Where it stops short of rtol the
    first-order solver takes over: on isotropic (200, 2) (V r = 400) its stages hit
    the step cap from the fourth on and it returned a gap of 1.7e-3 at rtol 1e-4 (the
    code before that, 0.47), and at rtol 1e-12 to 1e-14 its floor (near 1e-12) left
    gradients the ADMM certifies unconverged.  The counts and the elapsed time are
    those of the whole call."""
    from refgeo._lm_gradients import isotropic_gradient

    if case == "isotropic_200_2":
        G, rtol = isotropic_gradient(200, 2), 1e-4
    elif case == "random_5_2":
        rng = np.random.default_rng(1)
        G, rtol = rng.standard_normal((5, 2)), 1e-14
    else:  # a nearly flat last column (seeds found by a review)
        rng = np.random.default_rng(int(case.split("_")[1]))
        V, d = int(rng.integers(4, 14)), int(rng.integers(2, 4))
        G = rng.standard_normal((V, d))
        G[:, -1] *= 10.0 ** rng.uniform(-10, -4)
        rtol = 1e-12
    G = G - G.mean(axis=0)
    seen = []
    t0 = time.perf_counter()
    res = refgeo.diameter_lmo(G, rtol=rtol, max_time=60, callback=lambda info: seen.append(info))
    assert res.converged and res.gap <= rtol and res.lower_bound <= res.upper_bound
    assert _brute_diameter(res.update) <= 1.0
    assert res.rounds >= seen[-1]["rounds"] and res.iterations >= seen[-1]["iteration"]
    assert seen[-1]["elapsed"] <= res.elapsed <= time.perf_counter() - t0


def test_the_first_order_solver_after_the_barrier_method_is_bounded():
    """Where the barrier method stops at float64's floor (rtol 1e-14 on an LM gradient:
    a gap of 4.8e-14 in 0.05 s), the ADMM after it ran for 185 s (no max_time) to a gap
    it then reached, its estimates shrinking too slowly for its stall rule.  It gets
    max(1 s, twice the time so far)."""
    from refgeo._lm_gradients import lm_gradient

    def guard(info):
        assert info["elapsed"] < 30.0, "the solver after the barrier method runs unbounded"

    res = refgeo.diameter_lmo(lm_gradient(8, 3, seed=1), rtol=1e-14, callback=guard)
    assert res.lower_bound <= res.upper_bound and res.gap < 1e-12
    assert _brute_diameter(res.update) <= 1.0


def test_a_stop_asked_during_the_probe_starts_no_barrier_method():
    """A callback returning True in the probe ends the call there: the barrier method
    does not start after it (nor call the callback again)."""
    from refgeo._lm_gradients import lm_gradient

    calls = []
    res = refgeo.diameter_lmo(lm_gradient(70, 8), rtol=1e-8, callback=lambda info: calls.append(info) or True)
    assert len(calls) == 1 and res.method != "barrier" and not res.converged
    assert res.lower_bound <= res.upper_bound and _brute_diameter(res.update) <= 1.0


def test_the_barrier_method_starts_after_the_probe_only_where_its_steps_fit(monkeypatch):
    """With a budget just above the probe the barrier method's first Newton step and its
    certificate overran max_time: where three steps (their estimate, here made large)
    do not fit what the probe left, the probe's result is returned."""
    from refgeo._lm_gradients import lm_gradient

    G = lm_gradient(70, 8)
    monkeypatch.setattr(refgeo.lmo, "_BARRIER_PROBE_S", 0.05)
    monkeypatch.setattr(refgeo.lmo, "_BARRIER_NEWTON_S_PER_VR3", 1e3)  # steps that never fit
    res = refgeo.diameter_lmo(G, rtol=1e-12, max_time=60.0)
    assert res.method != "barrier" and res.elapsed < 30.0
    assert res.lower_bound <= res.upper_bound and _brute_diameter(res.update) <= 1.0
    monkeypatch.setattr(refgeo.lmo, "_BARRIER_NEWTON_S_PER_VR3", 0.0)  # steps that always fit
    assert refgeo.diameter_lmo(G, rtol=1e-12, max_time=60.0).method == "barrier"


@pytest.mark.slow
def test_a_barrier_that_leaves_the_path_returns_its_best_stage_to_irls(monkeypatch):
    """Isotropic (400, 2) at rtol 1e-4, the barrier method's weak case: its stages
    reached an estimated gap of 1.7e-4, then the stages that had left the central path
    ended at 3.9e-3, which was certified and returned, and IRLS went on from its own
    probe (5.5e-3) for about 940 iterations.  The best stage is now the barrier's
    result (certified within its estimate), and IRLS goes on from its multipliers
    (about 220 iterations)."""
    from refgeo._lm_gradients import isotropic_gradient

    G = isotropic_gradient(400, 2, seed=0)
    # stages of 50 Newton steps, as then (with up to 200 the barrier method converges
    # here: see test_low_dimensional_stages_get_the_newton_steps_they_need)
    monkeypatch.setattr(refgeo.lmo, "_BARRIER_NEWTON_MAX", 50)
    phase, seen, log = ["probe"], {}, []
    run = refgeo.lmo._Barrier.run

    def observed(self):
        phase[0] = "barrier"
        seen["barrier"] = res = run(self)
        phase[0] = "after"
        return res

    monkeypatch.setattr(refgeo.lmo._Barrier, "run", observed)
    res = refgeo.diameter_lmo(G, rtol=1e-4, callback=lambda info: log.append((phase[0], info["gap"])) and False)
    stages = [gap for p, gap in log if p == "barrier"]
    assert seen["barrier"].gap <= 1.5 * min(stages) and not seen["barrier"].converged
    assert res.method == "irls" and res.converged and res.gap <= 1e-4
    assert len([gap for p, gap in log if p == "after"]) <= 50  # rounds of 10 iterations
    assert _brute_diameter(res.update) <= 1.0


@pytest.mark.slow
def test_low_dimensional_stages_get_the_newton_steps_they_need():
    """Isotropic (350, 2) at rtol 1e-6: a stage needs a damped phase of up to 200
    Newton steps (full steps, the decrement near 3), after which the next stages center
    in a few dozen; cut at 50 the stages "did not center", the barrier method gave up
    and IRLS ended unconverged at a gap of 5.1e-5 after 33 s.  The bracket must hold
    an independent solve's (IRLS at 1e-4, alone)."""
    from refgeo._lm_gradients import isotropic_gradient

    G = isotropic_gradient(350, 2, seed=1)
    assert 350 * 2 <= 768  # where the cost model fits 200 steps in 2 s
    res = refgeo.diameter_lmo(G, rtol=1e-6)
    assert res.method == "barrier" and res.converged and res.gap <= 1e-6
    assert _brute_diameter(res.update) <= 1.0
    with pytest.MonkeyPatch.context() as m:
        m.setattr(refgeo.lmo, "_BARRIER_LIMIT", 0)
        m.setattr(refgeo.lmo, "_BARRIER_TIGHT_LIMIT", 0)
        loose = refgeo.diameter_lmo(G, rtol=1e-4)
    assert loose.method == "irls" and loose.converged
    assert loose.lower_bound <= res.upper_bound and res.lower_bound <= loose.upper_bound


def test_irls_starts_only_where_its_first_reweighting_fits(monkeypatch):
    """IRLS ran one reweighting and its certificate whatever the budget: started at
    0.18 s of ``max_time=0.3`` at V' = 1400 the call took 0.67 s.  Where that first
    round (its estimate, here made large) does not fit what is left, the RowNorm step
    is returned under the star flow; where it fits, IRLS runs."""
    from refgeo._lm_gradients import isotropic_gradient

    G = isotropic_gradient(120, 6, seed=3)
    # IRLS alone: above the barrier's tight limit.  Below it IRLS first gets a probe of
    # 2 s, converged here in 1.1 s on a quiet core and in more on a loaded CI machine,
    # where the barrier method then finished the solve and the last asserts failed
    monkeypatch.setattr(refgeo.lmo, "_BARRIER_TIGHT_LIMIT", 0)
    monkeypatch.setattr(refgeo.lmo, "_IRLS_FIRST_S_PER_V3", 1e3)  # a round that never fits
    res = refgeo.diameter_lmo(G, max_time=60.0)
    assert res.method == "rownorm" and res.iterations == 0 and res.elapsed < 30.0
    norms = np.linalg.norm(G, axis=1)
    assert res.lower_bound <= res.upper_bound <= (norms.sum() - norms.max()) * (1 + 1e-12)
    assert _brute_diameter(res.update) <= 1.0
    assert refgeo.diameter_lmo(G).method == "irls"  # no max_time: no estimate
    monkeypatch.setattr(refgeo.lmo, "_IRLS_FIRST_S_PER_V3", 0.0)  # a round that always fits
    res = refgeo.diameter_lmo(G, max_time=60.0)
    assert res.method == "irls" and res.converged


@pytest.mark.parametrize("V, d, seed", [(6, 2, 0), (12, 3, 2), (20, 3, 4)])
def test_irls_path_matches_independent_solver(V, d, seed, monkeypatch):
    """At moderate rtol the complete-graph IRLS runs: its bracket contains the optimum."""
    monkeypatch.setattr(refgeo.lmo, "_BARRIER_LIMIT", 0)  # IRLS, not the barrier method,
    monkeypatch.setattr(refgeo.lmo, "_BARRIER_TIGHT_LIMIT", 0)  # nor IRLS in a probe before it
    G = random_gradient(np.random.default_rng(seed), V, d)
    ref = independent_tension(G)
    res = refgeo.diameter_lmo(G, rtol=1e-5)
    assert res.method == "irls" and res.converged and res.gap <= 1e-5
    assert res.lower_bound <= ref * (1 + 1e-7) and ref <= res.upper_bound * (1 + 1e-10)
    assert _brute_diameter(res.update) <= 1.0
    assert np.all(res.pairs[:, 0] < res.pairs[:, 1]) and res.flows.sum() <= res.upper_bound * (1 + 1e-12)


@pytest.mark.parametrize("seed", range(2))
def test_ce_gradient_matches_independent_solver(seed):
    rng = np.random.default_rng(100 + seed)
    G = ce_gradient(rng, 14, 3, n_tokens=20)
    ref = independent_tension(G)
    res = refgeo.diameter_lmo(G, rtol=1e-8)
    assert res.lower_bound == pytest.approx(ref, rel=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_complementary_slackness_and_budget(seed):
    rng = np.random.default_rng(seed)
    G = random_gradient(rng, 25, 4)
    eta = 0.3
    res = refgeo.diameter_lmo(G, eta=eta, rtol=1e-7)
    S = np.asarray(res.update)
    assert _brute_diameter(S) <= eta
    assert refgeo.row_diameter(S).value <= eta
    np.testing.assert_allclose(S.sum(axis=0), 0.0, atol=1e-12)
    assert res.decrease == pytest.approx(-np.sum(G * S), rel=1e-14)
    assert res.decrease == pytest.approx(eta * res.lower_bound, rel=1e-14)
    # complementary slackness, as far as the certified gap makes it hold: with
    # <G, -S> = eta L <= sum_e f_e d_e (the flows' divergence is G up to a residual that
    # U charges) and sum_e f_e <= U, sum_e f_e (eta - d_e) <= eta (U - L); so a pair
    # carrying flow f is stretched to within (U - L) / f of the full budget, relative
    dist = np.linalg.norm(S[res.pairs[:, 0]] - S[res.pairs[:, 1]], axis=1)
    slack = eta * (res.upper_bound - res.lower_bound)
    assert np.sum(res.flows * (eta - dist)) <= slack + 1e-12 * eta * res.upper_bound
    big = res.flows > 1e3 * (res.upper_bound - res.lower_bound)
    assert big.sum() >= 2
    np.testing.assert_allclose(dist[big], eta, rtol=1e-3)
    assert res.flows.sum() <= res.upper_bound * (1 + 1e-12)
    assert res.flows.sum() == pytest.approx(res.lower_bound, rel=1e-6)
    assert np.all(res.pairs[:, 0] < res.pairs[:, 1])
    with pytest.raises(ValueError):
        res.update[0, 0] = 1.0  # read-only


@pytest.mark.parametrize("seed", range(2))
def test_invariances_of_the_optimum(seed):
    rng = np.random.default_rng(seed)
    G = random_gradient(rng, 18, 4)
    T = refgeo.diameter_lmo(G, rtol=1e-9).lower_bound
    perm = rng.permutation(18)
    Q, _ = np.linalg.qr(rng.standard_normal((4, 4)))
    for G2, factor in [(G[perm], 1.0), (G @ Q, 1.0), (3.5 * G, 3.5)]:
        r2 = refgeo.diameter_lmo(G2, rtol=1e-9)
        assert r2.lower_bound == pytest.approx(factor * T, rel=1e-7)


def test_warm_start_reuses_the_solution():
    rng = np.random.default_rng(3)
    G = random_gradient(rng, 30, 5)
    cold = refgeo.diameter_lmo(G, rtol=1e-7)
    warm = refgeo.diameter_lmo(G, rtol=1e-7, warm_start=cold)
    assert warm.iterations <= cold.iterations
    assert warm.lower_bound == pytest.approx(cold.lower_bound, rel=1e-6)
    # a nearby gradient
    G2 = G + 0.01 * random_gradient(rng, 30, 5)
    w2 = refgeo.diameter_lmo(G2, rtol=1e-7, warm_start=cold)
    c2 = refgeo.diameter_lmo(G2, rtol=1e-7)
    assert w2.lower_bound == pytest.approx(c2.lower_bound, rel=1e-6)


@pytest.fixture
def admm_only(monkeypatch):
    """Route small tight-tolerance problems to the ADMM (the barrier method takes them
    otherwise): for the tests of the ADMM's own warm start and stopping rules."""
    monkeypatch.setattr(refgeo.lmo, "_BARRIER_LIMIT", 0)
    monkeypatch.setattr(refgeo.lmo, "_BARRIER_TIGHT_LIMIT", 0)


@pytest.mark.parametrize("factor", [1e-6, 1e-200, 1e5, 1e100])
def test_warm_start_from_a_gradient_of_another_size(factor, admm_only):
    """An optimizer's gradients change size between steps.  The warm flows are in the
    units of the gradient they were solved for: 1e6 times too large (factor 1e-6) they
    made the ADMM return a step that raised the loss, at a gap above 1, and for
    factor 1e-200 it raised AttributeError."""
    import dataclasses

    rng = np.random.default_rng(3)
    G = rng.normal(size=(20, 3))
    G -= G.mean(axis=0)
    prev = refgeo.diameter_lmo(G, rtol=1e-9)
    assert prev.method == "admm"
    cold = refgeo.diameter_lmo(G * factor, rtol=1e-9)
    for warm in (prev, dataclasses.replace(prev, flows=np.asarray(prev.flows) * 1e300)):
        r = refgeo.diameter_lmo(G * factor, rtol=1e-9, warm_start=warm)
        assert r.converged and r.gap <= 1e-9
        assert r.decrease == pytest.approx(cold.decrease, rel=2e-9) and r.decrease > 0


@pytest.mark.parametrize("factor", [0.5, 0.9, 1.1, 3.0, 1e-3])
def test_a_warm_start_keeps_its_speed_when_the_gradient_changes_size(factor, admm_only):
    """The step of G is optimal for c G, and its flows are c times G's: sized by their
    own sum, they were c times off, and the warm start took 3,975 to 4,750 iterations
    on c G against 25 on G (5,375 cold).  They are sized by the warm step's value on
    the new gradient."""
    rng = np.random.default_rng(3)
    G = rng.normal(size=(20, 3))
    G -= G.mean(axis=0)
    prev = refgeo.diameter_lmo(G, rtol=1e-9)
    same = refgeo.diameter_lmo(G, rtol=1e-9, warm_start=prev)
    cold = refgeo.diameter_lmo(G * factor, rtol=1e-9)
    warm = refgeo.diameter_lmo(G * factor, rtol=1e-9, warm_start=prev)
    assert warm.converged and warm.decrease == pytest.approx(cold.decrease, rel=2e-9)
    assert warm.iterations <= 2 * same.iterations < cold.iterations / 10


def test_warm_start_pairs_in_either_order():
    """Pairs given as (j, i), repeated or as self-pairs are the same flows on the
    working set's pairs (i < j): reversed, they indexed past its end (IndexError), or
    put a flow on another pair."""
    import dataclasses

    rng = np.random.default_rng(3)
    G = rng.normal(size=(20, 3))
    G -= G.mean(axis=0)
    prev = refgeo.diameter_lmo(G, rtol=1e-9)
    P, f = np.asarray(prev.pairs), np.asarray(prev.flows)
    same = refgeo.diameter_lmo(G, rtol=1e-9, warm_start=prev)
    reordered = dataclasses.replace(prev, pairs=np.concatenate([P[:, ::-1], [[4, 4]]]), flows=np.append(f, 7.0))
    halves = dataclasses.replace(prev, pairs=np.concatenate([P, P[:, ::-1]]), flows=np.concatenate([f, f]) / 2)
    for warm in (reordered, halves):
        r = refgeo.diameter_lmo(G, rtol=1e-9, warm_start=warm)
        assert r.converged
        np.testing.assert_array_equal(r.update, same.update)


@pytest.mark.parametrize("rtol", [1e-3, 1e-7])
def test_iterative_laplacian_path(monkeypatch, rtol):
    """Above the dense limit the solver uses block CG (float32 iterates when rtol >= 1e-3);
    the certificate is still evaluated in float64 and must bracket the optimum."""
    rng = np.random.default_rng(11)
    G = ce_gradient(rng, 40, 5, n_tokens=64)
    exact = refgeo.diameter_lmo(G, rtol=1e-9)
    monkeypatch.setattr(refgeo.lmo, "_DENSE_LIMIT", 8)
    monkeypatch.setattr(refgeo.lmo, "_IRLS_LIMIT", 0)  # ADMM, not the complete-graph IRLS
    res = refgeo.diameter_lmo(G, eta=0.5, rtol=rtol)
    assert res.converged and res.gap <= rtol
    assert res.lower_bound <= exact.upper_bound * (1 + 1e-12)
    assert res.upper_bound >= exact.lower_bound * (1 - 1e-12)
    assert res.lower_bound >= exact.lower_bound * (1 - rtol)
    assert refgeo.row_diameter(res.update).value <= 0.5
    assert res.update.dtype == np.float64


def test_callback_limits_and_progress():
    rng = np.random.default_rng(0)
    G = random_gradient(rng, 30, 5)
    seen = []

    def cb(info):
        seen.append(info)
        return True  # stop after the first round

    res = refgeo.diameter_lmo(G, rtol=1e-12, callback=cb)
    assert len(seen) == 1 and res.rounds == 1
    assert set(seen[0]) == {"iteration", "rounds", "pairs", "lower", "upper", "gap", "elapsed"}
    # the bracket is certified whatever the stopping reason
    ref = refgeo.diameter_lmo(G, rtol=1e-9).lower_bound
    assert res.lower_bound <= ref * (1 + 1e-9) and res.upper_bound >= ref * (1 - 1e-9)
    assert not res.converged or res.gap <= 1e-12
    r0 = refgeo.diameter_lmo(G, max_iter=0)
    assert r0.iterations == 0 and r0.rounds == 1
    assert r0.lower_bound <= ref * (1 + 1e-9) <= r0.upper_bound * (1 + 2e-9)
    rt = refgeo.diameter_lmo(G, rtol=1e-12, max_time=1e-3)
    assert rt.lower_bound <= ref * (1 + 1e-9) and rt.upper_bound >= ref * (1 - 1e-9)
    refgeo.diameter_lmo(G, rtol=1e-3, progress=True)  # tqdm if installed; never fails


@pytest.mark.parametrize("limit", [{"max_iter": 0}, {"max_iter": 1}, {"max_time": 1e-3}, {"max_time": 0.0}])
@pytest.mark.parametrize("V, d, seed", [(600, 8, 2), (300, 4, 0), (40, 6, 1)])
def test_a_stopped_solve_decreases_at_least_as_much_as_projected_rownorm(limit, V, d, seed):
    """Stopped after a few iterations the solver's step decreased about half as much as
    RowNorm's (0.059 against 0.121 at (600, 8) under max_time=0.01); a stopped solve now
    returns the better of its step and the projected RowNorm step, whose decrease is the
    lower bound, and every promise of the result still holds."""
    from refgeo._lm_gradients import lm_gradient

    G = np.asarray(lm_gradient(V, d, seed=seed))
    eta = 2.5
    res = refgeo.diameter_lmo(G, eta=eta, **limit)
    S = np.asarray(res.update)
    projected = refgeo.projected_rownorm(G, eta=eta)
    assert res.decrease >= -np.sum(G * projected) * (1 - 1e-12)
    assert res.decrease >= eta * refgeo.tension_bounds(G).half_sum * (1 - 1e-12)
    assert res.decrease == pytest.approx(-np.sum(G * S), rel=1e-12)
    assert res.decrease == pytest.approx(eta * res.lower_bound, rel=1e-15)
    assert scipy.spatial.distance.pdist(S).max() <= eta
    assert np.abs(S.sum(axis=0)).max() <= 1e-12 * eta * V
    tb = refgeo.tension_bounds(G)  # closed-form bounds: brackets that must overlap
    assert res.lower_bound <= tb.upper * (1 + 1e-12) and res.upper_bound >= tb.lower * (1 - 1e-12)
    assert res.gap == pytest.approx((res.upper_bound - res.lower_bound) / res.upper_bound, abs=1e-15)
    assert res.converged == (res.gap <= 1e-4)


def test_max_time_holds_through_the_setup():
    """The setup ran outside the budget: merging rows, the SVD, the first working set and
    one separation pass (O(V^2 r) heuristics) took 3 s under ``max_time=0.01`` at
    (8000, 128).  Now the limit is checked inside them, and once it has passed the
    RowNorm step is returned with a star flow's upper bound.  Compared with the same
    setup unbudgeted (``max_iter=0``) in the same process, not with a wall-clock limit."""
    from refgeo._lm_gradients import lm_gradient

    G = lm_gradient(4000, 64, seed=0)
    t0 = time.perf_counter()
    refgeo.diameter_lmo(G, max_iter=0)
    setup = time.perf_counter() - t0
    budgeted = math.inf
    for _ in range(3):  # the best of three: a stall of a busy machine is not the call's
        t0 = time.perf_counter()
        res = refgeo.diameter_lmo(G, max_time=0.01)
        budgeted = min(budgeted, time.perf_counter() - t0)
    assert budgeted < 0.25 * setup, (budgeted, setup)
    assert res.method == "rownorm" and res.iterations == 0 and not res.converged


@pytest.mark.parametrize("V, d, seed", [(300, 5, 0), (400, 12, 1), (50, 3, 2)])
def test_a_spent_budget_returns_rownorm_under_a_star_flow_that_bounds_the_optimum(V, d, seed):
    """``max_time=0``: no solver starts; the bracket [RowNorm's decrease, the star
    flow's cost] must contain T(G), so it overlaps a converged solve's bracket, and is
    at worst a gap of 1/2 (the star into the longest row costs at most the sum of the
    row norms)."""
    from refgeo._lm_gradients import isotropic_gradient, lm_gradient

    for G in (lm_gradient(V, d, seed=seed), isotropic_gradient(V, d, seed=seed)):
        res = refgeo.diameter_lmo(G, max_time=0.0)
        T = refgeo.diameter_lmo(G, rtol=1e-3)
        assert res.lower_bound <= T.upper_bound * (1 + 1e-12)
        assert res.upper_bound >= T.lower_bound * (1 - 1e-12)
        norms = np.linalg.norm(G, axis=1)
        assert res.upper_bound <= (norms.sum() - norms.max()) * (1 + 1e-12)
        assert res.gap <= 0.5 + 1e-12
        assert res.lower_bound == pytest.approx(0.5 * norms.sum(), rel=1e-9)
        # the flows are the star's: one pair per nonzero row into the longest one
        hub = int(np.argmax(norms))
        assert np.all((res.pairs == hub).sum(axis=1) == 1)
        assert float(np.sum(res.flows)) == pytest.approx(norms.sum() - norms.max(), rel=1e-12)


def test_a_setup_that_takes_the_budget_starts_no_round(monkeypatch):
    """The ADMM's setup (working set, Laplacian solver) ran to its end and then one
    round (a step, a separation pass, a certificate) whatever the budget: 0.64 s under
    max_time=0.167 at (3000, 8).  A setup that passes the limit now returns the RowNorm
    step under the star flow.  The setup is made slow by a pause after it, so that the
    limit passes inside it on any machine."""
    from refgeo import lmo
    from refgeo._lm_gradients import lm_gradient

    real_init = lmo._ADMM.__init__

    def slow_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        time.sleep(0.3)

    monkeypatch.setattr(lmo._ADMM, "__init__", slow_init)
    G = lm_gradient(400, 16, seed=1)
    res = refgeo.diameter_lmo(G, rtol=1e-9, max_time=0.2)  # rtol below the IRLS's: the ADMM
    assert res.method == "rownorm" and res.rounds == 0 and res.iterations == 0
    norms = np.linalg.norm(G, axis=1)
    assert res.upper_bound <= (norms.sum() - norms.max()) * (1 + 1e-12)


@pytest.mark.parametrize("limit", [{"max_iter": 0}, {"max_iter": 1}, {"max_iter": 3}])
@pytest.mark.parametrize("V, d, seed", [(50, 8, 0), (300, 4, 1), (1700, 32, 2)])
def test_a_stopped_solve_certifies_at_least_the_star_flow(limit, V, d, seed):
    """A solve stopped early can certify an upper bound above the sum of the row norms
    (2.4e4 against 1.2e4 at (1700, 32)); the star flow into the longest row costs
    sum_{i != h} |g_i|, and the result now certifies the smaller of the two, with that
    flow's pairs and flows.  Clustered rows, as merged token rows of a head are."""
    g = np.random.default_rng(seed)
    centers = g.standard_normal((8, d))
    G = centers[g.integers(0, 8, V)] * g.uniform(0.5, 2.0, (V, 1)) + 0.05 * g.standard_normal((V, d))
    G -= G.mean(axis=0)
    res = refgeo.diameter_lmo(G, rtol=1e-9, **limit)
    norms = np.linalg.norm(G, axis=1)
    assert res.upper_bound <= (norms.sum() - norms.max()) * (1 + 1e-12)
    assert res.lower_bound <= res.upper_bound
    assert not np.any(np.signbit(res.update) & (res.update == 0))  # no -0.0 (zero rows)


def test_synthetic_gradients_do_not_depend_on_the_blas_thread_count():
    """``lm_gradient`` and ``isotropic_gradient`` are the inputs of tests and benchmarks
    and promise to be deterministic in their seed; their GEMMs ran on BLAS's threads,
    and OPENBLAS_NUM_THREADS=1 and 2 gave different bits (and LMO bounds)."""
    import os
    import subprocess
    import sys

    code = ("import hashlib; from refgeo._lm_gradients import lm_gradient, isotropic_gradient; "
            "print(hashlib.sha1(lm_gradient(500, 256, seed=0).tobytes()).hexdigest(), "
            "hashlib.sha1(isotropic_gradient(1700, 12, seed=0).tobytes()).hexdigest())")
    out = set()
    for n in ("1", "2"):
        env = {**os.environ, "OPENBLAS_NUM_THREADS": n, "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}
        out.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                               check=True).stdout)
    assert len(out) == 1, out


@pytest.mark.parametrize("stop", [dict(max_iter=0), dict(max_iter=3), dict(max_time=0.0),
                                  dict(callback=lambda info: True)])
def test_progress_reports_the_end_once_when_the_solve_stops_short(stop):
    """A solve stopped short of rtol reported only its start (max_iter=0, max_time=0, a
    callback) or a last fraction no different from a report in passing (max_iter=3), so
    a bar driven by the callable never closed; now the end comes once, done == total."""
    G = random_gradient(np.random.default_rng(0), 100, 8)
    calls = []
    res = refgeo.diameter_lmo(G, progress=calls.append, **stop)
    assert not res.converged
    assert calls[0]["done"] == 0 and calls[-1]["done"] == calls[-1]["total"] == 1.0
    assert sum(c["done"] == c["total"] for c in calls) == 1


def test_progress_callable_and_missing_tqdm(monkeypatch):
    from refgeo._lm_gradients import lm_gradient

    G = lm_gradient(400, 8, n_tokens=64, seed=3)
    calls = []
    t0 = time.perf_counter()
    res = refgeo.diameter_lmo(G, rtol=1e-4, progress=calls.append)
    elapsed = time.perf_counter() - t0
    assert calls and all(set(c) == {"done", "total", "elapsed", "eta"} for c in calls)
    assert all(0.0 <= c["done"] <= 1.0 and c["total"] == 1.0 for c in calls)
    assert [c["done"] for c in calls] == sorted(c["done"] for c in calls)
    assert res.converged and calls[-1]["done"] == 1.0
    assert len(calls) <= 2 + 4 * elapsed + 1  # throttled: at most 4 a second, plus the last
    # progress=True without tqdm: one warning, however many calls
    import builtins

    real_import = builtins.__import__

    def no_tqdm(name, *args, **kwargs):
        if name.startswith("tqdm"):
            raise ImportError("no tqdm here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tqdm)
    monkeypatch.setattr(refgeo._progress, "_TQDM_WARNED", False)
    small = random_gradient(np.random.default_rng(0), 8, 3)
    with pytest.warns(UserWarning, match="tqdm"):
        refgeo.diameter_lmo(small, rtol=1e-3, progress=True)
    import warnings as _w

    with _w.catch_warnings():
        _w.simplefilter("error")
        refgeo.diameter_lmo(small, rtol=1e-3, progress=True)  # warned once already
    with pytest.raises(TypeError, match="progress"):
        refgeo.diameter_lmo(small, progress="yes")


# ------------------------------------------------------------------ bounds


def _assert_bounds_hold(G, T_lo, T_hi):
    """Every field against its definition by brute force, and the bracket against the
    optimum [T_lo, T_hi] found by another solver: each bound is a bound, the reported
    pair is the best of them, and the bracket is not crossed."""
    b = refgeo.tension_bounds(G)
    norms = np.linalg.norm(_centered(G), axis=1)
    assert b.half_sum == pytest.approx(0.5 * norms.sum(), rel=1e-13)
    prod = math.sqrt(sum(norms[i] * norms[j] for i in range(len(norms)) for j in range(i + 1, len(norms))))
    assert b.product == pytest.approx(prod, rel=1e-12)
    Gc = _centered(G)
    V = G.shape[0]
    pw = sum(np.linalg.norm(Gc[i] - Gc[j]) for i in range(V) for j in range(i + 1, V)) / V
    assert b.pairwise_flow == pytest.approx(pw, rel=1e-12)
    k = np.linalg.matrix_rank(Gc)
    assert b.rank == k
    assert b.jung == pytest.approx(math.sqrt(k / (2 * (k + 1))) * norms.sum(), rel=1e-13)
    tol = 1 + 1e-10
    # the optimum lies in every bound and in the reported bracket
    for lb in (b.half_sum, b.lower):
        assert lb <= T_hi * tol
    for ub in (b.jung, b.product, b.pairwise_flow, b.upper):
        assert T_lo <= ub * tol
    # the reported bracket is at least as tight as each closed-form bound (by brute force)
    assert b.lower >= 0.5 * norms.sum() * (1 - 1e-13)
    assert b.upper <= min(math.sqrt(k / (2 * (k + 1))) * norms.sum(), prod, pw) * (1 + 1e-12)
    assert b.lower <= b.upper
    assert b.jung <= norms.sum() / math.sqrt(2) * tol


@pytest.mark.parametrize("seed", range(4))
def test_bounds_hold_on_random_gradients(seed):
    rng = np.random.default_rng(seed)
    V, d = [(6, 2), (10, 3), (25, 6), (30, 2)][seed]
    G = random_gradient(rng, V, d)
    res = refgeo.diameter_lmo(G, rtol=1e-8)
    _assert_bounds_hold(G, res.lower_bound, res.upper_bound)


@pytest.mark.parametrize("seed", range(3))
def test_bounds_hold_on_cross_entropy_gradients(seed):
    rng = np.random.default_rng(seed)
    G = ce_gradient(rng, 40, 6, n_tokens=32)
    assert np.linalg.norm(G.sum(axis=0)) <= 1e-12 * np.linalg.norm(G, axis=1).sum()
    res = refgeo.diameter_lmo(G, rtol=1e-8)
    _assert_bounds_hold(G, res.lower_bound, res.upper_bound)
    # exact LMO beats RowNorm, by at most the sqrt(2) factor
    ratio = res.lower_bound / (0.5 * np.linalg.norm(G, axis=1).sum())
    assert 1.0 <= ratio <= math.sqrt(2) + 1e-9


def test_tension_bounds_without_pairwise():
    G = random_gradient(np.random.default_rng(0), 8, 3)
    b = refgeo.tension_bounds(G, pairwise=False)
    assert math.isnan(b.pairwise_flow)
    T = independent_tension(G)  # a feasible value: <= T(G), within 1e-7 of it
    norms = np.linalg.norm(G, axis=1)
    prod = math.sqrt((norms.sum() ** 2 - norms @ norms) / 2)
    assert b.lower <= T * (1 + 1e-6) and T <= b.upper * (1 + 1e-12)
    assert b.upper <= min(math.sqrt(3 / 8) * norms.sum(), prod) * (1 + 1e-12)


def test_tension_upper_bounds_hold_below_the_numerical_rank_threshold():
    """A rank-one G plus 3,000 rows of 2e-14 in a plane at 120 degrees: numerical rank
    one (the plane's singular values are below max(V, d) eps s_max), but T(G) is larger
    than J_1 sum ||g_i||, as a feasible step S shows (the plane's rows on an
    equilateral triangle of side 1).  The Jung bound dropped the plane and its
    "certified" upper bound fell 5e-12 below T(G)."""
    V, r = 3002, 2e-14
    u = np.array([[0.0, 1.0, 0.0], [0.0, -0.5, math.sqrt(3) / 2], [0.0, -0.5, -math.sqrt(3) / 2]])
    tri = np.arange(V - 2) % 3
    G = np.zeros((V, 3))
    G[0, 0], G[1, 0] = 1.0, -1.0
    G[2:] = r * u[tri]
    s = np.linalg.svd(G, compute_uv=False)
    assert s[1] < s[0] * V * np.finfo(np.float64).eps  # below the rank threshold
    S = np.zeros_like(G)
    S[0, 0], S[1, 0] = 0.5, -0.5
    S[2:] = u[tri] / math.sqrt(3)
    # D(S) = 1 exactly: the triangle's side, the two ends, and sqrt(1/4 + 1/3) between
    pd = scipy.spatial.distance.pdist(np.unique(S, axis=0))
    assert pd.max() <= 1.0 + 1e-15
    T_feasible = float(np.sum(G * S))  # <= T(G), and 4.6e-12 above J_1 sum ||g_i||
    b = refgeo.tension_bounds(G, pairwise=False)
    assert b.rank == 1
    assert T_feasible - 0.5 * np.linalg.norm(G, axis=1).sum() > 4e-12
    for ub in (b.jung, b.upper):
        assert T_feasible <= ub * (1 + 1e-15)
    # and the bound stays tight: the added term is the plane's share, about 1e-10
    assert b.upper - T_feasible < 1e-9


def test_a_crossed_bracket_raises_beyond_rounding():
    """Bounds from different formulas may cross by rounding (then they meet); a larger
    crossing is an internal error, reported with both values rather than clamped."""
    check = refgeo.lmo._checked_bracket
    assert check(1.0, 2.0, "x") == (1.0, 2.0)
    assert check(1.0 + 4e-16, 1.0, "x") == (1.0 + 4e-16, 1.0 + 4e-16)
    with pytest.raises(RuntimeError, match=re.escape("internal error in x: the lower bound 1.0 exceeds the upper bound 0.999")):
        check(1.0, 0.999, "x")


# ------------------------------------------------------------------ memory layout

_LAYOUT_CASES = {
    "center_rows": lambda G: refgeo.center_rows(G),
    "row_normalize": lambda G: refgeo.row_normalize(G, eps=1e-3),
    "projected_rownorm": lambda G: refgeo.projected_rownorm(G, eta=0.5),
    "rescaled_rownorm": lambda G: refgeo.rescaled_rownorm(G),
    "tension_bounds": lambda G: refgeo.tension_bounds(G),
    "diameter_lmo": lambda G: refgeo.diameter_lmo(G, rtol=1e-4),
}


@pytest.mark.parametrize("name", sorted(_LAYOUT_CASES))
@settings(max_examples=10)
@given(seed=st.integers(0, 2**32 - 1), V=st.integers(2, 30), d=st.integers(1, 30))
@example(seed=0, V=2, d=1)  # the smallest gradient
@example(seed=1, V=9, d=8)  # the kernels' lane of 8, and one past it
@example(seed=2, V=8, d=9)
def test_results_do_not_depend_on_memory_layout(name, seed, V, d):
    """Fortran-order, strided and reversed views of a gradient give the same bits."""
    fn = _LAYOUT_CASES[name]
    G = random_gradient(np.random.default_rng(seed), V, d)
    want = fn(G)
    for view in other_layouts(G):
        assert_same_result(fn(view), want)


# ------------------------------------------------------------------ bad input


def test_bad_input():
    G = random_gradient(np.random.default_rng(0), 5, 2)
    bad = G + np.array([1.0, 0.0])
    with pytest.raises(ValueError, match=re.escape("G must have rows summing to zero")):
        refgeo.diameter_lmo(bad)
    with pytest.raises(ValueError, match=re.escape("G must have rows summing to zero")):
        refgeo.tension_bounds(bad)
    with pytest.raises(ValueError, match=re.escape("G must have rows summing to zero")):
        refgeo.rescaled_rownorm(bad)
    # centering on purpose is accepted
    refgeo.diameter_lmo(refgeo.center_rows(bad), rtol=1e-3)
    nan = G.copy()
    nan[0, 0] = np.nan
    msg = "G must contain only finite values, got 1 NaN and 0 infinite entries instead."
    for fn in (refgeo.diameter_lmo, refgeo.tension_bounds, refgeo.projected_rownorm, refgeo.rescaled_rownorm):
        with pytest.raises(ValueError, match=re.escape(msg)):
            fn(nan)
    for eta in (0.0, -1.0):
        for fn in (refgeo.diameter_lmo, refgeo.projected_rownorm, refgeo.rescaled_rownorm):
            with pytest.raises(ValueError, match=re.escape(f"eta == {eta}, must be > 0.0.")):
                fn(G, eta=eta)
    with pytest.raises(ValueError, match=re.escape("rtol must be in (0, 1), got 1.0 instead.")):
        refgeo.diameter_lmo(G, rtol=1.0)
    with pytest.raises(ValueError, match=re.escape("rtol == 0.0, must be > 0.0.")):
        refgeo.diameter_lmo(G, rtol=0.0)
    with pytest.raises(TypeError, match=re.escape("warm_start must be an LMOResult or None, got dict instead.")):
        refgeo.diameter_lmo(G, warm_start={})
    with pytest.raises(TypeError, match=re.escape("callback must be callable, got int instead.")):
        refgeo.diameter_lmo(G, callback=3)
    with pytest.raises(ValueError, match=re.escape("G must be a 2-D array of shape (V, d), got shape (5,) instead.")):
        refgeo.diameter_lmo(np.zeros(5))
    with pytest.raises(ValueError, match=re.escape("G must have at least 2 rows")):
        refgeo.diameter_lmo(np.zeros((1, 3)))
    with pytest.raises(ValueError, match=re.escape("eps == -1.0, must be >= 0.0.")):
        refgeo.row_normalize(G, eps=-1.0)
    other = refgeo.diameter_lmo(random_gradient(np.random.default_rng(1), 6, 2), rtol=1e-3)
    with pytest.raises(ValueError, match=re.escape("warm_start must come from a gradient of shape (5, 2)")):
        refgeo.diameter_lmo(G, warm_start=other)


def test_unreachable_rtol_returns_instead_of_looping():
    """rtol below float64 rounding: the solver stops at the rounding floor (it hung)."""
    G = random_gradient(np.random.default_rng(0), 5, 3)
    rounds = []

    def guard(info):
        rounds.append(info["rounds"])
        assert len(rounds) < 20000, "diameter_lmo keeps iterating at an unreachable rtol"

    r = refgeo.diameter_lmo(G, rtol=1e-16, callback=guard)
    assert r.lower_bound <= r.upper_bound and r.gap < 1e-13
    assert r.converged == (r.gap <= 1e-16)


@pytest.mark.parametrize("e", [-1000, -700, -540, 0, 500, 1000])
def test_power_of_two_scales_give_exactly_scaled_results(e):
    """No sum of squares may under- or overflow: at 2^-1000 .. 2^1000 every result is the
    unit-scale one times 2^e exactly (power-of-two scaling is exact)."""
    rng = np.random.default_rng(3)
    G = random_gradient(rng, 7, 3)
    Ge = np.ldexp(G, e)
    a, b = refgeo.diameter_lmo(G, rtol=1e-8), refgeo.diameter_lmo(Ge, rtol=1e-8)
    np.testing.assert_array_equal(a.update, b.update)
    assert (math.ldexp(a.lower_bound, e), math.ldexp(a.upper_bound, e)) == (b.lower_bound, b.upper_bound)
    np.testing.assert_array_equal(np.ldexp(a.flows, e), b.flows)
    ta, tb = refgeo.tension_bounds(G), refgeo.tension_bounds(Ge)
    assert (math.ldexp(ta.lower, e), math.ldexp(ta.upper, e), math.ldexp(ta.half_sum, e)) == (
        tb.lower, tb.upper, tb.half_sum)
    for fn in (refgeo.projected_rownorm, refgeo.rescaled_rownorm, refgeo.row_normalize):
        np.testing.assert_array_equal(fn(G), fn(Ge))


@settings(max_examples=40, deadline=None)
@given(
    hnp.arrays(np.float64, st.tuples(st.integers(2, 7), st.integers(1, 4)),
               elements=st.floats(-4.0, 4.0, allow_nan=False, allow_subnormal=False)),
    st.integers(-1000, 1000),
)
def test_power_of_two_scaling_is_exact_hypothesis(A, e):
    """tension_bounds(G 2^e) = 2^e tension_bounds(G) and projected_rownorm(G 2^e) =
    projected_rownorm(G), bit for bit, over the whole range 2^-1000 .. 2^1000."""
    G = _centered(A)
    # rows all equal center to rounding noise, not a centered gradient
    assume(np.linalg.norm(G.sum(axis=0)) <= 1e-8 * np.linalg.norm(G, axis=1).sum())
    Ge = np.ldexp(G, e)
    # the property is about exact scalings: centering can leave entries near 1e-16, which
    # 2^-1000 takes below the normal range (subnormal, rounded), so such draws are skipped
    assume(np.array_equal(np.ldexp(Ge, -e), G))
    a, b = refgeo.tension_bounds(G), refgeo.tension_bounds(Ge)
    for f in ("half_sum", "jung", "product", "pairwise_flow", "lower", "upper"):
        va, vb = getattr(a, f), getattr(b, f)
        assert math.isfinite(vb) and vb == math.ldexp(va, e), f
    assert (a.rank, a.closed_form) == (b.rank, b.closed_form)
    S, Se = refgeo.projected_rownorm(G), refgeo.projected_rownorm(Ge)
    assert np.all(np.isfinite(Se))
    np.testing.assert_array_equal(S, Se)
    np.testing.assert_array_equal(refgeo.row_normalize(G), refgeo.row_normalize(Ge))


def test_rows_near_the_float64_maximum():
    """Rows near 1e308: finite bounds where they are representable, a ValueError naming
    the range where they are not (a plain sum of squares overflowed)."""
    rng = np.random.default_rng(9)
    G = random_gradient(rng, 6, 3)
    G /= np.abs(G).max()
    T = refgeo.tension_bounds(G)
    e = 1023 - math.frexp(T.upper)[1]  # the largest scale keeping every bound finite
    b = refgeo.tension_bounds(np.ldexp(G, e))
    assert (b.lower, b.upper, b.pairwise_flow) == tuple(math.ldexp(v, e) for v in (T.lower, T.upper, T.pairwise_flow))
    assert b.upper > 1e307
    S = refgeo.projected_rownorm(np.ldexp(G, 1023))
    np.testing.assert_array_equal(S, refgeo.projected_rownorm(G))
    r = refgeo.diameter_lmo(np.ldexp(G, e), rtol=1e-6)
    assert math.isfinite(r.upper_bound) and r.upper_bound > 1e307 and _brute_diameter(r.update) <= 1.0
    with pytest.raises(ValueError, match=re.escape("beyond the float64 range")):
        refgeo.tension_bounds(np.ldexp(G, 1023))
    with pytest.raises(ValueError, match=re.escape("beyond the float64 range")):
        refgeo.diameter_lmo(np.ldexp(G, 1023))
    C = refgeo.center_rows(np.ldexp(np.array([[1.0, 0.0], [-1.0, 0.5], [-1.0, -0.5]]), 1023))
    np.testing.assert_allclose(C, np.ldexp(np.array([[4.0, 0.0], [-2.0, 1.5], [-2.0, -1.5]]) / 3, 1023), rtol=1e-15)


@pytest.mark.parametrize("c", [1e-300, 1.3e-162, 1e-200, 1e155, 1e300])
def test_extreme_scales_keep_the_budget_and_the_bracket(c):
    rng = np.random.default_rng(5)
    G = random_gradient(rng, 6, 2)
    Gc = G * c
    T = refgeo.tension_bounds(G)
    b = refgeo.tension_bounds(Gc)
    assert b.lower == pytest.approx(c * T.lower, rel=1e-12) and b.upper == pytest.approx(c * T.upper, rel=1e-12)
    for fn in (refgeo.projected_rownorm, refgeo.rescaled_rownorm):
        S = fn(Gc, eta=1.0)
        assert 0.45 < _brute_diameter(S) <= 1.0
    r = refgeo.diameter_lmo(Gc, rtol=1e-6)
    assert r.lower_bound <= r.upper_bound and r.lower_bound >= c * T.lower * (1 - 1e-9)
    assert _brute_diameter(r.update) <= 1.0 and r.method in ("admm", "irls", "barrier")


@pytest.mark.parametrize("eta", [1e-300, 1e-3, 1e300])
def test_bounds_do_not_depend_on_the_budget(eta):
    G = random_gradient(np.random.default_rng(6), 8, 3)
    a, b = refgeo.diameter_lmo(G, rtol=1e-8), refgeo.diameter_lmo(G, eta=eta, rtol=1e-8)
    assert (a.lower_bound, a.upper_bound) == (b.lower_bound, b.upper_bound)
    np.testing.assert_array_equal(b.update, a.update * eta)
    assert b.decrease == pytest.approx(-float(np.sum(G * b.update)), rel=1e-12)
    with pytest.raises(ValueError, match=re.escape("eta == 1e-310, must be >= 2.2250738585072014e-308")):
        refgeo.diameter_lmo(G, eta=1e-310)


def test_numerically_rank_one_gradient_bounds_its_residual():
    """Rank one up to a residual below the numerical-rank threshold: the closed form must
    not drop it (the half-sum lower bound exceeded the reported upper bound)."""
    V, d = 4000, 2
    rng = np.random.default_rng(0)
    G = np.zeros((V, d))
    G[0, 0], G[1, 0] = 1.0, -1.0
    E = np.zeros((V, d))
    E[:, 1] = rng.standard_normal(V)
    E[:, 1] -= E[:, 1].mean()
    E *= 0.5 * V * np.finfo(float).eps * np.linalg.norm(G, 2) / np.linalg.norm(E, 2)
    G2 = G + E
    half = 0.5 * float(np.sum(np.linalg.norm(G2, axis=1)))
    b = refgeo.tension_bounds(G2, pairwise=False)
    r = refgeo.diameter_lmo(G2)
    assert b.closed_form == "rank1" and r.method == "rank1"
    assert b.lower <= b.upper and half <= b.upper * (1 + 1e-15)
    assert half <= r.upper_bound * (1 + 1e-15) and r.lower_bound <= r.upper_bound


@pytest.mark.parametrize("case", ["one_token_float32", "rank_one_plus_noise"])
def test_gradients_merged_into_two_rows_are_solved_in_closed_form(case):
    """Merging left two rows (a closed form, lifted with its bound) and was thrown away
    as "rank one": but the rank-one closed form needs the numerical rank to be one, and
    a float32 gradient of one token, or rank one plus noise of 1e-10, went to the
    first-order solvers, which crawl there (no end in 150 s at (4000, 16); at
    max_time=5, (1600, 4) came back as RowNorm with a gap of 0.5)."""
    rng = np.random.default_rng(0)
    if case == "one_token_float32":
        W = rng.standard_normal((4000, 16)).astype(np.float32)
        h = rng.standard_normal(16).astype(np.float32)
        z = W @ h
        p = np.exp(z - z.max())
        p /= p.sum()
        p[7] -= 1.0
        G = np.outer(p, h).astype(np.float32)
    else:
        a = rng.standard_normal(1600)
        G = np.outer(a - a.mean(), rng.standard_normal(4)) + 1e-10 * rng.standard_normal((1600, 4))
        G -= G.mean(axis=0)
    r = refgeo.diameter_lmo(G, max_time=20.0)
    assert r.converged and r.gap <= 1e-4 and r.method != "rownorm"
    G64 = np.asarray(G, dtype=np.float64)
    half = 0.5 * float(np.sum(np.linalg.norm(G64, axis=1)))  # T >= the half-sum
    assert half <= r.upper_bound * (1 + 1e-12)
    assert refgeo.row_diameter(np.asarray(r.update, dtype=np.float64)).value <= 1.0
    assert r.decrease == pytest.approx(-float(np.sum(G64 * np.asarray(r.update, dtype=np.float64))), rel=1e-6)


def test_projected_rownorm_budget_holds_to_a_few_roundoffs_of_its_dtype():
    rng = np.random.default_rng(11)
    for dtype in (np.float64, np.float32):
        worst = 0.0
        for _ in range(200):
            G = rng.standard_normal((2, 2)).astype(dtype)
            S = refgeo.projected_rownorm(G, eta=3.0)
            worst = max(worst, _brute_diameter(S.astype(np.float64)) / 3.0)
        assert 1.0 - 1e-3 < worst <= 1.0 + 4 * np.finfo(dtype).eps


# ------------------------------------------------------------------ acceptance (slow)


@pytest.mark.slow
def test_acceptance_v60_against_independent_solver():
    rng = np.random.default_rng(60)
    G = random_gradient(rng, 60, 4)
    res = refgeo.diameter_lmo(G, rtol=1e-6)
    assert res.gap <= 1e-5
    ref = independent_tension(G)
    assert res.lower_bound == pytest.approx(ref, rel=1e-6)
    assert ref <= res.upper_bound * (1 + 1e-10)


@pytest.mark.slow
def test_acceptance_ce_v2000():
    rng = np.random.default_rng(2000)
    G = ce_gradient(rng, 2000, 64, n_tokens=1024)
    t0 = time.perf_counter()
    res = refgeo.diameter_lmo(G, rtol=1e-3, max_time=120.0)
    elapsed = time.perf_counter() - t0
    ratio = res.lower_bound / (0.5 * np.linalg.norm(G, axis=1).sum())
    print(f"V=2000 d=64: gap={res.gap:.2e} time={elapsed:.1f}s ratio={ratio:.4f} pairs={len(res.pairs)}")
    assert res.gap <= 1e-3
    assert 1.1 <= ratio <= 1.4


@pytest.mark.slow
def test_acceptance_ce_v8000():
    rng = np.random.default_rng(8000)
    G = ce_gradient(rng, 8000, 128, n_tokens=1024)
    t0 = time.perf_counter()
    res = refgeo.diameter_lmo(G, rtol=1e-2, max_time=300.0)
    elapsed = time.perf_counter() - t0
    print(f"V=8000 d=128: gap={res.gap:.2e} time={elapsed:.1f}s")
    assert res.gap <= 1e-2


# ------------------------------------------------------------------ Ctrl-C


@pytest.mark.slow
def test_ctrl_c_stops_diameter_lmo_at_its_next_round():
    import textwrap

    from ._interrupt import interrupt

    # an isotropic gradient at a tolerance far below what 60 s reach: the solver would
    # run for its whole max_time
    code = textwrap.dedent("""
        import numpy as np, refgeo
        G = np.random.default_rng(0).standard_normal((2000, 64))
        G -= G.mean(axis=0)
        print("started", flush=True)
        refgeo.diameter_lmo(G, rtol=1e-9, max_time=60)
        print("returned", flush=True)
    """)
    run = interrupt(code, ready="started")
    assert run.seconds < 2.0
    assert run.returncode != 0 and "returned" not in run.out
    assert "KeyboardInterrupt" in run.err


@pytest.mark.parametrize(
    "G",
    [
        np.outer([1.0, -2.0, 1.0, 0.0], [1.0, 2.0]),  # rank one: collinear rows merged
        np.array([[1.0, 1.0], [1.0, 1.0], [-1.0, 0.0], [-1.0, -2.0]]),  # duplicate rows merged
    ],
    ids=["rank_one", "duplicates"],
)
def test_merged_rows_update_is_centered(G):
    # Clusters of different sizes: repeating each cluster's step over its rows kept D
    # but not 1^T S = 0 (column sums 0.45 and 0.49 before).
    r = refgeo.diameter_lmo(G, eta=0.5, rtol=1e-6)
    assert np.abs(np.asarray(r.update).sum(axis=0)).max() <= 1e-15
    assert refgeo.row_diameter(r.update).value <= 0.5
    assert r.decrease == pytest.approx(-float(np.sum(G * r.update)), rel=1e-14)
    assert r.converged and r.gap <= 1e-6


@pytest.mark.parametrize(
    "G",
    [np.array([[3.0, 4.0, 0.0], [-3.0, -4.0, 0.0]]), np.array([[1.0], [-2.0], [1.0]])],
    ids=["two_rows", "rank_one"],
)
def test_closed_forms_report_converged_only_when_the_gap_reaches_rtol(G):
    # The certified gap of a closed form is a few ulps: it was reported converged=True
    # for any rtol, also below that gap.
    r = refgeo.diameter_lmo(G, rtol=1e-16)
    assert r.gap > 1e-16 and not r.converged
    r = refgeo.diameter_lmo(G, rtol=1e-12)
    assert r.converged and r.gap <= 1e-12
    r = refgeo.diameter_lmo(np.zeros((3, 2)), rtol=1e-16)
    assert r.converged and r.gap == 0.0


def test_results_beyond_the_range_of_the_dtype_are_errors_not_inf():
    # The centered rows of these columns are beyond the dtype's range (the exact values,
    # by Fraction, exceed its maximum): center_rows returned inf with a RuntimeWarning.
    from fractions import Fraction

    for dtype, top in ((np.float64, 1.7e308), (np.float32, 3e38)):
        A = np.array([[top], [-top], [-top]], dtype=dtype)
        exact = [Fraction(float(x)) for x in A[:, 0]]
        mean = sum(exact) / 3
        assert max(abs(x - mean) for x in exact) > Fraction(float(np.finfo(dtype).max))
        with pytest.raises(ValueError, match=re.escape(f"A must have centered rows inside the range of {np.dtype(dtype)}")):
            refgeo.center_rows(A)
    # the step of projected_rownorm has entries up to eta / 2, beyond float32 for eta = 1e300:
    # it was inf
    G = np.array([[1.0, 0.0], [-1.0, 0.0]], dtype=np.float32)
    with pytest.raises(ValueError, match=re.escape("eta must be small enough for the step to fit the dtype of G (float32")):
        refgeo.projected_rownorm(G, eta=1e300)
    S = refgeo.projected_rownorm(G, eta=1e38)  # entries 5e37 still fit
    assert S.dtype == np.float32
    np.testing.assert_array_equal(S, np.array([[-5e37, 0.0], [5e37, 0.0]], dtype=np.float32))


def test_projected_rownorm_refuses_a_budget_below_the_normal_range_of_a_float32_step():
    """The step takes G's dtype: below float32's smallest normal its entries are
    subnormal, and the diameter of the rounded step exceeded eta (1.02 eta at 1e-44; all
    zeros at 1e-45), as a float64 step would below 2.2e-308, which is refused."""
    from scipy.spatial.distance import pdist

    G = refgeo.center_rows(np.random.default_rng(2).standard_normal((6, 3)).astype(np.float32))
    tiny = float(np.finfo(np.float32).smallest_normal)
    for eta in (1e-44, 1e-40, tiny / 2):
        with pytest.raises(ValueError, match=re.escape("must be >= 1.1754943508222875e-38 (the smallest normal float32)")):
            refgeo.projected_rownorm(G, eta=eta)
    S = refgeo.projected_rownorm(G, eta=tiny)
    assert S.dtype == np.float32
    assert pdist(S.astype(np.float64)).max() <= tiny * (1 + 1e-5)  # within eta, to float32 rounding
    S64 = refgeo.projected_rownorm(G.astype(np.float64), eta=1e-44)  # a float64 G takes it
    assert pdist(S64).max() <= 1e-44 * (1 + 1e-15)


def test_warm_start_contents_are_checked(admm_only):
    # An LMOResult built or replaced by hand: pairs outside the rows failed in SciPy
    # ("axis 1 index 999 exceeds matrix dimension"), NaN flows or steps with an
    # AttributeError, and float pairs were truncated to other pairs silently.
    import dataclasses

    G = random_gradient(np.random.default_rng(7), 25, 2)
    r = refgeo.diameter_lmo(G, rtol=1e-9, max_iter=50)  # the ADMM, which reads the warm start
    assert r.method == "admm"
    bad = [
        (dict(pairs=np.array([[0, 999]]), flows=np.array([1.0])), "warm_start.pairs must be an integer array of shape (m, 2) with rows in [0, 24], got int64 pairs of shape (1, 2) with values in [0, 999] instead."),
        (dict(pairs=np.array([[-1, 3]]), flows=np.array([1.0])), "warm_start.pairs must be an integer array"),
        # the first row out of range, V itself (an off-by-one in the check let it through)
        (dict(pairs=np.array([[0, 25]]), flows=np.array([1.0])), "with values in [0, 25] instead."),
        (dict(pairs=np.array([[0.5, 3.0]]), flows=np.array([1.0])), "warm_start.pairs must be an integer array"),
        (dict(flows=np.full(len(r.flows), np.nan)), f"warm_start.flows must be {len(r.flows)} finite flow magnitudes >= 0"),
        (dict(pairs=np.array([[0, 3], [1, 2]]), flows=np.array([1.0])), "warm_start.flows must be 2 finite flow magnitudes >= 0"),
        (dict(update=np.full((25, 2), np.nan)), "warm_start.update must contain only finite values"),
        (dict(eta=-1.0), "warm_start.eta == -1.0, must be > 0.0."),
        # a subnormal eta, or an update far beyond its eta: update / eta overflowed to
        # NaN potentials, and an AttributeError ('NoneType' ... 'astype') followed
        (dict(eta=1e-310), "warm_start.eta == 1e-310, must be >= 2.2250738585072014e-308"),
        (dict(update=np.asarray(r.update) * 1e300, eta=1e-10), "warm_start.update / warm_start.eta must be finite"),
    ]
    for change, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            refgeo.diameter_lmo(G, rtol=1e-9, max_iter=50, warm_start=dataclasses.replace(r, **change))
    # lists of integers are well-formed: the bracket stays inside the half-sum and
    # 1/sqrt(2) bounds, computed here from the row norms
    w = refgeo.diameter_lmo(G, rtol=1e-9, max_iter=50, warm_start=dataclasses.replace(r, pairs=[[0, 3]], flows=[2]))
    s1 = float(np.sum(np.linalg.norm(G, axis=1)))
    assert s1 / 2 * (1 - 1e-12) <= w.upper_bound and w.lower_bound <= s1 / math.sqrt(2) * (1 + 1e-12)
    assert w.lower_bound <= w.upper_bound and _brute_diameter(w.update) <= 1.0


@pytest.mark.parametrize("k", [1074, 1073, 1072, 1060, 1040])
def test_brackets_of_subnormal_gradients_contain_the_tension(k):
    """G = G0 2**-k, an exact scaling into the subnormal range, where 2**-k T(G0) is not
    representable: the bounds were scaled back rounding to nearest, and the "certified"
    bracket was [5, 5] units of 2**-1074 where T = 4.63.  Lower bounds (and the
    decrease) round down, upper bounds up, and the gap and ``converged`` are those of
    the bounds returned.  (T(G0): the solve at the normal scale, a bracket within
    1e-12.)"""
    G0 = np.array([[3.0, 0.0], [-1.0, 2.0], [-2.0, -2.0]])
    ref = refgeo.diameter_lmo(G0, rtol=1e-12)
    G = np.ldexp(G0, -k)
    assert np.array_equal(np.ldexp(G, k), G0)
    r = refgeo.diameter_lmo(G, rtol=1e-8)
    tb = refgeo.tension_bounds(G)
    for lo, up in ((r.lower_bound, r.upper_bound), (tb.lower, tb.upper), (tb.half_sum, tb.jung)):
        assert math.ldexp(lo, k) <= ref.lower_bound and math.ldexp(up, k) >= ref.upper_bound, (lo, up)
    assert math.ldexp(r.decrease, k) <= ref.upper_bound
    assert r.gap >= (r.upper_bound - r.lower_bound) / r.upper_bound
    assert r.converged == (r.gap <= 1e-8)


@pytest.mark.parametrize("solver", ["admm", "barrier"])
def test_admm_stops_when_its_gap_stalls_above_rtol(solver, monkeypatch):
    """A nearly rank-one gradient at rtol 1e-12: the ADMM's estimates plateau near
    2e-11 and it looped forever (no max_time).  The bracket must still contain T(G),
    which is within T(P) <= sum ||p_i|| / sqrt(2) of the rank-one value 0.5 ||a||_1 ||b||."""
    rng = np.random.default_rng(3)
    a = np.array([2.0, -1.0, -1.0, 0.0, 3.0, -3.0])
    b = np.array([0.6, 0.8])
    P = 1e-10 * rng.standard_normal((6, 2))
    P -= P.mean(axis=0)
    G = np.outer(a, b) + P
    rounds = []

    def guard(info):
        rounds.append(info["rounds"])
        assert len(rounds) < 5000, "diameter_lmo keeps iterating on a stalled gap"

    if solver == "admm":
        monkeypatch.setattr(refgeo.lmo, "_BARRIER_LIMIT", 0)
        monkeypatch.setattr(refgeo.lmo, "_BARRIER_TIGHT_LIMIT", 0)
    r = refgeo.diameter_lmo(G, rtol=1e-12, callback=guard)
    if solver == "admm":
        # nearly rank one: RowNorm's step (exact at rank one) beats the stalled ADMM's
        # and is returned, with the ADMM's upper bound
        assert r.method in ("admm", "rownorm") and not r.converged and r.gap > 1e-12
    else:  # the barrier method's Newton steps do not stall here
        assert r.method in ("barrier", "rownorm")
    exact = 0.5 * float(np.sum(np.abs(a))) * float(np.linalg.norm(b))
    slack = float(np.sum(np.linalg.norm(P, axis=1))) / math.sqrt(2.0)
    assert r.lower_bound <= exact + slack and r.upper_bound >= exact - slack
    assert r.gap < 1e-9 and _brute_diameter(r.update) <= 1.0


def test_tension_bounds_beyond_the_range_only_in_a_secondary_bound():
    """Rows near 1e308 whose T is representable but whose pairwise-flow bound is not:
    that bound is inf (it raised a ValueError for the whole call)."""
    c = 1e308
    G = np.array([[c, -c], [-c, c], [0.0, 0.0]])
    D = decimal.Context(prec=40)
    # rank one, a = (1, -1, 0) c, b = (1, -1) / sqrt 2: T = ||a||_1 ||b|| / 2 = sqrt(2) c
    T = D.multiply(D.sqrt(decimal.Decimal(2)), decimal.Decimal(c))
    pairwise = D.divide(D.multiply(D.multiply(4, D.sqrt(decimal.Decimal(2))), decimal.Decimal(c)), 3)
    assert pairwise > decimal.Decimal(np.finfo(np.float64).max)
    b = refgeo.tension_bounds(G)
    assert b.pairwise_flow == math.inf
    assert b.closed_form == "rank1"
    assert b.lower == pytest.approx(float(T), rel=1e-15) and b.upper == pytest.approx(float(T), rel=1e-15)


def test_a_crossed_bracket_beyond_rounding_is_an_internal_error():
    """``_checked_bracket`` lifts an upper bound that rounding pushed below the lower one
    and raises where the crossing is too large for rounding (one of them is not a
    bound): a mutant that tolerated 1e12 ulps passed every end-to-end test."""
    from refgeo.lmo import _checked_bracket

    with pytest.raises(RuntimeError, match="more than rounding can explain"):
        _checked_bracket(1.0, 1.0 - 1e-6, "test")
    assert _checked_bracket(1.0, 1.0 - 1e-15, "test") == (1.0, 1.0)
    assert _checked_bracket(0.5, 2.0, "test") == (0.5, 2.0)


def test_the_centering_tolerance_is_the_documented_one():
    """||sum of rows|| / sum of row norms at 1.25 times the documented 2**-8 is refused by
    the function and by the optimizer, at 0.8 times it accepted by both (a mutant 1000
    times looser passed every other test; 1e-4 refused float32 gradients computed under
    bfloat16 autocast, see test_torch)."""
    def off_by(r):  # rows (1, 0) and (x - 1, 0): ratio x / (2 - x) = r
        x = 2.0 * r / (1.0 + r)
        return np.array([[1.0, 0.0], [x - 1.0, 0.0]])

    G = off_by(1.25 * 2.0**-8)
    with pytest.raises(ValueError, match=r"^G must have rows summing to zero"):
        refgeo.diameter_lmo(G)
    with pytest.raises(ValueError, match=r"^grad must have rows summing to zero"):
        refgeo.DiameterLMO(lr=0.5).step(np.zeros((2, 2)), G)
    G = off_by(0.8 * 2.0**-8)
    assert refgeo.diameter_lmo(G).decrease > 0
    assert np.all(np.isfinite(refgeo.DiameterLMO(lr=0.5).step(np.zeros((2, 2)), G)))
    with pytest.raises(TypeError, match=re.escape("pairwise must be a bool, got int instead.")):
        refgeo.tension_bounds(np.array([[1.0, 0.0], [-1.0, 0.0]]), pairwise=0)


def test_the_centering_error_reports_the_callers_numbers():
    """The check runs on G scaled by a power of two (no sum overflows); its message
    reported that copy's numbers (1.845e-01 against 1.291e+00 for rows of 1e-20)."""
    G = np.array([[1e-20, 0.0], [1e-20, 0.0], [-1.5e-20, 0.0]])
    total, norms = abs(G.sum(axis=0)[0]), np.abs(G[:, 0]).sum()
    msg = f"||sum of rows|| = {total:.3e} against sum of row norms {norms:.3e} instead"
    for call in (lambda: refgeo.diameter_lmo(G), lambda: refgeo.DiameterLMO(lr=0.1).step(np.zeros((3, 2)), G)):
        with pytest.raises(ValueError, match=re.escape(msg)):
            call()
