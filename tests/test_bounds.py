"""Upper bounds on the distance ratio (docs/theory/spreading.md): validity on every configuration,
closed forms, tightness, and the facts the proofs rest on."""

from __future__ import annotations

import decimal
import itertools
import math
import re

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import refgeo

BOUNDS = {
    "B0": refgeo.simplex_bound,
    "B1": refgeo.welch_bound,
    "B2": refgeo.hadamard_power_bound,
    "B3": refgeo.volume_bound,
}


def _rho(X) -> float:
    """Brute-force m/D by direct differences (independent of refgeo)."""
    X = np.asarray(X, dtype=np.float64)
    i, j = np.triu_indices(X.shape[0], 1)
    e = np.sqrt(((X[i] - X[j]) ** 2).sum(1))
    return float(e.min() / e.max()) if e.max() > 0 else 0.0  # all rows equal: rho := 0


def _assert_all_bounds_hold(X, d=None):
    V = X.shape[0]
    d = X.shape[1] if d is None else d
    rho = _rho(X)
    for name, f in BOUNDS.items():
        assert rho <= f(V, d), (name, V, d, rho, f(V, d))
    assert rho <= refgeo.ratio_upper_bound(V, d).value


# --------------------------------------------------------------------------- configurations


@st.composite
def configurations(draw):
    """Random clouds: Gaussian, uniform in a box, on a sphere, clustered, lattice-like,
    nearly collinear; various scales and offsets."""
    V = draw(st.integers(2, 24))
    d = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**32 - 1))
    kind = draw(st.sampled_from(["gauss", "box", "sphere", "clusters", "grid", "flat"]))
    rng = np.random.default_rng(seed)
    if kind == "gauss":
        X = rng.standard_normal((V, d))
    elif kind == "box":
        X = rng.uniform(-1, 1, (V, d))
    elif kind == "sphere":
        X = rng.standard_normal((V, d))
        X /= np.linalg.norm(X, axis=1, keepdims=True)
    elif kind == "clusters":
        C = rng.standard_normal((3, d)) * 5
        X = C[rng.integers(0, 3, V)] + 0.1 * rng.standard_normal((V, d))
    elif kind == "grid":
        X = rng.integers(-3, 4, (V, d)).astype(float) + 1e-3 * rng.standard_normal((V, d))
    else:
        X = np.outer(np.arange(V, dtype=float), rng.standard_normal(d)) + 1e-2 * rng.standard_normal((V, d))
    scale = draw(st.sampled_from([1e-3, 1.0, 1e3]))
    return X * scale + rng.standard_normal(d) * 10


@given(configurations())
def test_every_bound_holds_on_random_configurations(X):
    _assert_all_bounds_hold(X)


@st.composite
def constructed(draw):
    """Constructions of refgeo.spread, subsets of them, and padded copies."""
    which = draw(st.sampled_from(["simplex", "orth", "cross", "kerdock", "dg", "demicube", "rectified"]))
    if which == "simplex":
        d = draw(st.integers(1, 8))
        X = refgeo.regular_simplex(draw(st.integers(2, d + 1)), d)
    elif which == "orth":
        X = refgeo.orthogonal_simplices(draw(st.integers(1, 9)))
    elif which == "cross":
        X = refgeo.cross_polytope(draw(st.integers(1, 6)))
    elif which == "kerdock":
        d = draw(st.sampled_from([4, 16]))
        X = refgeo.kerdock_code(d, draw(st.integers(2, d * (d // 2 + 1))))
    elif which == "dg":
        X = refgeo.delsarte_goethals_code(16, draw(st.integers(200, 1040)))
    elif which == "demicube":
        X = _demicube()
    else:
        X = _rectified_simplex()
    if X.shape[0] > 2 and draw(st.booleans()):
        keep = draw(st.lists(st.integers(0, X.shape[0] - 1), min_size=2, max_size=X.shape[0], unique=True))
        X = X[sorted(keep)]
    pad = draw(st.integers(0, 2))
    return np.hstack([X, np.zeros((X.shape[0], pad))])


@settings(max_examples=60)
@given(constructed())
def test_every_bound_holds_on_constructions(X):
    _assert_all_bounds_hold(X)


def _demicube():
    """The 16 points of {+-1}^5 with an even number of minus signs."""
    P = np.array([p for p in itertools.product([1.0, -1.0], repeat=5) if p.count(-1.0) % 2 == 0])
    assert P.shape == (16, 5)
    return P


def _rectified_simplex():
    """Midpoints of the edges of the regular 4-simplex: e_i + e_j in R^5, a 4-flat."""
    P = np.array([np.eye(5)[i] + np.eye(5)[j] for i, j in itertools.combinations(range(5), 2)])
    # Coordinates in the hyperplane sum = 2: an orthonormal basis of 1^perp.
    Q, _ = np.linalg.qr(np.vstack([np.ones(5), np.eye(5)[:4]]).T)
    return (P - 0.4) @ Q[:, 1:5]


def _two_orthogonal_simplices(d):
    """Independent construction: simplices of d/2+1 points in orthogonal d/2-flats."""
    h = d // 2
    E = np.eye(h + 1) - 1.0 / (h + 1)  # h+1 points in the h-flat 1^perp of R^{h+1}
    _, _, Wt = np.linalg.svd(E)
    S = E @ Wt[:h].T  # coordinates in R^h
    S /= np.linalg.norm(S[0])
    X = np.zeros((d + 2, d))
    X[: h + 1, :h] = S
    X[h + 1 :, h:] = S
    return X


# --------------------------------------------------------------------------- tightness


@pytest.mark.parametrize("d", [2, 4, 6, 8, 10])
def test_welch_attained_by_two_orthogonal_simplices_even_d(d):
    X = _two_orthogonal_simplices(d)
    assert _rho(X) ** 2 == pytest.approx(d / (d + 2), abs=1e-12)
    assert refgeo.welch_bound(d + 2, d) == pytest.approx(_rho(X), abs=1e-12)
    assert refgeo.ratio_upper_bound(d + 2, d).binding == "B1"


@pytest.mark.parametrize("V, d, X", [(10, 4, _rectified_simplex()), (16, 5, _demicube())], ids=["10-4", "16-5"])
def test_welch_attained_at_10_4_and_16_5(V, d, X):
    assert X.shape == (V, d)
    assert np.linalg.matrix_rank(X - X.mean(0)) == d
    assert _rho(X) == pytest.approx(math.sqrt(0.5), abs=1e-12)
    assert refgeo.welch_bound(V, d) == pytest.approx(_rho(X), abs=1e-12)
    assert refgeo.welch_bound(V, d) >= _rho(X)  # outward rounding: never below the optimum


@pytest.mark.parametrize("V", [2, 3, 5, 17])
def test_volume_bound_exact_on_the_line(V):
    X = np.arange(V, dtype=float)[:, None]
    assert refgeo.volume_bound(V, 1) == pytest.approx(1.0 / (V - 1), rel=1e-14)
    assert refgeo.volume_bound(V, 1) >= _rho(X)


def test_simplex_values():
    for d in range(1, 8):
        for V in range(2, d + 2):
            assert refgeo.ratio_upper_bound(V, d).value == 1.0
            assert _rho(refgeo.regular_simplex(V, d)) == pytest.approx(1.0, abs=1e-12)
        assert refgeo.simplex_bound(d + 2, d) == pytest.approx(math.sqrt(d / (d + 1)), rel=1e-14)


# --------------------------------------------------------------------------- closed forms


def _welch_formula(V, d):
    w = math.sqrt((V - d - 1) / ((d + 1) * (V - 1)))
    return math.sqrt((1 - w) / (1 + w))


def _hadamard_formula(V, d):
    best = 1.0
    for k in range(1, 10**6):
        r = math.comb(d + k + 1, k)
        if r >= V:
            break
        u = ((V - r) / (r * (V - 1))) ** (1 / (2 * k))
        best = min(best, math.sqrt((1 - u) / (1 + u)))
    return best


@given(st.integers(2, 10**6), st.integers(1, 2048))
def test_closed_forms(V, d):
    if V > d + 1:
        assert refgeo.welch_bound(V, d) == pytest.approx(_welch_formula(V, d), rel=1e-13)
    assert refgeo.hadamard_power_bound(V, d) == pytest.approx(_hadamard_formula(V, d), rel=1e-13)
    b3 = refgeo.volume_bound(V, d)
    assert b3 == 1.0 or b3 == pytest.approx(1 / (V ** (1 / d) - 1), rel=1e-12)


def _decimal_hadamard(V, d, k):
    """The k-th Hadamard bound in 60-digit decimal arithmetic (1 when r_k >= V)."""
    r = math.comb(d + k + 1, k)
    if r >= V:
        return decimal.Decimal(1)
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        u = (decimal.Decimal(V - r) / (decimal.Decimal(r) * (V - 1))) ** (decimal.Decimal(1) / (2 * k))
        return ((1 - u) / (1 + u)).sqrt()


@settings(max_examples=300)
@given(st.integers(2, 2**53), st.integers(1, 8), st.integers(1, 4096))
@example(2, 1, 1)  # the corners of the drawn ranges
@example(2, 8, 4096)
@example(2**53, 1, 4096)
@example(2**53, 8, 1)
def test_hadamard_bound_is_rounded_outward_also_for_large_powers(V, d, k):
    """The returned float is never below the exact value of the formula (it was, by up
    to 1e-14 relative, where u = x**(1/2k) is near 1 and 1 - u cancels)."""
    got = refgeo.hadamard_power_bound(V, d, k=k)
    want = _decimal_hadamard(V, d, k)
    assert decimal.Decimal(got) >= want
    assert got == pytest.approx(float(want), rel=1e-14)


@pytest.mark.parametrize("V, d, k", [(10**15, 1, 4096), (10**12, 1, 2000), (10**6, 1, 1000), (2**53, 2, 4096)])
def test_hadamard_bound_is_rounded_outward_where_it_was_not(V, d, k):
    assert decimal.Decimal(refgeo.hadamard_power_bound(V, d, k=k)) >= _decimal_hadamard(V, d, k)


def test_reference_numbers_of_the_theory_page():
    # docs/theory/spreading.md: (1000, 64) B1 0.886; (4096, 256) B1 0.941; (50k, 1024) 0.96955;
    # (50k, 64) B2 0.865; (32768, 512) 0.957; (50257, 768) about 0.965.
    assert round(refgeo.welch_bound(1000, 64), 3) == 0.886
    assert round(refgeo.welch_bound(4096, 256), 3) == 0.941
    assert round(refgeo.welch_bound(50000, 1024), 5) == 0.96955
    b = refgeo.ratio_upper_bound(50000, 64)
    assert (b.binding, round(b.value, 3), b.k) == ("B2", 0.865, 2)
    assert round(refgeo.ratio_upper_bound(32768, 512).value, 3) == 0.957
    assert abs(refgeo.ratio_upper_bound(50257, 768).value - 0.965) < 1e-3


def test_b2_beats_b1_beyond_binomial():
    # "better than B1 once V > C(d+3, 2)" (docs/theory/spreading.md), checked near the crossover.
    for d in (8, 16, 32):
        V = 4 * math.comb(d + 3, 2)
        assert refgeo.hadamard_power_bound(V, d) < refgeo.welch_bound(V, d)
        assert refgeo.hadamard_power_bound(d + 4, d) >= refgeo.welch_bound(d + 4, d)


def test_hadamard_explicit_k():
    V, d = 50000, 64
    vals = [refgeo.hadamard_power_bound(V, d, k=k) for k in (1, 2, 3)]
    assert min(vals) == refgeo.hadamard_power_bound(V, d)
    assert refgeo.hadamard_power_bound(10, 8, k=1) == 1.0  # r_1 = d + 2 >= V: no information


@pytest.mark.parametrize("V, d, k", [(100, 10**6, 10**6), (2**53, 2**40, 2**40), (2**53, 2**20, 2**26)])
def test_hadamard_explicit_huge_power_is_fast(V, d, k):
    """r_k = comb(d + k + 1, k) >= V says nothing (bound 1): computing r_k in full took
    41 s at (100, 10**6, k=10**6), a number of 600,000 digits, and never ended beyond."""
    import time

    t0 = time.perf_counter()
    assert refgeo.hadamard_power_bound(V, d, k=k) == 1.0
    assert time.perf_counter() - t0 < 1.0
    # and where the power says something, still the exact formula, rounded outward
    want = _decimal_hadamard(2**53, 3, 40)
    assert want < 1 and decimal.Decimal(refgeo.hadamard_power_bound(2**53, 3, k=40)) >= want


@given(st.integers(2, 5000), st.integers(1, 300))
def test_monotone_in_V_and_d(V, d):
    b = refgeo.ratio_upper_bound(V, d).value
    assert refgeo.ratio_upper_bound(V + 1, d).value <= b + 1e-15
    assert refgeo.ratio_upper_bound(V, d + 1).value >= b - 1e-15
    assert 0.0 < b <= 1.0


def test_ratio_upper_bound_result():
    b = refgeo.ratio_upper_bound(1000, 64)
    assert b.value == min(b.b0, b.b1, b.b2, b.b3)
    assert b.as_dict()[b.binding] == b.value
    assert (b.V, b.d) == (1000, 64)
    with pytest.raises(AttributeError):
        b.value = 2.0  # frozen
    assert refgeo.ratio_upper_bound(3, 1).binding == "B3"


# --------------------------------------------------------------------------- the proofs' facts


@given(configurations())
def test_A_has_at_most_d_plus_1_positive_eigenvalues(X):
    """The fact behind B1 (bounds module notes): A = 11^T - E/s has <= d+1 positive
    eigenvalues and rank <= d + 2."""
    V, d = X.shape
    Xc = X - X.mean(0)
    E = ((Xc[:, None, :] - Xc[None, :, :]) ** 2).sum(-1)
    off = E[~np.eye(V, dtype=bool)]
    if off.min() <= 0 or V < 2:
        return
    s = (off.min() + off.max()) / 2
    A = 1.0 - E / s
    lam = np.linalg.eigvalsh(A)
    tol = 1e-8 * np.abs(lam).max()
    assert (lam > tol).sum() <= d + 1
    assert (np.abs(lam) > tol).sum() <= d + 2


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("f", list(BOUNDS.values()) + [refgeo.ratio_upper_bound])
def test_argument_errors(f):
    with pytest.raises(ValueError, match=re.escape("V == 1, must be >= 2.")):
        f(1, 3)
    with pytest.raises(ValueError, match=re.escape("d == 0, must be >= 1.")):
        f(5, 0)
    with pytest.raises(TypeError, match=re.escape("V must be an integer, got float (5.0) instead.")):
        f(5.0, 3)
    with pytest.raises(TypeError, match=re.escape("d must be an integer, got str ('3') instead.")):
        f(5, "3")


def test_hadamard_k_error():
    with pytest.raises(ValueError, match=re.escape("k == 0, must be >= 1.")):
        refgeo.hadamard_power_bound(100, 3, k=0)


def test_huge_sizes_are_fast_or_rejected_by_name():
    import time

    t0 = time.perf_counter()
    b = refgeo.ratio_upper_bound(2**53, 1)
    assert time.perf_counter() - t0 < 5.0  # the Hadamard scan grew like sqrt(V) (minutes)
    assert 0.0 < b.value <= 1.0 / (2**53 - 1) * (1 + 1e-12)
    with pytest.raises(ValueError, match=re.escape("V == 2**53 + 1".replace("2**53 + 1", str(2**53 + 1)))):
        refgeo.ratio_upper_bound(2**53 + 1, 3)


def _decimal_volume(V, d):
    """1 / (V^(1/d) - 1), capped at 1, in 60-digit decimal arithmetic."""
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        root = decimal.Decimal(V) ** (decimal.Decimal(1) / d)
        return decimal.Decimal(1) if root <= 2 else 1 / (root - 1)


@settings(max_examples=300)
@given(st.integers(2, 2**53), st.integers(2, 60))
@example(5513313044378792, 2)  # fell 1.3e-16 (relative) below the formula
@example(3297999912571353, 2)
@example(3795889586845811, 3)
@example(2**52, 52)  # V = 2^d: the root is exactly 2, the bound exactly 1
@example(2**52 + 1, 52)
@example(2**53, 52)
def test_volume_bound_is_never_below_the_formula(V, d):
    """exp(log(V)/d) is off by about (1 + log(V)/d) ulps, more than the outward rounding
    of 8 ulps covered for V near 2^53 in small d."""
    got = refgeo.volume_bound(V, d)
    want = _decimal_volume(V, d)
    assert decimal.Decimal(got) >= want
    assert got == pytest.approx(float(want), rel=1e-14)


def test_ties_bind_the_first_bound():
    """``binding`` names the first of equal bounds (docstring); V <= d + 1: every bound
    is 1, so B0.  (Mutation testing found the tie rule untested.)"""
    b = refgeo.ratio_upper_bound(3, 5)
    assert b.value == 1.0 and b.binding == "B0"
